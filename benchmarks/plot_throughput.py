"""Redraw the throughput plot of a recorded peers run (no benchmark is run).

`benchmarks/peers.py` writes one JSON record per system into its
`--results-dir` and draws `throughput.png` there at the end of the run. This
script draws the same figure again from those records, e.g. for the docs:

    .venv/bin/python -m benchmarks.plot_throughput benchmarks/results/peers-ideal-one-node docs/img/throughput.png

The bars follow the order the systems first ran in (each record's
`run_order`), as the run's own plot does.
"""

from __future__ import annotations

if not __package__:  # run as `python benchmarks/plot_throughput.py`
    import _repo_path  # noqa: F401

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks import common


def load_records(results_dir: Path) -> list[dict[str, Any]]:
    """The peers records (JSON files with `images_per_sec_mean`) in `results_dir`, in the run's order."""
    records = []
    for path in sorted(results_dir.glob("*.json")):
        record = json.loads(path.read_text())
        if isinstance(record, dict) and "images_per_sec_mean" in record and "system" in record:
            records.append(record)
    if not records:
        raise SystemExit(f"no peers records (JSON files with images_per_sec_mean) in {results_dir}")
    order: list[str] = []
    for name in records[0].get("run_order", []):
        if name not in order:
            order.append(name)
    rank = {name: i for i, name in enumerate(order)}
    return sorted(records, key=lambda r: rank.get(r["system"], len(rank)))


def config_of(record: dict[str, Any]) -> common.BenchConfig:
    """The run's BenchConfig, as its record states it (the plot's title reads it)."""
    return common.BenchConfig(model=record["model"], image_size=record["image_size"],
                              batch_size=record["batch_size_per_replica"], num_workers=record["num_workers"],
                              devices_per_worker=record["devices_per_worker"],
                              cpus_per_worker=record.get("cpus_per_worker", 1),
                              num_iters=record.get("num_iters", 0), warmup=record.get("warmup", 0))


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results_dir", type=Path, help="a peers run's --results-dir")
    parser.add_argument("png", type=Path, help="where to write the plot")
    args = parser.parse_args(argv)
    from benchmarks import peers

    records = load_records(args.results_dir)
    args.png.parent.mkdir(parents=True, exist_ok=True)
    peers.throughput_figure(records, config_of(records[0])).savefig(args.png, dpi=peers.PLOT_DPI, format="png")
    print(f"plot written to {args.png}")
    return args.png


if __name__ == "__main__":
    main()
