"""Runs a Triton kernel under the interpreter on raw host addresses.

Triton's interpreter copies torch tensors to the host and back around a
launch; jaxtdist's buffers already live in host memory (numpy arrays and the
shared heap), so this launcher hands the kernel their addresses directly and
needs no torch.
"""

from __future__ import annotations

import numpy as np
from triton.runtime import interpreter as _interpreter
from triton.runtime.interpreter import GridExecutor

_TRITON_DTYPE_NAMES = {
    np.dtype(np.float32): "float32",
    np.dtype(np.float16): "float16",
    np.dtype(np.float64): "float64",
    np.dtype(np.int8): "int8",
    np.dtype(np.int16): "int16",
    np.dtype(np.int32): "int32",
    np.dtype(np.int64): "int64",
    np.dtype(np.uint8): "uint8",
    np.dtype(np.uint32): "uint32",
    np.dtype(np.bool_): "int1",
}

# FP8 GEMM operands: Triton's names of e4m3 (no infinities, "fn") and e5m2.
_FP8_NAMES = {"float8_e4m3fn": "fp8e4nv", "float8_e5m2": "fp8e5"}


def triton_dtype_name(dtype) -> str:
    dtype = np.dtype(dtype)
    if dtype.name == "bfloat16":
        return "bfloat16"
    if dtype.name in _FP8_NAMES:  # ml_dtypes' names, as numpy spells them
        return _FP8_NAMES[dtype.name]
    try:
        return _TRITON_DTYPE_NAMES[dtype]
    except KeyError:
        raise TypeError(f"jaxtdist: no Triton pointer type for dtype {dtype}") from None


class HostPointer:
    """A typed address, passed to interpreted kernels as a pointer argument."""

    def __init__(self, address: int, dtype_name: str):
        self._address = address
        self.dtype = dtype_name

    def data_ptr(self) -> int:
        return self._address


