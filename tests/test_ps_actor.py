"""The parameter-server actor: many partitions per process, two transports, a fixed summing order,
and a bad push fails the step instead of hanging it."""

import concurrent.futures
import os

import numpy as np
import pytest
import ray

from dsgd.transport import object_store, streams
from dsgd import ps_actor
from dsgd.server.relays import Relay
from dsgd.wire import arrays, codec
from dsgd.errors import ActorFailure, DSGDTimeoutError, StepAborted
from dsgd.exchange.ps_client import ParameterServerClient
from dsgd.wire.partitions import VarSpec, plan_partitions, segments
from dsgd.transport.listener import shut_down
from dsgd.transport.ends import StreamWorkerEnd
from dsgd_test_models import Gate, pushes_waiting, wait_until

# Two partitions: one of two small variables (packed together), one of a large one (its own segment).
SPECS = [VarSpec("a", (5,), np.dtype(np.float32)), VarSpec("b", (3,), np.dtype(np.float32)),
         VarSpec("c", (20000,), np.dtype(np.float32))]
LAYOUT = plan_partitions(SPECS, 50_000)  # 80 KB in 2 partitions
SEGMENT_0 = segments(LAYOUT[0])[0].size


def _server(num_workers, timeout_s=30.0):
    return ps_actor.start(0, num_workers, LAYOUT, timeout_s)


def _data(rng, layout=LAYOUT):
    """One worker's flat copy of every partition (alignment gaps zero)."""
    out = []
    for partition in layout:
        flat = np.zeros(partition.size, np.float32)
        for p in partition.pieces:
            flat[p.partition_offset:p.partition_offset + p.size] = rng.standard_normal(p.size)
        out.append(flat)
    return out


def _segments_of(partition, flat):
    """A worker's copy of a partition as it travels: one array per segment."""
    return [flat[s.start:s.start + s.size] for s in segments(partition)]


def _stored(partition, flat):
    """What a remote worker pushes: the partition's segments as one object."""
    return object_store.put(_segments_of(partition, flat))


def _local_worker(server, worker_index):
    """This process as a worker on the server's node: the engine's client, over shared memory."""
    client = ParameterServerClient(worker_index, LAYOUT, [0] * len(LAYOUT), step_timeout_s=30, startup_timeout_s=30)
    assert client.connect([server]) == 1  # a worker on the server's node gets shared buffers
    return client


def _expected(parts):
    """The "simple" strategy's order: ((w0 + w1) + w2) / 3."""
    out = []
    for k in range(len(parts[0])):
        total = parts[0][k] + parts[1][k]
        for more in parts[2:]:
            total += more[k]
        out.append(total / np.float32(len(parts)))
    return out


def test_one_server_sums_many_partitions_in_worker_order_over_both_transports(ray_session):
    assert len(LAYOUT) == 2
    rng = np.random.default_rng(0)
    server = _server(3)
    local = _local_worker(server, 1)  # workers 0 and 2 stay remote
    for step, order in enumerate([(0, 1, 2), (2, 1, 0)]):
        parts = [_data(rng) for _ in range(3)]
        expected = _expected(parts)
        for partition in reversed(LAYOUT):  # partitions complete independently, in any order
            pushes = {}
            for w in order:
                if w == 1:  # the local worker announces its push on its signal channel
                    local.send(partition, step, _segments_of(partition, parts[w][partition.index]))
                else:
                    pushes[w] = server.push.remote(step, w, partition.index, _stored(partition, parts[w][partition.index]))
            local_mean = local.receive(partition, step)  # read in place in the shared mean buffer
            assert local.averaged[partition.index] == (0, 1, 2)
            np.testing.assert_array_equal(local_mean, expected[partition.index])  # bit for bit
            answers = {w: ray.get(push, timeout=30) for w, push in pushes.items()}
            assert {w: averaged for w, (_, averaged) in answers.items()} == {0: (0, 1, 2), 2: (0, 1, 2)}
            replies = {w: reply for w, (reply, _) in answers.items()}
            for w in (0, 2):
                [ref] = replies[w]
                [mean] = object_store.join(ray.get(ref, timeout=30), [partition.size])
                np.testing.assert_array_equal(mean, expected[partition.index])
            assert replies[0] == replies[2]  # one object of the mean, shared by the remote workers
    ray.kill(server)


def _remote_worker(server, worker_index, layout=LAYOUT):
    """This process as a worker on another node: the server offers it a stream (the node id is made up)."""
    info = ray.get(server.attach.remote(worker_index, "another node"), timeout=30)
    assert set(info) == {"stream", "slots"}
    return StreamWorkerEnd(info["stream"], info["slots"], layout, connect_timeout_s=30, send_timeout_s=30)


