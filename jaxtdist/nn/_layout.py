"""Where the layers' arrays live: the mesh, the axis names, and the sequence-parallel layout.

A layer is built on one mesh (``mesh=``, else the one given to
``jaxtdist.initialize``, else the one set with ``jax.set_mesh``) with a
tensor-parallel axis (``axis_name``) and data-parallel axes (``batch_axes``,
by default every other axis of the mesh, so that no mesh axis silently
repeats the work). Activations between layers are [batch, seq, d] sharded
``P(batch_axes, axis_name, None)`` (sequence parallel); inside a layer they
are [batch * seq, d] tokens sharded over ``(*batch_axes, axis_name)``, the
layout of ``ag_matmul`` / ``matmul_rs``. Tokens are in the order that makes
that a local reshape: each data-parallel group's rows, within them each
tensor-parallel rank's block of positions, within it the group's sequences'
slices of that block (``Layout.flatten`` / ``unflatten``; row-major where a
group holds one sequence). Explicit mesh axes (``jax.make_mesh``'s
default) and Auto axes are both handled here: the layers never care.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtdist.ops._shapes import check_dtype
from jaxtdist.runtime import _runtime

__all__ = ["Layout", "make_layout"]


def _context_mesh() -> Mesh | None:
    mesh = jax.sharding.get_mesh()
    return None if mesh is None or getattr(mesh, "empty", True) else mesh


@dataclasses.dataclass(frozen=True)
class Layout:
    """A layer's mesh, tensor-parallel axis and batch axes (static: part of the graph)."""

    layer: str
    mesh: Mesh
    axis_name: str
    batch_axes: tuple[str, ...]
    impl: str

    # -- sizes -------------------------------------------------------------------------
    @property
    def tp(self) -> int:
        return int(self.mesh.shape[self.axis_name])

    @property
    def dp(self) -> int:
        out = 1
        for axis in self.batch_axes:
            out *= int(self.mesh.shape[axis])
        return out

    @property
    def explicit(self) -> bool:
        return any(t == AxisType.Explicit for t in (self.mesh.axis_types or ()))

    # -- specs -------------------------------------------------------------------------
    @property
    def rows(self):
        """The PartitionSpec entry of data-parallel rows (None: replicated)."""
        axes = self.batch_axes
        return None if not axes else axes[0] if len(axes) == 1 else axes

    @property
    def tokens(self):
        """The PartitionSpec entry of sequence-parallel tokens."""
        axes = self.batch_axes + (self.axis_name,)
        return axes[0] if len(axes) == 1 else axes

    def named(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    # -- moving and reshaping ----------------------------------------------------------
    def constrain(self, x: jax.Array, spec: P) -> jax.Array:
        """x laid out as ``spec`` (no data moves when it already is)."""
        if self.explicit:
            return jax.sharding.reshard(x, self.named(spec))
        return jax.lax.with_sharding_constraint(x, self.named(spec))

    def reshape(self, x: jax.Array, shape: tuple[int, ...], spec: P) -> jax.Array:
        """``x.reshape(shape)`` laid out as ``spec``; on explicit axes the result's
        sharding is part of its type, so it is given."""
        if self.explicit:
            return jax.lax.reshape(x, shape, out_sharding=self.named(spec))
        return self.constrain(x.reshape(shape), spec)

    def dot(self, x: jax.Array, w: jax.Array, spec: P, precision=None) -> jax.Array:
        """``x @ w`` laid out as ``spec``: XLA moves the data (the ``impl="xla"`` path)."""
        if self.explicit:
            return jnp.dot(x, w, precision=precision, out_sharding=self.named(spec))
        return self.constrain(jnp.dot(x, w, precision=precision), spec)

    # -- the [batch, seq, d] <-> tokens boundary --------------------------------------
    def check_input(self, x, features: int, decode: bool,
                    aligned: bool = True) -> tuple[jax.Array, int, int]:
        """(x as an array, batch, seq) of a [batch, seq, features] input, or a
        ValueError naming the layer (``aligned``: also unless seq is a multiple of
        ``seq_multiple``, which ``pad_input`` makes it)."""
        self._check_context()
        x = jnp.asarray(x)
        if x.ndim != 3 or x.shape[-1] != features:
            raise ValueError(f"jaxtdist.nn.{self.layer}: x has shape {tuple(x.shape)}; expected "
                             f"[batch, seq, {features}] (features={features}, as the layer "
                             "was built)")
        batch, seq = x.shape[:2]
        if not batch or not seq:
            raise ValueError(f"jaxtdist.nn.{self.layer}: x has shape {tuple(x.shape)}, an empty "
                             "batch or sequence; jaxtdist's ops take no empty operand (skip the "
                             "call for an empty batch)")
        check_dtype(f"nn.{self.layer}", "x", x.dtype)
        if decode:
            if seq != 1:
                raise ValueError(f"jaxtdist.nn.{self.layer}: decode=True takes one token per "
                                 f"sequence, x of shape [batch, 1, {features}]; got "
                                 f"{tuple(x.shape)}")
        elif aligned and seq % self.seq_multiple(batch):
            # The layers pad (pad_input); reaching here is a layer that did not.
            raise ValueError(
                f"jaxtdist.nn.{self.layer}: x has shape {tuple(x.shape)}: seq={seq} must be "
                f"a multiple of {self.seq_multiple(batch)} at batch {batch} (tokens spread "
                f"over batch_axes={self.batch_axes} x {self.axis_name!r}); pad it with "
                "Layout.pad_input")
        return x, batch, seq

    def seq_multiple(self, batch: int) -> int:
        """The multiple of which a prefill's seq must be at ``batch`` sequences: seq
        divides over tp (sequence parallel), and batch * seq over dp x tp (a batch
        that does not divide over dp has its tokens spread over every device)."""
        unit = self.dp * self.tp // math.gcd(batch, self.dp * self.tp)
        return unit * self.tp // math.gcd(unit, self.tp)

    def pad_input(self, x, features: int, decode: bool) -> tuple[jax.Array, int, int, int]:
        """``check_input`` of x right-padded with zeros along seq to the next
        multiple of ``seq_multiple(batch)``: ``(x, batch, padded seq, real seq)``.
        Nothing is added where seq already is one (the padding rows' outputs are
        dropped by ``unpad``; a layer that mixes positions masks them)."""
        x, batch, real = self.check_input(x, features, decode, aligned=False)
        if decode:
            return x, batch, real, real
        seq = -(-real // self.seq_multiple(batch)) * self.seq_multiple(batch)
        if seq != real:
            x = self.constrain(x, P(self.batch_spec(batch), None, None))
            x = jnp.pad(x, ((0, 0), (0, seq - real), (0, 0)))
        return x, batch, seq, real

    def unpad(self, y: jax.Array, seq: int) -> jax.Array:
        """y [batch, padded seq, ...] -> [batch, seq, ...]: ``pad_input``'s padding
        dropped (the sequence dim first gathered: a cut of it is not sharded evenly;
        the last dim sharded over ``axis_name`` instead where it divides, so that a
        prefill's logits take no more memory than before)."""
        if y.shape[1] == seq:
            return y
        last = self.axis_name if y.ndim > 2 and y.shape[-1] % self.tp == 0 else None
        y = self.constrain(y, P(self.batch_spec(y.shape[0]), *(None,) * (y.ndim - 2), last))
        return y[:, :seq]

    def check_lengths(self, lengths, batch: int, seq: int) -> jax.Array:
        """``lengths`` (the real tokens of each sequence, the rest right padding) as
        int32 [batch] laid out with the batch, clipped to [0, seq]; a ValueError
        naming the layer for another shape or a non-integer dtype."""
        lengths = jnp.asarray(lengths)
        if lengths.shape != (batch,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
            raise ValueError(f"jaxtdist.nn.{self.layer}: lengths has shape "
                             f"{tuple(lengths.shape)} and dtype {lengths.dtype}; expected "
                             f"integers [batch] = [{batch}] (each sequence's real tokens, "
                             "the rest right padding)")
        lengths = jnp.clip(lengths.astype(jnp.int32), 0, seq)
        return self.constrain(lengths, P(self.batch_spec(batch)))

    def token_mask(self, lengths: jax.Array, batch: int, seq: int) -> jax.Array:
        """[batch * seq] bool in the tokens' layout (``to_tokens``): whether each
        token is at a position below its sequence's ``lengths`` [batch]."""
        b = self.batch_spec(batch)
        real = (jnp.arange(seq, dtype=jnp.int32)[None, :]
                < self.constrain(lengths, P(b))[:, None])
        real = self.constrain(real, P(b, None))[..., None]
        return self.to_tokens(real, False)[:, 0]

    def _check_context(self) -> None:
        """A ValueError inside a user's shard_map (the layers take global arrays and
        shard them themselves), or when the runtime now runs another mesh than the
        one the layer was built on (its parameters live there)."""
        manual = getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ())
        if manual:
            raise ValueError(f"jaxtdist.nn.{self.layer} takes global arrays and shards them "
                             f"itself: call it under jax.jit or nnx.jit, outside jax.shard_map "
                             f"(here inside one over {tuple(manual)})")
        if self.impl == "jaxtdist":
            if not _runtime.is_initialized():
                raise ValueError(f"jaxtdist.nn.{self.layer}: jaxtdist is not initialized (was "
                                 "it shut down?); call jaxtdist.initialize(mesh) with the mesh "
                                 "the layer was built on")
            current = _runtime.runtime().mesh
            if current != self.mesh:
                raise ValueError(
                    f"jaxtdist.nn.{self.layer} was built on the mesh {dict(self.mesh.shape)} "
                    f"(devices {[d.id for d in self.mesh.devices.flat]}), but jaxtdist is now "
                    f"initialized with {dict(current.shape)} (devices "
                    f"{[d.id for d in current.devices.flat]}); build the layer again on this "
                    "mesh, or jaxtdist.initialize(mesh) with the layer's")

    def divides(self, batch: int) -> bool:
        """Whether ``batch`` sequences divide over ``batch_axes``."""
        return batch % self.dp == 0

    def batch_spec(self, batch: int):
        """Rows over ``batch_axes`` when the batch divides over them, else replicated
        (XLA's layers allow such a batch: each group then repeats the work)."""
        return self.rows if self.divides(batch) else None

    def _reorders(self, batch: int, seq: int) -> bool:
        """Whether the tokens of [batch, seq] leave row-major order: when a
        data-parallel group holds several sequences cut over tensor-parallel ranks."""
        return (self.divides(batch) and batch > self.dp and self.tp > 1
                and seq % self.tp == 0)

    def flatten(self, x: jax.Array, spec: P, shape: tuple[int, ...], out_spec: P) -> jax.Array:
        """[batch, seq, ...] laid out as ``spec`` -> ``shape`` = [batch * seq, ...] laid
        out as ``out_spec``, the tokens in the layers' order (see the module): a
        rank's positions of the sequences become its block of rows, so that
        nothing moves where row-major order would send them to other ranks."""
        batch, seq, *rest = x.shape
        if self._reorders(batch, seq):
            x = self.reshape(x, (self.dp, batch // self.dp, self.tp, seq // self.tp, *rest),
                             P(spec[0], None, spec[1], None, *spec[2:]))
            x = jnp.swapaxes(x, 1, 2)
        return self.reshape(x, shape, out_spec)

    def unflatten(self, t: jax.Array, shape: tuple[int, ...], spec: P) -> jax.Array:
        """``flatten``'s inverse: tokens -> ``shape`` = [batch, seq, ...] laid out as
        ``spec``."""
        batch, seq, *rest = shape
        if self._reorders(batch, seq):
            t = self.reshape(t, (self.dp, self.tp, batch // self.dp, seq // self.tp, *rest),
                             P(spec[0], spec[1], None, None, *spec[2:]))
            t = jnp.swapaxes(t, 1, 2)
        return self.reshape(t, shape, spec)

    def to_tokens(self, x: jax.Array, decode: bool) -> jax.Array:
        """[batch, seq, d] -> [batch * seq, d] in the layout the ops take."""
        batch, seq, d = x.shape
        b = self.batch_spec(batch)
        if decode:  # one token per sequence, on every tensor-parallel rank
            x = self.constrain(x, P(b, None, None))
            return self.reshape(x, (batch, d), P(b, None))
        if not self.divides(batch):  # tokens spread over every rank, row-major
            x = self.constrain(x, P(None, None, None))
            return self.reshape(x, (batch * seq, d), P(self.tokens, None))
        spec = P(b, self.axis_name, None)
        return self.flatten(self.constrain(x, spec), spec, (batch * seq, d),
                            P(self.tokens, None))

    def _decode_groups(self, batch: int) -> tuple[int, int, int]:
        """(groups, ranks per group, tokens per rank) of a decode step's ``batch``
        tokens spread over the token axes: each data-parallel group over its own
        tensor-parallel ranks, or, when the batch does not divide over the groups
        (then it is replicated), over every rank."""
        groups = self.dp if self.divides(batch) else 1
        ranks = self.dp * self.tp // groups
        return groups, ranks, -(-(batch // groups) // ranks)

    def spread_decode(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        """A decode step's tokens [batch, d] as ``to_tokens`` gives them (a group's
        sequences on every one of its tensor-parallel ranks) -> ``(spread [G * R *
        n, d], real [G * R * n] bool)`` sharded over the token axes like a prefill:
        each group's tokens cut over its R ranks, padded to n per rank with zero
        rows (``real`` False). Nothing moves: a rank keeps a slice of what it holds.
        ``gather_decode`` is the inverse."""
        batch, d = tokens.shape
        groups, ranks, n = self._decode_groups(batch)
        b = self.batch_spec(batch)
        x = self.reshape(tokens, (groups, batch // groups, d), P(b, None, None))
        x = jnp.pad(x, ((0, 0), (0, ranks * n - batch // groups), (0, 0)))
        real = jnp.broadcast_to(jnp.arange(ranks * n) < batch // groups, (groups, ranks * n))
        total = groups * ranks * n
        return (self.reshape(x, (total, d), P(self.tokens, None)),
                self.reshape(real, (total,), P(self.tokens)))

    def gather_decode(self, y: jax.Array, batch: int) -> jax.Array:
        """``spread_decode``'s inverse: [G * R * n, d] -> [batch, d], each group's
        outputs gathered over its own ranks (over every rank where the batch does
        not divide over the groups), the padding dropped."""
        groups, ranks, n = self._decode_groups(batch)
        b = self.batch_spec(batch)
        mid = self.axis_name if self.divides(batch) else self.tokens
        y = self.reshape(y, (groups, ranks * n, y.shape[-1]), P(b, mid, None))
        y = self.constrain(y, P(b, None, None))[:, :batch // groups]
        return self.reshape(y, (batch, y.shape[-1]), P(b, None))

    def from_tokens(self, y: jax.Array, batch: int, seq: int, decode: bool) -> jax.Array:
        """[batch * seq, d] (the ops' layout) -> [batch, seq, d]."""
        b = self.batch_spec(batch)
        if decode:
            return self.reshape(y, (batch, 1, y.shape[-1]), P(b, None, None))
        if not self.divides(batch):
            y = self.constrain(y, P(None, None))
            return self.reshape(y, (batch, seq, y.shape[-1]), P(None, None, None))
        return self.unflatten(y, (batch, seq, y.shape[-1]), P(b, self.axis_name, None))


def make_layout(layer: str, *, mesh: Mesh | None, axis_name: str,
                batch_axes: str | Sequence[str] | None, impl: str) -> Layout:
    """The checked layout of a layer: every name is validated here, at construction.

    Raises:
      ValueError: an unknown ``impl``, no mesh to be found, an axis name not on the
        mesh, or ``axis_name`` also among ``batch_axes``.
    """
    if impl not in ("jaxtdist", "xla"):
        raise ValueError(f"jaxtdist.nn.{layer}: impl={impl!r}; allowed: 'jaxtdist' (the "
                         "overlapped ops), 'xla' (the same layer with XLA's collectives: "
                         "a reference with the same parameters)")
    if impl == "jaxtdist":
        if not _runtime.is_initialized():
            raise ValueError(f"jaxtdist.nn.{layer}: impl='jaxtdist' runs jaxtdist kernels: call "
                             "jaxtdist.initialize(mesh) first (impl='xla' needs no initialize)")
        runtime_mesh = _runtime.runtime().mesh
        if mesh is not None and mesh != runtime_mesh:
            raise ValueError(f"jaxtdist.nn.{layer}: mesh={mesh} is not the mesh given to "
                             f"jaxtdist.initialize ({runtime_mesh}); initialize with this mesh")
        mesh = runtime_mesh
    elif mesh is None:
        mesh = (_runtime.runtime().mesh if _runtime.is_initialized() else _context_mesh())
        if mesh is None:
            raise ValueError(f"jaxtdist.nn.{layer}: no mesh: pass mesh=, call "
                             "jax.set_mesh(mesh), or jaxtdist.initialize(mesh)")
    names = tuple(mesh.axis_names)
    if axis_name not in names:
        raise ValueError(f"jaxtdist.nn.{layer}: axis_name={axis_name!r} is not an axis of the "
                         f"mesh, whose axes are {names}; pass axis_name= one of them")
    if batch_axes is None:  # every other axis: none silently repeats the work
        batch_axes = tuple(a for a in names if a != axis_name)
    elif isinstance(batch_axes, str):
        batch_axes = (batch_axes,)
    batch_axes = tuple(batch_axes)
    for axis in batch_axes:
        if axis not in names:
            raise ValueError(f"jaxtdist.nn.{layer}: batch_axes={batch_axes} names {axis!r}, not "
                             f"an axis of the mesh, whose axes are {names}")
    if axis_name in batch_axes:
        raise ValueError(f"jaxtdist.nn.{layer}: axis_name={axis_name!r} is also in "
                         f"batch_axes={batch_axes}; the two must differ")
    return Layout(layer, mesh, axis_name, batch_axes, impl)


def check_divisible(layout: Layout, what: str, value: int) -> None:
    if value % layout.tp:
        raise ValueError(f"jaxtdist.nn.{layout.layer}: {what}={value} must be divisible by the "
                         f"size {layout.tp} of mesh axis {layout.axis_name!r} (each rank holds "
                         "an equal part)")
