"""Chaos: workers and parameter servers SIGKILLed at random moments, against fault-free runs, interleaved.

For each configuration (`--configs`, default all), `--rounds` rounds of a
fault-free run and a chaos run of the same plan (benchmarks/faults.py:
`--steps` steps of `SlopeNet`, two saves, a shrink by one worker and a grow
back; in the chaos run `--faults` faults, each killing one actor, two at
once, or one and another during the recovery, the first during a save, the
second during a resize), in an order rotated every round. The chaos run of
round r has the seed `--seed` + r.

  ps, simple, ps-backup (backup_workers=1), ps-bf16 (compression="bf16")
             3 workers on one node
  two-nodes  4 workers, 2 on each node of a two-node ray.cluster_utils
             cluster (3 CPUs each), "ps" with bf16: every partition is
             relayed from the node other than its server's
  two-nodes-streams  2 workers, one on each of the two nodes, "ps": every
             partition comes down a stream and through shared memory, and
             its server sums it as the pushes arrive

Reported per configuration: kills (faults injected; a fault is one kill or
two), kills survived (every victim replaced and the run passed every check:
step counts, replicas bit-identical, the weights the reference's, the stats
right, the checkpoints), steps lost (the step count the final weights show
against the steps run: must be 0), recovery time per kill (median, max: from
the kill to the end of the first call after which the engine uses no
victim), wall time of the chaos runs over the fault-free runs' (median of the
rounds' ratios), and whether each chaos run's final weights equal its round's
fault-free run's bit for bit. Writes benchmarks/results/chaos/chaos.json.
From the repository root:

    .venv/bin/python benchmarks/chaos.py
    .venv/bin/python -m benchmarks.chaos --configs ps simple --steps 100 --faults 3 --rounds 1
"""

from __future__ import annotations

if not __package__:  # run as `python benchmarks/chaos.py`
    import _repo_path  # noqa: F401

import argparse
import statistics
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import ray

from benchmarks import common, faults

CONFIGS = [*faults.CONFIGS, *faults.ACROSS_TWO_NODES]
FAULT_FREE, CHAOS = "fault-free", "chaos"
MIB = 1024 * 1024