@pytest.mark.parametrize("layout", [LAYOUT, plan_partitions(SPECS, 1_000_000)], ids=["2 partitions", "2 segments"])
def test_a_worker_on_another_node_pushes_down_a_stream_and_reads_the_same_mean(ray_session, layout):
    """Workers 0 and 2 on another node, worker 1 on the server's; one partition of two segments (with an
    alignment gap between them) lands in place as well."""
    rng = np.random.default_rng(11)
    server = ps_actor.start(0, 3, layout, 30.0)
    local = ParameterServerClient(1, layout, [0] * len(layout), step_timeout_s=30, startup_timeout_s=30)
    assert local.connect([server]) == 1
    streams = {0: _remote_worker(server, 0, layout), 2: _remote_worker(server, 2, layout)}
    for step in range(3):
        parts = [_data(rng, layout) for _ in range(3)]
        expected = _expected(parts)
        for partition in layout:
            for w, end in streams.items():
                end.push(server, w, partition, step, end.write(partition, segments(partition), _segments_of(partition, parts[w][partition.index])))
            local.send(partition, step, _segments_of(partition, parts[1][partition.index]))
            np.testing.assert_array_equal(local.receive(partition, step), expected[partition.index])  # bit for bit
            for w, end in streams.items():
                reply, averaged = end.answer(partition, step, timeout_s=30)
                assert reply == [] and averaged == (0, 1, 2)
                np.testing.assert_array_equal(end.read_mean(partition, step, reply, None), expected[partition.index])
    # The remote workers' pushes came down their streams, counted as from another node.
    assert ray.get(server.traffic.remote(), timeout=30) == {partition.index: 2 * 3 for partition in layout}
    ray.kill(server)


def test_a_push_down_a_stream_is_taken_as_it_arrives_not_when_the_answers_before_it_are_sent(ray_session):
    """Two streams push the server's two partitions in opposite orders. Each stream's answers go out in order, so
    worker 0's answer to partition 0 waits for worker 1's push of it, which comes after worker 1's partition 1;
    that closes only because worker 0's partition 1, behind the waiting answer, was counted as it arrived. Had it
    been counted only when its answer's turn came, each stream would wait for the other (until the timeout)."""
    rng = np.random.default_rng(5)
    server = _server(2)
    ends = {w: _remote_worker(server, w) for w in (0, 1)}
    parts = [_data(rng) for _ in range(2)]
    expected = _expected(parts)
    for w, order in ((0, LAYOUT), (1, LAYOUT[::-1])):
        for partition in order:
            ends[w].push(server, w, partition, 0, _segments_of(partition, parts[w][partition.index]))
    for w, order in ((0, LAYOUT), (1, LAYOUT[::-1])):
        for partition in order:
            reply, averaged = ends[w].answer(partition, 0, timeout_s=30)
            assert averaged == (0, 1)
            np.testing.assert_array_equal(ends[w].read_mean(partition, 0, reply, None), expected[partition.index])
    ray.kill(server)


# One partition of two segments, each larger than a stream's chunk: summed chunk by chunk as the pushes arrive.
BIG_SPECS = [VarSpec("d", (300_000,), np.dtype(np.float32)), VarSpec("e", (90_001,), np.dtype(np.float32))]
BIG = plan_partitions(BIG_SPECS, 10_000_000)


def _send_part(end, partition, step, flat, start, stop):
    """Bytes ``[start, stop)`` of a push of ``partition`` down ``end``'s stream (the header first, if ``start`` is
    0): a push cut in two, as the network may deliver it."""
    data = np.concatenate(_segments_of(partition, flat)).view(np.uint8)
    if start == 0:
        end.stream._socket.sendall(streams.PUSH.pack(0, step, partition.index, data.nbytes))
    end.stream._socket.sendall(data[start:stop].tobytes())


def _answer_begun(end, timeout_s):
    """Whether an answer's first bytes reach ``end`` within ``timeout_s``."""
    import select
    return bool(select.select([end.stream._socket], [], [], timeout_s)[0])


@pytest.mark.parametrize("compression", [None, "bf16"])
def test_with_every_worker_on_a_stream_the_mean_leaves_while_the_last_push_still_comes_in(ray_session, compression):
    """Three workers on other nodes push a 1.56 MB partition (0.78 MB in bf16); the last sends half of it and stops.
    Every worker's answer has begun (the workers averaged, the mean as far as it is summed), the half-sent push's
    own too, before the rest is sent, and the means read in the end are the same bit for bit as a sum of the whole
    pushes."""
    layout = plan_partitions(BIG_SPECS, 10_000_000, compression=compression)
    [partition] = layout
    assert partition.wire_nbytes > 2 * streams.CHUNK_BYTES
    server = ps_actor.start(0, 3, layout, 30.0)
    ends = {w: _remote_worker(server, w, layout) for w in range(3)}
    rng = np.random.default_rng(8)
    for step in range(2):
        parts = [_data(rng, layout) for _ in range(3)]
        wire = [[codec.convert_into(np.empty(a.size, partition.wire_dtype), a)
                 for a in _segments_of(partition, parts[w][0])] for w in range(3)]
        expected = np.empty(partition.size, partition.wire_dtype)  # the whole pushes averaged, as "simple" does
        average = arrays.average_rounded_into if compression else arrays.average_into
        for k, segment in enumerate(segments(partition)):
            average(expected[segment.start:segment.start + segment.size], [w[k] for w in wire], 3)
        for w in (0, 1):
            ends[w].stream.send(step, partition.index, wire[w])
        flat = np.concatenate(wire[2])
        half = flat.nbytes // 2
        _send_part(ends[2], partition, step, flat, 0, half)
        assert all(_answer_begun(ends[w], 10) for w in range(3)), "an answer waited for the last push to be whole"
        _send_part(ends[2], partition, step, flat, half, flat.nbytes)
        for w in range(3):
            reply, averaged = ends[w].answer(partition, step, timeout_s=30)
            assert averaged == (0, 1, 2)
            np.testing.assert_array_equal(ends[w].read_mean(partition, step, reply, None).view(np.uint8),
                                          expected.view(np.uint8))
    ray.kill(server)


