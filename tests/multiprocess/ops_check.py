"""Every jaxtdist op on a mesh spanning processes, checked against a host
reference computed from the same seeds (no XLA collectives needed).

Started by tests/test_cpu_multiprocess.py through the launcher:
  python -m jaxtdist.launch --nproc-per-node 2 tests/multiprocess/ops_check.py \
      [--ops [--transforms] [--grads]] [--chain N]

Each process checks the shards it holds and prints one ``CHECK op relerr``
line per op (with --grads also ``GRAD_PARTS op y=.. dx=.. dw=..``: the errors of
the three outputs whose largest the CHECK line gives), ``HEAP_READY_S s``
(initialize to a ready heap), ``OK`` at the end.
With ``--die-after K --victim R``, process R kills itself (SIGKILL) after K
calls of a chain of ops; the others must fail with an error naming it.
``--death raise`` (an exception) or ``exit0`` (``os._exit(0)``) ends it instead;
with ``--uncaught`` no process catches the chain's exception (a plain script).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jaxtdist.launch  # noqa: E402

jaxtdist.launch.initialize_from_env()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxtdist as td  # noqa: E402
from tests import kernels_for_tests as K  # noqa: E402
from tests.multiprocess.checks import GRADS, OPS, TRANSFORMS  # noqa: E402

# float32: the interpreter's dot is numpy's; GPUs' tensor cores take float32
# operands as TF32.
TOL = 1e-5 if jax.devices()[0].platform == "cpu" else 5e-3


def place(mesh, x: np.ndarray, spec) -> jax.Array:
    """A global array of host ``x`` laid out by ``spec`` (each process its shards)."""
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def relerr(out: jax.Array, ref: np.ndarray) -> float:
    """Largest relative error over the shards this process holds; inf where a shard's
    error is NaN (a NaN in the output: ``max`` would drop it, and the case pass)."""
    worst = 0.0
    for shard in out.addressable_shards:
        got = np.asarray(shard.data, np.float64)
        want = np.asarray(ref[shard.index], np.float64)
        err = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
        worst = max(worst, err if not np.isnan(err) else float("inf"))
    return worst


def nan_relerr(out: jax.Array, ref: np.ndarray) -> float:
    """``relerr`` where ``ref`` is not NaN; inf unless ``out`` is NaN exactly where
    ``ref`` is (and ``ref`` has some NaN: the case must poison the reference)."""
    worst = 0.0 if np.isnan(ref).any() else float("inf")
    for shard in out.addressable_shards:
        got = np.asarray(shard.data, np.float64)
        want = np.asarray(ref[shard.index], np.float64)
        if not np.array_equal(np.isnan(got), np.isnan(want)):
            return float("inf")
        kept = ~np.isnan(want)
        worst = max(worst, float(np.linalg.norm(got[kept] - want[kept])
                                 / max(np.linalg.norm(want[kept]), 1e-30)))
    return worst


def shard_mapper(mesh):
    """``sm(f, in_specs, out_specs, **kw)``: ``f`` jitted in a shard_map over ``mesh``."""
    return lambda f, i, o, **kw: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=i, out_specs=o,
                                                       **kw))


def xla_collectives(hlo: str) -> list[str]:
    """The XLA collectives of a compiled program's text, each with the JAX op that
    made it (several processes sharing one GPU cannot run them)."""
    found = []
    for line in hlo.splitlines():
        m = re.search(r"\s(all-reduce|all-gather|reduce-scatter|all-to-all|"
                      r"collective-permute)(-start)?\(", line)
        if m:
            name = re.search(r'op_name="([^"]*)"', line)
            found.append(f"{m.group(1)} from {name.group(1) if name else '?'}")
    return found


def rand(seed: int, shape) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def check_all(mesh, world: int) -> dict[str, float]:
    sm = shard_mapper(mesh)
    m, k, n = 8, 32, 16 * world
    errs = {}
    x, w = rand(1, (world * m, k)), rand(2, (k, n))
    f = sm(lambda a, b: td.ag_matmul(a, b, "tp"), (P("tp", None), P(None, "tp")), P(None, "tp"))
    errs["ag_matmul"] = relerr(f(place(mesh, x, P("tp", None)), place(mesh, w, P(None, "tp"))),
                               x @ w)
    x = rand(3, (world * 4, 24))
    f = sm(lambda a: td.all_gather(a, "tp"), P("tp", None), P(None, None), check_vma=False)
    errs["all_gather"] = relerr(f(place(mesh, x, P("tp", None))), x)
    x = rand(4, (world, 40))
    f = sm(lambda a: td.all_reduce(a, "tp"), P("tp", None), P(None, None), check_vma=False)
    errs["all_reduce"] = relerr(f(place(mesh, x, P("tp", None))), x.sum(0, keepdims=True))
    x = rand(5, (world, world * 6, 8))
    f = sm(lambda a: td.reduce_scatter(a[0], "tp")[None], P("tp", None, None),
           P("tp", None, None))
    ref = x.sum(0).reshape(world, 6, 8)
    errs["reduce_scatter"] = relerr(f(place(mesh, x, P("tp", None, None))), ref)
    x, w = rand(6, (world * 8, world * 16)), rand(7, (world * 16, 24))
    f = sm(lambda a, b: td.matmul_rs(a, b, "tp"), (P(None, "tp"), P("tp", None)),
           P("tp", None))
    errs["matmul_rs"] = relerr(f(place(mesh, x, P(None, "tp")), place(mesh, w, P("tp", None))),
                               x @ w)
    x, w = rand(8, (4, world * 16)), rand(9, (world * 16, 24))
    f = sm(lambda a, b: td.matmul_ar(a, b, "tp"), (P(None, "tp"), P("tp", None)),
           P(None, None), check_vma=False)
    errs["matmul_ar"] = relerr(f(place(mesh, x, P(None, "tp")), place(mesh, w, P("tp", None))),
                               x @ w)
    nn = 24

    def ring(a):
        out = td.triton_call(a[0], kernel=K.ring_kernel,
                             out_shape=jax.ShapeDtypeStruct((nn,), jnp.float32), grid=(1,),
                             axis_name="tp", workspace_bytes=256 + 2 * 4 * nn, N=nn, BLOCK=8)
        return out[None]

    f = sm(ring, P("tp", None), P("tp", None))
    worst = 0.0
    for seed in (10, 11, 12):  # both buffer parities, reused
        x = rand(seed, (world, nn))
        worst = max(worst, relerr(f(place(mesh, x, P("tp", None))), np.roll(x, 1, axis=0)))
    errs["triton_call"] = worst

    def shmem_gather(a):
        return td.triton_call(a[0], kernel=K.shmem_all_gather_kernel,
                              out_shape=jax.ShapeDtypeStruct((world * nn,), jnp.float32),
                              grid=(1,), axis_name="tp",
                              workspace_bytes=1024 + 2 * 4 * world * nn, N=nn, BLOCK=32)[None]

    f = sm(shmem_gather, P("tp", None), P("tp", None))
    worst = 0.0
    for seed in (13, 14, 15):  # both buffer parities, reused
        x = rand(seed, (world, nn))
        worst = max(worst, relerr(f(place(mesh, x, P("tp", None))),
                                  np.tile(x.reshape(1, -1), (world, 1))))
    errs["shmem_all_gather"] = worst
    b, hq, hkv, d, s = 2, 8, 2, 64, 5
    q = rand(16, (b, hq, d))
    kc, vc = rand(17, (b, world * s, hkv, d)), rand(18, (b, world * s, hkv, d))
    lens = np.array([world * s - 1, 3], np.int32)  # the second: rank 0's positions only
    f = sm(lambda a, k_, v_, n: td.flash_decode(a, k_, v_, n, "tp"),
           (P(), P(None, "tp"), P(None, "tp"), P()), P(), check_vma=False)
    errs["flash_decode"] = relerr(f(place(mesh, q, P()), place(mesh, kc, P(None, "tp")),
                                    place(mesh, vc, P(None, "tp")), place(mesh, lens, P())),
                                  decode_reference(q, kc, vc, lens))
    # NaN at a valid position of the last rank's shard poisons its partial, which
    # every rank's merge must carry (not take for an empty one); NaN and inf past
    # kv_len (a stale cache) must not reach the output.
    kc, vc = kc.copy(), vc.copy()
    kc[0, world * s - 2, 1, 3] = np.nan
    kc[1, 4:], vc[1, 4:] = np.nan, np.inf
    lens = np.array([world * s - 1, 4], np.int32)
    errs["flash_decode_nan"] = nan_relerr(
        f(place(mesh, q, P()), place(mesh, kc, P(None, "tp")), place(mesh, vc, P(None, "tp")),
          place(mesh, lens, P())), decode_reference(q, kc, vc, lens))
    q = rand(19, (1, world * 6, 4, 64))
    kc, vc = rand(20, (1, world * 6, 2, 64)), rand(21, (1, world * 6, 2, 64))
    spec = P(None, "tp")
    f = sm(lambda a, k_, v_: td.ag_attention(a, k_, v_, "tp"), (spec,) * 3, spec)
    errs["ag_attention"] = relerr(f(*(place(mesh, a, spec) for a in (q, kc, vc))),
                                  causal_reference(q, kc, vc))
    # Head dim 128 and, on GPUs, 256 float16 positions per rank: where it fits
    # (Hopper), the warp-specialized kernel reading peers' chunks from the inbox.
    gpu = jax.devices()[0].platform == "gpu"
    s_rank, dt = (256, np.float16) if gpu else (16, np.float32)
    q = rand(22, (1, world * s_rank, 4, 128)).astype(dt)
    kc, vc = (rand(23 + i, (1, world * s_rank, 2, 128)).astype(dt) for i in range(2))
    errs["ag_attention_d128"] = relerr(f(*(place(mesh, a, spec) for a in (q, kc, vc))),
                                       causal_reference(q, kc, vc))
    # MoE: tokens to their experts' ranks, identity experts (times 2), weighted back;
    # then the same with fp8 tokens and scales (dequantized by the experts).
    from jaxtdist.bench.moe import fp8_dequantize, fp8_tokens

    t, hdim, k, e = 5, 32, 2, 2 * world
    x = rand(25, (world * t, hdim))
    ids = np.argsort(np.random.default_rng(26).random((world * t, e)), axis=1)[:, :k]
    ids = ids.astype(np.int32)
    gate = rand(27, (world * t, k))
    ep = P("tp")

    def moe_layer(a, i, g):
        recv, _, handle = td.moe_dispatch(a, i, "tp", num_experts=e)
        return td.moe_combine(2 * recv, handle, g, "tp")

    f = sm(moe_layer, (ep,) * 3, ep)
    errs["moe"] = relerr(f(*(place(mesh, a, ep) for a in (x, ids, gate))),
                         2 * x.astype(np.float64) * gate.sum(1, keepdims=True))

    def moe_unzeroed(a, i, g):  # recv_x's unused rows left unwritten
        recv, _, handle = td.moe_dispatch(a, i, "tp", num_experts=e, zero_unused_rows=False)
        return td.moe_combine(2 * recv, handle, g, "tp")

    f = sm(moe_unzeroed, (ep,) * 3, ep)
    errs["moe_unzeroed"] = relerr(f(*(place(mesh, a, ep) for a in (x, ids, gate))),
                                  2 * x.astype(np.float64) * gate.sum(1, keepdims=True))

    def moe_routing_fused(a, i, g):  # the routing metadata inside the dispatch kernel
        recv, _, handle = td.moe_dispatch(a, i, "tp", num_experts=e,
                                          config=dict(ROUTING="fused"))
        return td.moe_combine(2 * recv, handle, g, "tp")

    f = sm(moe_routing_fused, (ep,) * 3, ep)
    errs["moe_routing_fused"] = relerr(f(*(place(mesh, a, ep) for a in (x, ids, gate))),
                                       2 * x.astype(np.float64) * gate.sum(1, keepdims=True))
    q8, scale = fp8_tokens(x, 2)

    def moe_fp8_layer(a, sc, i, g):
        (recv, recv_scale), _, handle = td.moe_dispatch(a, i, "tp", num_experts=e, x_scale=sc)
        return td.moe_combine(fp8_dequantize(recv, recv_scale), handle, g, "tp")

    f = sm(moe_fp8_layer, (ep,) * 4, ep)
    deq = np.asarray(q8, np.float64).reshape(world * t, 2, -1) * scale[..., None]
    errs["moe_fp8"] = relerr(f(*(place(mesh, a, ep) for a in (q8, scale, ids, gate))),
                             deq.reshape(world * t, hdim) * gate.sum(1, keepdims=True))
    # The tensor-parallel MoE MLP: every expert's FFN sharded over the ranks.
    w1, w2 = 0.3 * rand(28, (e, hdim, 8 * world)), 0.3 * rand(29, (e, 8 * world, hdim))
    w_in, w_out = P(None, None, "tp"), P(None, "tp", None)
    f = sm(lambda a, i, g, u, v: td.moe_tp_mlp(a, i, g, u, v, "tp"), (ep, ep, ep, w_in, w_out),
           ep)
    arrays = ((x, ep), (ids, ep), (gate, ep), (w1, w_in), (w2, w_out))
    errs["moe_tp"] = relerr(f(*(place(mesh, a, s) for a, s in arrays)),
                            moe_tp_reference(x, ids, gate, w1, w2))
    # The overlapped schedule: its two fused kernels push between processes too.
    f = sm(lambda a, i, g, u, v: td.moe_tp_mlp(a, i, g, u, v, "tp", overlap=True),
           (ep, ep, ep, w_in, w_out), ep)
    errs["moe_tp_overlapped"] = relerr(f(*(place(mesh, a, s) for a, s in arrays)),
                                       moe_tp_reference(x, ids, gate, w1, w2))
    return errs


def moe_tp_reference(x, ids, gate, w1, w2) -> np.ndarray:
    """float64: each token through each of its experts (silu MLP, whole FFN), weighted."""
    x, w1, w2 = (a.astype(np.float64) for a in (x, w1, w2))
    out = np.zeros_like(x)
    for t, experts in enumerate(ids):
        for j, e in enumerate(experts):
            hid = x[t] @ w1[e]
            out[t] += gate[t, j] * ((hid / (1 + np.exp(-hid))) @ w2[e])
    return out


def causal_reference(q, k, v) -> np.ndarray:
    """float64 causal attention over the whole sequence (GQA)."""
    bsz, s, hq, d = q.shape
    hkv = k.shape[2]
    scores = np.einsum("bqhgd,bkhd->bhgqk", q.reshape(bsz, s, hkv, hq // hkv, d).astype(
        np.float64), k.astype(np.float64)) / np.sqrt(d)
    scores = np.where(np.tril(np.ones((s, s), bool)), scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    o = np.einsum("bhgqk,bkhd->bqhgd", p / p.sum(-1, keepdims=True), v.astype(np.float64))
    return o.reshape(bsz, s, hq, d)


def decode_reference(q, k, v, kv_len) -> np.ndarray:
    """float64 decode attention over the whole cache (GQA), masked at kv_len."""
    bsz, hq, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    scores = np.einsum("bhgd,bshd->bhgs", q.reshape(bsz, hkv, hq // hkv, d).astype(np.float64),
                       k.astype(np.float64)) / np.sqrt(d)
    valid = np.arange(s)[None, :] < kv_len[:, None]
    scores = np.where(valid[:, None, None, :], scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    v = np.where(valid[:, :, None, None], v.astype(np.float64), 0.0)  # masked: never read
    o = np.einsum("bhgs,bshd->bhgd", p / p.sum(-1, keepdims=True), v)
    return o.reshape(bsz, hq, d)


def check_transforms(mesh, world: int, batch: int = 2) -> dict[str, float]:
    """``jax.vmap`` of every built-in op (one call per batch element)."""
    sm = shard_mapper(mesh)
    errs = {}
    b = batch
    x, w = rand(21, (b, world * 8, 32)), rand(22, (b, 32, 16 * world))
    f = sm(jax.vmap(lambda u, v: td.ag_matmul(u, v, "tp")),
           (P(None, "tp", None), P(None, None, "tp")), P(None, None, "tp"))
    errs["vmap_ag_matmul"] = relerr(f(place(mesh, x, P(None, "tp", None)),
                                      place(mesh, w, P(None, None, "tp"))), x @ w)
    x = rand(23, (b, world * 4, 24))
    f = sm(jax.vmap(lambda u: td.all_gather(u, "tp")), P(None, "tp", None),
           P(None, None, None), check_vma=False)
    errs["vmap_all_gather"] = relerr(f(place(mesh, x, P(None, "tp", None))), x)
    x = rand(24, (b, world, 40))
    f = sm(jax.vmap(lambda u: td.all_reduce(u, "tp")), P(None, "tp", None),
           P(None, None, None), check_vma=False)
    errs["vmap_all_reduce"] = relerr(f(place(mesh, x, P(None, "tp", None))),
                                     x.sum(1, keepdims=True))
    x = rand(25, (b, world, world * 6, 8))
    f = sm(jax.vmap(lambda u: td.reduce_scatter(u[0], "tp")[None]),
           P(None, "tp", None, None), P(None, "tp", None, None))
    errs["vmap_reduce_scatter"] = relerr(f(place(mesh, x, P(None, "tp", None, None))),
                                         x.sum(1).reshape(b, world, 6, 8))
    x, w = rand(26, (b, world * 8, world * 16)), rand(27, (b, world * 16, 24))
    f = sm(jax.vmap(lambda u, v: td.matmul_rs(u, v, "tp")),
           (P(None, None, "tp"), P(None, "tp", None)), P(None, "tp", None))
    errs["vmap_matmul_rs"] = relerr(f(place(mesh, x, P(None, None, "tp")),
                                      place(mesh, w, P(None, "tp", None))), x @ w)
    x, w = rand(28, (b, 4, world * 16)), rand(29, (b, world * 16, 24))
    f = sm(jax.vmap(lambda u, v: td.matmul_ar(u, v, "tp")),
           (P(None, None, "tp"), P(None, "tp", None)), P(None, None, None), check_vma=False)
    errs["vmap_matmul_ar"] = relerr(f(place(mesh, x, P(None, None, "tp")),
                                      place(mesh, w, P(None, "tp", None))), x @ w)
    return errs


def check_grads(mesh, world: int) -> dict[str, float]:
    """Gradients of ag_matmul and matmul_rs under ``jax.checkpoint``, through
    ``jax.vjp`` of the sharded function, forward and backward in one program."""
    sm = shard_mapper(mesh)
    errs = {}

    def grads(op, x, w, g, x_spec, w_spec, y_spec) -> float:
        f = sm(jax.checkpoint(lambda u, v: op(u, v, "tp")), (x_spec, w_spec), y_spec)

        def forward_and_backward(u, v, dy):
            y, vjp = jax.vjp(f, u, v)
            return (y, *vjp(dy))

        args = (place(mesh, x, x_spec), place(mesh, w, w_spec), place(mesh, g, y_spec))
        compiled = jax.jit(forward_and_backward).lower(*args).compile()
        found = xla_collectives(compiled.as_text())
        if found:  # the tests fail on this line: the backward must need no XLA collective
            print(f"XLA_COLLECTIVES {op.__name__}: {found}", flush=True)
        y, dx, dw = compiled(*args)
        parts = {"y": relerr(y, x @ w), "dx": relerr(dx, g @ w.T), "dw": relerr(dw, x.T @ g)}
        # Which output is wrong, for a run that fails (the CHECK line has the worst).
        print(f"GRAD_PARTS remat_grad_{op.__name__} "
              + " ".join(f"{k}={v:.3e}" for k, v in parts.items()), flush=True)
        return max(parts.values())

    x, w, g = rand(30, (world * 8, 32)), rand(31, (32, 16 * world)), rand(32, (world * 8, 16 * world))
    errs["remat_grad_ag_matmul"] = grads(td.ag_matmul, x, w, g, P("tp", None), P(None, "tp"),
                                         P(None, "tp"))
    x, w, g = rand(33, (world * 8, world * 16)), rand(34, (world * 16, 24)), rand(35, (world * 8, 24))
    errs["remat_grad_matmul_rs"] = grads(td.matmul_rs, x, w, g, P(None, "tp"), P("tp", None),
                                         P("tp", None))
    return errs


def chain(mesh, world: int, calls: int, die_after: int | None, victim: int,
          death: str = "kill") -> float:
    """ag_matmul then matmul_rs, ``calls`` times on changing data."""
    m, k, n = 8, 16, 8 * world

    def step(a, b, c):
        h = td.ag_matmul(a, b, "tp")          # [world*m, n/world]
        return td.matmul_rs(h, c, "tp")      # [m, k]

    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("tp", None), P(None, "tp"),
                                                          P("tp", None)),
                              out_specs=P("tp", None)))
    worst = 0.0
    for i in range(calls):
        if die_after is not None and i == die_after and jax.process_index() == victim:
            print(f"VICTIM dying at call {i}", flush=True)
            if death == "raise":
                raise RuntimeError(f"the victim raises at call {i}")
            if death == "exit0":
                os._exit(0)
            os.kill(os.getpid(), 9)
        x, w, c = rand(100 + i, (world * m, k)), rand(200 + i, (k, n)), rand(300 + i, (n, k))
        out = f(place(mesh, x, P("tp", None)), place(mesh, w, P(None, "tp")),
                place(mesh, c, P("tp", None)))
        worst = max(worst, relerr(out, (x @ w) @ c))
    td.check_errors()  # GPUs record a timed-out wait; the next call, or this, reports it
    return worst


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chain", type=int, default=4)
    ap.add_argument("--die-after", type=int, default=None)
    ap.add_argument("--victim", type=int, default=1)
    ap.add_argument("--death", choices=("kill", "raise", "exit0"), default="kill")
    ap.add_argument("--uncaught", action="store_true")
    ap.add_argument("--wait-timeout-s", type=float, default=60.0)
    ap.add_argument("--ops", action="store_true", help="check every op")
    ap.add_argument("--transforms", action="store_true",
                    help="with --ops: also vmap of every built-in op")
    ap.add_argument("--grads", action="store_true",
                    help="with --ops: also remat + grad of ag_matmul and matmul_rs")
    args = ap.parse_args()
    world = jax.device_count()
    mesh = jax.make_mesh((world,), ("tp",))
    t0 = time.perf_counter()
    rt = td.initialize(mesh, wait_timeout_s=args.wait_timeout_s, heap_bytes=8 << 20)
    print(f"HEAP_READY_S {time.perf_counter() - t0:.3f} backend={rt.backend_name} "
          f"local={rt.local_positions} process={jax.process_index()}/{jax.process_count()} "
          f"sms={rt.sms}", flush=True)
    bad = []
    if args.ops:
        errs = check_all(mesh, world)
        if args.transforms:
            errs.update(check_transforms(mesh, world))
        if args.grads:
            errs.update(check_grads(mesh, world))
        assert tuple(errs) == (OPS + (TRANSFORMS if args.transforms else ())
                               + (GRADS if args.grads else ())), tuple(errs)
        for op, err in errs.items():
            print(f"CHECK {op} {err:.3e}", flush=True)
            if not err <= TOL:
                bad.append(op)
    start = time.perf_counter()
    try:
        err = chain(mesh, world, args.chain, args.die_after, args.victim, args.death)
    except Exception as e:  # the survivors of --die-after land here
        if args.uncaught:
            raise
        # The status and jaxtdist's error lead the message (its first line).
        message = str(e).splitlines()[0]
        print(f"CHAIN_FAILED after {time.perf_counter() - start:.2f} s: "
              f"{type(e).__name__}: {message}", flush=True)
        # jax.distributed's shutdown barrier would wait for the dead process until
        # its heartbeat timeout: leave at once, as a job that gives up would.
        os._exit(3)
    print(f"CHECK chain {err:.3e}", flush=True)
    if not err <= TOL:
        bad.append("chain")
    td.shutdown()
    print("FAILED " + " ".join(bad) if bad else "OK", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
