"""Train a small convnet on handwritten digits with dsgd.

    python examples/mnist.py                       # 2 workers, "ps", local Ray
    python examples/mnist.py --address auto        # on a running Ray cluster
    python examples/mnist.py --logdir runs/mnist   # and: tensorboard --logdir runs

Data: MNIST from --data-dir or the Keras cache (``mnist.npz``, or the four
IDX files, gzipped or not). With no MNIST files on this machine (no internet
here), it says so and uses the 8x8 digits set that scikit-learn ships, so the
default command works offline.
"""

from __future__ import annotations

import argparse
import gzip
import logging
import time
from pathlib import Path

import numpy as np
import ray

import dsgd  # before tensorflow: dsgd keeps TensorFlow's start-up lines out of the output
import tensorflow as tf
from dsgd.progress import Progress

IDX_FILES = {
    "x_train": "train-images-idx3-ubyte", "y_train": "train-labels-idx1-ubyte",
    "x_test": "t10k-images-idx3-ubyte", "y_test": "t10k-labels-idx1-ubyte",
}


def _read_idx(path: Path) -> np.ndarray:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, np.uint8, offset=4 + 4 * ndim).reshape(dims)


def _find_mnist(data_dir: str | None) -> dict[str, np.ndarray] | None:
    dirs = [Path(data_dir)] if data_dir else []
    dirs.append(Path.home() / ".keras" / "datasets")
    for d in dirs:
        if (d / "mnist.npz").exists():
            with np.load(d / "mnist.npz") as f:
                return {k: f[k] for k in IDX_FILES}
        found = {}
        for key, name in IDX_FILES.items():
            for candidate in (d / name, d / (name + ".gz")):
                if candidate.exists():
                    found[key] = _read_idx(candidate)
        if len(found) == len(IDX_FILES):
            return found
    return None


def load_digits(data_dir: str | None) -> tuple[str, dict[str, np.ndarray]]:
    """(name, arrays): images as float32 NHWC in [0, 1], labels as int32."""
    arrays = _find_mnist(data_dir)
    if arrays is not None:
        name = "MNIST 28x28"
    else:
        from sklearn.datasets import load_digits as sklearn_digits  # ships its data; no download
        digits = sklearn_digits()
        order = np.random.RandomState(0).permutation(len(digits.target))
        split = int(0.8 * len(order))
        images = (digits.images / 16.0)[order]
        labels = digits.target[order]
        arrays = {"x_train": images[:split], "y_train": labels[:split],
                  "x_test": images[split:], "y_test": labels[split:]}
        name = "scikit-learn digits 8x8"
    for key in ("x_train", "x_test"):
        x = arrays[key].astype(np.float32)
        arrays[key] = (x / 255.0 if x.max() > 1.0 else x)[..., None]
    for key in ("y_train", "y_test"):
        arrays[key] = arrays[key].astype(np.int32)
    return name, arrays


def _conv(x: tf.Tensor, name: str, out_channels: int, stride: int) -> tf.Tensor:
    kernel = tf.compat.v1.get_variable(f"{name}/kernel", [3, 3, x.shape[-1], out_channels])
    bias = tf.compat.v1.get_variable(f"{name}/bias", [out_channels], initializer=tf.compat.v1.zeros_initializer())
    return tf.nn.relu(tf.nn.conv2d(x, kernel, stride, "SAME") + bias)


