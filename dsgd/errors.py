"""Exceptions raised by dsgd."""


class DSGDError(RuntimeError):
    """A distributed step or set-up failed; the message says where and why."""


class ModelCreatorError(DSGDError):
    """The user's model_creator raised or returned something unusable."""


class WorkerMismatchError(DSGDError):
    """Replicas or workers built models whose variables disagree."""
