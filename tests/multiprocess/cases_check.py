"""The correctness cases of the MoE and attention ops on a mesh spanning processes
(one PE per process: CPU, or processes sharing one GPU, under MPS or not), each
against a float64 host reference from the same seeds; no XLA collective (those
refuse several processes on one GPU) except with ``--xla-grads``.

  python -m jaxtdist.launch --nproc-per-node 2 [--share-gpu] \
      tests/multiprocess/cases_check.py [--xla-grads] [--ll] [--overlap-grads]

- MoE dispatch + combine with experts that scale each row by a factor of its
  own expert (so a row at the wrong expert shows): random routings, top-1 with
  one expert per rank, top-8 of many experts, every token to rank 0's experts,
  an expert no token picks, every token to one expert, T that divides nothing;
  50 chained calls with a new routing each; gradients of x and the weights.
- flash_decode: ragged lengths (one sequence on rank 0's positions only, so the
  other ranks hold none of it), grouped-query ratios 1, 4 and 8, head dims 64 and
  128; 50 chained decode steps with growing lengths.
- ag_attention: causal or not, ratios 1, 4 and 8, an odd shard (5 positions),
  head dim 128 (on GPUs float16, 128 positions per rank: the warp-specialized
  kernel reading peers' chunks from the inbox); with ``--xla-grads`` also its
  gradients (its backward gathers k and v with XLA's collectives).
- With ``--ll``, the low-latency MoE layout (moe_dispatch_ll -> experts ->
  moe_combine_ll, 16 tokens per rank, 8 experts per rank): a random routing in
  float32; in bfloat16 a routing skewed to rank 0's experts with ids out of
  range and repeated (M = 24 slots per source, more than the tokens); FP8
  dispatch (H = 1984: a partial 1 x 128 block), the experts dequantizing and
  running the masked grouped GEMM; a bfloat16 layer (the masked grouped GEMM,
  an expert per rank that no token picks) against the dense float64 layer; 20
  chained calls of one compiled program with a new routing each. The counts
  and the invalid pairs must match exactly.
- With ``--overlap-grads``, ag_attention's gradients through its overlapped
  backward (config ``BACKWARD="overlap"``: k and v pushed into peers' inboxes,
  dk and dv partials pushed back; no XLA collective, so processes sharing a GPU
  run it), causal and not, an odd shard and a longer one of 2 batches.

Prints ``CHECK name relerr`` per case (names: ``checks.CASES``, with
--xla-grads also ``checks.XLA_GRAD_CASES``, with --ll ``checks.LL_CASES``, with
--overlap-grads ``checks.OVERLAP_GRAD_CASES``; bounds: ``checks.tolerance``),
``XLA_COLLECTIVES`` for a program that should hold none but does, ``MISMATCH``
for counts that differ from the reference's, ``TOOK check seconds`` per group
of cases (its CHECK lines follow), ``ERROR check: traceback`` where an opt-in
group raised (its cases then report inf), ``HEAP_IN_USE`` bytes of the heap,
and ``OK`` or ``FAILED names`` at the end.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# ops_check joins jax.distributed as it is imported (before JAX's devices are used).
from tests.multiprocess.ops_check import (place, rand, relerr, shard_mapper,  # noqa: E402
                                          xla_collectives)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxtdist as td  # noqa: E402
from jaxtdist.ops.moe import ll_heap_bytes  # noqa: E402
from tests.fp8_rounding import dispatch_roundtrip  # noqa: E402
from tests.multiprocess.checks import (CASES, LL_CASES, OVERLAP_GRAD_CASES,  # noqa: E402
                                       XLA_GRAD_CASES, tolerance)

GPU = jax.devices()[0].platform == "gpu"
# float32: exact to rounding under the interpreter; TF32 (and float16 for head dim
# 128) on GPUs.
TOL = 5e-3 if GPU else 1e-5


def _no_xla_collectives(name: str, fn, *args):
    """``fn(*args)`` compiled, after reporting any XLA collective in it."""
    compiled = jax.jit(fn).lower(*args).compile()
    found = xla_collectives(compiled.as_text())
    if found:
        print(f"XLA_COLLECTIVES {name}: {found}", flush=True)
    return compiled(*args)


# -- MoE ---------------------------------------------------------------------------

def _routing(seed: int, tokens: int, k: int, experts) -> np.ndarray:
    """[tokens, k] int32: k distinct experts per token, drawn from ``experts``."""
    experts = np.asarray(experts)
    rng = np.random.default_rng(seed)
    return np.stack([rng.choice(experts, size=k, replace=False) for _ in range(tokens)]
                    ).astype(np.int32)


def _expert_scale(e: int) -> np.ndarray:
    return (1.0 + np.arange(e) / e).astype(np.float32)


def _moe_fn(mesh, world: int, e: int):
    """(x, ids, gate) -> out, each expert scaling its rows by ``_expert_scale``."""
    scale = _expert_scale(e)
    local = e // world

    def layer(x, ids, gate):
        recv, sizes, handle = td.moe_dispatch(x, ids, "tp", num_experts=e)
        # Row r of recv belongs to local expert searchsorted(cumsum(sizes), r, right).
        ends = jax.numpy.cumsum(sizes)
        row_expert = jax.numpy.searchsorted(ends, jax.numpy.arange(recv.shape[0]), side="right")
        first = jax.lax.axis_index("tp") * local
        factor = jax.numpy.asarray(scale)[jax.numpy.minimum(first + row_expert, e - 1)]
        return td.moe_combine(recv * factor[:, None], handle, gate, "tp")

    return shard_mapper(mesh)(layer, (P("tp"),) * 3, P("tp"))


def _moe_reference(x, ids, gate, e: int) -> np.ndarray:
    s = (gate.astype(np.float64) * _expert_scale(e)[ids]).sum(1)
    return x.astype(np.float64) * s[:, None]


def check_moe(mesh, world: int) -> dict[str, float]:
    errs = {}
    h = 32
    cases = {  # name: (tokens per rank, K, E, the experts drawn from)
        "moe_random_top2": (5, 2, 2 * world, None),
        "moe_top1_one_expert_per_rank": (7, 1, world, None),
        "moe_top8_of_many": (13, 8, 8 * world, None),
        "moe_all_to_rank0": (6, 2, 4 * world, range(4)),
        "moe_an_empty_expert": (9, 2, 2 * world, [i for i in range(2 * world) if i != 1]),
        "moe_all_to_one_expert": (5, 1, 2 * world, [2 * world - 1]),
    }
    for i, (name, (t, k, e, pool)) in enumerate(cases.items()):
        x, gate = rand(400 + i, (world * t, h)), rand(420 + i, (world * t, k))
        ids = _routing(440 + i, world * t, k, range(e) if pool is None else pool)
        f = _moe_fn(mesh, world, e)
        args = [place(mesh, a, P("tp")) for a in (x, ids, gate)]
        errs[name] = relerr(_no_xla_collectives(name, f, *args),
                            _moe_reference(x, ids, gate, e))
    # One compiled program, a new routing per call (counts are data).
    t, k, e = 5, 2, 2 * world
    f = jax.jit(_moe_fn(mesh, world, e))
    worst = 0.0
    for call in range(50):
        x, gate = rand(500 + call, (world * t, h)), rand(600 + call, (world * t, k))
        ids = _routing(700 + call, world * t, k, range(e))
        out = f(*(place(mesh, a, P("tp")) for a in (x, ids, gate)))
        worst = max(worst, relerr(out, _moe_reference(x, ids, gate, e)))
    errs["moe_chained_50"] = worst
    # Gradients of x and the weights: dispatch's backward a combine, combine's a
    # dispatch, on jaxtdist's kernels.
    x, gate, g = rand(800, (world * t, h)), rand(801, (world * t, k)), rand(802, (world * t, h))
    ids = _routing(803, world * t, k, range(e))
    f = _moe_fn(mesh, world, e)

    def vjp(x_, ids_, gate_, g_):
        _, back = jax.vjp(lambda a, b: f(a, ids_, b), x_, gate_)
        return back(g_)

    dx, dgate = _no_xla_collectives("moe_grads", vjp,
                                    *(place(mesh, a, P("tp")) for a in (x, ids, gate, g)))
    c = _expert_scale(e)[ids].astype(np.float64)
    ref_dx = g * (gate * c).sum(1)[:, None]
    ref_dgate = c * (x.astype(np.float64) * g).sum(1)[:, None]
    errs["moe_grads"] = max(relerr(dx, ref_dx), relerr(dgate, ref_dgate))
    return errs


# -- MoE: the low-latency layout (--ll) ----------------------------------------------

BF16 = jnp.bfloat16
# name: (tokens per rank T, H, K, routing, dtype, M (None: T), F of the experts' masked
# grouped GEMM (0: experts scaling their rows by their own factor), fp8). E = 8 per rank.
LL_SHAPES = {
    "moe_ll_random": (16, 512, 4, "random", np.float32, None, 0, False),
    "moe_ll_skewed_invalid": (16, 1024, 8, "skewed_invalid", BF16, 24, 0, False),
    "moe_ll_fp8": (16, 1984, 4, "random", BF16, None, 256, True),
    "moe_ll_layer": (16, 1024, 8, "empty", BF16, None, 512, False),
}
LL_CHAINED = 20  # calls of moe_ll_random's program, routings of every kind in turn


def _ll_heap_bytes(world: int) -> int:
    """Heap the LL cases' workspaces take (each shape keeps its own): the dispatch's
    (``ll_heap_bytes``) and the combine's two inboxes of T x K rows of F, its flags,
    with room for the alignment of each part."""
    total = 0
    for t, h, k, _, dtype, m, f, fp8 in LL_SHAPES.values():
        itemsize = np.dtype(dtype).itemsize
        total += ll_heap_bytes(world, 8 * world, m or t, h, itemsize, fp8=fp8) + (4 << 10)
        total += 2 * t * k * (f or h) * itemsize + 4 * world * t + (4 << 10)
    return total


def _ll_routing(seed: int, tokens: int, k: int, e: int, world: int, kind: str) -> np.ndarray:
    """[tokens, k] int32 ids: "random" (k distinct experts), "empty" (every rank's last
    expert picked by no token), "skewed_invalid" (80% of tokens to rank 0's experts
    0 and 1 first, then ids out of range and repeats: not sent, weigh zero)."""
    rng = np.random.default_rng(seed)
    pool = np.arange(e)
    if kind == "empty":
        pool = pool[pool % (e // world) != e // world - 1]
    ids = np.stack([rng.permutation(pool)[:k] for _ in range(tokens)]).astype(np.int32)
    if kind == "skewed_invalid":
        for t in np.flatnonzero(rng.random(tokens) < 0.8):
            ids[t] = [0, 1] + [x for x in rng.permutation(e) if x > 1][:k - 2]
        ids[::4, 0] = e + 1
        ids[1::4, -1] = -1
        ids[2::4, 1] = ids[2::4, 0]  # sent once, for its first k
    return ids


def _ll_valid(ids: np.ndarray, e: int) -> np.ndarray:
    """[N, K]: the pairs sent (in range, not a repeat of an earlier k of the token)."""
    ok = (ids >= 0) & (ids < e)
    for kk in range(1, ids.shape[1]):
        ok[:, kk] &= ~np.any(ids[:, :kk] == ids[:, kk:kk + 1], axis=1)
    return ok


def _ll_counts(ids: np.ndarray, world: int, e: int) -> np.ndarray:
    """recv_counts of every rank, [W, E / W, W]: valid pairs per (expert, source)."""
    e_loc, t = e // world, ids.shape[0] // world
    rows, cols = np.nonzero(_ll_valid(ids, e))
    g = ids[rows, cols]
    counts = np.zeros((world, e_loc, world), np.int32)
    np.add.at(counts, (g // e_loc, g % e_loc, rows // t), 1)
    return counts


def _ll_fn(mesh, world: int, e: int, m, fp8: bool, gemm: bool):
    """(x, ids, gate[, w]) -> (out, recv_counts [W, E / W, W], invalid [W]): dispatch,
    the experts (the masked grouped GEMM with w, or each scaling its rows by
    ``_expert_scale``), combine."""
    scale = _expert_scale(e)
    e_loc = e // world

    def layer(x, ids, gate, *w):
        recv, counts, handle = td.moe_dispatch_ll(x, ids, "tp", num_experts=e,
                                                  max_tokens_per_rank=m, fp8=fp8)
        if fp8:  # each 1 x 128 block times its scale, back in x's dtype
            q, sc = recv
            cols = jnp.repeat(sc, 128, axis=2)[:, :, :q.shape[2]]
            recv = (q.astype(jnp.float32) * cols).astype(x.dtype)
        if gemm:
            y = td.grouped_matmul_masked(recv, w[0], counts)
        else:  # a row at the wrong expert shows; the padding (NaN, maybe) is never read
            first = jax.lax.axis_index("tp") * e_loc
            factor = jax.lax.dynamic_slice(jnp.asarray(scale), (first,), (e_loc,))
            y = (recv.astype(jnp.float32) * factor[:, None, None]).astype(x.dtype)
        out = td.moe_combine_ll(y, handle, gate, "tp")
        return out, counts[None], handle.invalid[None]

    return shard_mapper(mesh)(layer, (P("tp"),) * (4 if gemm else 3), (P("tp"),) * 3)


def _ll_reference(x, ids, gate, e: int, w=None) -> np.ndarray:
    """float64: each valid pair's expert output (x times its expert's factor, or
    x @ w[expert]) times its weight, summed per token."""
    valid = _ll_valid(ids, e)
    g = np.where(valid, gate, 0).astype(np.float64)
    xs = np.asarray(x, np.float64)
    if w is None:
        return (g * _expert_scale(e)[np.where(valid, ids, 0)]).sum(1)[:, None] * xs
    out = np.zeros((x.shape[0], w.shape[2]))
    for j in range(e):  # expert by expert: [N, K, H, F] would not fit
        weight = np.where(ids == j, g, 0).sum(1)
        if weight.any():
            out += weight[:, None] * (xs @ np.asarray(w[j], np.float64))
    return out


def _exact(name: str, what: str, got: jax.Array, want: np.ndarray) -> bool:
    """Whether the shards this process holds equal ``want``'s; prints ``MISMATCH``."""
    for shard in got.addressable_shards:
        if not np.array_equal(np.asarray(shard.data), want[shard.index]):
            print(f"MISMATCH {name} {what}: {np.asarray(shard.data).ravel().tolist()} != "
                  f"{want[shard.index].ravel().tolist()}", flush=True)
            return False
    return True


