"""Reading back what the engine writes: TensorBoard event files (``logdir``) and Chrome traces (``write_timeline``)."""

import json
from collections import defaultdict

import tensorflow as tf


def read_scalars(logdir) -> dict[str, list[tuple[int, float, str]]]:
    """tag -> [(step, value, plugin name)] from every event file under logdir."""
    scalars: dict[str, list[tuple[int, float, str]]] = {}
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        for record in tf.data.TFRecordDataset(str(path)):
            event = tf.compat.v1.Event.FromString(record.numpy())
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append(
                    (event.step, float(tf.make_ndarray(value.tensor)), value.metadata.plugin_data.plugin_name))
    return scalars


def load_trace(path):
    events = json.loads(path.read_text())["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    spans = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            spans[processes[e["pid"]]].append(e)
    return processes, spans


def names(events):
    return {e["name"] for e in events}
