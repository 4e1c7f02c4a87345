"""Errors raised by the jaxtdist runtime."""


class JaxtdistError(RuntimeError):
    """Base class of jaxtdist's runtime errors."""


class NotInitializedError(JaxtdistError):
    """An op ran before ``jaxtdist.initialize(mesh)``."""


class HeapExhaustedError(JaxtdistError):
    """The symmetric heap has no room for a requested workspace."""


class WaitTimeoutError(JaxtdistError):
    """A kernel's bounded wait on a signal timed out."""


class WorkerDiedError(JaxtdistError):
    """A process a collective needs died: an interpreter worker of the CPU backend,
    or another process of a multi-process mesh (killed, crashed, out of memory).
    Recover with ``shutdown()`` + ``initialize()``; a dead rank of a multi-process
    job needs the job restarted."""