def test_servers_told_to_sum_whole_pushes_answer_only_once_every_push_is_in(ray_session, monkeypatch):
    """``DSGD_SERVER_SUMS=whole`` (the benchmarks' comparison): no answer begins while a push is still coming;
    anything but "arriving" or "whole" is refused by name."""
    from dsgd.config import server_sums

    monkeypatch.setenv("DSGD_SERVER_SUMS", "whole")
    assert server_sums() == "whole"
    [partition] = BIG
    server = ps_actor.start(0, 2, BIG, 30.0, sums_as_arriving=server_sums() == "arriving")
    ends = {w: _remote_worker(server, w, BIG) for w in range(2)}
    parts = [_data(np.random.default_rng(10), BIG) for _ in range(2)]
    ends[0].stream.send(0, partition.index, _segments_of(partition, parts[0][0]))
    flat = np.concatenate(_segments_of(partition, parts[1][0]))
    _send_part(ends[1], partition, 0, flat, 0, flat.nbytes // 2)
    assert not _answer_begun(ends[0], 1.0)
    _send_part(ends[1], partition, 0, flat, flat.nbytes // 2, flat.nbytes)
    reply, _ = ends[0].answer(partition, 0, timeout_s=30)
    np.testing.assert_array_equal(ends[0].read_mean(partition, 0, reply, None), _expected([p[0:1] for p in parts])[0])
    ray.kill(server)
    monkeypatch.setenv("DSGD_SERVER_SUMS", "chunked")
    with pytest.raises(ValueError, match=r"DSGD_SERVER_SUMS='chunked': expected one of \('arriving', 'whole'\)"):
        server_sums()


def test_a_step_that_fails_while_its_mean_leaves_as_summed_cuts_the_streams_and_the_workers_attach_anew(ray_session):
    """Worker 1's push stops half way and the driver aborts the step: worker 0, whose answer had begun, reads the
    end of its stream at once (its frame cannot be finished), not the timeout; after the reset both attach anew
    and the step runs again."""
    [partition] = BIG
    server = ps_actor.start(0, 2, BIG, 60.0)
    ends = {w: _remote_worker(server, w, BIG) for w in range(2)}
    parts = [_data(np.random.default_rng(9), BIG) for _ in range(2)]
    ends[0].stream.send(0, partition.index, _segments_of(partition, parts[0][0]))
    flat = np.concatenate(_segments_of(partition, parts[1][0]))
    _send_part(ends[1], partition, 0, flat, 0, flat.nbytes // 2)
    assert _answer_begun(ends[0], 10)
    ray.get(server.abort.remote(0), timeout=30)
    with pytest.raises(ConnectionError):
        ends[0].answer(partition, 0, timeout_s=20)
    ray.get(server.reset.remote(0, 1), timeout=30)
    for end in ends.values():
        end.close()
    ends = {w: _remote_worker(server, w, BIG) for w in range(2)}
    for w, end in ends.items():
        end.stream.send(0, partition.index, _segments_of(partition, parts[w][0]))
    for end in ends.values():
        reply, averaged = end.answer(partition, 0, timeout_s=30)
        assert averaged == (0, 1)
        np.testing.assert_array_equal(end.read_mean(partition, 0, reply, None), _expected([p[0:1] for p in parts])[0])
    ray.kill(server)


def test_a_stream_push_of_the_wrong_size_fails_the_step_and_the_stream_goes_on(ray_session):
    server = _server(2)
    partition = LAYOUT[1]
    end = _remote_worker(server, 0)
    end.stream.send(0, partition.index, [np.zeros(7, np.float32)])
    with pytest.raises(ValueError, match=f"expects {partition.wire_nbytes} bytes of partition 1 from worker 0, it sent 28"):
        end.answer(partition, 0, timeout_s=30)
    end.stream.send(0, 5, [np.zeros(3, np.float32)])
    with pytest.raises(ValueError, match=r"does not serve partition 5 \(worker 0 pushed it\); it serves \[0, 1\]"):
        end.stream.wait(0, 5, timeout_s=30)
    ray.kill(server)


def test_a_stream_sees_its_server_die_at_once_and_refuses_a_wrong_token(ray_session):
    server = _server(2)
    info = ray.get(server.attach.remote(0, "another node"), timeout=30)
    host, port, token = info["stream"]
    with pytest.raises(ConnectionError):  # the listener closes a connection without its token
        wrong = StreamWorkerEnd((host, port, bytes(len(token))), 1, LAYOUT, 30, 30)
        wrong.answer(LAYOUT[0], 0, timeout_s=30)
    end = StreamWorkerEnd(info["stream"], 1, LAYOUT, 30, 30)  # the right one still gets in
    partition = LAYOUT[0]
    end.push(server, 0, partition, 0, _segments_of(partition, _data(np.random.default_rng(4))[0]))
    ray.kill(server)  # worker 1 never pushes: the wait ends with the server, not at the timeout
    with pytest.raises(ConnectionError):
        end.answer(partition, 0, timeout_s=60)


def test_a_push_waits_for_every_worker(ray_session):
    server = _server(2)
    partition = LAYOUT[0]
    flat = _data(np.random.default_rng(2))[0]
    first = server.push.remote(0, 0, 0, _stored(partition, flat))
    wait_until(lambda: pushes_waiting(server) == {0: [1]})  # worker 0's push arrived; the partition waits for 1
    assert not ray.wait([first], timeout=0)[0]
    ray.get(server.push.remote(0, 1, 0, _stored(partition, flat)), timeout=30)
    [ref], _ = ray.get(first, timeout=30)
    np.testing.assert_array_equal(object_store.join(ray.get(ref), [partition.size])[0], flat)
    ray.kill(server)


def test_a_push_waits_at_most_the_step_timeout_and_names_the_missing_workers(ray_session):
    server = _server(3, timeout_s=1.0)
    partition = LAYOUT[0]
    first = server.push.remote(0, 0, 0, _stored(partition, _data(np.random.default_rng(3))[0]))
    with pytest.raises(DSGDTimeoutError, match=r"parameter server 0 waited more than 1s for workers \[1, 2\] "
                                                    r"to push partition 0 of step 0"):
        ray.get(first, timeout=30)
    ray.kill(server)


@pytest.mark.parametrize("bad, message", [
    ([np.zeros(7, np.float32)], "segments of sizes"),
    ([np.zeros(SEGMENT_0, np.float64)], "float64"),
])
def test_a_bad_push_fails_the_step_for_every_pusher(ray_session, bad, message):
    server = _server(3)
    partition = LAYOUT[0]
    good = _data(np.random.default_rng(3))[0]
    waiting = server.push.remote(0, 0, 0, _stored(partition, good))
    with pytest.raises(ValueError, match=message):
        ray.get(server.push.remote(0, 1, 0, object_store.put(bad)), timeout=30)
    for ref in (waiting, server.push.remote(0, 2, 0, _stored(partition, good))):
        with pytest.raises(ValueError, match=message):
            ray.get(ref, timeout=30)  # an error at once, not a wait for a sum that cannot come
    ray.kill(server)


def test_push_of_the_wrong_step_partition_or_twice_is_refused(ray_session):
    server = _server(2)
    partition = LAYOUT[0]
    flat = _data(np.random.default_rng(1))[0]
    waiting = server.push.remote(0, 0, 0, _stored(partition, flat))
    with pytest.raises(ValueError, match="pushed partition 0 of step 0 twice"):
        ray.get(server.push.remote(0, 0, 0, _stored(partition, flat)), timeout=30)
    with pytest.raises(ValueError, match="is summing step 0 of partition 0 but worker 1 pushed step 5"):
        ray.get(server.push.remote(5, 1, 0, _stored(partition, flat)), timeout=30)
    with pytest.raises(ValueError, match="twice"):
        ray.get(waiting, timeout=30)  # the step failed for its waiting push too
    with pytest.raises(ValueError, match=r"does not serve partition 9 .* it serves \[0, 1\]"):
        ray.get(server.push.remote(0, 0, 9, _stored(partition, flat)), timeout=30)
    with pytest.raises(ValueError, match="no shared input buffer"):
        ray.get(server.push.remote(0, 1, 1), timeout=30)  # no data and not attached on this node
    ray.kill(server)


@pytest.mark.parametrize("release", ["abort", "reset"])
def test_abort_and_reset_release_a_waiting_push(ray_session, release):
    server = _server(2)
    partition = LAYOUT[1]
    flat = _data(np.random.default_rng(5))[1]
    waiting = server.push.remote(0, 0, 1, _stored(partition, flat))
    wait_until(lambda: pushes_waiting(server) == {1: [1]})  # the push waits
    ray.get(server.abort.remote(0) if release == "abort" else server.reset.remote(0, 1), timeout=30)
    with pytest.raises(StepAborted):
        ray.get(waiting, timeout=30)
    ray.get(server.reset.remote(0, 2), timeout=30)
    pushes = [server.push.remote(0, w, 1, _stored(partition, flat)) for w in range(2)]  # usable again
    [ref], _ = ray.get(pushes[1], timeout=30)
    np.testing.assert_array_equal(object_store.join(ray.get(ref), [partition.size])[0], flat)
    ray.kill(server)


def test_an_abort_sent_before_a_reset_the_server_already_took_is_ignored(ray_session):
    """The server is a threaded actor, so Ray may run the driver's abort after the reset sent behind it; that late
    abort must not fail the step the reset made ready (it did: an engine's next step after a Ctrl-C in a resize
    raised StepAborted). An abort of the server's own generation still aborts."""
    server = _server(2)
    partition = LAYOUT[1]
    flat = _data(np.random.default_rng(6))[1]
    ray.get(server.reset.remote(0, 1), timeout=30)
    ray.get(server.abort.remote(0), timeout=30)  # sent in generation 0, taken after the reset to generation 1
    pushes = [server.push.remote(0, w, 1, _stored(partition, flat)) for w in range(2)]
    [ref], averaged = ray.get(pushes[1], timeout=30)
    assert averaged == (0, 1)
    np.testing.assert_array_equal(object_store.join(ray.get(ref), [partition.size])[0], flat)
    ray.get(server.abort.remote(1), timeout=30)
    with pytest.raises(StepAborted, match="step 1 was aborted"):
        ray.get(server.push.remote(1, 0, 1, _stored(partition, flat)), timeout=30)
    ray.kill(server)


@pytest.mark.parametrize("release", ["abort", "reset"])
def test_abort_and_reset_reach_a_local_worker_blocked_on_its_signal(ray_session, release):
    """A local worker's wait is on its signal channel, not on Ray: the driver's abort or reset still ends it."""
    server = _server(2)
    local = _local_worker(server, 1)
    partition = LAYOUT[1]
    local.send(partition, 0, _segments_of(partition, _data(np.random.default_rng(5))[1]))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        receiving = pool.submit(local.receive, partition, 0)
        wait_until(lambda: pushes_waiting(server) == {1: [0]})  # the push waits for worker 0
        assert not receiving.done()
        ray.get(server.abort.remote(0) if release == "abort" else server.reset.remote(0, 1), timeout=30)
        with pytest.raises(StepAborted, match=f"step 0 was {release}"):
            receiving.result(timeout=30)
    ray.kill(server)


def test_a_local_worker_drops_the_answers_of_a_failed_step(ray_session):
    """After an abort, a worker forgets its pushes: the re-run of the step gets means, not the old step's aborts."""
    server = _server(2)
    local = _local_worker(server, 1)
    parts = [_data(np.random.default_rng(7)) for _ in range(2)]
    for partition in LAYOUT:  # step 0, both partitions: worker 0 never comes
        local.send(partition, 0, _segments_of(partition, parts[1][partition.index]))
    wait_until(lambda: pushes_waiting(server) == {0: [0]})  # partition 1 is announced behind partition 0
    ray.get(server.abort.remote(0), timeout=30)
    with pytest.raises(StepAborted):
        local.receive(LAYOUT[0], 0)  # the step fails at its first partition; partition 1's abort is still to come
    local.forget_pushes()
    ray.get(server.reset.remote(0, 2), timeout=30)
    expected = _expected(parts)
    for partition in LAYOUT:  # step 0 again, both workers
        local.send(partition, 0, _segments_of(partition, parts[1][partition.index]))
        ray.get(server.push.remote(0, 0, partition.index, _stored(partition, parts[0][partition.index])), timeout=30)
    for partition in LAYOUT:
        np.testing.assert_array_equal(local.receive(partition, 0), expected[partition.index])
    ray.kill(server)


def test_a_local_worker_waits_for_a_stuck_server_within_its_bound_and_for_a_killed_one_not_at_all(ray_session):
    server = _server(2)
    local = ParameterServerClient(1, LAYOUT, [0] * len(LAYOUT), step_timeout_s=1, startup_timeout_s=30)
    assert local.connect([server]) == 1
    flat = _data(np.random.default_rng(8))
    local.send(LAYOUT[0], 0, _segments_of(LAYOUT[0], flat[0]))
    with pytest.raises(DSGDTimeoutError, match=r"worker 1 waited more than 1s for parameter server 0's sum of "
                                               r"partition 0, step 0"):
        local.receive(LAYOUT[0], 0)  # worker 0 never pushes: the server lives but the mean never comes
    other = _local_worker(server, 0)  # waits up to 30s
    other.send(LAYOUT[1], 0, _segments_of(LAYOUT[1], flat[1]))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        receiving = pool.submit(other.receive, LAYOUT[1], 0)
        wait_until(lambda: pushes_waiting(server) == {0: [0], 1: [1]})
        ray.kill(server)
        # the signal channel ends with the server: the wait fails at once, as a dead actor, not after its bound
        with pytest.raises(ActorFailure, match="worker 0 lost parameter server 0's sum of partition 1, step 0: "
                                               "the parameter server closed the channel"):
            receiving.result(timeout=60)


def test_a_push_whose_peers_never_come_times_out_with_their_names(ray_session):
    server = _server(3, timeout_s=0.5)
    flat = _data(np.random.default_rng(6))[0]
    with pytest.raises(DSGDTimeoutError, match=r"workers \[1, 2\] to push partition 0 of step 0"):
        ray.get(server.push.remote(0, 0, 0, _stored(LAYOUT[0], flat)), timeout=30)
    ray.kill(server)


def _held_by(pid: int, worker_index: int) -> tuple[int, int]:
    """The input buffers (distinct memfds: a buffer's fd and its mapping's are one) and signal-channel sockets of
    ``worker_index`` that server process ``pid`` holds."""
    with open("/proc/net/unix") as f:  # a channel's server end is named after its server and worker
        sockets = {f"socket:[{line.split()[6]}]" for line in f if f"dsgd-ps0-w{worker_index}-" in line}
    buffers, channels = set(), 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        path = f"/proc/{pid}/fd/{fd}"
        try:
            target = os.readlink(path)
            if f"memfd:dsgd-ps0-w{worker_index}" in target:
                buffers.add(os.stat(path).st_ino)
        except FileNotFoundError:  # closed meanwhile
            continue
        channels += target in sockets
    return len(buffers), channels


def test_reattaching_a_worker_replaces_its_buffer_without_leaking_it(ray_session):
    server = _server(2)
    pid = ray.get(server.identity.remote(), timeout=30).pid
    # As after recoveries: each attach makes a new input buffer and signal channel. The old clients stay
    # alive, so their channels close only because the server closes its ends.
    clients = [_local_worker(server, 1) for _ in range(6)]
    wait_until(lambda: _held_by(pid, 1) == (1, 1))
    assert len(clients) == 6
    ray.kill(server)


def test_a_worker_closes_its_signal_channels_on_reattach_and_close(ray_session):
    server = _server(2)
    pid = ray.get(server.identity.remote(), timeout=30).pid
    client = _local_worker(server, 1)
    first = client.server_ends[0].channel
    client.connect([server])  # a re-attach (after a recovery): the old channel is closed, a new one made
    second = client.server_ends[0].channel
    assert first._socket.fileno() == -1 and second._socket.fileno() != -1
    wait_until(lambda: _held_by(pid, 1) == (1, 1))
    client.close()  # the servers were replaced: nothing of this client stays open
    assert second._socket.fileno() == -1 and client.ends == [] and client.server_ends == []
    ray.kill(server)


def _relayed_pair(layout=LAYOUT, timeout_s=30.0):
    """Server 0 sums both partitions; server 1 relays them for workers 2 and 3 (as on another node)."""
    home = ps_actor.start(0, 4, layout, timeout_s, node_sums={partition.index: [(2, 3)] for partition in layout})
    relay = ps_actor.start(1, 4, [], timeout_s, relays=[Relay(partition, 0, (2, 3)) for partition in layout])
    ray.get(relay.set_peers.remote([home, relay]), timeout=30)
    return home, relay


@pytest.mark.parametrize("compression", [None, "bf16"])
def test_a_relay_pushes_one_partial_sum_and_the_server_averages_by_worker_count(ray_session, compression):
    """Node-local aggregation: workers 2 and 3 reach the relay (2 through shared memory), which pushes their
    sum once (float32, also when the workers push bf16); the mean is ((w0 + w1) + (w2 + w3)) / 4 in float32
    (rounded once to bf16), the same for every worker, bit for bit."""
    rng = np.random.default_rng(7)
    layout = plan_partitions(SPECS, 50_000, compression)
    home, relay = _relayed_pair(layout)
    client = ParameterServerClient(2, layout, [0] * len(layout), step_timeout_s=30, startup_timeout_s=30)
    client.connect([home, relay], routes=[1] * len(layout))
    for step in range(2):
        parts = [[codec.convert_into(np.empty(s.size, s.wire_dtype), flat) for s, flat in zip(layout, _data(rng))]
                 for _ in range(4)]  # what each worker pushes, in the wire dtype
        for partition in layout:
            j = partition.index
            pushes = {w: home.push.remote(step, w, j, _stored(partition, parts[w][j])) for w in (0, 1)}
            pushes[3] = relay.push.remote(step, 3, j, _stored(partition, parts[3][j]))
            client.send(partition, step, _segments_of(partition, parts[2][j]))  # on its signal channel
            answers = {w: ray.get(push, timeout=30) for w, push in pushes.items()}
            received = client.receive(partition, step)  # in the relay's mean buffer
            assert {w: averaged for w, (_, averaged) in answers.items()} == {w: (0, 1, 2, 3) for w in (0, 1, 3)}
            assert client.averaged[j] == (0, 1, 2, 3)
            w0, w1, w2, w3 = (codec.to_float32(part[j]) for part in parts)
            mean = ((w0 + w1) + (w2 + w3)) / np.float32(4)
            expected = codec.convert_into(np.empty(partition.size, partition.wire_dtype), mean)
            np.testing.assert_array_equal(received, expected)
            for w in (0, 1, 3):
                [ref] = answers[w][0]
                np.testing.assert_array_equal(object_store.join(ray.get(ref), [partition.size])[0], expected)
            assert answers[3][0] == answers[0][0]  # the relay hands on the server's mean, not a copy
    # Per partition and step: workers 0 and 1 and the relay's one partial sum came through the object store.
    assert ray.get(home.traffic.remote(), timeout=30) == {partition.index: 3 * 2 for partition in layout}
    for actor in (home, relay):
        ray.kill(actor)


@pytest.mark.parametrize("compression", [None, "bf16"])
def test_a_relay_on_another_node_pushes_its_float32_partial_sum_down_a_stream(ray_session, compression):
    """As a relaying server on another node does (``set_peers``): ``attach_relay`` gives it a stream, its partial
    sums of workers 2 and 3 go down it in float32 and the means come back in the wire dtype, the same as workers
    0 and 1 read; a second attach (the relaying server was replaced) closes the first stream."""
    rng = np.random.default_rng(12)
    layout = plan_partitions(SPECS, 50_000, compression)
    home = ps_actor.start(0, 4, layout, 30.0, node_sums={partition.index: [(2, 3)] for partition in layout})
    partitions = [partition.index for partition in layout]
    with pytest.raises(ValueError, match=r"expects no partial sum of partition 0 as worker 3's"):
        ray.get(home.attach_relay.remote(1, 3, "another node", partitions), timeout=30)
    means = {partition.index: np.empty(partition.size, partition.wire_dtype) for partition in layout}

    def relay():
        address = ray.get(home.attach_relay.remote(1, 2, "another node", partitions), timeout=30)
        return streams.Stream(address, lambda step, partition: means[partition], 30, 30)

    first = relay()
    stream = relay()
    with pytest.raises(ConnectionError):  # the server closed the replaced relay's stream
        first.wait(0, 0, timeout_s=30)
    for step in range(2):
        parts = [[codec.convert_into(np.empty(s.size, s.wire_dtype), flat) for s, flat in zip(layout, _data(rng))]
                 for _ in range(4)]
        for partition in layout:
            j = partition.index
            pushes = {w: home.push.remote(step, w, j, _stored(partition, parts[w][j])) for w in (0, 1)}
            w0, w1, w2, w3 = (codec.to_float32(part[j]) for part in parts)
            stream.send(step, j, _segments_of(partition, w2 + w3))
            assert stream.wait(step, j, timeout_s=30) == (0, 1, 2, 3)
            mean = ((w0 + w1) + (w2 + w3)) / np.float32(4)
            expected = codec.convert_into(np.empty(partition.size, partition.wire_dtype), mean)
            np.testing.assert_array_equal(means[j], expected)
            for w, push in pushes.items():
                [ref], averaged = ray.get(push, timeout=30)
                assert averaged == (0, 1, 2, 3)
                np.testing.assert_array_equal(object_store.join(ray.get(ref), [partition.size])[0], expected)
    # Per partition and step: workers 0 and 1 through the object store and the partial sum down the stream.
    assert ray.get(home.traffic.remote(), timeout=30) == {partition.index: 3 * 2 for partition in layout}
    ray.kill(home)


def test_a_relays_stream_that_ended_with_both_servers_alive_is_opened_anew_by_reset(ray_session):
    """A relaying server (here in this process, posing as on another node) whose stream to its partition's
    server ended under it (a send cut short): the reset of the recovery opens a new stream, and the relay's
    partial sum and the mean travel on it."""
    rng = np.random.default_rng(13)
    home = ps_actor.start(0, 4, LAYOUT, 30.0, node_sums={partition.index: [(2, 3)] for partition in LAYOUT})
    relay = ps_actor.ParameterServer(1, 4, [], 30.0, relays=[Relay(partition, 0, (2, 3)) for partition in LAYOUT])
    relay.transports.node_id = "another node"
    try:
        relay.set_peers([home, None])
        first = relay.links.streams[0]
        shut_down(first._socket)
        with pytest.raises(OSError):
            first.send(0, 0, [np.zeros(LAYOUT[0].size, np.float32)])
        assert first.broken
        ray.get(home.reset.remote(0, 1), timeout=30)  # the recovery resets every server of the group
        relay.reset(0, 1)
        assert relay.relay_transports() == {0: "stream"} and not relay.links.streams[0].broken
        assert first._socket.fileno() == -1  # the old one closed
        partition = LAYOUT[0]
        parts = [_data(rng)[0] for _ in range(4)]
        pushes = {w: home.push.remote(0, w, 0, _stored(partition, parts[w])) for w in (0, 1)}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # the node's workers, into the relay
            relayed = [pool.submit(relay.push, 0, w, 0, ray.get(_stored(partition, parts[w]))) for w in (2, 3)]
            assert [f.result(timeout=30)[1] for f in relayed] == [(0, 1, 2, 3)] * 2
        [ref], averaged = ray.get(pushes[0], timeout=30)
        assert averaged == (0, 1, 2, 3)
        expected = ((parts[0] + parts[1]) + (parts[2] + parts[3])) / np.float32(4)
        np.testing.assert_array_equal(object_store.join(ray.get(ref), [partition.size])[0], expected)
    finally:
        for stream in relay.links.streams.values():
            stream.close()
        ray.kill(home)


def _hold_pushes_of(server, key: int, gate: Gate) -> None:
    """On ``server``: each push of contributor ``key`` (its relay's, for a node's partial sum) waits at ``gate``
    once read off its transport, before the server takes it; its outcome, the exception's name or "answered",
    goes to ``held_outcomes``."""
    def install(ps):  # runs in the server (nested: pickled by value)
        push, ps.held_outcomes = ps.push, []

        def held(step_id, worker_index, j, stored=None, generation=None):
            if worker_index != key:
                return push(step_id, worker_index, j, stored, generation)
            gate.pass_through()
            try:
                answer = push(step_id, worker_index, j, stored, generation)
            except Exception as e:
                ps.held_outcomes.append(type(e).__name__)
                raise
            ps.held_outcomes.append("answered")
            return answer

        ps.push = held

    ray.get(server.__ray_call__.remote(install), timeout=30)


def _taken_or_refused(server, key: int) -> tuple[bool, list[str]]:
    """Whether ``server`` holds a push of ``key`` for the step it sums, and the outcomes of its held pushes."""
    def look(ps):
        with ps.changed:
            return any(key in p.waiting for p in ps.partitions.values()), list(ps.held_outcomes)

    return ray.get(server.__ray_call__.remote(look), timeout=30)


def test_a_relays_partial_sum_read_before_a_reset_and_taken_after_it_does_not_count_in_the_re_run(ray_session,
                                                                                                   tmp_path):
    """A late push after a reset, made to happen: the relay's partial sum of step 0 came down its stream before
    the recovery's abort, and the server takes it only after its reset to step 0. It is refused, not counted as
    the relay's partial sum of step 0 run again: the re-run's own partial sum is, bit for bit."""
    rng = np.random.default_rng(14)
    partition = LAYOUT[0]
    home = ps_actor.start(0, 4, LAYOUT, 30.0, node_sums={p.index: [(2, 3)] for p in LAYOUT})
    means = {p.index: np.empty(p.size, p.wire_dtype) for p in LAYOUT}
    address = ray.get(home.attach_relay.remote(1, 2, "another node", [p.index for p in LAYOUT]), timeout=30)
    relay = streams.Stream(address, lambda step, j: means[j], 30, 30)  # this process as the relaying server
    gate = Gate(str(tmp_path / "relay-push"))
    gate.close()
    _hold_pushes_of(home, 2, gate)
    try:
        relay.send(0, 0, _segments_of(partition, _data(rng)[0]))  # the partial sum of the step that fails
        gate.wait_arrived()  # read off the stream, not taken
        ray.get(home.abort.remote(0), timeout=30)  # the recovery: abort, then reset to run step 0 again
        ray.get(home.reset.remote(0, 1), timeout=30)  # the group's generation 1
        relay.forget(1)  # as the relaying server's own reset to generation 1 does
        gate.open()
        wait_until(lambda: _taken_or_refused(home, 2) != (False, []))
        assert _taken_or_refused(home, 2) == (False, ["StepAborted"])
        w0, w1, partial = (_data(rng)[0] for _ in range(3))  # step 0 run again: workers 0, 1 and the relay's sum
        pushes = [home.push.remote(0, w, 0, _stored(partition, flat)) for w, flat in [(0, w0), (1, w1)]]
        relay.send(0, 0, _segments_of(partition, partial))
        assert relay.wait(0, 0, timeout_s=30) == (0, 1, 2, 3)
        np.testing.assert_array_equal(means[0], ((w0 + w1) + partial) / np.float32(4))
        assert [averaged for _, averaged in ray.get(pushes, timeout=30)] == [(0, 1, 2, 3)] * 2
    finally:
        relay.close()
        ray.kill(home)


def test_a_worker_of_a_relayed_node_pushing_to_the_server_is_refused(ray_session):
    home, relay = _relayed_pair()
    partition = LAYOUT[0]
    with pytest.raises(ValueError, match=r"expects partition 0 from \[0, 1, 2\] .* not from worker 3"):
        ray.get(home.push.remote(0, 3, 0, _stored(partition, _data(np.random.default_rng(8))[0])), timeout=30)
    for actor in (home, relay):
        ray.kill(actor)


def test_a_relay_whose_server_is_aborted_fails_its_workers_pushes(ray_session):
    home, relay = _relayed_pair()
    partition = LAYOUT[0]
    flat = _data(np.random.default_rng(9))[0]
    ray.get(home.abort.remote(0), timeout=30)
    pushes = [relay.push.remote(0, w, 0, _stored(partition, flat)) for w in (2, 3)]
    for push in pushes:
        with pytest.raises(StepAborted):
            ray.get(push, timeout=30)
    for actor in (home, relay):
        ray.kill(actor)
