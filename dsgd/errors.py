"""Exceptions raised by dsgd."""


class DSGDError(RuntimeError):
    """A distributed step or set-up failed; the message says where and why."""


class ModelCreatorError(DSGDError):
    """The user's model_creator raised or returned something unusable."""


class WorkerMismatchError(DSGDError):
    """Replicas or workers built models whose variables disagree."""


class NonFiniteGradientError(DSGDError):
    """A step's averaged gradient held NaN or Inf; no replica applied it."""


class ActorFailure(DSGDError):
    """A worker or parameter server died, or lost an object, during a call."""


class DSGDTimeoutError(DSGDError):
    """A bounded wait on Ray ran out; the message says what was awaited."""


class StepAborted(RuntimeError):
    """The driver aborted the step a parameter-server call belonged to (another actor failed).

    Raised inside a parameter server; the driver treats it like a dead actor.
    """
