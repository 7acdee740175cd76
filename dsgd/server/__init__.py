"""The parameter server's parts (``dsgd.ps_actor.ParameterServer`` is the actor that holds them together).

``layout``: where each partition sits in the server's buffers. ``steps``: one
partition's step state machine and its closing rule. ``sums``: the arithmetic
of a closed step. ``relays``: node-local aggregation, a node's copies summed
and the partial sum pushed on to the partition's server. ``transports``:
choosing and attaching each pair's transport. ``diagnostics``: timelines and
traffic counts.

No TensorFlow here: a parameter server is a light process.
"""
