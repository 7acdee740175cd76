"""The engine's options: their allowed values, their checks, and what a worker is given.

``Options.checked`` turns ``DistributedSGD``'s arguments into one frozen
value or raises a ``ValueError`` naming the argument, what it got and what
it expects; nothing here touches Ray. ``WorkerConfig`` is the part of the
options a worker needs to build its graph, where ``use_ops`` is resolved
(``ops_wanted``).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from dsgd.transport import pacing
from dsgd.wire.codec import COMPRESSIONS

logger = logging.getLogger(__name__)

STRATEGIES = ("ps", "simple")
ALL_REDUCE_ALGS = ("simple", "nccl")
NAN_POLICIES = ("raise", "skip", "ignore")
# "ps": the policy of the workers' send schedulers (``dsgd.transport.pacing.policy``), read from the driver's
# environment as an engine is made; unset, ``DEFAULT_SEND_SCHEDULE``.
SEND_SCHEDULE_ENV = "DSGD_SEND_SCHEDULE"
DEFAULT_SEND_SCHEDULE = "streams"
# "ps": when a parameter server sums a partition that every worker pushes down a stream: "arriving" (chunk by
# chunk as the pushes come in, its mean going out as it is summed) or "whole" (once every push is in), read from
# the driver's environment as the servers start; unset, "arriving". "whole" is there to compare.
SERVER_SUMS_ENV = "DSGD_SERVER_SUMS"
SERVER_SUMS = ("arriving", "whole")


def server_sums() -> str:
    """The parameter servers' way of summing streamed pushes (``SERVER_SUMS_ENV``), checked."""
    sums = os.environ.get(SERVER_SUMS_ENV) or SERVER_SUMS[0]
    if sums not in SERVER_SUMS:
        raise ValueError(f"{SERVER_SUMS_ENV}={sums!r}: expected one of {SERVER_SUMS}")
    return sums


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker needs to build its graph, fixed at construction."""

    exchange: str  # how a step combines gradients: "alone", "simple" or "ps" (Options.exchange)
    devices_per_worker: int
    gpu: bool
    all_reduce_alg: str
    cpus_per_worker: int
    step_timeout_s: float  # bounds each wait inside a step (DistributedSGD's timeout_s)
    startup_timeout_s: float  # bounds each wait while connecting (DistributedSGD's startup_timeout_s)
    nan_policy: str = "raise"
    use_ops: bool = False  # "ps" exchange through the in-graph C++ ops (dsgd.ops)
    feed_concurrently: bool = False  # ask the replicas' get_feed_dict in threads of their own (Ray Data input)
    backup_workers: int = 0  # "ps": a step averages the first num_workers - backup_workers workers
    send_schedule: str = DEFAULT_SEND_SCHEDULE  # "ps": the send scheduler's policy (dsgd.transport.pacing)

    @property
    def applies_fed(self) -> bool:
        """Whether a step may apply means fed from Python: "simple" and the Python "ps" path (no op library), or
        a backup worker's catch-up. If not, the fed apply is built only to make the optimizer's slots, without
        its per-variable checks."""
        return not self.use_ops or self.backup_workers > 0


@dataclass(frozen=True)
class Options:
    """``DistributedSGD``'s arguments, checked (see its docstring for each); they never change (the count
    running now is ``dsgd.cluster.topology.Topology``'s)."""

    strategy: str
    num_workers: int  # the count asked for: an elastic engine's maximum
    devices_per_worker: int
    gpu: bool
    grad_shard_bytes: int | None
    all_reduce_alg: str
    num_parameter_servers: int | None
    cpus_per_worker: int
    nan_policy: str
    use_ops: bool | None
    max_failures: int
    timeout_s: float
    startup_timeout_s: float
    logdir: str | None
    batch_size: int | None
    compression: str | None
    backup_workers: int = 0
    min_workers: int | None = None  # num_workers=(min, max): the elastic bounds; None: a fixed count
    max_workers: int | None = None
    resize_interval_s: float = 60.0  # elastic engines: how often, at most, to look for room to grow
    server_resource: str | None = None  # "ps": the Ray custom resource of the nodes that hold the servers alone

    @classmethod
    def checked(cls, **given: Any) -> "Options":
        """The options, each checked; a ValueError names the first bad one."""
        _check_choice("strategy", given["strategy"], STRATEGIES)
        _check_choice("all_reduce_alg", given["all_reduce_alg"], ALL_REDUCE_ALGS)
        _check_choice("nan_policy", given["nan_policy"], NAN_POLICIES)
        if not isinstance(given["gpu"], bool):
            raise ValueError(f"gpu must be True or False, got {given['gpu']!r}")
        if given["all_reduce_alg"] == "nccl" and not given["gpu"]:
            raise ValueError("all_reduce_alg='nccl' needs gpu=True; use 'simple' on CPUs")
        if given["use_ops"] is not None and not isinstance(given["use_ops"], bool):
            raise ValueError(f"use_ops must be None, True or False, got {given['use_ops']!r}")
        compression = given["compression"]
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
        if compression is not None and given["strategy"] != "ps":
            raise ValueError(f"compression={compression!r} needs strategy='ps' (the parameter servers' wire); "
                             f"strategy={given['strategy']!r} sends float32: leave compression=None")
        if given["logdir"] is not None and not isinstance(given["logdir"], str):
            raise ValueError(f"logdir must be a directory path (str) or None, got {given['logdir']!r}")
        min_workers, max_workers = _check_worker_bounds(given["num_workers"])
        return cls(
            strategy=given["strategy"],
            num_workers=max_workers,
            devices_per_worker=check_int("devices_per_worker", given["devices_per_worker"], 1),
            gpu=given["gpu"],
            grad_shard_bytes=_check_optional_int("grad_shard_bytes", given["grad_shard_bytes"], 0),
            all_reduce_alg=given["all_reduce_alg"],
            num_parameter_servers=_check_optional_int("num_parameter_servers", given["num_parameter_servers"], 1),
            cpus_per_worker=check_int("cpus_per_worker", given["cpus_per_worker"], 1),
            nan_policy=given["nan_policy"],
            use_ops=given["use_ops"],
            max_failures=check_int("max_failures", given["max_failures"], 0),
            timeout_s=_check_seconds("timeout_s", given["timeout_s"]),
            startup_timeout_s=_check_seconds("startup_timeout_s", given["startup_timeout_s"]),
            logdir=given["logdir"],
            batch_size=_check_optional_int("batch_size", given["batch_size"], 1),
            compression=compression,
            backup_workers=_check_backup_workers(given.get("backup_workers", 0), given["strategy"], min_workers),
            min_workers=min_workers if isinstance(given["num_workers"], tuple) else None,
            max_workers=max_workers if isinstance(given["num_workers"], tuple) else None,
            resize_interval_s=_check_seconds("resize_interval_s", given["resize_interval_s"]),
            server_resource=_check_server_resource(given.get("server_resource"), given["strategy"]),
        )

    @property
    def elastic(self) -> bool:
        """``num_workers=(min, max)`` was given: the engine shrinks on losses it cannot replace and grows back."""
        return self.min_workers is not None

    def check_size(self, n: Any) -> int:
        """``n`` as a worker count for ``resize``: a TypeError if not an int, a ValueError if < 1 or out of bounds."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
            raise TypeError(f"resize(n): n must be an int (the number of workers), got {type(n).__name__} {n!r}")
        low, high = (self.min_workers, self.max_workers) if self.elastic else (1, None)
        if n < low or (high is not None and n > high):
            bounds = f"between {low} and {high} (num_workers={(low, high)})" if self.elastic else ">= 1"
            raise ValueError(f"resize(n): n must be {bounds}, got {n}")
        if self.backup_workers and n <= self.backup_workers:
            raise ValueError(f"resize(n): n must be > backup_workers={self.backup_workers} (a step averages "
                             f"n - backup_workers >= 1 workers), got {n}")
        return int(n)

    def worker_config(self, exchange: str, feed_concurrently: bool) -> WorkerConfig:
        """What a worker is built with, for the ``exchange`` of the engine's count now; ``use_ops`` resolved
        (``ops_wanted``), the send schedule read from ``SEND_SCHEDULE_ENV`` (checked)."""
        schedule = os.environ.get(SEND_SCHEDULE_ENV) or DEFAULT_SEND_SCHEDULE
        pacing.policy(schedule)
        return WorkerConfig(exchange, self.devices_per_worker, self.gpu, self.all_reduce_alg,
                            self.cpus_per_worker, self.timeout_s, self.startup_timeout_s, self.nan_policy,
                            use_ops=self.strategy == "ps" and ops_wanted(self.use_ops),
                            feed_concurrently=feed_concurrently, backup_workers=self.backup_workers,
                            send_schedule=schedule)


def ops_wanted(use_ops: bool | None) -> bool:
    """Whether the "ps" exchange uses the op library (``use_ops``; None: if it builds and loads, with a
    warning if not); builds it if needed."""
    if use_ops is False:
        return False
    from dsgd import ops

    if ops.is_available():
        return True
    if use_ops:
        ops.load()  # raises the build or load error, which says what is missing
    logger.warning("the dsgd op library could not be built or loaded (run `python -m dsgd.ops.build` "
                   "to see why); the 'ps' strategy exchanges partitions through Python instead")
    return False


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def check_int(name: str, value: Any, minimum: int, where: str = "") -> int:
    """``value`` as an int, or a ValueError naming ``name`` (``where`` says where the value came from)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}{where}")
    return int(value)


