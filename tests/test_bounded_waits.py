"""Every wait on Ray is bounded (README): each ``ray.get`` and ``ray.wait`` in dsgd/ passes a ``timeout=``, or a
comment ``# unbounded: <why>`` on its line or the line before says why not. Read from the sources (``ast`` for the
calls, ``tokenize`` for the comments); no Ray is started."""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "dsgd"
WAITS = ("get", "wait")
REASON = "# unbounded:"


def unbounded_waits(source: str, filename: str) -> list[str]:
    """'file:line: ray.get(...) has no timeout' for each wait in ``source`` with no bound and no reason given."""
    tree = ast.parse(source, filename)
    reasons = {token.start[0] for token in tokenize.generate_tokens(io.StringIO(source).readline)
               if token.type == tokenize.COMMENT and token.string.startswith(REASON)
               and token.string[len(REASON):].strip()}
    calls = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "ray" and any(a.name in WAITS for a in node.names):
            problem = "imports ray's wait by another name; call it as ray.get / ray.wait"
        elif (isinstance(node, ast.Attribute) and node.attr in WAITS and isinstance(node.value, ast.Name)
              and node.value.id == "ray"):
            if id(node) not in calls:
                problem = f"passes ray.{node.attr} on, to be called with no timeout"
            else:
                call = next(c for c in ast.walk(tree) if isinstance(c, ast.Call) and c.func is node)
                timeout = next((k.value for k in call.keywords if k.arg == "timeout"), None)
                if timeout is not None and not (isinstance(timeout, ast.Constant) and timeout.value is None):
                    continue
                problem = f"ray.{node.attr}(...) has no timeout"
                node = call
        else:
            continue
        lines = range(node.lineno - 1, (node.end_lineno or node.lineno) + 1)
        if not reasons.intersection(lines):
            found.append(f"{filename}:{node.lineno}: {problem} (pass timeout=, or say why not: {REASON} ...)")
    return found


def test_every_ray_get_and_wait_in_dsgd_is_bounded_or_says_why_not():
    sources = sorted(PACKAGE.rglob("*.py"))
    assert len(sources) > 20, f"no sources found under {PACKAGE}"
    found = [problem for path in sources
             for problem in unbounded_waits(path.read_text(), str(path.relative_to(PACKAGE.parent)))]
    assert not found, "waits on Ray with no bound:\n" + "\n".join(found)


@pytest.mark.parametrize("source,expected", [
    ("ray.get(ref, timeout=5)", []),
    ("ray.wait(refs, num_returns=2,\n         timeout=t)", []),
    ("ray.get(ref)", ["x.py:1: ray.get(...) has no timeout"]),
    ("x = 1\nray.wait(refs,\n  num_returns=1)", ["x.py:2: ray.wait(...) has no timeout"]),
    ("ray.get(ref, timeout=None)", ["x.py:1: ray.get(...) has no timeout"]),
    ("ray.get(ref)  # unbounded: the object is ready", []),
    ("# unbounded: the object is ready\nray.get(ref)", []),
    ("ray.get(ref)  # unbounded:", ["x.py:1: ray.get(...) has no timeout"]),  # a reason must be given
    ("ray.get(ref)  # bounded elsewhere", ["x.py:1: ray.get(...) has no timeout"]),
    ("values = map(ray.get, refs)", ["x.py:1: passes ray.get on, to be called with no timeout"]),
    ("from ray import get as fetch", ["x.py:1: imports ray's wait by another name"]),
    ("self.ray.get(ref)\nstore.get(key)", []),  # not Ray's module
])
def test_the_check_tells_bounded_from_unbounded_waits(source, expected):
    found = [problem.split(" (pass timeout=")[0] for problem in unbounded_waits(source, "x.py")]
    assert [f.split(";")[0] for f in found] == [e.split(";")[0] for e in expected]
