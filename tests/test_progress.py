"""The progress line (tqdm): plain lines in logs, one redrawn line on a terminal."""

import io

import pytest

from dsgd.progress import Progress


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
    assert [line.split("| ")[1].split(" ")[0] for line in lines] == ["2/5", "4/5", "5/5"]
    # 256 samples in 2 s; loss from step 3 (the last value given by step 4); 2 s done, 1 step left.
    assert "128 samples/s" in lines[1] and "loss 0.3333" in lines[1] and "[00:02<00:00" in lines[1]
    assert lines[2].startswith("100%|##########| 5/5 [00:02<00:00")
    assert lines[2].endswith("loss 0.2]")
    assert "\r" not in stream.getvalue()


def test_terminal_redraws_one_line_and_ends_it_on_close():
    clock, stream = FakeClock(), Terminal()
    bar = Progress(3, stream=stream, clock=clock)
    for step in range(3):
        clock.now += 1.0
        bar.update(samples=10, values={"loss": 3.0 - step})
    bar.close()
    text = stream.getvalue()
    assert "\r" in text and text.endswith("\n") and text.count("\n") == 1
    final = text.rstrip("\n").split("\r")[-1]
    assert "3/3" in final and "100%" in final and "10 samples/s, loss 1]" in final


def test_eta_of_the_remaining_steps():
    clock = FakeClock()
    bar = Progress(10, stream=io.StringIO(), clock=clock)
    clock.now += 30.0
    bar.update(steps=2)
    assert "2/10 [00:30<02:00" in bar.line()


def test_rejects_empty_total():
    with pytest.raises(ValueError, match="total"):
        Progress(0)