def _check_worker_bounds(value: Any) -> tuple[int, int]:
    """``num_workers``: an int n (bounds n, n) or a tuple (min, max) with 1 <= min <= max; else a ValueError."""
    if not isinstance(value, tuple):
        n = check_int("num_workers", value, 1)
        return n, n
    if len(value) != 2:
        raise ValueError(f"num_workers must be an int or a tuple (min, max) for an elastic engine, got {value!r}")
    low = check_int("num_workers", value[0], 1, " as min of num_workers=(min, max)")
    high = check_int("num_workers", value[1], 1, " as max of num_workers=(min, max)")
    if high < low:
        raise ValueError(f"num_workers=(min, max) needs min <= max, got {value!r}")
    return low, high


def _check_optional_int(name: str, value: Any, minimum: int) -> int | None:
    return None if value is None else check_int(name, value, minimum)


def _check_backup_workers(value: Any, strategy: str, num_workers: int) -> int:
    """``backup_workers``: an int, 0 or at most ``num_workers - 1`` with "ps" (num_workers already checked)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"backup_workers must be an integer (0 <= backup_workers < num_workers), "
                        f"got {value!r} of type {type(value).__name__}")
    if value == 0:
        return 0
    if value < 0:
        raise ValueError(f"backup_workers must be >= 0 (and < num_workers), got {value}")
    if strategy != "ps":
        raise ValueError(f"backup_workers needs strategy='ps' (the parameter servers close a step without the "
                         f"slowest workers), got backup_workers={value} with strategy={strategy!r}")
    if num_workers == 1:
        raise ValueError(f"backup_workers needs several workers (a step keeps num_workers - backup_workers >= 1 "
                         f"of them), got backup_workers={value} with num_workers=1")
    if value >= num_workers:
        raise ValueError(f"backup_workers must be < num_workers (a step averages num_workers - backup_workers >= 1 "
                         f"workers), got backup_workers={value} with num_workers={num_workers}")
    return int(value)


def _check_server_resource(value: Any, strategy: str) -> str | None:
    """``server_resource``: None, or the name of a Ray custom resource with strategy "ps"."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(f"server_resource must be None or the name of a Ray custom resource (a non-empty str, "
                         f"e.g. 'dsgd_server'), got {value!r}")
    if value in ("CPU", "GPU", "memory", "object_store_memory") or value.startswith("node:"):
        raise ValueError(f"server_resource must name a custom resource that marks the parameter servers' nodes "
                         f"(started with ray start --resources='{{\"dsgd_server\": 1}}'), not Ray's own {value!r}")
    if strategy != "ps":
        raise ValueError(f"server_resource needs strategy='ps' (it places the parameter servers), got "
                         f"server_resource={value!r} with strategy={strategy!r}")
    return value


def _check_seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)
