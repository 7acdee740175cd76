"""Elastic training: the MNIST convnet of examples/mnist.py, grown and shrunk while it trains.

    python examples/elastic_mnist.py                 # 1 -> 3 -> 2 workers, local Ray
    python examples/elastic_mnist.py --steps 600

The engine starts with one worker; a third of the way in it grows to
``--num-workers`` (new workers join with the current weights, Adam's slots
and the step count; the first worker goes on in its own process), two
thirds in it shrinks by one. The learning rate follows the replica count
(linear scaling: ``--lr`` per replica), set on every replica after each
resize. Prints the stats at every change and the test accuracy at the end.
"""

from __future__ import annotations

import argparse
import time

import ray.cloudpickle

import dsgd  # before tensorflow: dsgd keeps TensorFlow's start-up lines out of the output
import tensorflow as tf
import mnist  # examples/mnist.py, beside this file: its model, data and flags


class ScaledLRConvNet(mnist.ConvNet):
    """ConvNet whose Adam learning rate is a local variable: ``--lr`` x the replicas, set after each resize."""

    def __init__(self, worker_index: int, device_index: int, args: argparse.Namespace):
        super().__init__(worker_index, device_index, args)
        self.lr_var = tf.compat.v1.get_variable("learning_rate", [], trainable=False,
                                                initializer=tf.compat.v1.constant_initializer(args.lr),
                                                collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES])

    def get_optimizer(self) -> tf.compat.v1.train.Optimizer:
        return tf.compat.v1.train.AdamOptimizer(self.lr_var)

    def set_learning_rate(self, lr: float) -> None:
        self.lr_var.load(lr, tf.compat.v1.get_default_session())


def resize(sgd: dsgd.DistributedSGD, workers: int, args: argparse.Namespace) -> None:
    """Resize to ``workers`` and scale the learning rate with the replicas that will now step."""
    start_time = time.perf_counter()
    sgd.resize(workers)
    replicas = sgd.num_workers * sgd.devices_per_worker
    sgd.foreach_model(lambda model: model.set_learning_rate(args.lr * replicas))
    print(f"resized to {sgd.num_workers} workers in {time.perf_counter() - start_time:.1f}s; "
          f"learning rate {args.lr * replicas:g} for {replicas} replicas")


def main(argv: list[str] | None = None) -> float:
    p = mnist.common_parser(__doc__)
    p.set_defaults(num_workers=3, steps=300)
    args = p.parse_args(argv)
    if args.num_workers < 2:
        p.error("--num-workers must be at least 2: the example grows to it and shrinks by one")
    mnist.start(args)  # Ray with room for --num-workers workers
    ray.cloudpickle.register_pickle_by_value(mnist)  # the workers run examples/mnist.py's code too
    # Every model slices the training set by args.num_workers (the most workers it will run): a replica's
    # slice stays its own whatever the current count.
    with dsgd.DistributedSGD(lambda w, d: ScaledLRConvNet(w, d, args), num_workers=1,
                             devices_per_worker=args.devices_per_worker, strategy=args.strategy) as sgd:
        resize(sgd, 1, args)  # sets the learning rate for one worker's replicas
        plan = {args.steps // 3: args.num_workers, 2 * args.steps // 3: args.num_workers - 1}
        for step in range(args.steps):
            if step in plan:
                resize(sgd, plan[step], args)
            stats = sgd.step(fetch_stats=(step + 1) % args.log_every == 0 or step + 1 == args.steps)
            if stats:
                print(f"step {step + 1}: {stats['num_replicas']:.0f} replicas, loss {stats['loss']:.3f}, "
                      f"accuracy {stats['accuracy']:.3f}")
        accuracy = sgd.for_model(lambda model: model.test_accuracy())
    print(f"test accuracy {accuracy:.4f} after {args.steps} steps")
    return accuracy


if __name__ == "__main__":
    main()
