"""The TF1 graph runtime (``runtime``): the worker's graph (``worker_graph``, ``applies``, ``state``), its session (``session_config``, ``session_runs``) and its feeds (``feeds``)."""
