"""Input benchmark: Ray Data feeding against feed_dict from numpy, same model, interleaved in one run.

The model is examples/mnist_tf_keras.py's tf_keras convnet (dsgd.KerasModel) on
the same digits (MNIST if on this machine, else scikit-learn's 8x8 set),
built two ways at dsgd's defaults ("ps"):

  numpy     each replica fed its slice of numpy arrays shipped with the
            model creator (a list of batches; the feed_dict baseline)
  ray-data  the same rows as a ray.data.Dataset, DistributedSGD(datasets=...),
            each replica reading its streaming split (dsgd.get_dataset_shard)

For each batch size and each `--tiles` count (the training set repeated
that many times: Ray starts every epoch anew, so the 8x8 digits' 1437 rows,
an epoch every few steps, show the cost of starting epochs, and the tiled
set the cost per batch), both engines run interleaved (round r: each runs
`--chunk` steps, the last with fetch_stats=True so the chunk is applied, in
an order rotated by r). Reported: median samples/s of each over `--rounds`
rounds after `--warmup` warm-up rounds, and ray-data/numpy. Writes
benchmarks/results/data_input.json. From the repository root:

    .venv/bin/python benchmarks/data_input.py
    .venv/bin/python -m benchmarks.data_input --batch-sizes 64 --devices-per-worker 2
"""

from __future__ import annotations

if not __package__:  # run as `python benchmarks/data_input.py`
    import _repo_path  # noqa: F401

import argparse
import contextlib
import statistics
from pathlib import Path
from typing import Any

import numpy as np
import ray

import dsgd
from benchmarks import common

# The example's model creators go to the workers by value, with every example module they reach.
common.example("mnist")  # which mnist_keras imports
mnist_keras = common.example("mnist_keras")  # the flags
mnist_tf_keras = common.example("mnist_tf_keras")  # the tf_keras model and its two inputs

SYSTEMS = ("numpy", "ray-data")


def run_case(batch_size: int, tiles: int, args: argparse.Namespace, data: dict[str, np.ndarray]) -> dict[str, Any]:
    """Both engines at one per-replica batch size on the training set repeated ``tiles`` times; the record."""
    example_args = mnist_keras.parse_args(["--num-workers", str(args.num_workers), "--devices-per-worker",
                                           str(args.devices_per_worker), "--batch-size", str(batch_size)])
    order = np.random.RandomState(0).permutation(len(data["y_train"]) * tiles) % len(data["y_train"])
    arrays = {"image": data["x_train"][order], "label": data["y_train"][order]}
    dataset = ray.data.from_items([{"image": x, "label": y} for x, y in zip(arrays["image"], arrays["label"])])
    image_shape = arrays["image"].shape[1:]
    creators = {"numpy": (mnist_tf_keras.make_model_creator(example_args, image_shape, arrays), None),
                "ray-data": (mnist_tf_keras.make_model_creator(example_args, image_shape), {"train": dataset})}
    global_batch = batch_size * args.num_workers * args.devices_per_worker
    steps_per_epoch = len(order) // global_batch
    print(f"\n== batch {batch_size} per replica, {args.num_workers} x {args.devices_per_worker} replicas "
          f"(global batch {global_batch}), {len(order)} rows: an epoch every {steps_per_epoch} steps", flush=True)
    with contextlib.ExitStack() as engines_alive:
        systems = {}
        for name in SYSTEMS:
            creator, datasets = creators[name]
            sgd = engines_alive.enter_context(dsgd.DistributedSGD(
                creator, num_workers=args.num_workers, devices_per_worker=args.devices_per_worker,
                datasets=datasets))
            systems[name] = common.timed(lambda sgd=sgd: chunk(sgd, args.chunk))
        times, order_run, interrupted = common.run_rounds(
            systems, args.warmup + args.rounds, args.warmup,
            describe=lambda s: f"{args.chunk * global_batch / s:9.0f} samples/s")
    rates = {name: [args.chunk * global_batch / t for t in times[name][args.warmup:]] for name in SYSTEMS}
    medians = {name: statistics.median(r) if r else None for name, r in rates.items()}
    ratio = medians["ray-data"] / medians["numpy"] if all(medians.values()) else None
    print(f"batch {batch_size}, {len(order)} rows: median samples/s numpy {medians['numpy'] or 0:.0f}, "
          f"ray-data {medians['ray-data'] or 0:.0f}; ray-data/numpy {ratio or 0:.2f}", flush=True)
    return {"batch_size": batch_size, "rows": len(order), "steps_per_epoch": steps_per_epoch,
            "global_batch": global_batch, "samples_per_s": rates,
            "median_samples_per_s": medians, "ray_data_over_numpy": ratio, "order": order_run,
            "interrupted": interrupted}


def chunk(sgd: dsgd.DistributedSGD, steps: int) -> None:
    """`steps` steps, the last waited for (its stats fetched), so every one is applied on return."""
    for _ in range(steps - 1):
        sgd.step()
    sgd.step(fetch_stats=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 256], help="per replica")
    p.add_argument("--tiles", type=int, nargs="+", default=[1, 20],
                   help="run on the training set repeated this many times (each in turn)")
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--devices-per-worker", type=int, default=1)
    p.add_argument("--chunk", type=int, default=20, help="steps timed together (one round of one system)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up rounds, not measured")
    p.add_argument("--rounds", type=int, default=8, help="measured rounds")
    p.add_argument("--data-dir", default=None, help="folder with mnist.npz or the IDX files")
    common.add_ray_flags(p, "what both engines reserve, plus 2")
    p.add_argument("--out", type=Path, default=common.RESULTS_DIR / "data_input.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    command = common.command_line("benchmarks.data_input", argv)
    print(f"command: {command}", flush=True)
    common.connect_ray(args, 2 * args.num_workers + 2)
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    context.print_on_execution_start = False
    name, data = mnist_keras.mnist.load_digits(args.data_dir)
    print(f"data: {name}, {len(data['y_train'])} train images", flush=True)
    records = []
    for tiles in args.tiles:
        for batch_size in args.batch_sizes:
            records.append(run_case(batch_size, tiles, args, data))
            if records[-1]["interrupted"]:
                break
    lines = ["| batch per replica | rows | steps per epoch | numpy samples/s | ray-data samples/s | ray-data/numpy |",
             "|---|---|---|---|---|---|"]
    for r in records:
        m = r["median_samples_per_s"]
        lines.append(f"| {r['batch_size']} | {r['rows']} | {r['steps_per_epoch']} | {m['numpy'] or 0:.0f} | "
                     f"{m['ray-data'] or 0:.0f} | {r['ray_data_over_numpy'] or 0:.2f} |")
    table = "\n".join(lines)
    print(f"\n{command}\n\n{table}")
    result = {"command": command, "data": name, "num_workers": args.num_workers,
              "devices_per_worker": args.devices_per_worker, "chunk": args.chunk, "records": records,
              "table": table, **common.machine()}
    common.write_json(result, args.out)
    print(f"\nrecord written to {args.out}")
    return result


if __name__ == "__main__":
    main()
