"""A non-finite mean: the message its check fails with, and what the apply does about it (``nan_policy``).

The checks (``dsgd.worker.finite_checks``) fail the step's run with
``message``; the runtime finds it in TensorFlow's error (``parse``) and
``outcome`` raises ``NonFiniteGradientError`` or has the step skipped.
Every worker applies the same global mean, so every worker makes the same
choice and the replicas stay identical.
"""

from __future__ import annotations

import re

from dsgd.errors import NonFiniteGradientError

# an assert's message escapes the quotes
_MESSAGE = re.compile(r"dsgd: non-finite (gradient|value) of \\?'([^'\\]+)\\?'")


def message(kind: str, name: str) -> str:
    """What a check of variable ``name``'s mean fails with; ``kind``: "gradient" or "value"."""
    return f"dsgd: non-finite {kind} of '{name}'"


def parse(error_text: str) -> tuple[str, str] | None:
    """The kind and variable name of the first check's ``message`` in ``error_text``; None if there is none."""
    found = _MESSAGE.search(error_text)
    return (found.group(1), found.group(2)) if found else None


def outcome(error_text: str, step: int, nan_policy: str) -> str | None:
    """What skipping the step failed by ``error_text`` says ("skipped"'s text), or None if it was not a check's
    failure; raises ``NonFiniteGradientError`` under nan_policy "raise"."""
    found = parse(error_text)
    if found is None:
        return None
    what = f"non-finite {found[0]} of variable '{found[1]}' in step {step}"
    if nan_policy == "raise":
        raise NonFiniteGradientError(f"{what}; no replica applied it (nan_policy='skip' skips such steps)") from None
    return what
