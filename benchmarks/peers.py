"""dsgd against its peers on the same ResNet, global batch and workers.

Systems, all fed by the same in-graph synthetic ImageNet and all running the
graph built by `benchmarks.resnet.resnet_v1`:
  single   one plain TensorFlow process (tf.compat.v1 Session, all cores) doing
           the whole global batch: the no-distribution baseline;
  raytrain Ray Train's TensorflowTrainer, MultiWorkerMirroredStrategy, one
           replica of `devices_per_worker * batch_size` images per worker;
  simple   dsgd, strategy="simple";
  ps       dsgd, strategy="ps".
Writes one JSON record per system, report.md and throughput.png into
benchmarks/results/. Run from the repository root:

    python -m benchmarks.peers --model resnet101 --image-size 64 --batch-size 8
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import ray
import tensorflow as tf

from benchmarks import common, resnet

SYSTEMS = ("single", "raytrain", "simple", "ps")
SYSTEM_NAMES = {"single": "single-process", "raytrain": "raytrain-mwms",
                "simple": "dsgd-simple", "ps": "dsgd-ps"}


def run_single_process(cfg: common.BenchConfig) -> dict[str, Any]:
    """The whole global batch in this process, one tf.compat.v1 Session on all cores."""
    label = SYSTEM_NAMES["single"]
    start = time.perf_counter()
    graph = tf.Graph()
    with graph.as_default():
        loss, accuracy = resnet.build_v1_replica(cfg.model, cfg.global_batch, cfg.image_size)
        with tf.control_dependencies(tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)):
            train_op = resnet.make_optimizer().minimize(loss)
        init = tf.compat.v1.global_variables_initializer()
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(init)
        setup_s = time.perf_counter() - start

        def step() -> dict[str, float]:
            _, loss_value, accuracy_value = sess.run([train_op, loss, accuracy])
            return {"loss": float(loss_value), "accuracy": float(accuracy_value)}

        times, stats, interrupted = common.time_steps(step, cfg, label)
    return common.make_record(label, cfg, times, interrupted, threads="all cores", setup_s=setup_s,
                              final_loss=stats[-1]["loss"] if stats else None)


class VariableStore:
    """TF2 variable getter for `resnet_v1`, filled in two phases.

    First, a forward pass in inference mode records every variable's spec
    (returning zeros, so nothing is created or communicated); `create()` then
    makes the tf.Variables, under whatever distribution strategy scope is
    open; afterwards the getter returns those variables.
    """

    def __init__(self):
        self.specs: dict[str, tuple[list[int], resnet.Initializer, bool]] = {}
        self.variables: dict[str, tf.Variable] = {}

    def __call__(self, name: str, shape: list[int], initializer: resnet.Initializer,
                 trainable: bool) -> tf.Variable | tf.Tensor:
        if self.variables:
            return self.variables[name]
        self.specs[name] = (shape, initializer, trainable)
        return tf.zeros(shape)

    def create(self) -> None:
        for name, (shape, initializer, trainable) in self.specs.items():
            # Moving statistics are per replica (updated locally, mean on read).
            sync = ({} if trainable else
                    {"synchronization": tf.VariableSynchronization.ON_READ,
                     "aggregation": tf.VariableAggregation.MEAN})
            self.variables[name] = tf.Variable(initializer(shape, dtype=tf.float32), name=name,
                                               trainable=trainable, **sync)

    @property
    def trainable_variables(self) -> list[tf.Variable]:
        return [v for v in self.variables.values() if v.trainable]


def _ray_train_loop(config: dict[str, Any]) -> None:
    """Ray Train worker: MultiWorkerMirroredStrategy around the shared ResNet graph."""
    from ray import train

    cfg = common.BenchConfig(**config)
    tf.config.threading.set_intra_op_parallelism_threads(cfg.cpus_per_worker)
    tf.config.threading.set_inter_op_parallelism_threads(max(2, cfg.cpus_per_worker))  # as dsgd's workers
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    replica_batch = cfg.batch_size * cfg.devices_per_worker
    store = VariableStore()
    resnet.resnet_v1(tf.zeros([1, 32, 32, 3]), cfg.model, store, training=False)
    with strategy.scope():
        store.create()
        optimizer = resnet.make_optimizer()
    trainable = store.trainable_variables

    def replica_step() -> tf.Tensor:
        images, labels = resnet.synthetic_imagenet(replica_batch, cfg.image_size)
        with tf.GradientTape() as tape:
            logits = resnet.resnet_v1(images, cfg.model, store, training=True)
            loss, _ = resnet.loss_and_accuracy(logits, labels)
            # v1 optimizers sum the replicas' gradients: scale to get their mean.
            scaled_loss = loss / strategy.num_replicas_in_sync
        grads = tape.gradient(scaled_loss, trainable)
        optimizer.apply_gradients(zip(grads, trainable))
        return loss

    @tf.function
    def train_step() -> tf.Tensor:
        return strategy.experimental_local_results(strategy.run(replica_step))[0]

    rank = train.get_context().get_world_rank()
    times, stats, interrupted = common.time_steps(
        lambda: {"loss": float(train_step())}, cfg, f"{SYSTEM_NAMES['raytrain']} rank {rank}",
        verbose=rank == 0)
    metrics = {"step_times_s": times, "interrupted": interrupted,
               "final_loss": stats[-1]["loss"] if stats else None}
    # Ray Train v2 only returns metrics attached to a checkpoint: rank 0 sends an empty one.
    with tempfile.TemporaryDirectory() as empty:
        checkpoint = train.Checkpoint.from_directory(empty) if rank == 0 else None
        train.report(metrics, checkpoint=checkpoint)


def run_ray_train(cfg: common.BenchConfig) -> dict[str, Any]:
    """Ray Train's TensorflowTrainer with MultiWorkerMirroredStrategy, one replica per worker."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.tensorflow import TensorflowTrainer

    label = SYSTEM_NAMES["raytrain"]
    print(f"[{label}] starting {cfg.num_workers} worker(s)", flush=True)
    storage = tempfile.mkdtemp(prefix="dsgd-raytrain-")
    try:
        trainer = TensorflowTrainer(
            _ray_train_loop, train_loop_config=dataclasses.asdict(cfg),
            scaling_config=ScalingConfig(num_workers=cfg.num_workers,
                                         resources_per_worker={"CPU": cfg.cpus_per_worker}),
            run_config=RunConfig(name="resnet", storage_path=storage))
        start = time.perf_counter()
        metrics = trainer.fit().metrics
        total_s = time.perf_counter() - start
    finally:
        shutil.rmtree(storage, ignore_errors=True)
    return common.make_record(label, cfg, metrics["step_times_s"], metrics["interrupted"],
                              replica_batch=cfg.batch_size * cfg.devices_per_worker,
                              fit_s=total_s, final_loss=metrics["final_loss"])


