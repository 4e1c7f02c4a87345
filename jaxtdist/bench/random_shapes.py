"""Random model-layer problems, drawn from a seed: benchmarks that cannot be fitted.

A fixed shape list invites defaults fitted to it. ``gemm_problems(n, seed)`` draws
``n`` per-rank GEMMs of transformer layers instead: a hidden size of a published
model family, its MLP width and attention heads (GQA, head dims 64 to 256), a
tensor-parallel degree of 1 to 8, a layer (fused QKV, attention output, fused
gate + up, down), and a token count: prefill (batch x sequence, odd lengths
included) or decode (1 to 256 rows). Column-parallel layers are ``ag_matmul``'s
problem (m tokens, n = N / tp, k = d), row-parallel ones ``matmul_rs``'s
(prefill) or ``matmul_ar``'s (decode; k = K / tp, n = d). The same seed gives the
same problems on every machine (NumPy's PCG64); pick a new seed to validate a
default rule. ``attention_problems(n, seed)`` draws attention layers the same
way: a family's heads and head dim split over tp (GQA ratios 1 to 8, head dims
64 to 256), a batch and sequence (short sequences at batch > 1, lengths off
every tile included), causal or not.

Plain data and NumPy only: nothing of jaxtdist or JAX.

Example:
  >>> gemm_problems(3, seed=7)
  [('ag_matmul', ...), ...]
  >>> attention_problems(2, seed=7)
  [AttentionProblem(batch=..., seq=..., heads=..., kv_heads=..., head_dim=..., causal=...), ...]
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["AttentionProblem", "attention_problems", "gemm_problems"]

# (d_model, MLP width, attention heads, key/value heads, head dim) of published
# dense models and MoE experts' widths: the population the draws start from.
# Llama-3 8B / 70B, Llama-3.2 1B / 3B, Mistral 7B, Qwen2.5 7B / 14B / 32B / 72B,
# Gemma-2 2B / 9B / 27B, Phi-3 mini / medium, Qwen3 MoE and Mixtral experts.
MODEL_LAYERS = (
    (4096, 14336, 32, 8, 128), (8192, 28672, 64, 8, 128), (2048, 8192, 32, 8, 64),
    (3072, 8192, 24, 8, 128), (4096, 14336, 32, 8, 128), (3584, 18944, 28, 4, 128),
    (5120, 13824, 40, 8, 128), (5120, 27648, 40, 8, 128), (8192, 29568, 64, 8, 128),
    (2304, 9216, 8, 4, 256), (3584, 14336, 16, 8, 256), (4608, 36864, 32, 16, 128),
    (3072, 8192, 32, 32, 96), (5120, 17920, 40, 10, 128), (2048, 768, 32, 4, 128),
    (4096, 1536, 64, 4, 128),
)
TENSOR_PARALLEL = (1, 2, 4, 8)
LAYERS = ("qkv", "attn_out", "gate_up", "down")
DECODE_SHARE = 0.3      # of draws: decode rows (1..256), the rest prefill
MAX_PREFILL_ROWS = 16384
NON_CAUSAL_SHARE = 0.2  # of attention draws: encoder-style, no mask
MAX_ATTENTION_TOKENS = 32768  # batch x sequence of one attention draw


class AttentionProblem(NamedTuple):
    """One attention call per rank: q [batch, seq, heads, head_dim], k and v
    [batch, seq, kv_heads, head_dim]."""
    batch: int
    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool


def _rows(rng: np.random.Generator) -> tuple[int, bool]:
    """A step's token rows and whether it is a decode step."""
    if rng.random() < DECODE_SHARE:
        return int(rng.choice((1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256))), True
    # Sequence lengths log-uniform in [256, 16384], a third of them off any power of 2.
    seq = int(2 ** rng.uniform(8, 14))
    if rng.random() < 2 / 3:
        seq = 1 << int(round(np.log2(seq)))
    batch = int(rng.choice((1, 1, 2, 4, 8)))
    return max(1, min(batch * seq, MAX_PREFILL_ROWS)), False


def _layer(rng: np.random.Generator) -> tuple[str, int, int, int]:
    """(op, m, n, k) of one drawn layer's per-rank GEMM."""
    d, mlp, heads, kv_heads, head_dim = MODEL_LAYERS[rng.integers(len(MODEL_LAYERS))]
    layer = LAYERS[rng.integers(len(LAYERS))]
    tp = _tp_degree(rng, heads, mlp, kv_heads)
    rows, decode = _rows(rng)
    kv_per_rank = max(kv_heads // tp, 1)  # KV heads are replicated where tp > kv_heads
    qkv = (heads // tp + 2 * kv_per_rank) * head_dim
    if layer == "qkv":
        return "ag_matmul", rows, qkv, d
    if layer == "gate_up":
        return "ag_matmul", rows, 2 * mlp // tp, d
    k = heads * head_dim // tp if layer == "attn_out" else mlp // tp
    return ("matmul_ar" if decode else "matmul_rs"), rows, d, k


def _tp_degree(rng: np.random.Generator, heads: int, mlp: int, kv_heads: int) -> int:
    """A drawn tensor-parallel degree, halved until it splits the heads and the MLP
    evenly (KV heads split, or replicated where tp is a multiple of them)."""
    tp = int(rng.choice(TENSOR_PARALLEL))
    while tp > 1 and (heads % tp or mlp % tp or (kv_heads % tp and tp % kv_heads)):
        tp //= 2
    return tp


def _attention(rng: np.random.Generator) -> AttentionProblem:
    _, mlp, heads, kv_heads, head_dim = MODEL_LAYERS[rng.integers(len(MODEL_LAYERS))]
    tp = _tp_degree(rng, heads, mlp, kv_heads)
    # Sequences log-uniform in [128, 16384], half of them off every power of 2 (and
    # so off every tile); batches up to 16 at short lengths.
    seq = int(2 ** rng.uniform(7, 14))
    if rng.random() < 0.5:
        seq = 1 << int(round(np.log2(seq)))
    batch = int(rng.choice((1, 1, 2, 4, 8, 16)))
    batch = max(1, min(batch, MAX_ATTENTION_TOKENS // seq))
    return AttentionProblem(batch, seq, heads // tp, max(kv_heads // tp, 1), head_dim,
                            bool(rng.random() >= NON_CAUSAL_SHARE))


def _check_draw(n, seed) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"random problems: n={n!r} must be an int >= 1")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"random problems: seed={seed!r} must be an int >= 0")


def attention_problems(n: int, seed: int) -> list[AttentionProblem]:
    """``n`` per-rank attention problems of random model layers.

    Args:
      n: how many problems (>= 1).
      seed: the draw's seed; the same seed gives the same problems.

    Raises:
      ValueError: ``n`` below 1 or a seed that is not a non-negative int.
    """
    _check_draw(n, seed)
    rng = np.random.default_rng(seed)
    return [_attention(rng) for _ in range(n)]


def gemm_problems(n: int, seed: int) -> list[tuple[str, int, int, int]]:
    """``n`` per-rank GEMM problems ``(op, m, n, k)`` of random model layers.

    Args:
      n: how many problems (>= 1).
      seed: the draw's seed; the same seed gives the same problems.

    Returns:
      ``(op, m, n, k)`` tuples: ``op`` is "ag_matmul" (column-parallel layers),
      "matmul_rs" (row-parallel prefill) or "matmul_ar" (row-parallel decode).

    Raises:
      ValueError: ``n`` below 1 or a seed that is not a non-negative int.
    """
    _check_draw(n, seed)
    rng = np.random.default_rng(seed)
    return [_layer(rng) for _ in range(n)]
