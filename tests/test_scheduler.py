"""A worker's send scheduler alone (dsgd.transport.scheduler, dsgd.transport.pacing), without Ray: every partition
pushed once a step on its lane, in the lane's order; a lane whose socket is full holds up no other; a failed lane
fails the step, which runs again on new lanes; and the means the servers' arithmetic makes do not depend on the
order the pushes arrive in."""

from __future__ import annotations

import random
import socket
import struct
import threading

import numpy as np
import pytest

from dsgd.server import sums
from dsgd.server.layout import Place
from dsgd.server.steps import PartitionSteps
from dsgd.transport import pacing
from dsgd.transport.scheduler import SendScheduler
from dsgd.wire.partitions import VarSpec, plan_partitions

LONG_S = 120  # a bound on waits that end as soon as what they wait for happens


class RecordingLanes:
    """Lanes that answer every push at once with its payload doubled, recording each push as (lane, j, step)."""

    def __init__(self, lane_of, fail_lane=None):
        self.lane_of = lane_of
        self.fail_lane = fail_lane
        self.pushed: list[tuple[int, int, int]] = []
        self.lock = threading.Lock()

    def push(self, j, step, payload):
        if self.lane_of[j] == self.fail_lane:
            raise ConnectionResetError(f"server {self.fail_lane} died")
        with self.lock:
            self.pushed.append((self.lane_of[j], j, step))
        return payload

    def mean(self, j, step, ticket):
        return ticket * 2

    def crosses_nodes(self, lane):
        return False

    def pace(self, lane, bytes_per_s):
        raise AssertionError("nothing here crosses nodes")


def _schedule(lanes, lane_of, policy="streams"):
    return SendScheduler(lanes, lane_of, pacing.policy(policy), [[j] for j in range(len(lane_of))])


@pytest.mark.parametrize("policy", ["streams", "rounds"])
def test_every_partition_is_pushed_once_a_step_on_its_lane_in_the_lanes_order(policy):
    lane_of = [0, 1, 2, 0, 1, 2, 0, 0]
    lanes = RecordingLanes(lane_of)
    scheduler = _schedule(lanes, lane_of, policy)
    try:
        rng = random.Random(0)
        for step in range(3):
            handed = list(range(len(lane_of)))
            rng.shuffle(handed)  # the step produces its partitions in any order
            for j in handed:
                scheduler.hand(j, step, 10 * step + j)
            assert [scheduler.result(j, step, LONG_S) for j in range(len(lane_of))] == \
                [2 * (10 * step + j) for j in range(len(lane_of))]
        for lane in set(lane_of):
            on_lane = [(j, step) for l, j, step in lanes.pushed if l == lane]
            assert on_lane == [(j, step) for step in range(3) for j in range(len(lane_of)) if lane_of[j] == lane]
        if policy == "rounds":  # one at a time, in the rounds' order, whatever the order handed over
            assert lanes.pushed == [(lane_of[j], j, step) for step in range(3) for j in range(len(lane_of))]
    finally:
        scheduler.close()


class SocketLanes:
    """Each lane a socketpair: a push sends the payload's bytes down the worker's end, a server thread per lane
    reads each push and answers with its byte count; lane ``stalled``'s server reads nothing until ``go``."""

    def __init__(self, lanes: int, stalled: int):
        self.ends = [socket.socketpair() for _ in range(lanes)]
        self.go = threading.Event()
        self.pushed = {lane: threading.Event() for lane in range(lanes)}  # a push returned on the lane
        for lane, (_, server) in enumerate(self.ends):
            threading.Thread(target=self._serve, args=(server, lane == stalled), daemon=True).start()

    def _serve(self, sock, stalled):
        if stalled:
            self.go.wait(LONG_S)
        try:
            while header := sock.recv(8, socket.MSG_WAITALL):
                (nbytes,) = struct.unpack("<q", header)
                got = 0
                while got < nbytes:
                    got += len(sock.recv(min(1 << 20, nbytes - got)))
                sock.sendall(struct.pack("<q", got))
        except OSError:
            pass

    def push(self, j, step, payload):
        lane, data = payload
        worker = self.ends[lane][0]
        worker.sendall(struct.pack("<q", len(data)))
        worker.sendall(data)
        self.pushed[lane].set()
        return lane

    def mean(self, j, step, lane):
        return struct.unpack("<q", self.ends[lane][0].recv(8, socket.MSG_WAITALL))[0]

    def crosses_nodes(self, lane):
        return False

    def close(self):
        for pair in self.ends:
            for sock in pair:
                sock.close()


