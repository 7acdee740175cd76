"""The linked cluster of benchmarks/links.py: nodes in network namespaces behind rate-limited veths.

The script runs in its own process (it starts its own Ray cluster of 4 nodes,
the scaling benchmark's middle size), in the background (``background_jobs``).
The run interrupts it with Ctrl-C (SIGINT) once it has measured every link
at the first rate; the test checks that the limit held and that nothing it
made is left: namespaces, links, processes.
"""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from background_jobs import QUEUE, Call
from benchmarks import linked_cluster
from benchmarks.linked_cluster import PREFIX, missing_requirements, tbf_args
from job_processes import stopped_at_session_end

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMIT_GBIT = 0.2
NODES = 4
START_TIMEOUT_S = 240


def _leftovers() -> list[str]:
    """Namespaces, links and processes named for a linked cluster that still exist."""
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    processes = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return [line for text in (namespaces, links) for line in text.splitlines() if PREFIX in line] + \
           [line for line in processes.splitlines() if "dsgd-ln-" in line and "ray" in line]


def _qdisc(node: int) -> tuple[str, str]:
    """`tc qdisc show` of node ``node``'s link: its head end here, its node end in the node's namespace."""
    names = linked_cluster.LinkedCluster(nodes=NODES, link_gbit=LIMIT_GBIT, temp_dir="")  # the script's naming
    head_end, node_end = names.veths(node)
    show = ["tc", "qdisc", "show", "dev"]
    return (subprocess.run([*show, head_end], capture_output=True, text=True).stdout,
            subprocess.run(["ip", "netns", "exec", names.namespace(node), *show, node_end],
                           capture_output=True, text=True).stdout)


def test_token_bucket_burst_fits_an_offloaded_segment_and_one_millisecond():
    assert tbf_args(1.0)[:5] == ["tbf", "rate", "1000mbit", "burst", str(128 << 10)]
    assert tbf_args(10.0)[4] == str(int(10e9 / 8 / 1000))


def ctrl_c_run(scratch: str, environ: dict[str, str]) -> dict:
    """Start the script, read each node's measured rate, look at every link's qdisc, Ctrl-C it during its second
    measurement: what it wrote, its exit code, the qdiscs and what of a linked cluster existed before and after."""
    before = _leftovers()
    job = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.linked_cluster", "--nodes", str(NODES),
         "--link-gbit", str(LIMIT_GBIT), str(LIMIT_GBIT), "--probe-mb", "8"],
        cwd=REPO, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.default_int_handler))
    output, rates, qdiscs = [], [], []
    deadline = time.monotonic() + START_TIMEOUT_S
    with stopped_at_session_end(job, subprocess.Popen.terminate):  # SIGTERM: the script tears its cluster down
        try:
            for line in job.stdout:
                output.append(line)
                match = re.match(r"link [\d.]+ Gbit/s, node (169\.254\.77\.\d+): node -> head ([\d.]+) Gbit/s, "
                                 r"head -> node ([\d.]+) Gbit/s", line)
                if match:
                    rates += [float(match[2]), float(match[3])]
                    if len(rates) == 2 * NODES:  # every node of the first rate measured: interrupt the second
                        qdiscs = [_qdisc(node) for node in range(1, NODES + 1)]
                        job.send_signal(signal.SIGINT)
                if time.monotonic() > deadline:
                    break
            job.wait(timeout=120)
        finally:
            if job.poll() is None:
                job.kill()
                job.wait()
    return {"before": before, "output": "".join(output), "rates": rates, "qdiscs": qdiscs,
            "returncode": job.returncode, "after": _leftovers()}


BACKGROUND_JOBS = {} if missing_requirements() else {"run": Call("linked-cluster", ctrl_c_run, START_TIMEOUT_S + 120)}


@pytest.fixture(scope="module")
def run() -> dict:
    return QUEUE.result(BACKGROUND_JOBS["run"])


@pytest.mark.skipif(missing_requirements() is not None, reason=f"linked cluster: {missing_requirements()}")
def test_links_hold_their_rate_and_ctrl_c_tears_everything_down(run):
    assert not run["before"], "a previous linked cluster was left behind"
    text, rates = run["output"], run["rates"]
    assert len(rates) >= 2 * NODES, text[-3000:]
    # Load on this machine can only lower a measured rate, so the bound below holds even if tc did nothing:
    # the token buckets themselves are asserted, on both ends of every link, at the rate asked for.
    for head_end, node_end in run["qdiscs"]:
        assert re.search(rf"qdisc tbf .* rate {LIMIT_GBIT * 1000:.0f}Mbit", head_end), head_end
        assert re.search(rf"qdisc tbf .* rate {LIMIT_GBIT * 1000:.0f}Mbit", node_end), node_end
    assert max(rates) <= LIMIT_GBIT * 1.1, f"a link beat its {LIMIT_GBIT} Gbit/s limit: {rates}"
    assert "KeyboardInterrupt" in text, text[-3000:]  # stopped by Ctrl-C, not finished
    assert run["returncode"] != 0
    assert not run["after"]


def test_without_root_the_script_says_why_and_starts_nothing(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SystemExit, match="needs root"):
        linked_cluster.main(["--nodes", "1"])
