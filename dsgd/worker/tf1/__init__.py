"""The TF1 graph runtime: the worker's graph (``worker_graph``) and the session runs of a step (``step_runner``)."""
