"""Search the MNIST example's learning rate with Ray Tune: one DistributedSGD per trial, ASHA.

    python examples/tune_mnist.py                  # 4 learning rates, 2 workers per trial, local Ray
    python examples/tune_mnist.py --address auto   # on a running Ray cluster

Each trial trains examples/mnist.py's ConvNet (Adam at the trial's learning
rate) with dsgd; ASHA stops the weak trials early. The best trial's last
checkpoint is then restored into a new DistributedSGD to measure its test
accuracy. Needs the ``tune`` extra (``pip install -e ".[tune,examples]"``).
Data as in examples/mnist.py: MNIST files if found, else scikit-learn's digits.
"""

from __future__ import annotations

import argparse
import logging
import time

import ray
import ray.cloudpickle
from ray import tune
from ray.tune.schedulers import ASHAScheduler

import dsgd
import dsgd.tune
import mnist  # examples/mnist.py, beside this file

LEARNING_RATES = [1e-4, 1e-3, 1e-2, 1e-1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lr", type=float, nargs="+", default=LEARNING_RATES, help="learning rates to try")
    p.add_argument("--num-workers", type=int, default=2, help="workers per trial")
    p.add_argument("--batch-size", type=int, default=32, help="per replica")
    p.add_argument("--steps-per-report", type=int, default=20)
    p.add_argument("--max-reports", type=int, default=10, help="reports (Tune iterations) of a trial ASHA keeps")
    p.add_argument("--data-dir", default=None, help="folder with mnist.npz or the IDX files")
    p.add_argument("--address", default=None, help="Ray cluster address; default: start a local one")
    p.add_argument("--num-cpus", type=int, default=6,
                   help="logical CPUs of the local Ray instance (each trial takes 1 + num_workers)")
    p.add_argument("--storage-path", default=None, help="where Tune keeps results and checkpoints")
    p.add_argument("--time-budget-s", type=float, default=900, help="bound on the whole search")
    return p.parse_args(argv)


def model_args(args: argparse.Namespace, lr: float) -> argparse.Namespace:
    """examples/mnist.py's arguments for one ConvNet: its defaults, this run's sizes, the trial's lr."""
    return mnist.parse_args(["--num-workers", str(args.num_workers), "--batch-size", str(args.batch_size),
                             "--lr", str(lr)] + (["--data-dir", args.data_dir] if args.data_dir else []))


def main(argv: list[str] | None = None) -> tune.ResultGrid:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if args.address:
        ray.init(address=args.address)
    else:
        ray.init(num_cpus=args.num_cpus, include_dashboard=False)
    # Trials and workers run elsewhere: ship examples/mnist.py's code with the model creator.
    ray.cloudpickle.register_pickle_by_value(mnist)

    def config_to_model_creator(config: dict):
        trial_args = model_args(args, config["lr"])
        return lambda worker_index, device_index: mnist.ConvNet(worker_index, device_index, trial_args)

    trainable = dsgd.tune.trainable(config_to_model_creator, steps_per_report=args.steps_per_report,
                                    num_workers=args.num_workers, strategy="ps", batch_size=args.batch_size)
    scheduler = ASHAScheduler(max_t=args.max_reports, grace_period=2, reduction_factor=2)
    tuner = tune.Tuner(
        trainable,
        param_space={"lr": tune.grid_search(args.lr)},
        tune_config=tune.TuneConfig(metric="loss", mode="min", scheduler=scheduler,
                                    time_budget_s=args.time_budget_s),
        run_config=tune.RunConfig(name="dsgd_tune_mnist", storage_path=args.storage_path, verbose=1,
                                  stop={"training_iteration": args.max_reports}))
    start = time.perf_counter()
    results = tuner.fit()
    search_s = time.perf_counter() - start
    print(f"\n{len(results)} trials in {search_s:.0f}s:")
    for result in sorted(results, key=lambda r: r.config["lr"]):
        m = result.metrics
        print(f"  lr={result.config['lr']:<8g} steps={m.get('num_steps', 0):<4} loss={m.get('loss', float('nan')):.4f} "
              f"train batch accuracy={m.get('accuracy', float('nan')):.3f}"
              + (f"  error: {result.error}" if result.error else ""))

    best = results.get_best_result()
    with dsgd.DistributedSGD(config_to_model_creator(best.config), num_workers=1, strategy="simple") as sgd:
        with best.checkpoint.as_directory() as directory:
            sgd.restore(directory)
        accuracy = sgd.for_model(lambda model: model.test_accuracy())
    print(f"best trial: lr={best.config['lr']:g}, loss {best.metrics['loss']:.4f} after "
          f"{best.metrics['num_steps']} steps; its checkpoint ({best.checkpoint.path}) restored: "
          f"test accuracy {accuracy:.4f}")
    return results


if __name__ == "__main__":
    main()