def _install_scalar_index_fix() -> None:
    """Lets interpreted scalars index ``range`` under NumPy >= 2.4.

    Triton 3.6's interpreter turns a scalar tensor into an int with
    ``int(handle.data)``; scalars loaded from memory hold a 1-element 1-D
    array there, which NumPy 2.4 no longer converts.
    """
    original = _interpreter._patch_lang_tensor
    if getattr(original, "_jaxtdist_fixed", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__",
                       lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    patched._jaxtdist_fixed = True
    _interpreter._patch_lang_tensor = patched


def _install_bf16_dot_fix() -> None:
    """Makes ``tl.dot`` on bfloat16 operands compute in float32 under the interpreter.

    Triton 3.6's interpreter stores bfloat16 as uint16 bit patterns and hands
    them to ``np.matmul`` as integers.
    """
    builder_cls = _interpreter.InterpreterBuilder
    original = builder_cls.create_dot
    if getattr(original, "_jaxtdist_fixed", False):
        return

    def widen(handle):
        if handle.dtype.scalar == _interpreter.tl.bfloat16:
            data = (handle.data.astype(np.uint32) << 16).view(np.float32)
            return _interpreter.TensorHandle(data, _interpreter.tl.float32)
        return handle

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    create_dot._jaxtdist_fixed = True
    builder_cls.create_dot = create_dot


def float32_to_bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounded to nearest even as GPUs and
    XLA round; NaN stays NaN (quiet)."""
    bits = np.ascontiguousarray(values, np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
    out = (rounded >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(values)
    if np.any(nan):
        out = np.where(nan, ((bits >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16), out)
    return out


def _install_bf16_rounding_fix() -> None:
    """Makes float32 -> bfloat16 casts round to nearest even under the interpreter.

    Triton 3.6's interpreter truncates (rounds toward zero), doubling the error of
    every bf16 result against what GPUs and XLA compute.
    """
    builder_cls = _interpreter.InterpreterBuilder
    original = builder_cls.cast_impl
    if getattr(original, "_jaxtdist_fixed", False):
        return

    def cast_impl(self, src, dst_type):
        if (src.dtype.scalar == _interpreter.tl.float32
                and dst_type.scalar == _interpreter.tl.bfloat16):
            return _interpreter.TensorHandle(float32_to_bfloat16_bits(src.data),
                                             dst_type.scalar)
        return original(self, src, dst_type)

    cast_impl._jaxtdist_fixed = True
    builder_cls.cast_impl = cast_impl
    # The cast entry points bound the original at class creation.
    for name in ("create_fp_trunc", "create_fp_ext"):
        setattr(builder_cls, name, lambda self, src, dst_type: self.cast_impl(src, dst_type))


def _install_device_call_fast_path() -> None:
    """Skips Triton's re-patching of ``triton.language`` on every device-function call
    when the language is patched already.

    Triton 3.6's interpreter patches the language modules (``tl``, ``tl.core``,
    the tensor class, ``tl.math``, tensor descriptors) once per launch, and again
    on every call of a ``@triton.jit`` helper from a kernel: an
    ``inspect.getmembers`` of each module per call, which patches nothing more
    once the launch's patch is in place (it replaces builtins only, and those are
    gone). jaxtdist's kernels call helpers thousands of times per launch; that
    re-patching was about a third of the workers' time. Each module's builtins
    are patched, and restored, all at once, so one builtin per module tells
    whether the module is patched now; a helper whose modules are not all
    patched (``tl.core`` used by a helper but not by the kernel) patches as before.
    """
    cls = _interpreter.InterpretedFunction
    original = cls.__call__
    if getattr(original, "_jaxtdist_fixed", False):
        return
    tl, is_builtin = _interpreter.tl, _interpreter.tl.core.is_builtin

    def a_builtin(namespace) -> str:
        return next(name for name in dir(namespace) if is_builtin(getattr(namespace, name)))

    # (namespace, the name of one of its builtins), read before any launch patches them.
    tensor_probe = (tl.tensor, a_builtin(tl.tensor))
    descriptor_probe = (tl.core.tensor_descriptor_base, a_builtin(tl.core.tensor_descriptor_base))
    probes = {tl: [(tl, a_builtin(tl)), (tl.math, a_builtin(tl.math))],
              tl.core: [(tl.core, a_builtin(tl.core))]}
    for lang in probes:
        probes[lang] += [tensor_probe, descriptor_probe]
    langs_of: dict = {}

    def patched(fn) -> bool:
        langs = langs_of.get(fn)
        if langs is None:  # what _patch_lang(fn) patches: tl and/or tl.core
            langs = langs_of[fn] = tuple({id(v): v for v in fn.__globals__.values()
                                          if v is tl or v is tl.core}.values())
        return bool(langs) and not any(is_builtin(getattr(namespace, name))
                                       for lang in langs for namespace, name in probes[lang])

    def __call__(self, *args, **kwargs):
        if not patched(self.fn):
            _interpreter._patch_lang(self.fn)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise _interpreter.InterpreterError(repr(e)) from e

    __call__._jaxtdist_fixed = True
    cls.__call__ = __call__


_install_scalar_index_fix()
_install_bf16_dot_fix()
_install_bf16_rounding_fix()
_install_device_call_fast_path()


class _InPlaceGridExecutor(GridExecutor):
    # The buffers are host memory already: no copies in or out.
    def _init_args_hst(self, args_dev, kwargs):
        return list(args_dev), dict(kwargs)

    def _restore_args_dev(self, args_dev, args_hst, kwargs, kwargs_hst):
        pass


def launch(kernel, grid, args, constexprs) -> None:
    """Runs ``kernel[grid](*args, **constexprs)``; numpy arrays become pointers."""
    fn = getattr(kernel, "fn", kernel)
    while hasattr(fn, "fn"):  # heuristics/autotuner wrappers
        fn = fn.fn
    arg_names = kernel.arg_names
    converted = [HostPointer(a.ctypes.data, triton_dtype_name(a.dtype))
                 if isinstance(a, np.ndarray) else a for a in args]
    grid = tuple(grid) if isinstance(grid, (tuple, list)) else (int(grid),)
    _InPlaceGridExecutor(fn, arg_names, grid)(*converted, **constexprs)
