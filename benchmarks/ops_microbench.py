"""Micro-benchmark of the dsgd op library against plain numpy + Ray.

A ResNet-101-sized gradient set (44.5 M float32, ResNet-101-like variable
sizes) split into ~10 MB partitions. Write side: (a) numpy pack + ray.put vs.
(b) in-graph DsgdPack + ray.put of the packed partition (two copies) vs. the
engine's paths, dsgd.ops.build_send handing over the partition's segments (views
of large gradients, DsgdPack only for runs of small ones): (c) put as one
object, each byte copied once by one thread (to a server on another node);
(c2) copied into a shared-memory buffer made once (to a server on the same
node, dsgd.exchange.ps_client). Read side: (d) ray.get + feed_dict + TF slicing
vs. (e) the zero-copy DsgdAliasTensor + DsgdUnpack path
(dsgd.ops.receive_partition + unpack). Prints wall time and the process's CPU time (all
threads): on a machine whose cores are busy training, CPU time is what a
copy really costs.

    python -m benchmarks.ops_microbench [--reps 10] [--partition-bytes 10000000]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import numpy as np
import ray
import tensorflow as tf

import dsgd.ops as ops
from dsgd.transport import object_store, shared_memory
from dsgd.wire.partitions import VarSpec, pack, plan_partitions, segments

TOTAL_FLOATS = 44_500_000


def resnet_like_specs() -> list[VarSpec]:
    """Variables with ResNet-101-like sizes, last layer first, 44.5 M floats."""
    rng = np.random.default_rng(0)
    shapes = [(2048, 1000), (1000,)]
    total = 2048 * 1000 + 1000
    while total < TOTAL_FLOATS:
        shape = [(3, 3, 256, 256), (1, 1, 1024, 256), (1, 1, 256, 1024), (1024,), (256,),
                 (3, 3, 512, 512), (1, 1, 2048, 512), (512,), (2048,)][rng.integers(9)]
        shapes.append(shape)
        total += int(np.prod(shape))
    return [VarSpec(f"v{i}", s, np.dtype(np.float32)) for i, s in enumerate(shapes)]


def timed(fn, reps: int) -> tuple[float, float]:
    """(median wall seconds, mean CPU seconds of this process) of ``fn()`` over ``reps`` runs."""
    fn()
    times, cpu = [], 0.0
    for _ in range(reps):
        gc.collect()
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        times.append(time.perf_counter() - start)
        cpu += time.process_time() - start_cpu
    return statistics.median(times), cpu / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--partition-bytes", type=int, default=10_000_000)
    args = parser.parse_args()

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    ops.load()
    specs = resnet_like_specs()
    layout = plan_partitions(specs, args.partition_bytes)
    rng = np.random.default_rng(1)
    grads = [rng.standard_normal(s.shape, dtype=np.float32) for s in specs]
    nbytes = sum(g.nbytes for g in grads)
    print(f"{len(specs)} variables, {nbytes / 1e6:.1f} MB, {len(layout)} partitions "
          f"of ~{args.partition_bytes / 1e6:.0f} MB, {args.reps} reps (median)")

    flat_src = np.concatenate([g.reshape(-1) for g in grads])
    flat_dst = np.empty_like(flat_src)
    results = {"memcpy of all gradient bytes (bound)": timed(lambda: np.copyto(flat_dst, flat_src), args.reps)}

    def numpy_pack_put():
        refs = [ray.put(pack(grads, s, np.empty(s.size, s.dtype))) for s in layout]
        del refs

    results["(a) numpy pack + ray.put"] = timed(numpy_pack_put, args.reps)

    graph = tf.Graph()
    with graph.as_default():
        grad_vars = [tf.Variable(g) for g in grads]  # gradients that already sit in TF memory
        grad_tensors = [v.read_value() for v in grad_vars]
        sent = []
        tokens = [ops.build_send(grad_tensors, s, lambda s, arrays: sent.append(object_store.put(arrays)))
                  for s in layout]
        shared = [shared_memory.array(shared_memory.SharedBuffer(s.nbytes).memory, s.dtype, 0, s.size)
                  for s in layout]

        def copy_to_shared(partition, arrays):
            for seg, a in zip(segments(partition), arrays):
                np.copyto(shared[partition.index][seg.start:seg.start + seg.size], a.reshape(-1))

        shared_tokens = [ops.build_send(grad_tensors, s, copy_to_shared) for s in layout]
        packed = [ops.pack(grad_tensors, s) for s in layout]
        pack_only = [ops.data_address(p) for p in packed]  # runs the packs, copies nothing out

        def put_packed(array):
            sent.append(ray.put(array))
            return np.int64(0)

        pack_put = [tf.numpy_function(put_packed, [p], tf.int64) for p in packed]
    sess = tf.compat.v1.Session(graph=graph)
    sess.run([v.initializer for v in grad_vars])

    results["    DsgdPack alone (in graph)"] = timed(lambda: sess.run(pack_only), args.reps)

    def graph_run(fetches):
        sess.run(fetches)
        sent.clear()

    results["(b) DsgdPack + ray.put of the packed partition"] = timed(lambda: graph_run(pack_put), args.reps)
    results["(c) dsgd.ops.build_send (segments, one copy)"] = timed(lambda: graph_run(tokens), args.reps)
    results["(c2) build_send into shared memory (same node)"] = timed(lambda: graph_run(shared_tokens), args.reps)

    refs = [ray.put(pack(grads, s, np.empty(s.size, s.dtype))) for s in layout]
    with graph.as_default():
        placeholders = [tf.compat.v1.placeholder(tf.float32, [s.size]) for s in layout]
        fed = []
        for spec_index, spec in enumerate(specs):  # slice each gradient out of the fed partitions
            parts = [tf.slice(placeholders[i], [p.partition_offset], [p.size])
                     for i, s in enumerate(layout) for p in s.pieces if p.var_index == spec_index]
            flat = parts[0] if len(parts) == 1 else tf.concat(parts, 0)
            fed.append(tf.reshape(flat, spec.shape))
        received = ops.unpack([ops.receive_partition(lambda s=s: ray.get(refs[s.index]), s) for s in layout],
                              layout, specs)

        def consume(ts):
            return tf.add_n([tf.reshape(t, [-1])[0] for t in ts])

        consume_fed, consume_received = consume(fed), consume(received)
        partitions_only = [ops.data_address(ops.receive_partition(lambda s=s: ray.get(refs[s.index]), s))
                       for s in layout]

    def get_and_feed():
        arrays = ray.get(refs)
        sess.run(consume_fed, dict(zip(placeholders, arrays)))

    def zero_copy_receive():
        sess.run(consume_received)
        ops.drain_released()

    def receive_partitions_only():
        sess.run(partitions_only)
        ops.drain_released()

    results["(d) ray.get + feed_dict + tf.slice"] = timed(get_and_feed, args.reps)
    results["    zero-copy partitions only, no unpack"] = timed(receive_partitions_only, args.reps)
    results["(e) dsgd.ops.receive_partition + unpack (zero-copy)"] = timed(zero_copy_receive, args.reps)
    sess.close()
    ray.shutdown()

    print(f"{'':48s} {'wall ms':>8} {'GB/s':>6} {'CPU ms':>8}")
    for name, (seconds, cpu) in results.items():
        print(f"{name:48s} {seconds * 1e3:8.1f} {nbytes / seconds / 1e9:6.2f} {cpu * 1e3:8.1f}")
    a, b, c = (results[k] for k in ("(a) numpy pack + ray.put", "(b) DsgdPack + ray.put of the packed partition",
                                    "(c) dsgd.ops.build_send (segments, one copy)"))
    d, e = results["(d) ray.get + feed_dict + tf.slice"], results["(e) dsgd.ops.receive_partition + unpack (zero-copy)"]
    print(f"write, wall: (a)/(c) = {a[0] / c[0]:.2f}x, (b)/(c) = {b[0] / c[0]:.2f}x; "
          f"CPU: (a)/(c) = {a[1] / c[1]:.2f}x, (b)/(c) = {b[1] / c[1]:.2f}x   read, wall: (d)/(e) = {d[0] / e[0]:.2f}x")


if __name__ == "__main__":
    main()