def _ll_error(name: str, outs, x, ids, gate, world: int, e: int, w=None) -> float:
    """The combined output's relative error; inf where the counts or the invalid
    pairs differ from the reference's."""
    out, counts, invalid = outs
    t, k = x.shape[0] // world, ids.shape[1]
    ok = _exact(name, "recv_counts", counts, _ll_counts(ids, world, e))
    missing = (~_ll_valid(ids, e)).reshape(world, t * k).sum(1).astype(np.int32)
    ok &= _exact(name, "invalid", invalid, missing)
    if name == "moe_ll_fp8":
        x = dispatch_roundtrip(np.asarray(x, np.float32), GPU)
    err = relerr(out, _ll_reference(x, ids, gate, e, w))
    return err if ok else float("inf")


def check_moe_ll(mesh, world: int) -> dict[str, float]:
    errs = {}
    e = 8 * world
    for i, (name, (t, h, k, kind, dtype, m, f, fp8)) in enumerate(LL_SHAPES.items()):
        x = rand(1200 + i, (world * t, h)).astype(dtype)
        ids = _ll_routing(1210 + i, world * t, k, e, world, kind)
        gate = rand(1220 + i, (world * t, k))
        host = [x, ids, gate]
        if f:
            host.append((0.05 * rand(1230 + i, (e, h, f))).astype(dtype))
        fn = _ll_fn(mesh, world, e, m, fp8, bool(f))
        outs = _no_xla_collectives(name, fn, *(place(mesh, a, P("tp")) for a in host))
        errs[name] = _ll_error(name, outs, x, ids, gate, world, e, host[3] if f else None)
    # One compiled program, a new routing of each kind in turn per call (the counts
    # are data; both parities of every box reused ten times).
    t, h, k, _, dtype, m, _, _ = LL_SHAPES["moe_ll_random"]
    fn = _ll_fn(mesh, world, e, m, False, False)
    compiled = None
    worst = 0.0
    for call in range(LL_CHAINED):
        x = rand(1300 + call, (world * t, h)).astype(dtype)
        ids = _ll_routing(1400 + call, world * t, k, e, world,
                          ("random", "skewed_invalid", "empty")[call % 3])
        gate = rand(1500 + call, (world * t, k))
        args = [place(mesh, a, P("tp")) for a in (x, ids, gate)]
        if compiled is None:
            compiled = jax.jit(fn).lower(*args).compile()
        outs = compiled(*args)
        worst = max(worst, _ll_error(f"moe_ll_chained_{LL_CHAINED} call {call}", outs, x, ids,
                                     gate, world, e))
    errs[f"moe_ll_chained_{LL_CHAINED}"] = worst
    return errs


