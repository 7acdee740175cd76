"""dsgd's benchmarks (docs/benchmarks.md).

Importing the package quiets TensorFlow in this process, as dsgd's own
processes are: `import dsgd` installs the filter of TensorFlow's start-up
lines (dsgd.worker.tf_logs), and TF_CPP_MIN_LOG_LEVEL, unless set, is 3 (dsgd's
workers' default), which `common.start_ray` passes on to every Ray worker
of the job (Ray Train's too). Every script imports the package before TensorFlow: as
`python -m benchmarks.x`, or through `_repo_path` when run as a file.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import dsgd  # noqa: E402,F401
