"""Loader and graph helpers for the dsgd C++ op library.

Every helper builds ordinary graph ops, so the step they go into may be a TF1
graph or a ``tf.function`` (``dsgd.exchange.ps.PsWorkerOps.build``). In a
``tf.function`` the sends and receives are ordered by their explicit control
dependencies alone, not by automatic control dependencies' chain of stateful
ops (``_run_independently``), so a send never waits for an earlier receive.

Write side: ``build_send`` hands a partition to a Python callback from inside the
graph, so each partition leaves as soon as its gradients exist. The partition travels
as segments (``dsgd.wire.partitions.segments``): large pieces as zero-copy views of the
gradient tensors, runs of small pieces packed by ``pack`` (one C++ pass); the
callback (``dsgd.exchange.ps``, through ``dsgd.transport.ends``) copies them
once, into a shared buffer or the object store. A compressed partition
(``dsgd.wire.codec``) has no views: ``pack`` converts float32 to its 16-bit wire
form while it copies, and ``unpack`` converts the 16-bit mean back.

Read side: ``receive_partition`` turns the numpy array a fetch function returns
(a view of a shared-memory mean buffer, or the zero-copy view ``ray.get``
gives of an object) into a tensor aliasing the same memory; ``unpack`` splits partitions into per-variable gradients that alias them.
The array is kept in a registry until the last tensor using its memory dies;
the C++ side then queues its handle and ``drain_released`` drops the array.

Diagnostics, which the engine does not call: ``live_buffers`` counts the
arrays TensorFlow still holds (a leak check), ``data_address`` gives a
tensor's data address when the graph runs (to see that a read is zero-copy).
The tests and benchmarks/ops_microbench.py use both.
"""

from __future__ import annotations

import ctypes
import threading
from collections import defaultdict
from typing import Any, Callable, Sequence

import numpy as np
import tensorflow as tf

from dsgd.wire import arrays
from dsgd.wire.partitions import VIEW_BYTES, Segment, Partition, VarSpec, piece_view, segments

__all__ = [
    "is_available", "load", "pack", "build_send", "receive_partition", "unpack",
    "owned_copy", "drain_released", "discard_unclaimed", "live_buffers", "data_address",
]

_lock = threading.Lock()
_ops: Any = None
_clib: ctypes.CDLL | None = None
_arrays: dict[int, np.ndarray] = {}  # handle -> array kept alive for TensorFlow


def load() -> Any:
    """Build (if needed) and load the op library; return its op module."""
    global _ops, _clib
    from dsgd.ops.build import build

    with _lock:
        if _ops is None:
            path = str(build())
            ops = tf.load_op_library(path)
            clib = ctypes.CDLL(path)
            clib.dsgd_register_buffer.restype = ctypes.c_int64
            clib.dsgd_register_buffer.argtypes = [ctypes.c_uint64, ctypes.c_uint64]
            for name in ("dsgd_drain_released", "dsgd_discard_unclaimed"):
                getattr(clib, name).restype = ctypes.c_uint64
                getattr(clib, name).argtypes = [ctypes.POINTER(ctypes.c_int64), ctypes.c_uint64]
            clib.dsgd_live_buffer_count.restype = ctypes.c_uint64
            _ops, _clib = ops, clib
        return _ops


def is_available() -> bool:
    """Whether the op library is built or can be built, and loads."""
    from dsgd.ops.build import BuildError

    try:
        load()
    except (BuildError, tf.errors.NotFoundError, OSError):
        return False
    return True


def _tf_dtype(dtype: np.dtype) -> tf.DType:
    return tf.as_dtype(np.dtype(dtype))


def _tf_wire_dtype(part: Partition | Segment) -> tf.DType:
    """The TensorFlow dtype of a partition's wire form: bf16, which numpy holds as uint16, is tf.bfloat16."""
    if part.wire_dtype == part.dtype:
        return _tf_dtype(part.dtype)
    return tf.bfloat16 if part.wire_dtype == np.dtype(np.uint16) else _tf_dtype(part.wire_dtype)


def _piece_attrs(items) -> dict[str, list[int]]:
    """Op attrs for ``items``: (input index, Piece) pairs."""
    return {
        "piece_input": [i for i, _ in items],
        "piece_var_offset": [p.var_offset for _, p in items],
        "piece_partition_offset": [p.partition_offset for _, p in items],
        "piece_size": [p.size for _, p in items],
    }


