"""The pjit-style form of an op (``pjit_wrapper``: global arrays with NamedShardings,
no hand-written ``shard_map``) and the helpers op files declare their specs with.

Example: ``pjit_wrapper(broadcast, name="broadcast_sharded", in_specs=lambda axis,
batch: (P(rows_over(axis, batch)),), out_specs=lambda axis, batch: P(rows_over(axis,
batch)))``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtdist.ops._op import later_output
from jaxtdist.ops._protocol import (check_outside_shard_map, order_record, order_token,
                                    record_output, same_mesh_axes)
from jaxtdist.runtime._runtime import runtime

__all__ = ["mesh_devices", "pjit_wrapper", "rows_over"]


def pjit_wrapper(op_fn: Callable, *, name: str,
                 in_specs: Callable[[str, tuple[str, ...]], tuple],
                 out_specs: Callable[[str, tuple[str, ...]], Any],
                 check: Callable[..., None] | None = None) -> Callable:
    """The op ``op_fn`` (called inside shard_map) for pjit-style code.

    ``in_specs(axis_name, batch_axes)`` and ``out_specs(axis_name, batch_axes)``
    give the shardings (``PartitionSpec``s) of the op's arrays over the mesh:
    ``batch_axes`` are data-parallel mesh axes (outermost first) and
    ``axis_name`` the tensor-parallel one. A spec may be a prefix of a pytree
    argument or result (one ``PartitionSpec`` for every leaf of a handle). The
    wrapper takes the op's arrays, ``axis_name``, ``batch_axes``, ``mesh``
    (default: the runtime's) and the op's other keyword arguments.
    ``check(*arrays, axis_name=, batch_axes=, mesh=, **static)`` (optional)
    checks the global arguments, raising ``ValueError``, once the axis names
    are known to be the mesh's.
    """

    def wrapper(*arrays: jax.Array, axis_name: str | Sequence[str],
                batch_axes: str | Sequence[str] = (), mesh=None, **static: Any):
        rt = runtime()
        check_outside_shard_map(name, inside=name.removesuffix("_sharded"))
        if mesh is None:
            mesh = rt.mesh
        elif not isinstance(mesh, jax.sharding.Mesh):
            raise TypeError(f"jaxtdist.{name}: mesh= must be a jax.sharding.Mesh (or left out: "
                            f"the initialized mesh), got {type(mesh).__name__}")
        elif not same_mesh_axes(mesh, rt.mesh):
            raise ValueError(f"jaxtdist.{name}: mesh= {dict(mesh.shape)} differs from the mesh "
                             f"given to jaxtdist.initialize {dict(rt.mesh.shape)}; leave mesh= "
                             "out (the initialized mesh) or initialize with this mesh")
        if batch_axes is None or not isinstance(batch_axes, (str, tuple, list)):
            raise TypeError(f"jaxtdist.{name}: batch_axes must be a mesh axis name or a tuple "
                            f"of them (() for none), got {batch_axes!r}")
        batch_axes = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes)
        # A tuple (or list) of axes is one group, outermost first, as inside shard_map.
        if isinstance(axis_name, (tuple, list)):
            axis_name = tuple(axis_name)
            group = axis_name
        else:
            group = (axis_name,)
        if not group or len(set(group)) != len(group):
            raise ValueError(f"jaxtdist.{name}: axis_name {axis_name!r} must be one mesh axis "
                             "or a tuple of distinct ones")
        if set(group) & set(batch_axes):
            raise ValueError(f"jaxtdist.{name}: axis_name {axis_name!r} is also in "
                             f"batch_axes {batch_axes}")
        for a in batch_axes + group:
            if not isinstance(a, str) or a not in mesh.axis_names:
                raise ValueError(f"jaxtdist.{name}: {a!r} is not an axis of the mesh; its "
                                 f"axes are {tuple(mesh.axis_names)}")
        if check is not None:
            check(*arrays, axis_name=axis_name, batch_axes=batch_axes, mesh=mesh, **static)
        # Separate shard_maps are separate traces: the previous wrapper's result goes
        # in as an argument (in its own sharding: nothing moves), so that this
        # call's prologue runs after it on every device.
        # The order token (``_protocol.order_token``, one element per device) too:
        # the op's last kernel need not make its result (a copy-out after the GEMM).
        previous = order_record(rt)
        after = (previous is not None and previous.spec is not None
                 and previous.spec[0] == mesh)
        every_device = P(tuple(mesh.axis_names))
        token, token_spec = (((previous.value, previous.token),
                              (previous.spec[1], every_device)) if after else ((), ()))

        specs = tuple(in_specs(axis_name, batch_axes))
        # Python lists and numbers, NumPy arrays and scalars as the op itself takes them
        # (shard_map takes none of them on Explicit axes, the first two on none).
        arrays = tuple(jnp.asarray(a) if isinstance(a, (list, int, float, np.ndarray, np.generic))
                       else a for a in arrays)
        _check_shards(name, mesh, arrays, specs)
        arrays = _placed(mesh, arrays, specs)

        def body(*args):
            if after:
                record_output(rt, args[0], token=args[1])
            try:
                out = op_fn(*args[len(token):], axis_name=axis_name, **static)
            except ValueError as e:
                if type(e) is not ValueError:  # JAX's own subclasses pass unchanged
                    raise
                # The op saw one shard: say how its sizes follow from the caller's.
                raise ValueError(
                    f"{e} [in jaxtdist.{name}: the op sees one shard of each argument, shapes "
                    f"{_shard_shapes(mesh, arrays, specs)} of the global "
                    f"{[getattr(a, 'shape', type(a).__name__) for a in arrays]} (in_specs "
                    f"{list(specs)})]") from None
            return out, _token_of(out, args[:len(token)])

        spec_out = out_specs(axis_name, batch_axes)
        out, out_token = jax.shard_map(body, mesh=mesh, in_specs=token_spec + specs,
                                       out_specs=(spec_out, every_device))(*token, *arrays)
        first, first_spec = (out, spec_out) if isinstance(out, jax.Array) else (
            out[0], spec_out[0])
        record_output(rt, first, spec=(mesh, first_spec), token=out_token)
        return out

    wrapper.__name__ = name
    return wrapper


def _placed(mesh, arrays, specs) -> tuple:
    """The arrays resharded to their specs where the mesh has Explicit axes:
    shard_map takes an argument there only as placed as its spec says, while on
    Auto axes XLA moves it by itself."""
    if all(t != jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ())):
        return arrays
    # A spec is a prefix of a pytree argument (a handle): every leaf takes it.
    return tuple(jax.tree.map(lambda leaf, s=s: jax.sharding.reshard(leaf, NamedSharding(mesh, s))
                              if isinstance(leaf, jax.Array) else leaf, a)
                 if isinstance(s, P) else a for a, s in zip(arrays, specs))


def _spec_sizes(mesh, spec, ndim: int) -> list[int]:
    """Devices each of ``ndim`` dimensions is split over under ``spec``."""
    entries = tuple(spec) + (None,) * (ndim - len(spec))
    return [mesh_devices(mesh, () if e is None else (e,) if isinstance(e, str) else e)[0]
            for e in entries[:ndim]]


def _shard_shapes(mesh, arrays, specs) -> list:
    return [tuple(d // n for d, n in zip(a.shape, _spec_sizes(mesh, s, a.ndim)))
            if isinstance(s, P) and hasattr(a, "shape") else "?" for a, s in zip(arrays, specs)]


def _check_shards(name: str, mesh, arrays, specs) -> None:
    """A ``ValueError`` naming the op where an argument has fewer dimensions than its
    spec shards, or a sharded dimension that is no multiple of its devices (else
    shard_map's error names the wrapper's body)."""
    for i, (a, spec) in enumerate(zip(arrays, specs)):
        if not isinstance(spec, P) or not hasattr(a, "shape"):
            continue
        if a.ndim < len(spec):
            raise ValueError(
                f"jaxtdist.{name}: argument {i} has shape {tuple(a.shape)} ({a.ndim} "
                f"dimensions); the op shards it as {spec}, which needs at least {len(spec)}: "
                "see the op's docstring for its shapes")
        for dim, (size, n) in enumerate(zip(a.shape, _spec_sizes(mesh, spec, a.ndim))):
            if size % n:
                entry = spec[dim]
                axes = mesh_devices(mesh, (entry,) if isinstance(entry, str) else entry)[1]
                raise ValueError(
                    f"jaxtdist.{name}: argument {i} has shape {tuple(a.shape)}; its dimension "
                    f"{dim} ({size}) is split over {axes} ({n} devices), which must divide it")


def _token_of(out, after: Sequence) -> jax.Array:
    """The order token of the op that made ``out`` (a shard_map body's result), made
    from its last kernel's output where that is not ``out``."""
    rt = runtime()
    record = order_record(rt)
    if record is not None and record.spec is None and record.token is not None:
        return record.token
    return order_token(rt, later_output(out, after))


def mesh_devices(mesh, axes: Sequence[str]) -> tuple[int, str]:
    """The devices of mesh ``axes`` together, and words naming them for errors
    ("dp=2 x sp=4"; "no axes" for none)."""
    axes = tuple(axes)
    size = 1
    for a in axes:
        size *= int(mesh.shape[a])
    return size, " x ".join(f"{a}={mesh.shape[a]}" for a in axes) or "no axes"


def rows_over(axis_name: str | tuple[str, ...] | None, batch_axes: tuple[str, ...]):
    """The mesh axes sharding rows: the batch axes, then ``axis_name`` (if given; a
    tuple of axes, outermost first, as one)."""
    group = axis_name if isinstance(axis_name, tuple) else (axis_name,) if axis_name else ()
    axes = tuple(batch_axes) + group
    return (axes if len(axes) > 1 else axes[0]) if axes else None
