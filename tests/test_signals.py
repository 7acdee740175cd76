"""The signal channel of a same-node worker-server pair (dsgd.transport.signals), in one process: no Ray."""

import concurrent.futures
import os
import threading

import pytest

from dsgd.transport import signals


def _threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"dsgd signals {name}"]


def test_answers_come_back_to_the_thread_waiting_for_each_and_errors_as_themselves():
    release = threading.Event()

    def answer(a, b):
        if b == 0:
            release.wait(30)  # the first request is answered only after the second has been asked for
        if b < 0:
            raise ValueError(f"bad request {(a, b)}")
        return a * 10 + b

    listener = signals.ChannelListener("answers", answer, 30)
    channel = signals.Channel(listener.address, 30)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        channel.send(1, 0)
        channel.send(1, 1)
        first = pool.submit(channel.wait, 1, 0, 30)
        second = pool.submit(channel.wait, 1, 1, 30)
        release.set()
        assert (first.result(timeout=30), second.result(timeout=30)) == (10, 11)
    channel.send(2, -1)
    with pytest.raises(ValueError, match=r"bad request \(2, -1\)"):
        channel.wait(2, -1, 30)
    listener.close()


def test_a_request_picked_apart_is_answered_on_its_own_thread_and_the_next_ones_go_on():
    """As a relayed partition's push: it waits on another node, the partitions after it must not wait for it."""
    release = threading.Event()

    def answer(a, b):
        if b == 1:
            assert release.wait(30)
        return a * 10 + b

    listener = signals.ChannelListener("apart", answer, 30, apart=lambda a, b: b == 1)
    channel = signals.Channel(listener.address, 30)
    for b in (0, 1, 2):
        channel.send(5, b)
    assert channel.wait(5, 0, 30) == 50
    assert channel.wait(5, 2, 30) == 52  # answered while request 1 still waits
    release.set()
    assert channel.wait(5, 1, 30) == 51
    listener.close()


def test_a_wait_is_bounded_and_forget_drops_the_answers_still_to_come():
    release = threading.Event()
    listener = signals.ChannelListener("forget", lambda a, b: release.wait(30) and (a, b), 30)
    channel = signals.Channel(listener.address, 30)
    channel.send(0, 0)
    with pytest.raises(TimeoutError):
        channel.wait(0, 0, 0.2)
    channel.forget()
    release.set()  # the old request's answer arrives now, after forget
    channel.send(0, 0)  # the same request again
    assert channel.wait(0, 0, 30) == (0, 0)
    with pytest.raises(TimeoutError):  # the old answer was dropped, not kept for a second wait
        channel.wait(0, 0, 0.2)
    listener.close()


def test_closing_either_end_ends_the_other_and_the_server_thread():
    # The listeners wait ACCEPT_S for a worker; each thread must end within JOIN_S, far sooner, so a thread
    # that only left when its accept timed out fails.
    ACCEPT_S, JOIN_S = 600, 60
    listener = signals.ChannelListener("close-server", lambda a, b: (a, b), ACCEPT_S)
    channel = signals.Channel(listener.address, 30)
    channel.send(0, 0)
    assert channel.wait(0, 0, 30) == (0, 0)
    listener.close()
    with pytest.raises(ConnectionError, match="closed the channel"):
        channel.wait(0, 1, ACCEPT_S)  # end-of-file at once, not after the bound
    for thread in _threads("close-server"):
        thread.join(JOIN_S)
        assert not thread.is_alive()

    listener = signals.ChannelListener("close-worker", lambda a, b: (a, b), ACCEPT_S)
    signals.Channel(listener.address, 30).close()
    for thread in _threads("close-worker"):
        thread.join(JOIN_S)
        assert not thread.is_alive()
    listener.close()

    listener = signals.ChannelListener("never-connected", lambda a, b: (a, b), ACCEPT_S)
    listener.close()  # a worker that fell back to the object store: the thread waiting in accept ends
    for thread in _threads("never-connected"):
        thread.join(JOIN_S)
        assert not thread.is_alive()


def test_a_channel_refuses_a_socket_not_held_by_the_given_process():
    listener = signals.ChannelListener("impostor", lambda a, b: (a, b), 30)
    pid, name = listener.address
    assert pid == os.getpid()
    with pytest.raises(ConnectionRefusedError, match=f"not held by process {pid + 1}"):
        signals.Channel((pid + 1, name), 30)
    listener.close()
