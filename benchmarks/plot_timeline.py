"""Render a dsgd Chrome trace as a PNG (one row per actor track), for docs.

    .venv/bin/python -m benchmarks.plot_timeline trace.json docs/img/timeline.png

Perfetto (ui.perfetto.dev) or chrome://tracing show the same file
interactively; this picture is for places where those are not at hand.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

# Colours by what an event is; anything else is a TensorFlow op.
PALETTE = [("send", "tab:orange"), ("receive", "tab:green"), ("dsgd_", "tab:orange"), ("average", "tab:red"),
           ("put the mean", "tab:purple"), ("push", "tab:gray"), ("get_feed_dict", "tab:olive")]


def colour(name: str) -> str:
    return next((c for key, c in PALETTE if key in name), "tab:blue")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("png")
    p.add_argument("--min-us", type=float, default=200.0, help="hide events shorter than this")
    args = p.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = json.load(open(args.trace))["traceEvents"]
    process = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    thread = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    spans = [e for e in events if e["ph"] == "X" and e["dur"] >= args.min_us]
    start = min(e["ts"] for e in spans)
    rows = defaultdict(list)
    for e in spans:
        rows[(e["pid"], thread.get((e["pid"], e["tid"]), str(e["tid"])))].append(e)
    order = sorted(rows)
    fig, ax = plt.subplots(figsize=(14, 0.32 * len(order) + 1.5))
    for y, key in enumerate(order):
        for e in rows[key]:
            ax.barh(y, e["dur"] / 1000, left=(e["ts"] - start) / 1000, height=0.8, color=colour(e["name"]),
                    edgecolor="none")
    ax.set_yticks(range(len(order)), [f"{process[pid]}: {track}" for pid, track in order], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step started")
    ax.set_title("one dsgd step (orange: partition sends, green: receives, red/purple: PS sums, blue: TF ops)")
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)


if __name__ == "__main__":
    main()
