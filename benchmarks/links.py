"""The exchange and end-to-end ResNet-101 over links of known bandwidth (Ray nodes in network namespaces).

Starts a linked cluster (``benchmarks.linked_cluster``): a head node here
with no CPUs for workers, and `--nodes` worker nodes, each in its own network
namespace behind a veth link limited with `tc` to each `--link-gbit` rate in
turn. At each rate, in this order:

  probe     a `--probe-mb` MB object moved node -> head and back, per node:
            the rate the links really give through Ray's object store;
  exchange  `benchmarks.exchange` on the cluster (its systems interleaved,
            `--shapes`, "ps-bf16" among them unless `--compression` says
            otherwise), with M/B beside each shape: M one worker's float32
            gradient bytes, B the link rate; (ps - floor) / (M/B) is the
            exchange time in units of one link-time of the gradients;
  peers     with `--peers`, `benchmarks.peers` (ResNet-101 end to end,
            Ray Train against dsgd, one worker per node).

With `--tls` the cluster runs with Ray's TLS on (a CA made for it): Ray
encrypts its traffic and dsgd's streams theirs; results are written with
a "-tls" suffix.

Needs root and iproute2 (`ip`, `tc`); without them it says so and exits.
Everything it makes is torn down on exit, Ctrl-C and errors included.
Writes everything of a run into `--out-dir` (default benchmarks/results/links/,
which git ignores: move a run worth keeping to a directory of its own, as
benchmarks/results/links-kernels-1/): links.json (the table), exchange-<rate>.json
and peers-<rate>/ per rate. From the repository root:

    .venv/bin/python benchmarks/links.py --link-gbit 1 10
    .venv/bin/python -m benchmarks.links --link-gbit 1 --peers --nodes 2
    .venv/bin/python -m benchmarks.links --link-gbit 1 --shapes resnet101 --compression --tls
"""

from __future__ import annotations

if not __package__:  # run as `python benchmarks/links.py`
    import _repo_path  # noqa: F401

import argparse
import sys
from pathlib import Path
from typing import Any

from benchmarks import common, exchange, peers
from benchmarks.linked_cluster import linked_cluster, measure_link, missing_requirements, with_tls, worker_node_ids


def gradient_bytes(shape_record: dict[str, Any]) -> int:
    """M: one worker's float32 gradient bytes of an exchange shape."""
    return shape_record["elements"] * 4


