"""Errors raised by the jaxtdist runtime.

An error raised while a compiled program runs cannot reach the caller as its
own Python type: XLA turns it into a status, and JAX raises
``jax.errors.JaxRuntimeError`` whose message is ``STATUS: jaxtdist.Name:
message`` (``status`` below gives each class's status). The GPU handlers form
that message in C++; the CPU backend forms it with ``runtime_status``.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator


class JaxtdistError(RuntimeError):
    """Base class of jaxtdist's runtime errors."""

    #: The XLA status (absl name) a compiled program reports this error with.
    status = "FAILED_PRECONDITION"


class NotInitializedError(JaxtdistError):
    """An op ran before ``jaxtdist.initialize(mesh)``."""


class HeapExhaustedError(JaxtdistError):
    """The symmetric heap has no room for a requested workspace."""

    status = "RESOURCE_EXHAUSTED"


class WaitTimeoutError(JaxtdistError):
    """A kernel's bounded wait on a signal timed out."""

    status = "DEADLINE_EXCEEDED"


class WorkerDiedError(JaxtdistError):
    """A process a collective needs died: an interpreter worker of the CPU backend,
    or another process of a multi-process mesh (killed, crashed, out of memory).
    Recover with ``shutdown()`` + ``initialize()``; a dead rank of a multi-process
    job needs the job restarted."""

    status = "UNAVAILABLE"


def error_name(cls: type) -> str:
    """The name an error class goes by in messages: its public module path
    (private components dropped) and class name.

    Example:
      >>> error_name(WaitTimeoutError)
      'jaxtdist.WaitTimeoutError'
      >>> error_name(ValueError)
      'ValueError'
    """
    module = ".".join(p for p in cls.__module__.split(".") if not p.startswith("_"))
    return cls.__qualname__ if module in ("", "builtins") else f"{module}.{cls.__qualname__}"


def runtime_status(error: BaseException) -> tuple[str, str]:
    """The XLA status and message a compiled program reports ``error`` with: the
    error's name, then its message, as the GPU handlers form it (no traceback).

    jaxtdist's messages start with ``jaxtdist: `` or with the error's own name
    (``jaxtdist.WaitTimeoutError: `` from the native error record); that prefix
    is not repeated. Errors other than jaxtdist's are ``INTERNAL``.

    Example:
      >>> runtime_status(WorkerDiedError("jaxtdist: the worker of position 1 died"))
      ('UNAVAILABLE', 'jaxtdist.WorkerDiedError: the worker of position 1 died')
    """
    name = error_name(type(error))
    message = str(error)
    for prefix in (f"{name}: ", "jaxtdist: "):
        if message.startswith(prefix):
            message = message[len(prefix):]
            break
    status = getattr(type(error), "status", None) if isinstance(error, JaxtdistError) else None
    return status or "INTERNAL", f"{name}: {message}" if message else name


@contextlib.contextmanager
def errors() -> Iterator[None]:
    """Re-raises jaxtdist's errors that reach the caller through compiled code as
    their own types.

    Inside ``with jaxtdist.errors():``, an exception whose message carries
    ``jaxtdist.WaitTimeoutError: ...`` (or another jaxtdist error's name), as
    ``jax.errors.JaxRuntimeError`` or, for small one-device programs, ``ValueError``
    carry them, is raised again as that jaxtdist type with the same message, the
    original as its ``__cause__``. Other exceptions pass through unchanged.

    Example:
      >>> try:
      ...     with jaxtdist.errors():
      ...         y = step(x)
      ... except jaxtdist.WaitTimeoutError:
      ...     jaxtdist.shutdown(); jaxtdist.initialize(mesh)
    """
    try:
        yield
    except JaxtdistError:
        raise
    except Exception as err:  # noqa: BLE001 - only jaxtdist's own messages are mapped
        typed = _typed(str(err))
        if typed is None:
            raise
        raise typed from err


_NAMED = re.compile(r"jaxtdist\.(\w+): (.*)", re.S)


def _typed(message: str) -> JaxtdistError | None:
    """The jaxtdist error a runtime message names, or None."""
    found = _NAMED.search(message)
    if not found:
        return None
    classes = {cls.__name__: cls for cls in (JaxtdistError, *_subclasses(JaxtdistError))}
    cls = classes.get(found.group(1))
    return cls(found.group(2)) if cls is not None else None


def _subclasses(cls: type) -> list[type]:
    return [c for sub in cls.__subclasses__() for c in (sub, *_subclasses(sub))]