# -- attention -----------------------------------------------------------------------

def _attention_reference(q, k, v, causal: bool, kv_len=None, q_first: int = 0):
    """float64 softmax attention, GQA. q [B, Sq, Hq, D] at global positions
    [q_first, q_first + Sq); k, v [B, Sk, Hkv, D]; kv_len [B] masks keys at or past it.
    Returns (out [B, Sq, Hq, D], p [B, Hkv, G, Sq, Sk]) for the gradients."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    qg = q.reshape(b, sq, hkv, hq // hkv, d).astype(np.float64)
    s = np.einsum("bqhgd,bkhd->bhgqk", qg, k.astype(np.float64)) / np.sqrt(d)
    keep = np.ones((b, 1, 1, sq, sk), bool)
    if causal:
        keep &= (np.arange(sk)[None, :] <= q_first + np.arange(sq)[:, None])[None, None, None]
    if kv_len is not None:
        keep &= (np.arange(sk)[None, :] < kv_len[:, None])[:, None, None, None, :]
    s = np.where(keep, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    vv = np.where(keep.any((1, 2, 3))[:, :, None, None], v.astype(np.float64), 0.0)
    o = np.einsum("bhgqk,bkhd->bqhgd", p, vv)
    return o.reshape(b, sq, hq, d), p


def _attention_grads(q, k, v, do, causal: bool):
    """float64 (dq, dk, dv) of the whole sequence's attention, GQA."""
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    _, p = _attention_reference(q, k, v, causal)
    dog = do.reshape(b, s, hkv, hq // hkv, d).astype(np.float64)
    qg = q.reshape(b, s, hkv, hq // hkv, d).astype(np.float64)
    dv = np.einsum("bhgqk,bqhgd->bkhd", p, dog)
    dp = np.einsum("bqhgd,bkhd->bhgqk", dog, v.astype(np.float64))
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) / np.sqrt(d)
    dq = np.einsum("bhgqk,bkhd->bqhgd", ds, k.astype(np.float64)).reshape(b, s, hq, d)
    dk = np.einsum("bhgqk,bqhgd->bkhd", ds, qg)
    return dq, dk, dv


def check_flash_decode(mesh, world: int) -> dict[str, float]:
    errs = {}
    sm = shard_mapper(mesh)
    specs = (P(), P(None, "tp"), P(None, "tp"), P())
    s = 64 if GPU else 8
    # Sequence 0 over every rank's positions (but the last), sequence 1 on rank 0's
    # only (the other ranks hold none of it), sequence 2 ragged.
    lens = np.array([world * s - 1, s // 2, world * s // 2 + 1], np.int32)
    for name, hq, hkv, d in (("fd_gqa1", 8, 8, 64), ("fd_gqa4", 8, 2, 64), ("fd_gqa8", 8, 1, 64),
                             ("fd_d128", 8, 2, 128)):
        seed = sum(map(ord, name))
        q = rand(seed, (3, hq, d))
        kc, vc = rand(seed + 1, (3, world * s, hkv, d)), rand(seed + 2, (3, world * s, hkv, d))
        f = sm(lambda a, k_, v_, n: td.flash_decode(a, k_, v_, n, "tp"), specs, P(),
               check_vma=False)
        args = [place(mesh, a, sp) for a, sp in zip((q, kc, vc, lens), specs)]
        out = _no_xla_collectives(name, f, *args)
        ref, _ = _attention_reference(q[:, None], kc, vc, False, kv_len=lens)
        errs[name] = relerr(out, ref[:, 0])
    # 50 decode steps over one cache, the lengths growing (lengths are data).
    hq, hkv, d = 8, 2, 64
    kc, vc = rand(900, (2, world * s, hkv, d)), rand(901, (2, world * s, hkv, d))
    f = jax.jit(sm(lambda a, k_, v_, n: td.flash_decode(a, k_, v_, n, "tp"), specs, P(),
                   check_vma=False))
    placed_k, placed_v = place(mesh, kc, specs[1]), place(mesh, vc, specs[2])
    worst = 0.0
    for step in range(50):
        n = np.array([1 + step * (world * s - 1) // 49, 1 + step * (world * s // 2) // 49],
                     np.int32)
        q = rand(1000 + step, (2, hq, d))
        out = f(place(mesh, q, P()), placed_k, placed_v, place(mesh, n, P()))
        ref, _ = _attention_reference(q[:, None], kc, vc, False, kv_len=n)
        worst = max(worst, relerr(out, ref[:, 0]))
    errs["fd_chained_50"] = worst
    return errs


def check_ag_attention(mesh, world: int) -> dict[str, float]:
    errs = {}
    sm = shard_mapper(mesh)
    spec = P(None, "tp")
    for name, causal, hq, hkv, d, s in (
            ("ag_causal_gqa1", True, 8, 8, 64, 5), ("ag_causal_gqa4", True, 8, 2, 64, 5),
            ("ag_causal_gqa8", True, 8, 1, 64, 5), ("ag_noncausal_gqa4", False, 8, 2, 64, 5),
            ("ag_causal_d128", True, 4, 2, 128, 128 if GPU else 16),
            ("ag_noncausal_d128", False, 4, 2, 128, 128 if GPU else 16)):
        seed = sum(map(ord, name))
        dt = np.float16 if GPU and d == 128 else np.float32
        q = rand(seed, (1, world * s, hq, d)).astype(dt)
        kc, vc = (rand(seed + 1 + i, (1, world * s, hkv, d)).astype(dt) for i in range(2))
        f = sm(lambda a, k_, v_, c=causal: td.ag_attention(a, k_, v_, "tp", causal=c),
               (spec,) * 3, spec)
        out = _no_xla_collectives(name, f, *(place(mesh, a, spec) for a in (q, kc, vc)))
        errs[name] = relerr(out, _attention_reference(q, kc, vc, causal)[0])
    return errs


def _ag_grads_error(mesh, world: int, causal: bool, b: int, s: int, seed: int,
                    config=None, name=None) -> float:
    """The worst relative error of ag_attention's (dq, dk, dv) on [b, world * s, ...]
    operands against the float64 gradients; with ``name``, after reporting any XLA
    collective in the compiled program."""
    sm = shard_mapper(mesh)
    spec = P(None, "tp")
    q, do = rand(seed, (b, world * s, 8, 64)), rand(seed + 1, (b, world * s, 8, 64))
    kc, vc = rand(seed + 2, (b, world * s, 2, 64)), rand(seed + 3, (b, world * s, 2, 64))
    f = sm(lambda a, k_, v_: td.ag_attention(a, k_, v_, "tp", causal=causal, config=config),
           (spec,) * 3, spec)

    def vjp(a, k_, v_, g):
        _, back = jax.vjp(f, a, k_, v_)
        return back(g)

    args = [place(mesh, a, spec) for a in (q, kc, vc, do)]
    got = _no_xla_collectives(name, vjp, *args) if name else jax.jit(vjp)(*args)
    ref = _attention_grads(q, kc, vc, do, causal)
    return max(relerr(a, r) for a, r in zip(got, ref))


def check_ag_attention_grads(mesh, world: int) -> dict[str, float]:
    """Gradients of q, k and v (its backward gathers k and v with XLA's collectives)."""
    return {name: _ag_grads_error(mesh, world, causal, 1, 5, 1100)
            for name, causal in (("ag_grads_causal", True), ("ag_grads_noncausal", False))}


# (B, S_shard) of the overlapped backward's cases (Hq 8, Hkv 2, D 64, float32).
OVERLAP_SHAPES = ((1, 5), (2, 200 if GPU else 24))


def _overlap_heap_bytes(world: int) -> int:
    """Heap the overlapped backward's cases take: its workspace (under 4 W B S Hkv D
    (itemsize + 4) bytes, the bound ag_attention's warning gives) and as much again
    for the forward's KV inbox."""
    return sum(2 * 4 * world * b * s * 2 * 64 * (4 + 4) for b, s in OVERLAP_SHAPES)


def check_ag_attention_overlap_grads(mesh, world: int) -> dict[str, float]:
    """Gradients of q, k and v through the overlapped backward (config BACKWARD=
    "overlap"; on GPUs "auto" keeps XLA's collectives until this has run), no XLA
    collective: the worst of an odd shard (5 positions: one partial key tile) and
    2 batches of a longer one (several key tiles on GPUs, the inbox's chunks per
    batch)."""
    errs = {}
    for name, causal in (("ag_grads_overlap_causal", True),
                         ("ag_grads_overlap_noncausal", False)):
        errs[name] = max(_ag_grads_error(mesh, world, causal, b, s, 1600 + 10 * i,
                                         config=dict(BACKWARD="overlap"), name=name)
                         for i, (b, s) in enumerate(OVERLAP_SHAPES))
    return errs


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--xla-grads", action="store_true",
                    help="also ag_attention's gradients (XLA's collectives in its backward)")
    ap.add_argument("--ll", action="store_true",
                    help="also the low-latency MoE layout (moe_dispatch_ll, "
                         "grouped_matmul_masked, moe_combine_ll)")
    ap.add_argument("--overlap-grads", action="store_true",
                    help="also ag_attention's gradients through its overlapped backward "
                         "(config BACKWARD='overlap': no XLA collective)")
    args = ap.parse_args()
    world = jax.device_count()
    mesh = jax.make_mesh((world,), ("tp",))
    # 16 MiB hold the other cases' workspaces; the opt-in ones' come on top.
    heap = ((16 << 20) + (_ll_heap_bytes(world) if args.ll else 0)
            + (_overlap_heap_bytes(world) if args.overlap_grads else 0))
    rt = td.initialize(mesh, wait_timeout_s=60.0, heap_bytes=heap)
    # Each group's CHECK lines as it ends (a later group that hangs leaves them in the
    # log). An opt-in group that raises (on GPUs: a kernel that does not compile, a
    # wait that times out) reports its cases as inf and the next group still runs:
    # one new feature's failure must not hide another's results.
    checks = [(check_moe, None), (check_flash_decode, None), (check_ag_attention, None)]
    checks += [(check_ag_attention_grads, XLA_GRAD_CASES)] if args.xla_grads else []
    checks += [(check_moe_ll, LL_CASES)] if args.ll else []
    checks += [(check_ag_attention_overlap_grads, OVERLAP_GRAD_CASES)] \
        if args.overlap_grads else []
    errs, bad = {}, []
    for check, names in checks:
        start = time.perf_counter()
        try:
            got = check(mesh, world)
        except Exception:
            if names is None:
                raise
            print(f"ERROR {check.__name__}: {traceback.format_exc()[-3000:]}", flush=True)
            got = dict.fromkeys(names, float("inf"))
        print(f"TOOK {check.__name__} {time.perf_counter() - start:.1f} s", flush=True)
        for name, err in got.items():
            print(f"CHECK {name} {err:.3e}", flush=True)
            if not err <= tolerance(name, TOL):
                bad.append(name)
        errs.update(got)
    assert tuple(errs) == (CASES + (XLA_GRAD_CASES if args.xla_grads else ())
                           + (LL_CASES if args.ll else ())
                           + (OVERLAP_GRAD_CASES if args.overlap_grads else ())), tuple(errs)
    print(f"HEAP_IN_USE {rt.bytes_in_use} of {rt.heap_bytes}", flush=True)
    td.shutdown()
    print("FAILED " + " ".join(bad) if bad else "OK", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
