"""Shared pieces of the grouped-GEMM benchmarks (``grouped_matmul --dtype fp8``
and ``moe_ll``'s masked GEMM): the replicated shard_map wrapper the grouped ops
are called in, their FP8 operands, and float32 references computed a few groups
at a time (a float32 copy of DeepSeek-V3's 256 experts is 15 GB)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

__all__ = ["FP8", "fp8_operands", "fp8_reference", "fp8_weights", "gbps_cell", "group_sizes",
           "local_fn", "packed_reference", "weight_gbps"]

FP8 = jnp.float8_e4m3fn
# Groups per float32 reference call: about this many bytes of float32 weights.
_REFERENCE_BYTES = 1 << 31


def group_sizes(seed: int, rows: int, groups: int, used: float) -> np.ndarray:
    """int32 [G]: ``round(used * rows)`` rows dealt to the groups with a mild skew
    (Dirichlet(2) shares); some groups may get none."""
    rng = np.random.default_rng(seed)
    return rng.multinomial(int(round(used * rows)), rng.dirichlet([2.0] * groups)).astype(
        np.int32)


def local_fn(fn, mesh, nargs: int):
    """``fn`` jitted in a shard_map over ``mesh`` with every argument replicated: the
    grouped ops are local (every device computes the same, as one rank would)."""
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(),) * nargs, out_specs=P(),
                                 check_vma=False))


def fp8_operands(x, w, block: bool):
    """bf16 x ([R, H] or [G, M, H]) and w [G, H, F] as the grouped ops' FP8 operands
    (xq, wq K-major [G, F, H], x_scale, w_scale): per tensor (x_scale (), w_scale [G],
    one per expert as FP8 checkpoints store them) or blockwise (1 x 128 for x,
    128 x 128 per group for w; H a multiple of 128)."""
    from jaxtdist.ops.quant import quantize

    xq, xs = quantize(x, FP8, (1, 128) if block else None)
    wq, ws = fp8_weights(w, block)
    return xq, wq, xs, ws


def fp8_weights(w, block: bool):
    """w [G, H, F] -> (wq [G, F, H], w_scale [G] or [G, cdiv(F, 128), H / 128]),
    ``jaxtdist.quantize_weight`` per group, a chunk of groups at a time: its float32
    temporaries over DeepSeek-V3's 256 experts at once (15 GB each) would crowd the
    GPU's memory."""
    from jaxtdist.ops.quant import quantize_weight

    one = jax.jit(jax.vmap(lambda wg: quantize_weight(wg, FP8, **(
        {} if block else dict(block=None)))))
    per = max(1, _REFERENCE_BYTES // (w.shape[1] * w.shape[2] * 4))
    parts = [one(w[g0:g0 + per]) for g0 in range(0, w.shape[0], per)]
    return (jnp.concatenate([p[0] for p in parts]), jnp.concatenate([p[1] for p in parts]))


def _expand(scale, shape) -> jnp.ndarray:
    """A scale of ``ops.quant``'s layouts broadcast to ``shape`` (128-blocks on the
    last two axes; () per tensor; [G] per group of a [G, F, H] stack)."""
    if scale.ndim == 0:
        return scale
    if scale.ndim == len(shape) - 2:  # one per group (per-tensor weights): [G] -> [G, 1, 1]
        return scale[..., None, None]
    for axis in (-2, -1):
        if scale.shape[axis] != shape[axis]:
            scale = jnp.repeat(scale, 128, axis=axis)
            scale = jax.lax.slice_in_dim(scale, 0, shape[axis], axis=scale.ndim + axis)
    return scale


@jax.jit
def _exact(x, w, sizes):
    return jax.lax.ragged_dot(x, w, sizes, precision=jax.lax.Precision.HIGHEST)


@jax.jit
def _dequant_weights(wq, ws):
    """wq [g, F, H] and its scale -> float32 [g, H, F]."""
    return jnp.swapaxes(wq.astype(jnp.float32) * _expand(ws, wq.shape), 1, 2)


def _by_groups(x32, weights, sizes, groups: int, f: int) -> np.ndarray:
    """Float32 ``ragged_dot(x32, W, sizes)`` on the host, ``weights(g0, g1)`` giving
    float32 [g1 - g0, H, F] a chunk at a time; groups without rows are skipped."""
    counts = np.asarray(sizes)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(int)
    per = max(1, _REFERENCE_BYTES // (x32.shape[1] * f * 4))
    out = np.zeros((x32.shape[0], f), np.float32)
    for g0 in range(0, groups, per):
        g1 = min(groups, g0 + per)
        r0, r1 = offsets[g0], offsets[g1]
        if r1 > r0:
            out[r0:r1] = np.asarray(_exact(x32[r0:r1], weights(g0, g1), sizes[g0:g1]))
    return out


def packed_reference(x, w, sizes) -> np.ndarray:
    """Float32 grouped product of packed x [R, H] and w [G, H, F] (rows past the
    groups: zero)."""
    return _by_groups(jnp.asarray(x, jnp.float32),
                      lambda g0, g1: jnp.asarray(w[g0:g1], jnp.float32), sizes, w.shape[0],
                      w.shape[2])


def fp8_reference(xq, wq, xs, ws, sizes) -> np.ndarray:
    """Float32 grouped product of the dequantized packed FP8 operands (xq [R, H])."""
    x32 = xq.astype(jnp.float32) * _expand(xs, xq.shape)

    def weights(g0, g1):
        return _dequant_weights(wq[g0:g1], ws if ws.ndim == 0 else ws[g0:g1])
    return _by_groups(x32, weights, sizes, wq.shape[0], wq.shape[1])


def weight_gbps(stats: dict, weight_bytes: float, peak: float | None) -> None:
    """Adds the weight-read bandwidth (``gb_per_s``, and ``hbm_fraction`` of
    ``peak`` bytes/s where known) to a contender's stats that have a time."""
    if "mean_us" not in stats:
        return
    stats["gb_per_s"] = weight_bytes / stats["mean_us"] / 1e3
    if peak:
        stats["hbm_fraction"] = stats["gb_per_s"] * 1e9 / peak


def gbps_cell(entry: dict | None) -> str:
    """``GB/s (x% HBM)`` of a contender's stats, or n/a."""
    if not entry or "gb_per_s" not in entry:
        return "n/a"
    frac = entry.get("hbm_fraction")
    return f"{entry['gb_per_s']:.0f}" + (f" ({frac:.0%})" if frac is not None else "")