def test_a_lane_whose_socket_is_full_holds_up_no_other_lane():
    """Lane 0's server stops reading; its push, far larger than a socket's buffers, blocks in sendall. Lane 1's
    partitions, handed over after it, still go and their answers come back; under the rounds' order (one push at a
    time) they would wait for lane 0's."""
    lanes = SocketLanes(2, stalled=0)
    lane_of = [0, 1, 1]
    scheduler = _schedule(lanes, lane_of)
    big = bytes(64 << 20)
    try:
        scheduler.hand(0, 0, (0, big))
        scheduler.hand(1, 0, (1, b"x" * 1000))
        scheduler.hand(2, 0, (1, b"y" * 3000))
        assert scheduler.result(1, 0, LONG_S) == 1000
        assert scheduler.result(2, 0, LONG_S) == 3000
        assert not lanes.pushed[0].is_set()  # lane 0 is still stuck in its send
        lanes.go.set()
        assert scheduler.result(0, 0, LONG_S) == len(big)
    finally:
        lanes.go.set()
        scheduler.close()
        lanes.close()


def test_the_rounds_policy_lets_one_partition_go_at_a_time_in_the_rounds_order():
    policy = pacing.InRounds()
    policy.attach(None, [0, 1], [[2, 0], [1, 3]])
    assert [policy.may_send(j) for j in range(4)] == [False, False, True, False]
    assert list(policy.sent(2)) == [0]  # each send frees the next in the rounds (its lane's sender is woken)
    assert [policy.may_send(j) for j in (0, 1, 3)] == [True, False, False]
    assert list(policy.sent(0)) == [1]
    assert list(policy.sent(1)) == [3]
    assert policy.may_send(3)
    assert list(policy.sent(3)) == []  # the step's last: the next starts at the first again (always free)
    assert policy.may_send(2) and not policy.may_send(0)
    policy.forget()
    assert policy.may_send(2) and not policy.may_send(1)


