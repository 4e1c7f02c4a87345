"""jaxtdist.triton_call: run a user's distributed Triton kernel from JAX."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxtdist.ops._op import DistributedOp
from jaxtdist.ops._protocol import Call
from jaxtdist.ops._shapes import align

__all__ = ["triton_call"]


def _arg_names(kernel) -> list[str]:
    return list(getattr(kernel, "arg_names", []))


def triton_call(*args: Any, kernel, out_shape, grid: int | Sequence[int], axis_name,
                workspace_bytes: int = 0, stage: jax.Array | None = None,
                name: str | None = None, num_warps: int = 4, num_stages: int = 3,
                tma: bool = False, **constexprs: Any):
    """Runs a distributed Triton kernel inside ``jax.shard_map``.

    The kernel is called as ``kernel[grid](ctx, *args, *outputs, **constexprs)``
    where ``ctx`` is the heap context that ``jaxtdist.language`` primitives
    take (rank, peers, epoch). The same kernel runs on GPUs and on CPU
    (Triton's interpreter, one worker process per rank). On GPUs jaxtdist's
    own launcher runs it (Python scalars are passed at run time: one compiled
    kernel serves every value), or jax-triton where the runtime's ``launcher``
    is "jax-triton". Not differentiable: ``jax.grad`` through it raises a
    ``TypeError``.

    Args:
      *args: arrays (passed as pointers) and Python scalars.
      kernel: a ``@triton.jit`` function defined at module top level.
      out_shape: a ``jax.ShapeDtypeStruct`` or a sequence of them.
      grid: the launch grid.
      axis_name: the mesh axis (or axes) whose group the kernel communicates in.
      workspace_bytes: bytes of symmetric heap the kernel needs; their heap
        offset is passed as the constexpr ``WORKSPACE``. Reused by every call
        of this kernel: keep call k's and call k+1's data apart (e.g. by
        ``dl.epoch(ctx) % 2``) and compare signals against the epoch.
      stage: an array to copy into this rank's heap before the kernel; its
        offset is passed as ``STAGE`` (call parity 0) and the distance to the
        parity-1 copy as ``STAGE_BYTES``: the copy of epoch e is at
        ``STAGE + (e % 2) * STAGE_BYTES``.
      name: the workspace's name (defaults to the kernel's).
      num_warps, num_stages: GPU launch options. A warp-specialized loop
        (``tl.range(..., warp_specialize=True)``) compiles to more warps than
        ``num_warps``; jaxtdist's launcher launches the compiled count, jax-triton
        0.3.1 the requested one (the launch fails): give such kernels arrays only.
      tma: the kernel builds tensor descriptors on the device
        (``tl.make_tensor_descriptor``), which need Triton's global scratch:
        on GPUs it then runs through jaxtdist's own launcher, which provides
        it from the heap.
      **constexprs: the kernel's constexpr arguments.

    Returns:
      The kernel's output(s).

    Example:
      >>> from examples.ring_kernels import ring_exchange_kernel, ring_workspace_bytes
      >>> out = jaxtdist.triton_call(x, kernel=ring_exchange_kernel, grid=(1,), axis_name="x",
      ...                            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
      ...                            workspace_bytes=ring_workspace_bytes(x.size), N=x.size,
      ...                            BLOCK=128)
    """
    grid = _checked_grid(kernel, grid)
    args = tuple(_scalar_or_array(kernel, i, a) for i, a in enumerate(args))
    _check_call(kernel, len(args), out_shape, workspace_bytes, stage is not None, constexprs)
    arrays = [a for a in args if _is_array(a)]
    # Where each argument goes: ("array", i) of the op's arrays, or a Python scalar.
    slots = tuple(("array", sum(map(_is_array, args[:j]))) if _is_array(a) else ("scalar", a)
                  for j, a in enumerate(args))
    if stage is not None:
        arrays.append(stage)
    if isinstance(out_shape, list):
        out_shape = tuple(out_shape)
    return _TRITON_CALL(*arrays, axis_name=axis_name, kernel=kernel, slots=slots,
                        out_shape=out_shape, grid=grid,
                        workspace_bytes=workspace_bytes, staged=stage is not None, name=name,
                        num_warps=num_warps, num_stages=num_stages, tma=tma,
                        constexprs=constexprs)


def _kernel_name(kernel) -> str:
    return getattr(kernel, "__name__", repr(kernel))


def _checked_grid(kernel, grid) -> tuple[int, ...]:
    """``grid`` as a tuple of 1 to 3 positive ints (an int is a 1-D grid)."""
    dims = (grid,) if not isinstance(grid, (tuple, list)) else tuple(grid)
    if not 1 <= len(dims) <= 3 or any(
            isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1 for d in dims):
        raise ValueError(f"jaxtdist.triton_call: grid={grid!r} (kernel {_kernel_name(kernel)}) "
                         "must be a positive int or a tuple of 1 to 3 positive ints (programs "
                         "per dimension)")
    return tuple(int(d) for d in dims)


def _scalar_or_array(kernel, i: int, a):
    """Argument ``i`` as the launch takes it: an array, or a Python int or float
    (NumPy scalars and bools become those)."""
    if _is_array(a):
        return a
    if isinstance(a, (bool, np.bool_, np.integer)):
        return int(a)
    if isinstance(a, np.floating):
        return float(a)
    if isinstance(a, (int, float)):
        return a
    raise ValueError(f"jaxtdist.triton_call: argument {i} of kernel {_kernel_name(kernel)} is "
                     f"{type(a).__name__} {a!r}; pass arrays, or ints and floats (run-time "
                     "scalars), and constexprs as keyword arguments")


def _check_call(kernel, n_args: int, out_shape, workspace_bytes, staged: bool,
                constexprs: dict) -> None:
    """At trace time, what a launch would find wrong: a negative workspace, and
    keyword arguments the kernel lacks or parameters left without a value (the
    offsets jaxtdist fills in counted as given)."""
    name = _kernel_name(kernel)
    for leaf in jax.tree_util.tree_leaves(out_shape):
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            raise ValueError(f"jaxtdist.triton_call: out_shape={out_shape!r} (kernel {name}) "
                             "must be a jax.ShapeDtypeStruct (or a tuple or list of them), one "
                             "per output")
    if isinstance(workspace_bytes, bool) or not isinstance(workspace_bytes, (int, np.integer)) \
            or workspace_bytes < 0:
        raise ValueError(f"jaxtdist.triton_call: workspace_bytes={workspace_bytes!r} must be "
                         f"an int >= 0 (kernel {name})")
    # The offsets jaxtdist passes the kernel: it must take them.
    filled = ({"WORKSPACE"} if workspace_bytes > 0 else set()) | (
        {"STAGE", "STAGE_BYTES"} if staged else set())
    names = _arg_names(kernel)
    for required in sorted(filled):
        if required not in names:
            raise ValueError(f"jaxtdist.triton_call: kernel {name} needs a constexpr parameter "
                             f"{required} to receive its offset")
    fn = getattr(kernel, "fn", None)
    if not inspect.isfunction(fn):  # not a plain @triton.jit kernel (autotuned, say)
        return
    params = list(inspect.signature(fn).parameters.values())
    outputs = len(jax.tree_util.tree_leaves(out_shape))
    keyword = params[1 + n_args + outputs:]  # after ctx, the arguments, the outputs
    given = set(constexprs) | filled
    unknown = sorted(set(constexprs) - {p.name for p in keyword})
    if unknown:
        raise ValueError(f"jaxtdist.triton_call: kernel {name} has no parameter "
                         f"{', '.join(unknown)} after its {n_args} argument(s) and {outputs} "
                         f"output(s); its parameters there: {[p.name for p in keyword]}")
    missing = [p.name for p in keyword
               if p.name not in given and p.default is inspect.Parameter.empty]
    if missing:
        hint = ""
        if "WORKSPACE" in missing:
            hint = " (WORKSPACE: pass workspace_bytes > 0)"
        raise ValueError(f"jaxtdist.triton_call: kernel {name} needs {', '.join(missing)}: "
                         f"pass them as keyword arguments{hint}")


def _is_array(a) -> bool:
    return isinstance(a, (jax.Array, np.ndarray))


def _forward(*arrays, axis_name, kernel, slots, out_shape, grid, workspace_bytes, staged, name,
             num_warps, num_stages, tma, constexprs):
    stage = arrays[-1] if staged else None
    args = tuple(arrays[v] if kind == "array" else v for kind, v in slots)
    constexprs = dict(constexprs)
    call = Call("triton_call", axis_name)
    slot = 0
    if stage is not None:
        slot = align(stage.size * np.dtype(stage.dtype).itemsize)
    total = align(max(workspace_bytes, 0)) + 2 * slot
    ws = call.workspace(name or getattr(kernel, "__name__", repr(kernel)), max(total, 1),
                        int(workspace_bytes),
                        None if stage is None else (stage.shape, stage.dtype.name))
    stage_offset = ws.offset + align(max(workspace_bytes, 0))
    if workspace_bytes > 0:
        constexprs["WORKSPACE"] = ws.offset
    if stage is not None:
        constexprs["STAGE"] = stage_offset
        constexprs["STAGE_BYTES"] = slot
    out = call.run(kernel, *args, workspace=ws, out_shape=out_shape, grid=grid, stage=stage,
                   stage_offset=stage_offset, parity_bytes=slot, num_warps=num_warps,
                   num_stages=num_stages, needs_scratch=tma, **constexprs)
    return out, None


# No backward: differentiating a user kernel raises an error naming it.
_TRITON_CALL = DistributedOp("triton_call", forward=_forward)

