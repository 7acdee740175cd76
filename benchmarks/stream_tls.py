"""What TLS costs a stream in CPU: a pushing end and a server in this process, plain TCP against TLS, interleaved.

One ``dsgd.transport.streams`` pair per mode over loopback (no Ray, no link
limit: the CPU is the bound), TLS with a CA made for the run
(``benchmarks.tls_files``), as when Ray's TLS is on. A round: each mode, in
an order rotated every round, pushes a partition of `--mb` MB (float32, in
`--segments` segments, sent straight from the array) and waits for its
mean, the same size, to come back (the server answers with what it
received, without summing). Reported per mode, over the rounds after
`--warmup`: the median round trip, the process's median CPU time per round
trip (both ends: encrypt and decrypt both ways, with TLS), the GB/s one
core's CPU second moves (bytes moved both ways per CPU second), and TLS
against plain. Writes benchmarks/results/stream_tls.json (`--out`):

    .venv/bin/python benchmarks/stream_tls.py
"""

from __future__ import annotations

if not __package__:  # run as `python benchmarks/stream_tls.py`
    import _repo_path  # noqa: F401

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import common, tls_files
from dsgd.transport import streams

MODES = ("plain", "tls")
TIMEOUT_S = 60.0


class Pair:
    """A server end that answers each push with the bytes it received, and the pushing end joined to it."""

    def __init__(self, nbytes: int, segments: int, contexts: Any):
        self.inputs = np.zeros(nbytes // 4, np.float32)
        self.means = np.zeros_like(self.inputs)
        self.cuts = np.linspace(0, self.inputs.nbytes, segments + 1).astype(int)
        self.listener = streams.StreamListener("bench", "127.0.0.1", self._target,
                                               lambda step, j, epoch: ((), self.inputs), TIMEOUT_S,
                                               tls_context=contexts and contexts.server)
        self.stream = streams.Stream(self.listener.address, lambda step, j: self.means, TIMEOUT_S, TIMEOUT_S,
                                     tls_context=contexts and contexts.client)
        self.step = 0
        self.cpu_s: list[float] = []

    def _target(self, j: int, nbytes: int) -> list[memoryview]:
        memory = memoryview(self.inputs).cast("B")
        return [memory[a:b] for a, b in zip(self.cuts[:-1], self.cuts[1:])]

    def round_trip(self, data: np.ndarray) -> float:
        """Push ``data`` and wait for its mean; the wall time (and the CPU time, kept in ``cpu_s``)."""
        elements = self.cuts // 4
        cpu, start = time.process_time(), time.perf_counter()
        self.stream.send(self.step, 0, [data[a:b] for a, b in zip(elements[:-1], elements[1:])])
        self.stream.wait(self.step, 0, TIMEOUT_S)
        wall = time.perf_counter() - start
        self.cpu_s.append(time.process_time() - cpu)
        self.step += 1
        return wall

    def close(self) -> None:
        self.stream.close()
        self.listener.close()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=89.0, help="partition MB pushed and received per round trip "
                                                          "(89: ResNet-101's half of one worker's gradients)")
    p.add_argument("--segments", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", type=Path, default=common.RESULTS_DIR / "stream_tls.json")
    args = p.parse_args(argv)
    command = common.command_line("benchmarks.stream_tls", argv)
    print(f"command: {command}", flush=True)
    nbytes = int(args.mb * 1e6) // 4 * 4
    data = np.random.default_rng(0).standard_normal(nbytes // 4).astype(np.float32)
    with tempfile.TemporaryDirectory(prefix="dsgd-tls-") as scratch:
        contexts = tls_files.contexts(tls_files.make(Path(scratch)))
        pairs = {"plain": Pair(nbytes, args.segments, None), "tls": Pair(nbytes, args.segments, contexts)}
        try:
            times, _, interrupted = common.run_rounds({m: (lambda m=m: pairs[m].round_trip(data)) for m in MODES},
                                                      args.warmup + args.steps, args.warmup)
            encryption = pairs["tls"].stream.encryption
            for mode, pair in pairs.items():  # what came back is what went, both ways
                np.testing.assert_array_equal(pair.means, data, err_msg=mode)
        finally:
            for pair in pairs.values():
                pair.close()
    modes = {}
    for mode in MODES:
        wall, cpu = times[mode][args.warmup:], pairs[mode].cpu_s[args.warmup:]
        modes[mode] = {"median_ms": statistics.median(wall) * 1000, "cpu_median_ms": statistics.median(cpu) * 1000,
                       "gb_per_cpu_s": 2 * nbytes / 1e9 / statistics.median(cpu)}
    ratios = {"wall": modes["tls"]["median_ms"] / modes["plain"]["median_ms"],
              "cpu": modes["tls"]["cpu_median_ms"] / modes["plain"]["cpu_median_ms"]}
    table = "\n".join(["| mode | round trip ms | CPU ms | GB moved per CPU s |", "|---|---|---|---|",
                       *(f"| {m} | {r['median_ms']:.0f} | {r['cpu_median_ms']:.0f} | {r['gb_per_cpu_s']:.2f} |"
                         for m, r in modes.items())])
    print(f"\n{command}\n{args.mb:g} MB each way, {encryption}\n\n{table}\n\n"
          f"TLS / plain: {ratios['wall']:.2f}x wall, {ratios['cpu']:.2f}x CPU", flush=True)
    result = {"command": command, "mb": args.mb, "segments": args.segments, "warmup": args.warmup,
              "steps": args.steps, "interrupted": interrupted, "encryption": encryption, "modes": modes,
              "tls_over_plain": ratios, "times_s": times, **common.machine()}
    common.write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
