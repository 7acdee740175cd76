"""matplotlib, as the test session's other processes see it: not installed (``job_processes.HIDDEN_DIR`` says why)."""

raise ImportError("matplotlib is hidden from the test session's Ray workers and jobs (tests/job_processes.py)")
