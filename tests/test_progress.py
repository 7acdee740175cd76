"""The progress line: plain lines in logs, one redrawn line on a terminal."""

import io

import pytest

from dsgd.progress import Progress, format_duration


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_every_n_steps_and_at_the_end():
    clock, stream = FakeClock(), io.StringIO()
    bar = Progress(5, every=2, stream=stream, clock=clock)
    for step in range(5):
        clock.now += 0.5
        bar.update(samples=64, values={"loss": 1.0 / (step + 1)} if step % 2 == 0 else None)
    bar.close()
    lines = stream.getvalue().splitlines()
    assert [line.split("  ")[0] for line in lines] == ["step 2/5", "step 4/5", "step 5/5"]
    # 128 samples/s; loss from step 3 (the last value given by step 4); 1 s done, 1 step left.
    assert "128 samples/s" in lines[1] and "loss 0.3333" in lines[1] and "ETA 0:00" in lines[1]
    assert lines[2].endswith("loss 0.2  in 0:02")
    assert "\r" not in stream.getvalue()


def test_terminal_redraws_one_line_and_ends_it_on_close():
    clock, stream = FakeClock(), Terminal()
    bar = Progress(3, stream=stream, clock=clock)
    for _ in range(3):
        clock.now += 1.0
        bar.update(samples=10)
    bar.close()
    text = stream.getvalue()
    assert text.count("\r") == 3 and text.endswith("\n") and text.count("\n") == 1
    assert "step 3/3  [####################]  100%  10 samples/s  in 0:03" in text


def test_eta_and_durations():
    clock = FakeClock()
    bar = Progress(10, stream=io.StringIO(), clock=clock)
    clock.now += 30.0
    bar.update(steps=2)
    assert bar.line().endswith("ETA 2:00")
    assert [format_duration(s) for s in (42, 725, 3723)] == ["0:42", "12:05", "1:02:03"]


def test_rejects_empty_total():
    with pytest.raises(ValueError, match="total"):
        Progress(0)
