"""The per-flow measurement tools, on made-up input: a traced step read partition by partition
(benchmarks.partition_timeline) and `ss -tin` samples cut into steps (benchmarks.flows)."""

import io

from benchmarks import flows, partition_timeline


def _event(pid, name, start_ms, dur_ms):
    return {"ph": "X", "pid": pid, "tid": 0, "name": name, "ts": start_ms * 1000.0, "dur": dur_ms * 1000.0}


def test_a_traced_step_gives_each_partitions_pushes_sum_and_reads_and_each_links_span():
    names = ["driver", "worker 0", "worker 1", "parameter server 0"]
    trace = {"traceEvents": [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}}
                             for pid, name in enumerate(names)] + [
        _event(1, "push partition 0", 0, 10), _event(2, "push partition 0", 5, 20),
        _event(3, "worker 0's push of partition 0 (waits for the sum)", 11, 20),
        _event(3, "worker 1's push of partition 0 (waits for the sum)", 26, 5),
        _event(3, "average partition 0 of workers [0, 1]", 26, 4),
        _event(1, "answer of partition 0", 10, 25), _event(2, "read the mean of partition 0", 40, 2)]}
    [(j, p)] = partition_timeline.partitions_of(trace).items()
    assert (j, p.server, p.pushes, p.summed) == (0, 0, {0: (0, 10000), 1: (5000, 25000)}, 30000)
    assert (p.taken, p.read) == ({0: 11000, 1: 26000}, {0: 35000, 1: 42000})
    lines = partition_timeline.report({0: p})
    assert lines[-1] == "last push ends 25 ms, last sum 30 ms, last mean read 42 ms"
    assert any(line.split() == ["1", "->", "0", "5", "25", "20"] for line in lines)


def test_flow_samples_are_parsed_and_cut_into_each_steps_bytes_start_end_and_rate():
    class Cluster:
        linked = ()

    monitor = flows.FlowMonitor(Cluster(), {"10.0.0.2": "node 1"})

    class Loop:
        stdout = io.StringIO("\n0 0 10.0.0.2:5000 10.0.0.3:6000\n\t cubic bytes_sent:9 bytes_acked:100 segs_out:3\n"
                             "0 0 10.0.0.2:5001 10.0.0.3:6001\n\t cubic rtt:1/1\n")

    monitor._read(Loop())
    assert [(ends, [b for _, b in points]) for ends, points in monitor.samples.items()] == \
        [(("10.0.0.2:5000", "10.0.0.3:6000"), [100])]  # a connection without bytes_acked is skipped
    monitor.samples = {("10.0.0.2:5000", "10.0.0.3:6000"): [(0.0, 0), (1.0, 0), (1.5, 1 << 20), (2.0, 2 << 20),
                                                           (2.5, 2 << 20)],
                       ("10.0.0.2:5001", "10.0.0.3:6001"): [(1.0, 0), (2.0, 100)]}  # chatter: below MIN_BYTES
    [row] = monitor.per_step([(1.0, 3.0)])
    assert (row["from"], row["to"]) == ("node 1:5000", "10.0.0.3:6000")
    [step] = row["steps"]
    assert (step["bytes"], step["start_ms"], step["end_ms"]) == (2 << 20, 500.0, 1000.0)
    assert step["gbit"] == (2 << 20) * 8 / 0.5 / 1e9
