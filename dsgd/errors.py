"""Exceptions raised by dsgd."""


class DSGDError(RuntimeError):
    """A distributed step or set-up failed; the message says where and why.

    The base class of dsgd's errors: ``except dsgd.DSGDError`` catches them
    all. Raised as itself for, e.g., a cluster without room for the workers
    asked for (the message names what is missing), a lost actor that cannot
    be replaced, ``max_failures`` recoveries used up, or a call on an engine
    that was shut down.
    """


class ModelCreatorError(DSGDError):
    """The user's model_creator raised or returned something unusable.

    Raised by ``DistributedSGD(...)`` (and by ``resize`` for a new worker);
    when ``model_creator`` raised, the message holds its traceback. Also for
    a ``get_metrics()`` that returns something other than a dict of scalar
    tensors or numbers.
    """


class WorkerMismatchError(DSGDError):
    """Replicas or workers built models whose variables disagree.

    Every replica must create the same variables (names, shapes, dtypes);
    the message names the first that differs and where.
    """


class NonFiniteGradientError(DSGDError):
    """A step's averaged gradient held NaN or Inf; no replica applied it.

    Raised by ``step`` with ``nan_policy="raise"`` (the default), naming the
    variable. Every replica sees the same mean, so all of them skip the
    step alike; ``nan_policy="skip"`` skips such steps with a warning
    instead.
    """


class ActorFailure(DSGDError):
    """A worker or parameter server died, or lost an object, during a call.

    The engine usually recovers from it by itself (the actor is replaced and
    the step run again); it reaches the caller when it cannot.
    """


class DSGDTimeoutError(DSGDError):
    """A bounded wait on Ray ran out; the message says what was awaited.

    Every wait is bounded: ``timeout_s`` for steps and calls on the actors,
    ``startup_timeout_s`` for building the workers.
    """


class StepAborted(RuntimeError):
    """The driver aborted the step a parameter-server call belonged to (another actor failed).

    Raised inside a parameter server; the driver treats it like a dead actor.
    """
