"""Shape, dtype and workspace arithmetic shared by the ops."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
ALIGN = 256


def align(n: int) -> int:
    return -(-int(n) // ALIGN) * ALIGN


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def static_bool(op: str, name: str, value, *, none: str | None = None) -> bool | None:
    """``value`` of a static flag as a Python bool (a NumPy bool, what NumPy
    comparisons give, included); anything else (1, 1.0, "yes") raises ValueError
    naming the argument. ``none``: what None means where None is allowed."""
    if none is not None and value is None:
        return None
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    allowed = "True or False" if none is None else f"True, False or None ({none})"
    raise ValueError(f"jaxtdist.{op}: {name}={value!r} must be {allowed}{traced_hint(value)}")


def traced_hint(value) -> str:
    """For a static argument's error: what to do when ``value`` is a traced array."""
    if isinstance(value, jax.core.Tracer):
        return (", a Python value, not a traced array: it picks the compiled program "
                "(pass a constant, or mark the argument static in jax.jit)")
    return ""


def check_dtype(op: str, name: str, dtype) -> None:
    if jnp.dtype(dtype) not in SUPPORTED_DTYPES:
        raise ValueError(f"jaxtdist.{op}: {name} has dtype {jnp.dtype(dtype).name}; supported "
                         f"dtypes are {', '.join(d.name for d in SUPPORTED_DTYPES)}")


class GatherWorkspace:
    """Byte layout of a gather workspace: peers' ready flags and local chunk flags
    (world * chunks int32 each), then two staging slots (call parities)."""

    def __init__(self, world: int, rows: int, cols: int, dtype, chunk_rows: int):
        self.n_chunks = -(-rows // chunk_rows)
        self.ready = 0
        self.flags = align(4 * world * self.n_chunks)
        self.slot_bytes = align(rows * cols * np.dtype(dtype).itemsize)
        self.stage = self.flags + align(4 * world * self.n_chunks)
        self.nbytes = self.stage + 2 * self.slot_bytes


class InboxWorkspace:
    """Byte layout of a push workspace: chunk flags (world * chunks int32) that
    senders raise, one "sent" word per peer step, then two inboxes (call
    parities) of [world * rows, cols] that peers push their shards into."""

    def __init__(self, world: int, rows: int, cols: int, dtype, chunk_rows: int):
        self.n_chunks = -(-rows // chunk_rows)
        self.flags = 0
        self.sent = align(4 * world * self.n_chunks)
        self.parity_bytes = align(world * rows * cols * np.dtype(dtype).itemsize)
        self.inbox = self.sent + align(4 * world)
        self.nbytes = self.inbox + 2 * self.parity_bytes


class SplitKWorkspace:
    """Byte layout of a split-K workspace: one float32 plane of the output per
    split ([split_k, rows, cols]), then one int32 arrival counter per output tile."""

    def __init__(self, split_k: int, rows: int, cols: int, n_tiles: int):
        self.partials = 0
        self.counters = align(4 * split_k * rows * cols)
        self.nbytes = self.counters + align(4 * n_tiles)


class StreamKWorkspace:
    """Byte layout of a stream-K tail workspace: one float32 [block_m, block_n]
    partial per (program, tail tile) pair that a run can cover (programs +
    tail_tiles - 1 slots: slot program + tile), then one int32 arrival
    counter per tail tile."""

    def __init__(self, programs: int, tail_tiles: int, block_m: int, block_n: int):
        self.partials = 0
        self.counters = align(4 * (programs + tail_tiles - 1) * block_m * block_n)
        self.nbytes = self.counters + align(4 * tail_tiles)
