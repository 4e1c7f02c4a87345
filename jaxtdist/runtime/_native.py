"""Loads the native library (csrc) and registers its XLA FFI handlers."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import threading
from types import ModuleType

import jax

PROLOGUE_TARGET = "jaxtdist_prologue"
TRITON_LAUNCH_TARGET = "jaxtdist_triton_launch"
CE_GATHER_TARGET = "jaxtdist_ce_gather"
_ENV_LIBRARY = "JAXTDIST_FFI_LIBRARY"

_lock = threading.Lock()
_module: ModuleType | None = None
_registered: set[tuple[str, str]] = set()


def _load() -> ModuleType:
    path = os.environ.get(_ENV_LIBRARY)
    if path:
        if not os.path.exists(path):
            raise ImportError(f"{_ENV_LIBRARY}={path!r} does not exist")
        loader = importlib.machinery.ExtensionFileLoader("jaxtdist._jaxtdist_ffi", path)
        spec = importlib.util.spec_from_file_location("jaxtdist._jaxtdist_ffi", path, loader=loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        return module
    try:
        from jaxtdist import _jaxtdist_ffi  # pytype: disable=import-error
    except ImportError as e:
        raise ImportError(
            "jaxtdist's native library is not built. Install the package with "
            "`pip install --no-build-isolation -e .` (needs cmake and a C++ compiler), "
            f"or point {_ENV_LIBRARY} at a built _jaxtdist_ffi library.") from e
    return _jaxtdist_ffi


def check_layout(module: ModuleType) -> None:
    """Raises ImportError unless ``module`` was built with the context and
    error-record layout of ``jaxtdist/language/_layout.py``, which the kernels
    and the runtime use: a library built from other sources (a stale build)
    would copy contexts of the wrong size or read the wrong error words."""
    from jaxtdist.language import _layout

    where = getattr(module, "__file__", module.__name__)
    if not hasattr(module, "ctx_layout"):
        raise ImportError(f"jaxtdist's native library {where} predates ctx_layout(): a stale "
                          "build. Rebuild it (`pip install --no-build-isolation -e .`).")
    wrong = [f"{name}: native {value}, jaxtdist/language/_layout.py "
             f"{getattr(_layout, name, '(missing)')}"
             for name, value in sorted(module.ctx_layout().items())
             if getattr(_layout, name, None) != value]
    if wrong:
        raise ImportError(f"jaxtdist's native library {where} disagrees with "
                          f"jaxtdist/language/_layout.py on the context layout ({'; '.join(wrong)}): "
                          "a stale build. Rebuild it (`pip install --no-build-isolation -e .`).")


def native() -> ModuleType:
    """Returns the native module, loading it and registering FFI targets once."""
    global _module
    with _lock:
        if _module is None:
            module = _load()
            check_layout(module)
            _module = module
        for target, per_platform in _module.handlers().items():
            for platform, capsule in per_platform.items():
                if (target, platform) not in _registered:
                    jax.ffi.register_ffi_target(target, capsule, platform=platform)
                    _registered.add((target, platform))
        return _module


def native_library_path() -> str:
    """Path of the native library in use (the pip-built one or ``$JAXTDIST_FFI_LIBRARY``)."""
    return native().__file__