def _check_dtype(grad: tf.Tensor, var_index: int, part: Partition | Segment) -> None:
    if grad.dtype != _tf_dtype(part.dtype):
        raise TypeError(f"grads[{var_index}] has dtype {grad.dtype.name}, but its partition holds "
                        f"{np.dtype(part.dtype).name}")


def pack(grads: Sequence[tf.Tensor], part: Partition | Segment) -> tf.Tensor:
    """Flat 1-D tensor of ``part.size`` holding the pieces of ``grads`` of a partition or segment.

    ``grads`` are indexed by ``Piece.var_index`` (all variables' gradients, in
    the order of the specs the layout was planned from); only the ones this
    part uses become inputs. Alignment gaps are zero. The tensor is in the
    part's wire form (tf.bfloat16 or tf.float16 for a compressed one),
    converted while copying.
    """
    used = list(dict.fromkeys(p.var_index for p in part.pieces))
    position = {v: i for i, v in enumerate(used)}
    inputs = [tf.convert_to_tensor(grads[v]) for v in used]
    for v, t in zip(used, inputs):
        _check_dtype(t, v, part)
    return load().dsgd_pack(inputs, W=_tf_wire_dtype(part), partition_size=part.size,
                            **_piece_attrs([(position[p.var_index], p) for p in part.pieces]))


def build_send(grads: Sequence[tf.Tensor], partition: Partition,
               on_ready: Callable[[Partition, Any], None],
               inputs: Sequence[tf.Tensor] = (), view_bytes: int = VIEW_BYTES) -> tf.Tensor:
    """Hand ``partition``'s gradients to ``on_ready`` from inside the graph.

    When the graph runs, as soon as the partition's gradients exist,
    ``on_ready(partition, arrays, *input_values)`` is called with one flat array
    per segment in the wire dtype (zero-copy views of large pieces, packed runs
    of small ones, converted if compressed; valid only during the call),
    which typically copies them to the partition's
    parameter server. ``inputs`` are extra tensors whose numpy values are
    passed along (e.g. a step number); control dependencies on the returned
    token order sends.
    ``view_bytes``: see ``dsgd.wire.partitions.segments``.
    Returns an int64 scalar token (the partition index) to fetch or depend on.
    """
    parts = segments(partition, view_bytes)
    tensors = []
    for seg in parts:
        if seg.view:
            v = seg.pieces[0].var_index
            tensors.append(tf.convert_to_tensor(grads[v]))
            _check_dtype(tensors[-1], v, seg)
        else:
            tensors.append(pack(grads, seg))

    def send(*values: np.ndarray) -> np.int64:
        arrays = [piece_view(a, seg.pieces[0]) if seg.view else a.view(seg.wire_dtype) for a, seg in zip(values, parts)]
        on_ready(partition, arrays, *values[len(parts):])
        return np.int64(partition.index)

    token = tf.numpy_function(send, [*tensors, *inputs], tf.int64, stateful=True,
                              name=f"dsgd_send_{partition.index}")
    token.set_shape([])
    _run_independently(token)
    return token


def _run_independently(*tensors: tf.Tensor) -> None:
    """When a ``tf.function`` is being traced, take the ops of ``tensors`` out of automatic control
    dependencies' chain of stateful ops (which would order every send and receive of a step one after the
    other, ending the pipelining); they still run before the function returns. Nothing in a TF1 graph."""
    manager = tf.compat.v1.get_default_graph().experimental_acd_manager
    if manager is not None:
        for t in tensors:
            manager.run_independently(t.op)


def _register(array: np.ndarray) -> int:
    drain_released()
    address, nbytes = arrays.address_range(array)
    with _lock:
        handle = _clib.dsgd_register_buffer(address, nbytes)
        _arrays[handle] = array
    return handle


def receive_partition(fetch: Callable[..., np.ndarray], partition: Partition,
                  inputs: Sequence[tf.Tensor] = ()) -> tf.Tensor:
    """1-D tensor of ``partition`` that aliases the array ``fetch`` returns.

    ``fetch(*input_values)`` runs inside the graph (it may block, e.g. on
    ``ray.get``) and must return a C-contiguous array of ``partition.size``
    elements of ``partition.wire_dtype``; the tensor is in the matching
    TensorFlow dtype. The array is kept alive until TensorFlow
    drops every tensor using its memory (see ``drain_released``).
    """
    load()
    dtype = partition.wire_dtype

    def fetch_and_register(*values: np.ndarray) -> np.int64:
        array = fetch(*values)
        if not isinstance(array, np.ndarray) or array.dtype != dtype or array.size != partition.size:
            raise ValueError(
                f"fetch for partition {partition.index} must return a numpy array of {partition.size} "
                f"{dtype.name} elements, got {type(array).__name__} "
                f"{getattr(array, 'dtype', '')} of size {getattr(array, 'size', '?')}")
        return np.int64(_register(array))

    handle = tf.numpy_function(fetch_and_register, list(inputs), tf.int64, stateful=True,
                               name=f"dsgd_fetch_{partition.index}")
    handle.set_shape([])
    tensor = _ops.dsgd_alias_tensor(handle, T=_tf_wire_dtype(partition), size=partition.size)
    _run_independently(handle, tensor)
    return tensor