def test_the_equal_rate_policy_paces_the_lanes_that_cross_nodes_at_an_equal_share_of_the_link():
    class Lanes:
        paced = {}

        def crosses_nodes(self, lane):
            return lane != "local"

        def pace(self, lane, bytes_per_s):
            self.paced[lane] = bytes_per_s

    lanes = Lanes()
    pacing.policy("equal-rate:0.1").attach(lanes, ["local", 1, 2, 3, 4], [])
    assert lanes.paced == {lane: 0.1e9 / 8 // 4 for lane in (1, 2, 3, 4)}


@pytest.mark.parametrize("spec", ["equal-rate", "fast", "rounds:1", "equal-rate:x"])
def test_an_unknown_send_schedule_is_refused(spec):
    with pytest.raises(ValueError):
        pacing.policy(spec)


def test_a_dead_servers_lane_fails_the_step_at_once_and_the_re_run_on_new_lanes_pushes_each_partition_once():
    lane_of = [0, 1, 0, 1]
    dead = RecordingLanes(lane_of, fail_lane=1)
    scheduler = _schedule(dead, lane_of)
    try:
        scheduler.hand(1, 7, 1)  # the dead lane's first: its failure is in before the healthy lane reads a mean
        with pytest.raises(ConnectionResetError, match="server 1 died"):
            scheduler.result(1, 7, LONG_S)
        for j in (0, 2, 3):
            scheduler.hand(j, 7, j)
        for j in range(len(lane_of)):  # even the healthy lane's partitions: the step fails as a whole
            with pytest.raises(ConnectionResetError, match="server 1 died"):
                scheduler.result(j, 7, LONG_S)
        scheduler.forget()  # the worker's forget_pushes; the driver replaces the server, the worker re-attaches
        replaced = RecordingLanes(lane_of)
        scheduler.attach(replaced, lane_of, [[j] for j in range(len(lane_of))])
        for j in reversed(range(len(lane_of))):
            scheduler.hand(j, 7, j)
        assert [scheduler.result(j, 7, LONG_S) for j in range(len(lane_of))] == [0, 2, 4, 6]
        assert sorted(replaced.pushed) == [(0, 0, 7), (0, 2, 7), (1, 1, 7), (1, 3, 7)]
    finally:
        scheduler.close()


class Servers:
    """In-process servers' arithmetic: every partition's ``PartitionSteps`` and mean slot, pushes taken as they
    come, a step summed (``dsgd.server.sums``) once every worker's push is in."""

    def __init__(self, layout, workers):
        self.changed = threading.Condition()
        self.steps = {p.index: PartitionSteps(Place(p, 0, ((0, p.size),), (np.zeros(p.size, np.float32),)),
                                              {w: (w,) for w in range(workers)}, workers) for p in layout}

    def push(self, worker, j, step, array):
        with self.changed:
            p = self.steps[j]
            p.check(step, worker, "the test's server")
            p.waiting[worker] = [array.copy()]
            if p.closes(step, {}, 1):
                inputs, averaged = p.close(step)
                sums.average(p.place, step, inputs, len(averaged))
                p.keep(step, None, averaged, 1)
                self.changed.notify_all()

    def mean(self, j, step):
        with self.changed:
            assert self.changed.wait_for(lambda: self.steps[j].settled(step), LONG_S)
            return self.steps[j].place.mean(step).copy()


class WorkerLanes:
    """One worker's lanes to ``Servers``, a lane a server (``lane_of``); each push delayed a random moment, so the
    pushes of different workers arrive in a different order every run."""

    def __init__(self, servers, worker, rng):
        self.servers, self.worker, self.rng = servers, worker, rng
        self.lock = threading.Lock()

    def push(self, j, step, array):
        with self.lock:
            pause = self.rng.random() / 500
        threading.Event().wait(pause)
        self.servers.push(self.worker, j, step, array)

    def mean(self, j, step, ticket):
        return self.servers.mean(j, step)

    def crosses_nodes(self, lane):
        return False


def _run_step(layout, lane_of, grads, seed):
    """Every worker's scheduler hands its partitions over in an order of its own; the means read back."""
    servers = Servers(layout, len(grads))
    rng = random.Random(seed)
    schedulers = [_schedule(WorkerLanes(servers, w, random.Random(rng.random())), lane_of)
                  for w in range(len(grads))]
    try:
        for w, scheduler in enumerate(schedulers):
            order = list(range(len(layout)))
            rng.shuffle(order)
            for j in order:
                scheduler.hand(j, 0, grads[w][j])
        return [[scheduler.result(j, 0, LONG_S) for j in range(len(layout))] for scheduler in schedulers]
    finally:
        for scheduler in schedulers:
            scheduler.close()


def test_the_means_are_bit_for_bit_the_same_whatever_order_the_pushes_arrive_in():
    layout = plan_partitions([VarSpec(f"v{k}", (3000,), np.dtype(np.float32)) for k in range(6)], 12_000)
    lane_of = [p.index % 3 for p in layout]
    rng = np.random.default_rng(0)
    workers = 4
    grads = [[(rng.standard_normal(p.size) * 10.0 ** rng.integers(-4, 4, p.size)).astype(np.float32)
              for p in layout] for _ in range(workers)]
    expected = []
    for j in range(len(layout)):  # the "simple" strategy's order: ((w0 + w1) + w2 + w3) / 4
        total = grads[0][j] + grads[1][j]
        for w in range(2, workers):
            total = total + grads[w][j]
        expected.append(total / np.float32(workers))
    for seed in range(3):
        for means in _run_step(layout, lane_of, grads, seed):
            for got, want in zip(means, expected):
                assert got.tobytes() == want.tobytes()
