"""The correctness cases of the MoE and attention ops on a mesh spanning processes
(one PE per process: CPU, or processes sharing one GPU, under MPS or not), each
against a float64 host reference from the same seeds; no XLA collective (those
refuse several processes on one GPU) except with ``--xla-grads``.

  python -m jaxtdist.launch --nproc-per-node 2 [--share-gpu] \
      tests/multiprocess/cases_check.py [--xla-grads]

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

Prints ``CHECK name relerr`` per case (names: ``checks.CASES``, with
--xla-grads also ``checks.XLA_GRAD_CASES``), ``XLA_COLLECTIVES`` for a program
that should hold none but does, and ``OK`` or ``FAILED names`` at the end.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# ops_check joins jax.distributed as it is imported (before JAX's devices are used).
from tests.multiprocess.ops_check import (place, rand, relerr, shard_mapper,  # noqa: E402
                                          xla_collectives)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxtdist as td  # noqa: E402
from tests.multiprocess.checks import CASES, XLA_GRAD_CASES  # noqa: E402

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


def check_ag_attention_grads(mesh, world: int) -> dict[str, float]:
    """Gradients of q, k and v (its backward gathers k and v with XLA's collectives)."""
    sm = shard_mapper(mesh)
    spec = P(None, "tp")
    errs = {}
    for name, causal in (("ag_grads_causal", True), ("ag_grads_noncausal", False)):
        q, do = rand(1100, (1, world * 5, 8, 64)), rand(1101, (1, world * 5, 8, 64))
        kc, vc = rand(1102, (1, world * 5, 2, 64)), rand(1103, (1, world * 5, 2, 64))
        f = sm(lambda a, k_, v_, c=causal: td.ag_attention(a, k_, v_, "tp", causal=c),
               (spec,) * 3, spec)

        def vjp(a, k_, v_, g):
            _, back = jax.vjp(f, a, k_, v_)
            return back(g)

        got = jax.jit(vjp)(*(place(mesh, a, spec) for a in (q, kc, vc, do)))
        ref = _attention_grads(q, kc, vc, do, causal)
        errs[name] = max(relerr(a, r) for a, r in zip(got, ref))
    return errs


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--xla-grads", action="store_true",
                    help="also ag_attention's gradients (XLA's collectives in its backward)")
    args = ap.parse_args()
    world = jax.device_count()
    mesh = jax.make_mesh((world,), ("tp",))
    td.initialize(mesh, wait_timeout_s=60.0, heap_bytes=16 << 20)
    errs = {**check_moe(mesh, world), **check_flash_decode(mesh, world),
            **check_ag_attention(mesh, world)}
    if args.xla_grads:
        errs.update(check_ag_attention_grads(mesh, world))
    assert tuple(errs) == CASES + (XLA_GRAD_CASES if args.xla_grads else ()), tuple(errs)
    bad = []
    for name, err in errs.items():
        print(f"CHECK {name} {err:.3e}", flush=True)
        if not err <= TOL:
            bad.append(name)
    td.shutdown()
    print("FAILED " + " ".join(bad) if bad else "OK", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
