"""jaxtdist.runtime: the symmetric heap, its workspaces and its errors."""

from jaxtdist.runtime._native import native_library_path
from jaxtdist.runtime._runtime import (
    DEFAULT_HEAP_BYTES,
    DEFAULT_WAIT_TIMEOUT_S,
    Layout,
    Runtime,
    Workspace,
    initialize,
    is_initialized,
    runtime,
    shutdown,
)
from jaxtdist._errors import (
    HeapExhaustedError,
    JaxtdistError,
    NotInitializedError,
    WaitTimeoutError,
    WorkerDiedError,
)

__all__ = [
    "DEFAULT_HEAP_BYTES",
    "DEFAULT_WAIT_TIMEOUT_S",
    "HeapExhaustedError",
    "JaxtdistError",
    "Layout",
    "NotInitializedError",
    "Runtime",
    "WaitTimeoutError",
    "WorkerDiedError",
    "Workspace",
    "initialize",
    "is_initialized",
    "native_library_path",
    "runtime",
    "shutdown",
]