class ConvNet(dsgd.Model):
    """Two 3x3 conv layers and a dense softmax layer, on this replica's slice of the data."""

    def __init__(self, worker_index: int, device_index: int, args: argparse.Namespace):
        _, data = load_digits(args.data_dir)
        replica = worker_index * args.devices_per_worker + device_index
        replicas = args.num_workers * args.devices_per_worker
        self.x_train = data["x_train"][replica::replicas]
        self.y_train = data["y_train"][replica::replicas]
        self.x_test, self.y_test = data["x_test"], data["y_test"]
        self.batch_size, self.lr = args.batch_size, args.lr
        self.rng = np.random.RandomState(replica)
        self.order, self.cursor = self.rng.permutation(len(self.y_train)), 0

        height, width = self.x_train.shape[1:3]
        self.images = tf.compat.v1.placeholder(tf.float32, [None, height, width, 1], name="images")
        self.labels = tf.compat.v1.placeholder(tf.int32, [None], name="labels")
        h = _conv(self.images, "conv1", 32, 1)
        h = _conv(h, "conv2", 64, 2)
        h = tf.reshape(h, [-1, int(np.prod(h.shape[1:]))])
        w = tf.compat.v1.get_variable("dense/kernel", [h.shape[-1], 10])
        b = tf.compat.v1.get_variable("dense/bias", [10], initializer=tf.compat.v1.zeros_initializer())
        logits = tf.matmul(h, w) + b
        self.loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=self.labels, logits=logits))
        correct = tf.equal(tf.argmax(logits, 1, output_type=tf.int32), self.labels)
        self.accuracy = tf.reduce_mean(tf.cast(correct, tf.float32))

    def get_loss(self) -> tf.Tensor:
        return self.loss

    def get_optimizer(self) -> tf.compat.v1.train.Optimizer:
        return tf.compat.v1.train.AdamOptimizer(self.lr)

    def get_metrics(self) -> dict[str, tf.Tensor]:
        return {"accuracy": self.accuracy}

    def get_feed_dict(self) -> dict:
        if self.cursor + self.batch_size > len(self.order):
            self.order, self.cursor = self.rng.permutation(len(self.y_train)), 0
        idx = self.order[self.cursor:self.cursor + self.batch_size]
        self.cursor += self.batch_size
        return {self.images: self.x_train[idx], self.labels: self.y_train[idx]}

    def test_accuracy(self) -> float:
        """Accuracy on the test set, in the worker's session (the default while dsgd runs ``fn``)."""
        return float(self.accuracy.eval({self.images: self.x_test, self.labels: self.y_test}))


def common_parser(description: str) -> argparse.ArgumentParser:
    """The flags both MNIST examples take (this one and examples/mnist_keras.py)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--devices-per-worker", type=int, default=1)
    p.add_argument("--strategy", choices=["ps", "simple"], default="ps")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=32, help="per replica")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--log-every", type=int, default=50,
                   help="fetch loss and accuracy every this many steps (progress lines, --logdir)")
    p.add_argument("--data-dir", default=None, help="folder with mnist.npz or the IDX files")
    p.add_argument("--address", default=None, help="Ray cluster address; default: start a local one")
    p.add_argument("--num-cpus", type=int, default=None, help="logical CPUs of the local Ray instance")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common_parser(__doc__)
    p.add_argument("--logdir", default=None, help="write TensorBoard scalars (loss, accuracy, samples/s) here")
    return p.parse_args(argv)


def start(args: argparse.Namespace, **init_kwargs) -> dict[str, np.ndarray]:
    """Logging on, the digits loaded (and said which), Ray started or joined; the data."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    name, data = load_digits(args.data_dir)
    if name != "MNIST 28x28":
        print("No MNIST files found (--data-dir, ~/.keras/datasets); using the digits set scikit-learn ships.")
    print(f"data: {name}, {len(data['y_train'])} train / {len(data['y_test'])} test images")
    if args.address:
        ray.init(address=args.address, **init_kwargs)
    else:
        ray.init(address="local", num_cpus=args.num_cpus or max(4, args.num_workers), include_dashboard=False, **init_kwargs)
    return data


def train(sgd: dsgd.DistributedSGD, args: argparse.Namespace) -> float:
    """``args.steps`` steps with a progress bar (loss and accuracy every ``--log-every``); the seconds taken."""
    global_batch = args.batch_size * args.num_workers * args.devices_per_worker
    progress = Progress(args.steps, unit="samples", every=args.log_every)
    train_start = time.perf_counter()
    for step in range(1, args.steps + 1):
        stats = sgd.step(fetch_stats=(step % args.log_every == 0 or step == args.steps))
        values = {"loss": stats["loss"], "accuracy": stats["accuracy"]} if stats else None
        progress.update(samples=global_batch, values=values)
    progress.close()
    return time.perf_counter() - train_start


def main(argv: list[str] | None = None) -> float:
    args = parse_args(argv)
    start(args)
    start_time = time.perf_counter()
    with dsgd.DistributedSGD(lambda w, d: ConvNet(w, d, args), num_workers=args.num_workers,
                             devices_per_worker=args.devices_per_worker, strategy=args.strategy,
                             logdir=args.logdir, batch_size=args.batch_size) as sgd:
        print(f"built {args.num_workers} x {args.devices_per_worker} replicas ({args.strategy}) "
              f"in {time.perf_counter() - start_time:.1f}s")
        train_s = train(sgd, args)
        accuracy = sgd.for_model(lambda model: model.test_accuracy())
    print(f"test accuracy {accuracy:.4f} after {args.steps} steps; training {train_s:.1f}s "
          f"({train_s / args.steps * 1000:.1f} ms/step), total {time.perf_counter() - start_time:.1f}s")
    return accuracy


if __name__ == "__main__":
    main()