def unpack(partition_tensors: Sequence[tf.Tensor], layout: Sequence[Partition],
           specs: Sequence[VarSpec]) -> list[tf.Tensor]:
    """Per-variable gradients (shapes of ``specs``) from the layout's partitions.

    ``partition_tensors[i]`` holds ``layout[i]``, in its wire form. A variable
    held in one piece aliases its partition; one split over several partitions, or
    in a compressed partition (converted to float32 here), is copied together
    (one op per group of variables spanning the same partitions, so a group only
    waits for its own partitions). Zero-size variables get zero-size constants.
    """
    load()
    pieces = defaultdict(list)  # var_index -> [(layout position, piece)]
    for position, partition in enumerate(layout):
        for p in partition.pieces:
            pieces[p.var_index].append((position, p))
    groups = defaultdict(list)  # partition positions -> var indices
    for v, owned in pieces.items():
        groups[tuple(sorted({pos for pos, _ in owned}))].append(v)
    grads: list[tf.Tensor | None] = [None] * len(specs)
    for positions, var_indices in groups.items():
        input_of = {pos: i for i, pos in enumerate(positions)}
        output_of = {v: k for k, v in enumerate(var_indices)}
        flat = [(pos, p) for v in var_indices for pos, p in pieces[v]]
        outputs = _ops.dsgd_unpack(
            [partition_tensors[pos] for pos in positions],
            T=_tf_dtype(specs[var_indices[0]].dtype),
            num_outputs=len(var_indices),
            shapes=[specs[v].shape for v in var_indices],
            piece_output=[output_of[p.var_index] for _, p in flat],
            **_piece_attrs([(input_of[pos], p) for pos, p in flat]))
        for v, t in zip(var_indices, outputs):
            grads[v] = t
    for v, spec in enumerate(specs):
        if grads[v] is None:
            grads[v] = tf.zeros(spec.shape, _tf_dtype(spec.dtype))
    return grads


def owned_copy(tensor: tf.Tensor) -> tf.Tensor:
    """A copy of ``tensor`` in memory of its own, to assign to a variable.

    A tensor that aliases a received buffer (``unpack``'s outputs) assigned
    as it is makes the variable share that buffer (TensorFlow's assign keeps
    the value's buffer when it can): the buffer stays alive, and its next
    write changes the variable.
    """
    return tf.raw_ops.DeepCopy(x=tensor)


def _drop_arrays(function_name: str) -> int:
    """Drop the arrays whose handles the C++ function ``function_name`` hands back; the count."""
    if _clib is None:
        return 0
    buffer = (ctypes.c_int64 * 256)()
    handles: list[int] = []
    while True:
        n = getattr(_clib, function_name)(buffer, len(buffer))
        handles.extend(buffer[:n])
        if n < len(buffer):
            break
    with _lock:
        for h in handles:
            _arrays.pop(h, None)
    return len(handles)


def drain_released() -> int:
    """Drop the arrays TensorFlow no longer uses; return how many were dropped.

    Called on every fetch; the engine should also call it after each
    ``session.run`` so the arrays (object-store objects among them) are released promptly.
    """
    return _drop_arrays("dsgd_drain_released")


def discard_unclaimed() -> int:
    """Drop arrays that were fetched but never turned into a tensor.

    That happens only when a ``session.run`` fails between the fetch and the
    op that aliases it; call this after such a failure. Returns the count.
    """
    return _drop_arrays("dsgd_discard_unclaimed")


def live_buffers() -> int:
    """Arrays currently registered (in use by TensorFlow or about to be)."""
    return 0 if _clib is None else int(_clib.dsgd_live_buffer_count())


def data_address(tensor: tf.Tensor) -> tf.Tensor:
    """int64 scalar: the address of ``tensor``'s data when the graph runs."""
    return load().dsgd_data_address(tensor)
