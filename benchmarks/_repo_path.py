"""Lets a benchmark run as a script, `python benchmarks/x.py`, as well as `python -m benchmarks.x`.

A script's own directory, not the repository root, starts `sys.path`, so
`import benchmarks` would fail. Each script imports this module first (which imports the
package, see its docstring) when
it has no package (`__package__` is empty), which puts the root in front.
"""

import sys
from pathlib import Path

REPO_ROOT = str(Path(__file__).resolve().parent.parent)

if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

import benchmarks  # noqa: E402,F401  (its set-up runs before the script imports TensorFlow)