def link_table(rows: list[dict[str, Any]]) -> str:
    """A markdown table: per link rate and shape, the medians and the exchange time against M/B."""
    systems = [s for s in rows[0]["median_ms"] if s != "bound"] if rows else []
    exchanged = [s for s in systems if s != "floor"]
    lines = ["| link Gbit/s | probe Gbit/s (min) | shape | M MB | M/B ms | "
             + " | ".join(f"{s} ms" for s in systems) + " | "
             + " | ".join(f"({s} − floor)/(M/B)" for s in exchanged) + " |",
             "|---" * (5 + len(systems) + len(exchanged)) + "|"]
    for row in rows:
        ms = row["median_ms"]

        def over_link(system: str) -> str:
            if ms.get(system) is None or ms.get("floor") is None:
                return "–"
            return f"{(ms[system] - ms['floor']) / row['m_over_b_ms']:.2f}"

        lines.append(f"| {row['link_gbit']:g} | {row['probe_gbit']:.2f} | {row['shape']} | {row['m_bytes'] / 1e6:.0f} "
                     f"| {row['m_over_b_ms']:.0f} | "
                     + " | ".join("–" if ms.get(s) is None else f"{ms[s]:.0f}" for s in systems) + " | "
                     + " | ".join(over_link(s) for s in exchanged) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=2, help="worker nodes (one dsgd worker each)")
    p.add_argument("--link-gbit", type=float, nargs="+", default=[1.0, 10.0], help="link rates, measured in turn")
    p.add_argument("--shapes", nargs="+", choices=exchange.SHAPES, default=["resnet101", "huge"])
    p.add_argument("--warmup", type=int, default=2, help="exchange warm-up rounds")
    p.add_argument("--steps", type=int, default=5, help="exchange measured rounds")
    p.add_argument("--scale", type=float, default=1.0, help="exchange shapes' size fraction (smoke runs)")
    p.add_argument("--compression", nargs="*", choices=["bf16", "fp16"], default=["bf16"],
                   help='"ps" with 16-bit partitions beside float32 (none: float32 only)')
    p.add_argument("--probe-mb", type=float, default=64.0)
    p.add_argument("--peers", action="store_true", help="also ResNet-101 end to end against Ray Train")
    p.add_argument("--peers-iters", type=int, default=5)
    p.add_argument("--object-store-memory", type=int, default=2 << 30, help="bytes per node")
    p.add_argument("--tls", action="store_true", help="Ray's TLS on (and so the streams'), with a CA made for it")
    p.add_argument("--out-dir", type=Path, default=common.RESULTS_DIR / "links",
                   help="where the run's records go (a rerun replaces them)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    reason = missing_requirements()
    if reason:
        sys.exit(f"benchmarks.links: {reason}; nothing was started.")
    if args.tls:
        with_tls(args.nodes, "benchmarks.links", argv)
    command = common.command_line("benchmarks.links", argv)
    print(f"command: {command}", flush=True)
    rows: list[dict[str, Any]] = []
    peer_records: dict[str, Any] = {}
    suffix = "-tls" if args.tls else ""
    # Logical CPUs per node: a worker of each engine (they take turns) and their servers.
    with linked_cluster(args.nodes, args.link_gbit[0], cpus_per_node=8, head_cpus=0,
                        object_store_memory=args.object_store_memory, dashboard=args.peers, tls=args.tls):
        for gbit in args.link_gbit:
            cluster_rates = []
            for ip, node_id in sorted(worker_node_ids().items()):
                rates = measure_link(node_id, int(args.probe_mb * 1e6))
                cluster_rates += rates.values()
                print(f"link {gbit:g} Gbit/s, node {ip}: node -> head {rates['node_to_head_gbit']:.2f}, "
                      f"head -> node {rates['head_to_node_gbit']:.2f} Gbit/s", flush=True)
            result = exchange.main(["--shapes", *args.shapes, "--num-workers", str(args.nodes),
                                    "--warmup", str(args.warmup), "--steps", str(args.steps),
                                    "--scale", str(args.scale),
                                    *(["--compression", *args.compression] if args.compression else []),
                                    "--out", str(args.out_dir / f"exchange-{gbit:g}{suffix}.json")])
            for record in result["shapes"]:
                m_bytes = gradient_bytes(record)
                rows.append({"link_gbit": gbit, "probe_gbit": min(cluster_rates), "shape": record["shape"],
                             "m_bytes": m_bytes, "m_over_b_ms": m_bytes * 8 / (gbit * 1e9) * 1000,
                             "median_ms": record["first"]["median_ms"]})
            if args.peers:
                peer_records[f"{gbit:g}"] = peers.main([
                    "--model", "resnet101", "--image-size", "64", "--batch-size", "8",
                    "--num-workers", str(args.nodes), "--num-iters", str(args.peers_iters), "--warmup", "2",
                    "--systems", "raytrain", "simple", "ps", *(["ps-bf16"] if "bf16" in args.compression else []),
                    "--spread", "--no-plot",
                    "--results-dir", str(args.out_dir / f"peers-{gbit:g}{suffix}")])
    table = link_table(rows)
    print(f"\n{command}\n\n{table}")
    result = {"command": command, "nodes": args.nodes, "tls": args.tls, "rows": rows, "table": table,
              "peers": {gbit: [{k: r[k] for k in ("system", "images_per_sec_mean")} for r in records]
                        for gbit, records in peer_records.items()}, **common.machine()}
    common.write_json(result, args.out_dir / f"links{suffix}.json")
    return result


if __name__ == "__main__":
    main()