def one_run(name: str, kind: str, plan: faults.Plan) -> dict[str, Any]:
    """A run of ``plan`` on configuration ``name`` (faults injected if ``kind`` is CHAOS); its record, with an
    ``error`` if it raised."""
    num_workers, kwargs = faults.ACROSS_TWO_NODES.get(name, (faults.NUM_WORKERS, faults.CONFIGS.get(name)))
    started = time.monotonic()
    try:
        run = faults.run(plan, num_workers, inject=kind == CHAOS, **kwargs)
    except Exception as e:  # a defect: recorded, and the benchmark goes on
        return {"config": name, "kind": kind, "seed": plan.seed, "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc(), "seconds": time.monotonic() - started}
    record = {"config": name, "kind": kind, **run.record(), "seconds": time.monotonic() - started}
    record["weights"] = {k: v.tolist() for k, v in run.weights.items()}
    kills = ", ".join(f"{'+'.join(k.victims)} in {k.landed_in}"
                      + (f" ({k.recovered_s:.1f} s)" if k.recovered_s is not None else " (never recovered)")
                      for k in run.kills)
    print(f"  {name} {kind} (seed {plan.seed}): {run.wall_s:.1f} s, {run.failures} recoveries, "
          f"{len(run.problems)} problems" + (f"; kills: {kills}" if kills else ""), flush=True)
    for problem in run.problems:
        print(f"    problem: {problem}", flush=True)
    return record


def run_config(name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The rounds of configuration ``name``: a fault-free and a chaos run each, in rotated order."""
    num_workers = faults.ACROSS_TWO_NODES.get(name, (faults.NUM_WORKERS,))[0]
    records = []
    for r in range(args.rounds):
        seed = args.seed + r
        plans = {FAULT_FREE: faults.make_plan(seed, args.steps, 0, num_workers),
                 CHAOS: faults.make_plan(seed, args.steps, args.faults, num_workers)}
        for kind in common.rotated([FAULT_FREE, CHAOS], r):
            records.append({"round": r, **one_run(name, kind, plans[kind])})
    return records


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's figures over its rounds."""
    chaos = [r for r in records if r["kind"] == CHAOS]
    free = {r["round"]: r for r in records if r["kind"] == FAULT_FREE}
    kills = [k for r in chaos for k in r.get("kills", [])]
    survived = [k for r in chaos if not r.get("problems") and "error" not in r
                for k in r["kills"] if k["recovered_s"] is not None]
    recovery = [k["recovered_s"] for k in kills if k["recovered_s"] is not None]
    ratios = [r["wall_s"] / free[r["round"]]["wall_s"] for r in chaos
              if "error" not in r and "error" not in free[r["round"]]]
    identical = [all(np.array_equal(r["weights"][k], free[r["round"]]["weights"][k]) for k in r["weights"])
                 for r in chaos if "error" not in r and "error" not in free[r["round"]]]
    return {
        "kills": len(kills), "actors_killed": sum(len(k["victims"]) for k in kills),
        "kills_survived": len(survived),
        "steps_lost": sum(r["steps_lost"] for r in records if "error" not in r),
        "recoveries": sum(r.get("failures", 0) for r in chaos),
        "recovery_median_s": statistics.median(recovery) if recovery else None,
        "recovery_max_s": max(recovery) if recovery else None,
        "wall_ratio_median": statistics.median(ratios) if ratios else None,
        "chaos_wall_s": [r.get("wall_s") for r in chaos], "fault_free_wall_s": [r.get("wall_s") for r in free.values()],
        "bit_identical_to_fault_free": identical,
        "resize_errors": sum(len(r.get("resize_errors", [])) for r in chaos),
        "problems": [f"{r['kind']} round {r['round']} (seed {r['seed']}): {p}" for r in records
                     for p in r.get("problems", []) + ([r["error"]] if "error" in r else [])],
    }


def table(summary: dict[str, dict[str, Any]]) -> str:
    def seconds(x: float | None) -> str:
        return "–" if x is None else f"{x:.1f} s"

    lines = ["| config | kills (actors) | survived | steps lost | recovery median | recovery max | "
             "wall chaos/fault-free | weights = fault-free | problems |", "|---|---|---|---|---|---|---|---|---|"]
    for name, s in summary.items():
        ratio = "–" if s["wall_ratio_median"] is None else f"{s['wall_ratio_median']:.2f}x"
        same = f"{sum(s['bit_identical_to_fault_free'])}/{len(s['bit_identical_to_fault_free'])}"
        lines.append(f"| {name} | {s['kills']} ({s['actors_killed']}) | {s['kills_survived']} | {s['steps_lost']} | "
                     f"{seconds(s['recovery_median_s'])} | {seconds(s['recovery_max_s'])} | {ratio} | {same} | "
                     f"{len(s['problems'])} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", choices=CONFIGS, default=CONFIGS)
    p.add_argument("--steps", type=int, default=300,
                   help=f"steps per run ({4 * faults.TAIL} to {faults.MAX_STEPS})")
    p.add_argument("--faults", type=int, default=8, help="faults per chaos run (at least 2: a save's and a resize's)")
    p.add_argument("--rounds", type=int, default=1, help="fault-free + chaos runs per configuration")
    p.add_argument("--seed", type=int, default=None, help="the first round's seed (default: random, printed)")
    p.add_argument("--out", type=Path, default=common.RESULTS_DIR / "chaos" / "chaos.json")
    args = p.parse_args(argv)
    if not 4 * faults.TAIL <= args.steps <= faults.MAX_STEPS:
        p.error(f"--steps must be {4 * faults.TAIL} to {faults.MAX_STEPS}")
    if args.faults < 2 or args.rounds < 1:
        p.error("--faults must be at least 2 and --rounds at least 1")
    if args.seed is None:
        args.seed = int(np.random.SeedSequence().entropy % (1 << 31))
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    command = common.command_line("benchmarks.chaos", argv)
    print(f"command: {command}\nseed: {args.seed}", flush=True)
    records: dict[str, list[dict[str, Any]]] = {}
    one_node = [c for c in args.configs if c not in faults.ACROSS_TWO_NODES]
    if one_node:
        common.start_ray(num_cpus=8, object_store_memory=1 << 30)
        try:
            for name in one_node:
                records[name] = run_config(name, args)
        finally:
            ray.shutdown()
    for name in [c for c in args.configs if c in faults.ACROSS_TWO_NODES]:
        with common.local_cluster(nodes=2, cpus_per_node=3, object_store_memory=200 * MIB):
            records[name] = run_config(name, args)
    summary = {name: summarize(r) for name, r in records.items()}
    text = table(summary)
    print(f"\n{command}\n{args.steps} steps, {args.faults} faults per chaos run, {args.rounds} round(s), "
          f"seeds {args.seed}..{args.seed + args.rounds - 1}\n\n{text}", flush=True)
    for name, s in summary.items():
        for problem in s["problems"]:
            print(f"{name}: {problem}")
    result = {"command": command, "steps": args.steps, "faults": args.faults, "rounds": args.rounds,
              "seed": args.seed, "summary": summary, "table": text, "runs": records, **common.machine()}
    common.write_json(result, args.out)
    print(f"\nrecord written to {args.out}")
    return result


if __name__ == "__main__":
    main()