def run_system(system: str, cfg: common.BenchConfig) -> dict[str, Any]:
    """One system's record; `system` is one of SYSTEMS."""
    if system == "single":
        return run_single_process(cfg)
    if system == "raytrain":
        return run_ray_train(cfg)
    from benchmarks.resnet101 import run_dsgd
    return run_dsgd(cfg, strategy=system)


def _ratio(record: dict[str, Any], peer: dict[str, Any] | None) -> str:
    if peer is None or not record["images_per_sec_mean"] or not peer["images_per_sec_mean"]:
        return "–"
    return f"{record['images_per_sec_mean'] / peer['images_per_sec_mean']:.2f}"


def write_report(records: list[dict[str, Any]], cfg: common.BenchConfig, out_dir: Path) -> Path:
    """A markdown table of images/s with ratios to the single process and to Ray Train."""
    by_system = {r["system"]: r for r in records}
    single, raytrain = by_system.get(SYSTEM_NAMES["single"]), by_system.get(SYSTEM_NAMES["raytrain"])
    host = records[0]["host"] if records else {"cpu_model": "?", "cores": "?"}
    lines = [
        f"# {cfg.model} on synthetic ImageNet: dsgd and its peers",
        "",
        f"{cfg.image_size}x{cfg.image_size} images, {cfg.batch_size} per replica, "
        f"{cfg.num_workers} worker(s) x {cfg.devices_per_worker} device(s), global batch "
        f"{cfg.global_batch}; {cfg.cpus_per_worker} CPU(s)/threads per worker; {cfg.warmup} warm-up "
        f"steps excluded, {cfg.num_iters} measured. Host: {host['cpu_model']}, {host['cores']} cores.",
        "",
        "| system | images/s (mean ± std) | steps | vs single process | vs Ray Train |",
        "|---|---|---|---|---|",
    ]
    for r in records:
        mean, std = r["images_per_sec_mean"], r["images_per_sec_std"]
        rate = "–" if mean is None else f"{mean:.2f} ± {std:.2f}"
        lines.append(f"| {r['system']} | {rate} | {r['measured_steps']} | {_ratio(r, single)} | "
                     f"{_ratio(r, raytrain)} |")
    lines += ["", f"Generated {time.strftime('%Y-%m-%d %H:%M')} by `python -m benchmarks.peers`.", ""]
    path = out_dir / "report.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    return path


def plot_throughput(records: list[dict[str, Any]], cfg: common.BenchConfig, out_dir: Path) -> Path:
    """A bar chart of images/s per system, error bars one standard deviation."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r for r in records if r["images_per_sec_mean"] is not None]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([r["system"] for r in measured], [r["images_per_sec_mean"] for r in measured],
           yerr=[r["images_per_sec_std"] for r in measured], capsize=4, color="tab:blue")
    ax.set_ylabel("images/s")
    ax.set_title(f"{cfg.model}, {cfg.image_size}px, global batch {cfg.global_batch}, "
                 f"{cfg.num_workers}x{cfg.devices_per_worker}")
    fig.tight_layout()
    path = out_dir / "throughput.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_run_flags(parser)
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--object-store-memory", type=int, default=None,
                        help="bytes, when this script starts Ray itself")
    parser.add_argument("--results-dir", type=Path, default=common.RESULTS_DIR)
    parser.add_argument("--no-plot", action="store_true", help="skip throughput.png (needs matplotlib)")
    args = parser.parse_args(argv)
    cfg = common.bench_config_from_args(args)
    if not ray.is_initialized():
        ray.init(object_store_memory=args.object_store_memory)
    records = []
    try:
        for system in args.systems:
            record = run_system(system, cfg)
            common.print_summary(record)
            common.write_json(record, args.results_dir / f"{record['system']}.json")
            records.append(record)
    except KeyboardInterrupt:
        print("interrupted: reporting the systems that finished", flush=True)
    report = write_report(records, cfg, args.results_dir)
    print(report.read_text())
    if records and not args.no_plot:
        print(f"plot written to {plot_throughput(records, cfg, args.results_dir)}")
    return records


if __name__ == "__main__":
    main()
