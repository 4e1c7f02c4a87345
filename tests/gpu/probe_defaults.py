"""Probes behind default configs: an op's own kernels under config overrides, timed
side by side with the contender they must beat (CUPTI, interleaved rounds, one
process). The numbers quoted in the defaults' comments and in docs/perf come
from these.

Usage (repo root, GPU node): python3 tests/gpu/probe_defaults.py {moe,moe_trace,fd_race,
attention,attention_ws,attention_bwd,flash_decode,gemm,gemm_one_round,grouped,push,float32,rs_loop,rs_trace} [world]. ``moe`` and ``moe_trace`` run at the
world given (default 2, as ``fd_race``), ``push`` and ``rs_trace`` at 4 by default, and need that many GPUs; the
others run on one.
Prints one line per shape: each variant's median time, its ratio to the
contender, its error.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxtdist as td
from jaxtdist.bench import harness as h


def _mesh(world: int, axis: str):
    return jax.make_mesh((world,), (axis,), devices=jax.devices()[:world],
                         axis_types=(jax.sharding.AxisType.Auto,))


def _report(title: str, stats: dict, base: str) -> None:
    print(f"{title}: " + " | ".join(
        f"{name} {h.us(s)} ({h.ratio(s, stats[base])}) err={s.get('rel_err', s.get('error'))}"
        for name, s in stats.items()), flush=True)


def _moe_setup(world: int, t: int, hidden: int, k: int, e: int):
    """The MoE probes' mesh (axis "ep", runtime with room for both kernels'
    workspaces) and operands: bf16 tokens, a random top-k routing and weights,
    placed rows-sharded. Returns (mesh, (x, ids, w) placed, x, w)."""
    from jaxtdist.bench import moe as mb

    mesh = _mesh(world, "ep")
    td.initialize(mesh, heap_bytes=2 * mb.ep_heap_bytes([(t, hidden, k, e)], world, 2))
    x = h.normal(1600, (world * t, hidden), jnp.bfloat16)
    ids = mb._routing(1700, world * t, k, e)
    w = np.random.default_rng(1800).random((world * t, k), np.float32)
    args = tuple(jax.device_put(a, NamedSharding(mesh, mb.EP_SPEC))
                 for a in (x, jnp.asarray(ids), jnp.asarray(w)))
    return mesh, args, x, w


def _moe_contenders(world: int, t: int, variants: dict, dispatch: bool = True) -> dict:
    """DeepSeek-V3's decode routing (H 7168, top-8 of 256 experts) at `world`, `t`
    tokens per rank: per name -> (dispatch config, combine config, zero_unused_rows)
    of `variants`, "d_<name>" the dispatch alone (with `dispatch`) and "l_<name>"
    dispatch + combine (identity experts, checked against float32)."""
    from jaxtdist.bench import moe as mb

    e = 256
    mesh, args, x, w = _moe_setup(world, t, 7168, 8, e)
    specs = dict(mesh=mesh, in_specs=(mb.EP_SPEC,) * 3, out_specs=mb.EP_SPEC, check_vma=False)
    ref = np.asarray(x, np.float32) * w.sum(1, keepdims=True)  # identity experts
    contenders = {}
    for name, (d_cfg, c_cfg, zero) in variants.items():
        def send(x, ids, d_cfg=d_cfg, zero=zero):
            return td.moe_dispatch(x, ids, "ep", num_experts=e, config=d_cfg,
                                   zero_unused_rows=zero)

        def layer(x, ids, w, send=send, c_cfg=c_cfg):
            recv, _, handle = send(x, ids)
            return td.moe_combine(recv, handle, w, "ep", config=c_cfg)

        if dispatch:
            contenders[f"d_{name}"] = h.Contender(
                jax.jit(jax.shard_map(lambda x, ids, w, send=send: send(x, ids)[0], **specs)),
                args, world)
        contenders[f"l_{name}"] = h.Contender(jax.jit(jax.shard_map(layer, **specs)), args,
                                              world, ref)
    return contenders


def probe_moe(world: int = 2) -> None:
    """Dispatch and dispatch + combine, at `world`, DeepSeek-V3's decode routing: the
    copy step (BLOCK_H) and warps (MoeConfig)."""
    # BLOCK_H: elements per copy step (the combine's "blocks" way moves a token's
    # rows as one [KL, BLOCK_H / KL] block per step; "rows" one valid pair's row).
    variants = {"default": None, "blocks": dict(COMBINE_SEND="blocks"),
                "blocks_h32768w16": dict(COMBINE_SEND="blocks", BLOCK_H=32768, num_warps=16),
                "h4096w4": dict(BLOCK_H=4096), "h8192w8": dict(BLOCK_H=8192, num_warps=8),
                "h2048w4": dict(BLOCK_H=2048)}
    contenders = _moe_contenders(world, 128, {n: (c, c, True) for n, c in variants.items()})
    for name, s in h.interleaved(contenders, 40, 4).items():
        kernels = "; ".join(f"{k_} {v:.1f}" for k_, v in s.get("kernel_us", {}).items()
                            if "moe" in k_)
        print(f"{name}: {h.us(s)} err={s.get('rel_err', s.get('error'))} kernels: {kernels}",
              flush=True)


def probe_moe_routing(world: int = 4) -> None:
    """Dispatch at `world` with each ROUTING (where the routing words are computed),
    DeepSeek-V3's routing (H 7168, top-8 of 256 experts) at 128 to 2048 tokens per
    rank: where the fused routing's per-program scan of every token stops paying."""
    from jaxtdist.bench import moe as mb

    hidden, k, e = 7168, 8, 256
    for t in (128, 256, 512, 1024, 2048):
        mesh, args, _, _ = _moe_setup(world, t, hidden, k, e)
        specs = dict(mesh=mesh, in_specs=(mb.EP_SPEC,) * 3, out_specs=mb.EP_SPEC,
                     check_vma=False)
        contenders = {}
        for routing in ("fused", "xla"):
            def dispatch(x, ids, w, routing=routing):
                cfg = dict(ROUTING=routing)
                return td.moe_dispatch(x, ids, "ep", num_experts=e, config=cfg)[0]

            contenders[routing] = h.Contender(jax.jit(jax.shard_map(dispatch, **specs)),
                                              args, world)
        _report(f"moe dispatch world {world} T={t}", h.interleaved(contenders, 20, 4),
                "fused")


def probe_moe_trace(world: int = 2, t: int = 128, hidden: int = 7168, k: int = 8,
                    e: int = 256, runs: int = 20) -> None:
    """Where dispatch's and combine's kernel time goes, at `world`, DeepSeek-V3's decode
    routing: per-program phase timestamps (``trace=True``), median and max over
    programs of each phase, per device, in us."""
    from jaxtdist.bench import moe as mb
    from jaxtdist.ops.moe import moe_combine_kernels, moe_dispatch_kernels

    mesh, args, _, _ = _moe_setup(world, t, hidden, k, e)

    def body(x, ids, w):
        recv, _, handle, d_stamps = moe_dispatch_kernels(x, ids, "ep", num_experts=e,
                                                         trace=True)
        _, c_stamps = moe_combine_kernels(recv, handle, w, "ep", trace=True)
        return d_stamps[None], c_stamps[None]

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(mb.EP_SPEC,) * 3,
                               out_specs=(mb.EP_SPEC,) * 2, check_vma=False))
    phases = {"dispatch": ("push rows+meta", "headers+flags", "wait peers", "lay out",
                           "zero tail"),
              # With chunks (bulk sizes) the sends' phase holds all but the last
              # chunk's sums.
              "combine": ("send rows+flags", "wait peers", "sum")}
    runs = [fn(*args) for _ in range(runs)][runs // 4:]  # after warm-up
    for kernel, stamps in zip(phases, zip(*runs)):
        # [runs, world, P, 6] int32 ns (low bits): steps modulo 2**32, in us.
        st = np.stack([np.asarray(s_).astype(np.int64) for s_ in stamps])
        names = phases[kernel]
        steps = np.diff(st[..., :len(names) + 1], axis=-1) % (1 << 32) / 1e3
        start_spread = (st[..., 0] - st[..., 0].min(axis=-1, keepdims=True)) % (1 << 32) / 1e3
        total = (st[..., len(names)] - st[..., 0].min(axis=-1, keepdims=True)) % (1 << 32) / 1e3
        # No cross-device line: the GPUs' global timers do not agree (on 4 x H100 the
        # devices' first starts read 0-917 us apart, the same in both kernels, while no
        # device waited more than 9 us for its peers).
        for dev in range(world):
            cells = " | ".join(f"{n} {np.median(steps[:, dev, :, i]):.1f}/"
                               f"{np.max(np.median(steps[:, dev], axis=0)[:, i]):.1f}"
                               for i, n in enumerate(names))
            print(f"{kernel} dev {dev}: program start spread "
                  f"{np.median(np.max(start_spread[:, dev], axis=-1)):.1f} | {cells} | "
                  f"first start to last end {np.median(np.max(total[:, dev], axis=-1)):.1f} "
                  "(median/max over programs, us)", flush=True)


def probe_moe_chunks(world: int = 2, t: int = 4096) -> None:
    """Dispatch and dispatch + combine at `world`, `t` tokens per rank (DeepSeek-V3's
    routing: H 7168, top-8 of 256 experts), per CHUNK_TOKENS (one chunk per program:
    the unpipelined dispatch), zeroing the unused rows and not; and the combine's
    ways at that size."""
    variants = {f"c{chunk}{'' if zero else '_nozero'}": (dict(CHUNK_TOKENS=chunk), None, zero)
                for chunk in (0, 2, 4, 8, 16) for zero in (True, False)
                if zero or chunk in (0, 4)}
    variants.update({name: (cfg, cfg, True) for name, cfg in
                     {"blocks": dict(COMBINE_SEND="blocks"), "w8": dict(num_warps=8)}.items()})
    contenders = _moe_contenders(world, t, variants)
    _report(f"moe chunks world {world} T={t}", h.interleaved(contenders, 10, 4), "d_c0")


def probe_moe_combine_rows(world: int = 2, t: int = 4096) -> None:
    """Dispatch + combine at `world`, `t` tokens per rank (DeepSeek-V3's routing),
    per COMBINE_ROWS (a token's valid pair rows the combine loads at once)."""
    contenders = _moe_contenders(world, t, {f"rows{r}": (None, dict(COMBINE_ROWS=r), True)
                                            for r in (1, 2, 3, 4)}, dispatch=False)
    _report(f"moe d + c world {world} T={t}", h.interleaved(contenders, 10, 4), "l_rows1")


def _attention_setup(heap_bytes: int):
    """The attention probes' world-1 mesh (axis "sp"), runtime, shard_map specs of
    [B, S, H, D] operands and cuDNN's causal attention."""
    mesh = _mesh(1, "sp")
    td.initialize(mesh, heap_bytes=heap_bytes)
    sp = P(None, "sp")
    specs = dict(mesh=mesh, in_specs=(sp,) * 3, out_specs=sp, check_vma=False)
    cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="cudnn"))
    return mesh, sp, specs, cudnn


def probe_attention() -> None:
    """ag_attention's kernel at world 1 against cuDNN: query and key tiles, warps,
    stages and the causal order over head groups (AgAttentionConfig), B=1, H=32,
    D=128, causal, bf16."""
    from jaxtdist.ops.ag_attention import ag_attention_kernels

    mesh, sp, specs, cudnn = _attention_setup(1 << 30)
    variants = {"default": None, "m128n64w8": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8),
                "m128n128w8": dict(BLOCK_M=128, BLOCK_N=128, num_warps=8),
                "m128n128w8s2": dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2),
                "m64n64w4": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4),
                "m64n64w4s4": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=4),
                "m64n128w4": dict(BLOCK_M=64, BLOCK_N=128, num_warps=4),
                "head_group1": dict(HEAD_GROUP=1), "head_group4": dict(HEAD_GROUP=4),
                "head_group8": dict(HEAD_GROUP=8)}
    for s in (4096, 16384):
        q, k, v = (h.normal(600 + j, (1, s, 32, 128), jnp.bfloat16) for j in range(3))
        args = tuple(jax.device_put(a, NamedSharding(mesh, sp)) for a in (q, k, v))
        ref = np.asarray(cudnn(*args), np.float32)  # compared with cuDNN's output
        contenders = dict(cudnn=h.Contender(cudnn, args, 1, ref))
        for name, cfg in variants.items():
            fn = jax.jit(jax.shard_map(
                lambda *a, cfg=cfg: ag_attention_kernels(*a, "sp", causal=True, config=cfg),
                **specs))
            contenders[name] = h.Contender(fn, args, 1, ref)
        _report(f"S={s}", h.interleaved(contenders, 12, 3), "cudnn")


def probe_attention_bwd() -> None:
    """ag_attention's forward + fused backward at world 1 against cuDNN's: the tiles,
    warps and stages of the backward's dq kernel (AgAttentionConfig BWD_BLOCK_Q,
    ...) and of its dk/dv kernel (BWD_BLOCK_KV, ...), B=1, H=32, D=128, causal,
    bf16; gradients compared with cuDNN's."""
    from jaxtdist.bench.ag_attention import _with_grads

    mesh, sp, _, _ = _attention_setup(1 << 30)
    specs = dict(mesh=mesh, in_specs=(sp,) * 4, out_specs=(sp,) * 3, check_vma=False)
    cudnn = jax.jit(_with_grads(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="cudnn")))
    # Each kernel's tiles varied with the other's at the default: a variant's time
    # minus the default's is its kernel's difference.
    variants = {"default": None}
    for tile, step, warps, stages in ((128, 64, 8, 2), (128, 32, 8, 2), (64, 32, 4, 3),
                                      (64, 64, 4, 3), (128, 64, 8, 3)):
        variants[f"dq_q{tile}s{step}w{warps}s{stages}"] = dict(
            BWD_BLOCK_Q=tile, BWD_BLOCK_STEP=step, BWD_WARPS=warps, BWD_STAGES=stages)
    for tile, step, warps, stages in ((128, 32, 8, 2), (128, 32, 8, 3), (64, 32, 4, 2),
                                      (64, 64, 8, 2), (128, 64, 8, 2), (128, 16, 8, 3),
                                      (64, 32, 4, 3)):
        variants[f"kv_k{tile}s{step}w{warps}s{stages}"] = dict(
            BWD_BLOCK_KV=tile, BWD_KV_STEP=step, BWD_KV_WARPS=warps, BWD_KV_STAGES=stages)
    for s in (4096, 16384):
        q, k, v = (h.normal(600 + j, (1, s, 32, 128), jnp.bfloat16) for j in range(3))
        c = h.normal(650, (1, s, 32, 128), jnp.float32)
        args = tuple(jax.device_put(a, NamedSharding(mesh, sp)) for a in (q, k, v, c))
        ref = tuple(np.asarray(g, np.float32) for g in cudnn(*args))
        contenders = dict(cudnn=h.Contender(cudnn, args, 1, ref))
        for name, cfg in variants.items():
            fn = jax.jit(jax.shard_map(_with_grads(
                lambda q, k, v, cfg=cfg: td.ag_attention(q, k, v, "sp", causal=True,
                                                         config=cfg)), **specs))
            contenders[name] = h.Contender(fn, args, 1, ref)
        _report(f"fwd+bwd S={s}", h.interleaved(contenders, 6, 2), "cudnn")


def probe_attention_ws() -> None:
    """A causal attention forward on TMA descriptors, with and without Triton's
    warp specialization (``tests/gpu/attention_probe_kernels.py``), against cuDNN
    and ag_attention's kernel at world 1: B=1, H=32, D=128, bf16."""
    from jaxtdist.ops.ag_attention import ag_attention_kernels
    from tests.gpu.attention_probe_kernels import causal_attention_tma_kernel

    mesh, sp, specs, cudnn = _attention_setup(1 << 30)

    def tma(s, bm, bn, warps, stages, one_loop, ws):
        def f(q, k, v):
            return td.triton_call(
                q, k, v, kernel=causal_attention_tma_kernel, grid=(s // bm, 32), axis_name="sp",
                tma=True, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype), num_warps=warps,
                num_stages=stages, B=1, S=s, HQ=32, HKV=32, D=128,
                QK_SCALE=128 ** -0.5 * 1.4426950408889634, BLOCK_M=bm, BLOCK_N=bn,
                ONE_LOOP=one_loop, WS=ws)
        return jax.jit(jax.shard_map(f, **specs))

    variants = {"ws_m128n128": (128, 128, 4, 2, True, True),
                "ws_m128n64": (128, 64, 4, 2, True, True),
                "one_loop_m128n128w8": (128, 128, 8, 2, True, False),
                "split_m128n128w8": (128, 128, 8, 2, False, False),
                "split_m128n64w8s3": (128, 64, 8, 3, False, False)}
    for s in (4096, 16384, 32768):
        q, k, v = (h.normal(600 + j, (1, s, 32, 128), jnp.bfloat16) for j in range(3))
        args = tuple(jax.device_put(a, NamedSharding(mesh, sp)) for a in (q, k, v))
        ref = np.asarray(cudnn(*args), np.float32)  # compared with cuDNN's output
        contenders = dict(cudnn=h.Contender(cudnn, args, 1, ref), ag_attention=h.Contender(
            jax.jit(jax.shard_map(lambda *a: ag_attention_kernels(*a, "sp", causal=True),
                                  **specs)), args, 1, ref))
        for name, variant in variants.items():
            contenders[name] = h.Contender(tma(s, *variant), args, 1, ref)
        _report(f"S={s}", h.interleaved(contenders, 12 if s < 32768 else 5, 3), "cudnn")


def _fd_world_1(variants: dict, seqs, dtype, seed: int, fill: float = 1.0) -> None:
    """flash_decode's kernel at world 1 under each config of ``variants`` (None: the
    default) against XLA's decode, per sequence length; ``fill``: the valid share of
    the cache (kv_len)."""
    from jaxtdist.bench import flash_decode as fb
    from jaxtdist.ops.flash_decode import flash_decode_kernels

    mesh = fb._mesh(1)
    td.initialize(mesh)
    specs = dict(mesh=mesh, in_specs=fb.SPECS, out_specs=P(), check_vma=False)
    b, hq, hkv, d = fb.FLASH_DECODE_HEADS
    for i, s in enumerate(seqs):
        q, k, v, n = fb._operands(seed + 3 * i, b, hq, hkv, d, s, dtype)
        if fill != 1.0:
            n = jnp.full_like(n, int(s * fill))
        ref = fb._reference(q, k, v, n)
        args = fb.placed(mesh, q, k, v, n)
        contenders = dict(xla=h.Contender(jax.jit(fb._xla_decode_local), args, 1, ref))
        for name, cfg in variants.items():
            fn = jax.jit(jax.shard_map(
                lambda *a, cfg=cfg: flash_decode_kernels(*a, "sp", config=cfg), **specs))
            contenders[name] = h.Contender(fn, args, 1, ref)
        _report(f"{jnp.dtype(dtype).name} S={s} fill={fill}", h.interleaved(contenders, 20, 4),
                "xla")


def probe_flash_decode() -> None:
    """flash_decode's kernel at world 1 against XLA's decode: splits, step, warps."""
    _fd_world_1({"default": None, "s4": dict(num_stages=4), "w8": dict(num_warps=8),
                 "s4_w8": dict(num_stages=4, num_warps=8),
                 "n64_s5": dict(BLOCK_N=64, num_stages=5),
                 "n64_s5_sp32": dict(BLOCK_N=64, num_stages=5, NUM_SPLITS=32),
                 "n256_s2_w8": dict(BLOCK_N=256, num_stages=2, num_warps=8),
                 "sp8": dict(NUM_SPLITS=8), "sp12": dict(NUM_SPLITS=12),
                 "s2": dict(num_stages=2), "n64_s6": dict(BLOCK_N=64, num_stages=6),
                 "n64_s3_sp32": dict(BLOCK_N=64, num_stages=3, NUM_SPLITS=32)},
                (32768, 131072, 8192), jnp.bfloat16, 700)


def probe_fd_short() -> None:
    """flash_decode's kernel at world 1 on short caches (8K and 16K positions, where
    the default reads at 65%): smaller steps and more programs per SM."""
    _fd_world_1({"default": None, "w8": dict(num_warps=8), "s2": dict(num_stages=2),
                 "n64_s3_sp32": dict(BLOCK_N=64, num_stages=3, NUM_SPLITS=32),
                 "n64_s2_sp32": dict(BLOCK_N=64, num_stages=2, NUM_SPLITS=32),
                 "n64_s4": dict(BLOCK_N=64, num_stages=4),
                 "n32_s4_sp32": dict(BLOCK_N=32, num_stages=4, NUM_SPLITS=32),
                 "n32_s6_sp32": dict(BLOCK_N=32, num_stages=6, NUM_SPLITS=32),
                 "n64_s3_sp48": dict(BLOCK_N=64, num_stages=3, NUM_SPLITS=48)},
                (8192, 16384), jnp.bfloat16, 730)


def probe_fd_fill() -> None:
    """flash_decode's kernel at world 1 on caches filled to 30% and 60% (every program
    takes a part of the valid positions) against the kernel before deac491, which
    cut the whole cache into fixed chunks, so that only the chunks holding valid
    positions had work: emulated by a cache of just those chunks (same programs,
    same chunk size)."""
    for s, fill in ((32768, 0.3), (131072, 0.3), (32768, 0.6)):
        _fd_world_1({"default": None}, (s,), jnp.bfloat16, 710, fill=fill)
        chunk = s // 16  # 16 splits: the default on 132 SMs with Hkv = 8
        active = -(-int(s * fill) // chunk)
        _fd_world_1({"static_chunks": dict(NUM_SPLITS=active)}, (active * chunk,),
                    jnp.bfloat16, 710, fill=int(s * fill) / (active * chunk))


def probe_fd_f32() -> None:
    """flash_decode's kernel at world 1 on float32 caches against XLA's decode (both
    on TF32 tensor cores under JAX's default precision), and under "highest"
    (tf32x3 against XLA's float32): steps and warps."""
    variants = {"default": None, "n64_w8": dict(BLOCK_N=64, num_warps=8),
                "n32_w4": dict(BLOCK_N=32, num_warps=4), "n32_w8": dict(BLOCK_N=32, num_warps=8)}
    _fd_world_1(variants, (8192, 32768), jnp.float32, 800)
    with jax.default_matmul_precision("highest"):
        _fd_world_1({"default": None}, (8192,), jnp.float32, 900)


def _decode_variant(block_n: int, split_k: int, tma: bool = False, **more) -> dict:
    """{name: config} of a decode-rows GEMM variant (matmul_ar's and ag_matmul's
    decode kernels): loads (TMA or pointer), N tile, K split, and any other
    overrides (named after their values)."""
    short = {"BLOCK_K": "k", "num_warps": "w", "num_stages": "st", "NUM_COMM": "c"}
    name = f"{'tma' if tma else 'ptr'}_n{block_n}s{split_k}" + "".join(
        f"_{short[key]}{value}" for key, value in more.items())
    return {name: dict(TMA=tma, BLOCK_N=block_n, SPLIT_K=split_k, **more)}


def _ag_decode_variants() -> dict:
    """ag_matmul's decode kernel (one tile over all rows, pointer loads): N tile, K
    split, K step, stages, warps, producer programs."""
    out = {}
    for bn, sk, more in [(64, 2, {}), (64, 8, {}), (128, 4, {}), (128, 8, {}), (32, 4, {}),
                         (32, 8, {}), (64, 4, dict(BLOCK_K=128, num_stages=3)),
                         (64, 8, dict(num_stages=6)), (128, 8, dict(num_warps=8)),
                         (64, 4, dict(NUM_COMM=1)), (128, 16, {}), (256, 8, dict(num_warps=8))]:
        out.update(_decode_variant(bn, sk, **more))
    return out


def probe_gemm(only: str = "") -> None:
    """The GEMM core's slowest shapes at world 1 against jnp.dot: tiles, K steps,
    pointer loads, matmul_ar's K splits (the ops' configs)."""
    from jaxtdist.bench.gemm import _tile

    mesh = _mesh(1, "tp")
    td.initialize(mesh)
    cases = {
        # matmul_ar's default is pointer loads everywhere (TMA lost on all four shapes
        # on 1 x H200); from 128 rows 128 x 64 tiles with 8 warps (default), against
        # the previous 64 x 128 with 4 warps and other pointer tiles.
        ("matmul_ar", 256, 4096, 512): {
            "tma": dict(TMA=True),
            "m64n128k64s5": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4,
                                 num_stages=5),
            "m64n64k128s3": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_stages=3),
            "m128n64k128s3w8": dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, num_warps=8,
                                    num_stages=3),
            "m128n64k64s5w8": dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=8,
                                   num_stages=5),
            "m128n64k64s4w4": dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=4,
                                   num_stages=4),
            "m128n32k128s4w4": dict(BLOCK_M=128, BLOCK_N=32, BLOCK_K=128, num_warps=4,
                                    num_stages=4)},
        # Decode rows: 64 columns and K splits to cover the SMs (n64s2 here, n64s1 at
        # 1 x 8192 x 3584), against 128 columns and the old TMA default.
        ("matmul_ar", 32, 4096, 7168): dict(
            _decode_variant(32, 1, tma=True), **_decode_variant(64, 4), **_decode_variant(128, 4),
            **_decode_variant(64, 2, num_warps=8)),
        ("matmul_ar", 1, 8192, 3584): dict(
            _decode_variant(64, 1, tma=True), **_decode_variant(64, 2), **_decode_variant(128, 2)),
        ("matmul_ar", 128, 8192, 2048): {
            "tma": dict(TMA=True),
            "m64n128k64s5": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4,
                                 num_stages=5),
            "m64n64k128s3": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_stages=3),
            "m128n64k128s3w8": dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, num_warps=8,
                                    num_stages=3)},
        ("matmul_ar", 512, 8192, 4096): {
            "m64n128k64s5": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4,
                                 num_stages=5),
            "m128n128k64s4w8": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8,
                                    num_stages=4)},
        ("ag_matmul", 512, 3584, 4096): {
            "stream_k": dict(STREAM_K=True), "t64x256": _tile(64, 256),
            "t128x128s5": _tile(128, 128, stages=5), "t64x128": _tile(64, 128),
            "t128x128k128s3": dict(_tile(128, 128, stages=3), BLOCK_K=128),
            "t128x128g4": _tile(128, 128, GROUP_M=4), "t128x128g1": _tile(128, 128, GROUP_M=1),
            "t128x128sub1": dict(_tile(128, 128), SUBTILE=1)},
        # Decode rows (one tile over all rows, split K; default n64 s4 k64, 4 stages).
        ("ag_matmul", 16, 3072, 4096): _ag_decode_variants(),
    }
    for i, ((op, m, n, k), variants) in enumerate(cases.items()):
        if only and f"{op} {m}x{n}x{k}" != only:
            continue
        _gemm_variants(mesh, op, m, n, k, 700 + 2 * i, variants, 30, 3)


def _gemm_variants(mesh, op: str, m: int, n: int, k: int, seed: int, variants: dict,
                   iterations: int, rounds: int) -> None:
    """One line: ``op``'s kernels at world 1 on fresh bf16 x [m, k] @ w [k, n], the
    default config and each of ``variants``, against jnp.dot."""
    from jaxtdist.bench.gemm import _SPECS, _kernel_fn

    x = h.normal(seed, (m, k), jnp.bfloat16, scale=1 / np.sqrt(k))
    w = h.normal(seed + 1, (k, n), jnp.bfloat16)
    args = (jax.device_put(x, NamedSharding(mesh, _SPECS[op][0])),
            jax.device_put(w, NamedSharding(mesh, _SPECS[op][1])))
    ref = h.float32_matmul(x, w, jax.devices()[0])
    contenders = dict(jnp_dot=h.Contender(jax.jit(jnp.dot), args, 1, ref),
                      default=h.Contender(_kernel_fn(op, mesh, None), args, 1, ref))
    for name, cfg in variants.items():
        contenders[name] = h.Contender(_kernel_fn(op, mesh, cfg), args, 1, ref)
    _report(f"{op} {m}x{n}x{k}", h.interleaved(contenders, iterations, rounds), "jnp_dot")


def probe_gemm_one_round() -> None:
    """Shapes whose 128 x 128 tiles fill at most one round of the SMs (the GEMM core's
    one-round rule): the default's 8 warps against one warpgroup (4 warps) per tile
    at 3-5 stages, against jnp.dot, 60 iterations in 6 interleaved rounds."""
    from jaxtdist.bench.gemm import _tile

    mesh = _mesh(1, "tp")
    td.initialize(mesh)
    variants = {"w4s5": _tile(128, 128, stages=5), "w4s4": _tile(128, 128, stages=4),
                "w4s3": _tile(128, 128, stages=3), "w8s4": _tile(128, 128, stages=4, warps=8)}
    for i, (op, m, n, k) in enumerate([("ag_matmul", 512, 3584, 4096),
                                       ("matmul_rs", 512, 3584, 4096),
                                       ("ag_matmul", 256, 4096, 4096),
                                       ("ag_matmul", 384, 5120, 4096),
                                       ("ag_matmul", 512, 2048, 8192),
                                       ("matmul_rs", 256, 8192, 2048)]):
        _gemm_variants(mesh, op, m, n, k, 760 + 2 * i, variants, 60, 6)


def push_fn(mesh, rows: int, cols: int, programs: int, block: int, peer_major: bool,
            check: bool = False, num_warps: int = 4, tma_rows: int = 0):
    """``push_rows_kernel`` over the mesh's "ep" axis as a jitted function of x
    [world * rows, cols] (rows-sharded); CHECK returns every rank's inbox;
    ``tma_rows`` > 0: TMA tiles of that many rows (tensor descriptors)."""
    from tests.gpu import push_probe_kernels as pk

    world = mesh.shape["ep"]
    if cols % block or (tma_rows and rows % tma_rows):
        raise ValueError(f"push_fn: block={block} must divide cols={cols} (a step past a "
                         f"row's end stores into the next row) and tma_rows={tma_rows} "
                         f"rows={rows}")

    def body(x):
        out = (jax.ShapeDtypeStruct((world * rows, cols), x.dtype) if check
               else jax.ShapeDtypeStruct((programs,), jnp.int32))
        return td.triton_call(
            x, kernel=pk.push_rows_kernel, grid=(programs,), axis_name="ep", out_shape=out,
            workspace_bytes=pk.push_workspace_bytes(world, programs, rows, cols,
                                                    x.dtype.itemsize),
            name=f"push_probe_{programs}", num_warps=num_warps, num_stages=1, ROWS=rows,
            COLS=cols, W=world, P=programs, BLOCK=block, PEER_MAJOR=peer_major, CHECK=check,
            ITEMSIZE=x.dtype.itemsize, FLAG_BYTES=pk.flag_bytes(world, programs),
            TMA_ROWS=tma_rows, tma=tma_rows > 0)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"),
                                 check_vma=False))


def probe_push(world: int = 4) -> None:
    """Pushes of every rank's rows to every peer (the traffic of an all_gather, and
    the dispatch's at 128 tokens x 7168, bf16): egress GB/s per GPU by programs,
    warps, columns per store step and store order, SM stores (``p..``) against
    TMA stores of [rows, columns] tiles (``tma..``), beside XLA's all_gather of
    the same rows. Each variant's inbox is checked against the rows first."""
    mesh = _mesh(world, "ep")
    # 384 rows to one peer: the egress of 128 rows to three.
    shapes = ((128, 7168), (384, 7168), (1024, 7168))
    from tests.gpu import push_probe_kernels as pk
    td.initialize(mesh, heap_bytes=64 * 1024 * 1024 + 16 * sum(
        pk.push_workspace_bytes(world, 132, r, c, 2) for r, c in shapes))
    # name: (programs, warps, columns, peer-major, TMA rows)
    variants = {f"p{p}w{w}b{b}{'_peer' if pm else ''}": (p, w, b, pm, 0)
                for p, w, b, pm in [(132, 4, 1024, False), (132, 8, 1024, False),
                                    (264, 4, 1024, False), (528, 4, 1024, False)]}
    variants.update({f"tma_p{p}w{w}r{r}b{b}": (p, w, b, True, r)
                     for p, w, b, r in [(132, 4, 256, 1), (264, 4, 256, 1), (132, 4, 128, 1),
                                        (132, 4, 256, 2), (64, 4, 256, 4), (132, 8, 256, 2)]})
    gather = jax.jit(jax.shard_map(lambda x: jax.lax.all_gather(x, "ep", tiled=True),
                                   mesh=mesh, in_specs=P("ep"), out_specs=P("ep"),
                                   check_vma=False))
    for rows, cols in shapes:
        x = jax.device_put(h.normal(1900, (world * rows, cols), jnp.bfloat16),
                           NamedSharding(mesh, P("ep")))
        want = np.asarray(jax.device_get(x))
        contenders = {"xla_all_gather": h.Contender(gather, (x,), world)}
        for name, (p, w, b, pm, r) in variants.items():
            programs = min(p, rows // max(r, 1))
            got = np.asarray(jax.device_get(push_fn(mesh, rows, cols, programs, b, pm, True, w,
                                                    r)(x)))
            exact = all(np.array_equal(got[i * world * rows:(i + 1) * world * rows], want)
                        for i in range(world))
            if not exact:
                print(f"push {rows} x {cols}: {name} delivered wrong rows", flush=True)
                continue
            contenders[name] = h.Contender(push_fn(mesh, rows, cols, programs, b, pm,
                                                   num_warps=w, tma_rows=r), (x,), world)
        stats = h.interleaved(contenders, 20, 4)
        egress = (world - 1) * rows * cols * 2
        print(f"push {rows} x {cols} bf16 to {world - 1} peers ({egress / 1e6:.1f} MB out "
              "per GPU): " + " | ".join(
                  f"{n} {h.us(s)} us ({egress / s['mean_us'] / 1e3:.0f} GB/s)"
                  if s and "mean_us" in s else f"{n} n/a" for n, s in stats.items()),
              flush=True)


def probe_float32() -> None:
    """float32 GEMM kernels at world 1 beside jnp.dot, under JAX's default matmul
    precision (ours: TF32 on operands rounded to nearest, and truncated as the
    tensor cores read them; the other kernel family where the default has two) and "highest" (ours: tf32x3): the float32 default's cost and error
    (errors against float64)."""
    import contextlib
    import importlib

    from jaxtdist.bench.gemm import _SPECS, _kernel_fn

    mesh = _mesh(1, "tp")
    td.initialize(mesh)
    precision_module = importlib.import_module("jaxtdist.ops._precision")

    @contextlib.contextmanager
    def forced(precision):  # the kernels' DOT_PRECISION for float32, whatever JAX asks
        original = precision_module.dot_precision
        precision_module.dot_precision = lambda *a, **k: precision
        try:
            yield
        finally:
            precision_module.dot_precision = original

    def compiled(fn, args, precision=None, force=False, dot=None):
        with jax.default_matmul_precision(precision), \
                (forced(dot) if force else contextlib.nullcontext()):
            return jax.jit(fn).lower(*args).compile()

    for i, (op, m, n, k) in enumerate((("ag_matmul", 4096, 4096, 4096),
                                       ("ag_matmul", 512, 4096, 4096),
                                       ("matmul_rs", 2048, 4096, 3584),
                                       ("matmul_ar", 128, 8192, 2048))):
        x = h.normal(800 + 2 * i, (m, k), jnp.float32, scale=1 / np.sqrt(k))
        w = h.normal(801 + 2 * i, (k, n), jnp.float32)
        args = (jax.device_put(x, NamedSharding(mesh, _SPECS[op][0])),
                jax.device_put(w, NamedSharding(mesh, _SPECS[op][1])))
        ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)

        def ours():  # a fresh function each time: no trace shared across precisions
            return _kernel_fn(op, mesh, None)

        contenders = {
            "jnp_dot": h.Contender(compiled(jnp.dot, args), args, 1, ref),
            "default": h.Contender(compiled(ours(), args), args, 1, ref),
            "truncated": h.Contender(compiled(ours(), args, force=True), args, 1, ref),
            "jnp_dot_highest": h.Contender(compiled(jnp.dot, args, "highest"), args, 1, ref),
            "tf32x3": h.Contender(compiled(ours(), args, "highest"), args, 1, ref)}
        if op == "matmul_ar":  # float32's default there is the pointer GEMM
            contenders["tma"] = h.Contender(
                compiled(_kernel_fn(op, mesh, dict(TMA=True)), args), args, 1, ref)
        if op == "ag_matmul":  # the default is the TMA GEMM, whose tiles round x
            contenders["pointer"] = h.Contender(
                compiled(_kernel_fn(op, mesh, dict(TMA=False)), args), args, 1, ref)
            # x rounded by XLA instead (what the kernel gets without "tf32_rn_a").
            f = ours()
            rounded = jax.jit(lambda a, b: f(precision_module.round_to_tf32(a),
                                              precision_module.round_to_tf32(b)))
            contenders["x_rounded_by_xla"] = h.Contender(
                compiled(rounded, args, force=True), args, 1, ref)
        _report(f"{op} {m}x{n}x{k} float32", h.interleaved(contenders, 20, 3), "jnp_dot")


def probe_rs_loop() -> None:
    """matmul_rs's kernels at world 1 on the per-rank problems of its world-2 and
    world-4 benchmark shapes: the fused tile-and-K loop (FLATTEN, world 1 only)
    against the loop every world > 1 runs, and jnp.dot (what the GEMM half of
    the overlapped op costs before any push)."""
    from jaxtdist.bench.gemm import _SPECS, _kernel_fn

    mesh = _mesh(1, "tp")
    td.initialize(mesh)
    dot = jax.jit(jnp.dot)
    for i, (m, n, k) in enumerate([(8192, 4096, 6144), (8192, 8192, 14784),
                                   (8192, 4096, 3072)]):
        x = h.normal(900 + 2 * i, (m, k), jnp.bfloat16, scale=1 / np.sqrt(k))
        w = h.normal(901 + 2 * i, (k, n), jnp.bfloat16)
        args = (jax.device_put(x, NamedSharding(mesh, _SPECS["matmul_rs"][0])),
                jax.device_put(w, NamedSharding(mesh, _SPECS["matmul_rs"][1])))
        ref = h.float32_matmul(x, w, jax.devices()[0])
        contenders = dict(jnp_dot=h.Contender(dot, args, 1, ref),
                          flatten=h.Contender(_kernel_fn("matmul_rs", mesh, None), args, 1, ref),
                          tile_loop=h.Contender(_kernel_fn("matmul_rs", mesh,
                                                           dict(FLATTEN=False)), args, 1, ref))
        _report(f"matmul_rs {m}x{n}x{k}", h.interleaved(contenders, 20, 3), "jnp_dot")


def _rs_phases(stamps: np.ndarray, counts: list, peer: list) -> dict:
    """Per-phase medians (us) of matmul_rs's tile stamps [P, T, 3] of one device:
    program p's first counts[p] tiles are traced, its first peer[p] of them peers'."""
    t = stamps.astype(np.int64)
    t0 = min(int(t[p, 0, 0]) for p in range(len(counts)) if counts[p])
    rel = lambda a: ((a - t0) % (1 << 32)) / 1e3  # noqa: E731 - us since the first start
    main = {"peer": [], "own": []}
    epi = {"peer": [], "own": []}
    gaps, peer_end, end = [], [], []
    for p, c in enumerate(counts):
        for i in range(c):
            kind = "peer" if i < peer[p] else "own"
            start, mid, stop = (rel(t[p, i, j]) for j in range(3))
            main[kind].append(mid - start)
            epi[kind].append(stop - mid)
            if i:
                gaps.append(start - rel(t[p, i - 1, 2]))
        if peer[p]:
            peer_end.append(rel(t[p, peer[p] - 1, 2]))
        if c:
            end.append(rel(t[p, c - 1, 2]))
    med = lambda v, q=50: float(np.percentile(v, q)) if v else float("nan")  # noqa: E731
    return dict(span=max(end), peer_end=med(peer_end), main_peer=med(main["peer"]),
                epi_peer=med(epi["peer"]), epi_peer_p90=med(epi["peer"], 90),
                main_own=med(main["own"]), epi_own=med(epi["own"]),
                epi_own_p90=med(epi["own"], 90), gap=med(gaps))


def probe_rs_trace(world: int = 4, m: int = 8192, n: int = 4096, k: int = 12288) -> None:
    """matmul_rs at ``world`` (default 4) on its benchmark's 8192 x 4096 x 12288,
    where the exchange is not hidden: per-tile clock stamps (``trace_tiles``) of
    the default, SM-store pushes, float32 partials and 128 x 128 tiles, and of the
    same kernel at world 1 on one rank's problem (the GEMM half alone), with each
    variant's CUPTI time. Prints per variant the medians over devices of: kernel
    span, when the peers' tiles are done, a peer tile's mainloop and epilogue
    (push issue, and with TMA pushes the previous tile's store wait and flag),
    an own tile's mainloop and epilogue (flag waits, partial loads, store)."""
    from jaxtdist.ops._config import Problem
    from jaxtdist.ops._partial_sums import MatmulRsConfig, matmul_rs_kernels

    sms = getattr(jax.devices()[0], "core_count", 0) or 4
    variants = {"default": {}, "sm_stores": dict(PUSH="stores"),
                "float32_partials": dict(PARTIAL="float32"),
                "tiles_128x128": dict(BLOCK_M=128, BLOCK_N=128, SUBTILE=2, num_stages=4)}
    for w_ in (world, 1):
        mesh = _mesh(w_, "tp")
        td.initialize(mesh)
        k_shard = k // world
        x = h.normal(2100, (m, k_shard * w_), jnp.bfloat16, scale=1 / np.sqrt(k))
        wt = h.normal(2101, (k_shard * w_, n), jnp.bfloat16)
        args = (jax.device_put(x, NamedSharding(mesh, P(None, "tp"))),
                jax.device_put(wt, NamedSharding(mesh, P("tp", None))))
        ref = h.float32_matmul(x, wt, jax.devices()[0])
        base = MatmulRsConfig.default(Problem("gpu", w_, (m, n, k_shard * w_), "bfloat16",
                                              sms))
        contenders, traces = {}, {}
        for name, extra in (variants if w_ > 1 else {"world_1": dict(FLATTEN=False)}).items():
            cfg = dict(dict(BLOCK_M=base.BLOCK_M, BLOCK_N=base.BLOCK_N,
                            SUBTILE=base.SUBTILE, num_stages=base.num_stages), **extra)
            bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
            per_rank = -(-(m // w_) // bm) * -(-n // bn)
            peer_tiles, programs = (w_ - 1) * per_rank, min(sms, w_ * per_rank)
            peer = [len(range(p, peer_tiles, programs)) for p in range(programs)]
            own = [len(range((p + programs - peer_tiles % programs) % programs, per_rank,
                             programs)) for p in range(programs)]
            counts = [a + b for a, b in zip(peer, own)]
            specs = dict(mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)),
                         check_vma=False)
            contenders[name] = h.Contender(jax.jit(jax.shard_map(
                lambda a, b, cfg=cfg: matmul_rs_kernels(a, b, "tp", config=cfg),
                out_specs=P("tp", None), **specs)), args, w_, ref, aligned=True)
            traced = jax.jit(jax.shard_map(
                lambda a, b, cfg=cfg, c=max(counts): matmul_rs_kernels(
                    a, b, "tp", config=cfg, trace_tiles=c)[1][None],
                out_specs=P("tp"), **specs))
            for _ in range(5):
                stamps = np.asarray(traced(*args))
            phases = [_rs_phases(stamps[d], counts, peer) for d in range(w_)]
            traces[name] = {key: float(np.median([ph[key] for ph in phases]))
                            for key in phases[0]}
            print(f"rs_trace world {w_} {name} {bm}x{bn}: " + " ".join(
                f"{key}={v:.1f}" for key, v in traces[name].items()), flush=True)
        stats = h.interleaved(contenders, 40, 4)
        print(f"rs_trace world {w_} CUPTI: " + " | ".join(
            f"{name} {h.us(st)} err={st.get('rel_err')}" for name, st in stats.items()),
            flush=True)


def probe_fd_world(world: int = 4) -> None:
    """flash_decode at ``world`` on S = 8K, 32K and 128K total: the default against
    other splits and steps, launch alignment off, and the local kernel at world 1 on
    one rank's shard (what the exchange adds). Mean and fastest device."""
    from jaxtdist.bench import flash_decode as fb
    from jaxtdist.ops.flash_decode import flash_decode_kernels

    b, hq, hkv, d = fb.FLASH_DECODE_HEADS
    variants = {"default": (None, True), "unaligned": (None, False),
                "sp8": (dict(NUM_SPLITS=8), True), "sp32": (dict(NUM_SPLITS=32), True),
                "n64_sp32": (dict(BLOCK_N=64, NUM_SPLITS=32), True),
                "n64_sp48_st4": (dict(BLOCK_N=64, NUM_SPLITS=48, num_stages=4), True)}
    for w_ in (1, world):
        mesh = fb._mesh(w_)
        td.initialize(mesh)
        specs = dict(mesh=mesh, in_specs=fb.SPECS, out_specs=P(), check_vma=False)
        for i, s in enumerate((8192, 32768, 131072)):
            s_rank = s // world
            q, k, v, n = fb._operands(900 + 3 * i, b, hq, hkv, d, s_rank * w_, jnp.bfloat16)
            ref = fb._reference(q, k, v, n)
            args = fb.placed(mesh, q, k, v, n)
            contenders = {}
            for name, (cfg, aligned) in (variants if w_ > 1 else
                                         {"world_1_shard": (None, True),
                                          "w1_sp32": (dict(NUM_SPLITS=32), True),
                                          "w1_n64_sp48_st4": (dict(BLOCK_N=64, NUM_SPLITS=48,
                                                                   num_stages=4), True)}).items():
                fn = jax.jit(jax.shard_map(
                    lambda *a, cfg=cfg: flash_decode_kernels(*a, "sp", config=cfg), **specs))
                contenders[name] = h.Contender(fn, args, w_, ref, aligned=aligned)
            stats = h.interleaved(contenders, 40, 4)
            print(f"fd world {w_} S/rank={s_rank}: " + " | ".join(
                f"{name} {h.us(st)} (min dev {h.us_min(st)}) err={st.get('rel_err')}"
                for name, st in stats.items()), flush=True)


def probe_fd_trace(world: int = 4) -> None:
    """flash_decode at ``world`` and at world 1 on one rank's shard: clock stamps
    (``flash_decode_kernels(trace=True)``) of S/rank = 2K and 32K. Per device (us
    from that device's first program start): when the split-KV work is done (last
    program), and for the groups' mergers (medians) the local merge, the pushes
    and flags, the wait and merge of the peers' partials, the store; then the
    devices' first starts against each other (global timers, comparable only as
    far as the GPUs' timers agree)."""
    from jaxtdist.bench import flash_decode as fb
    from jaxtdist.ops.flash_decode import flash_decode_kernels

    b, hq, hkv, d = fb.FLASH_DECODE_HEADS
    for w_ in (1, world):
        mesh = fb._mesh(w_)
        td.initialize(mesh)
        specs = dict(mesh=mesh, in_specs=fb.SPECS, check_vma=False)
        traced = jax.jit(jax.shard_map(
            lambda *a: flash_decode_kernels(*a, "sp", trace=True)[1][None],
            out_specs=P("sp"), **specs))
        for i, s_rank in enumerate((2048, 32768)):
            q, k, v, n = fb._operands(950 + 3 * i, b, hq, hkv, d, s_rank * w_, jnp.bfloat16)
            args = fb.placed(mesh, q, k, v, n)
            runs = []
            for _ in range(30):
                runs.append(np.asarray(traced(*args)).astype(np.int64))
            rows = []
            for st in runs[10:]:
                mergers = st[:, :, 2] != 0  # the kernel stores 0 for the others
                t0 = st[:, :, 0].min(axis=1)  # per device
                rel = ((st - t0[:, None, None]) % (1 << 32)) / 1e3  # us
                per_dev = []
                for dev in range(w_):
                    mm = rel[dev][mergers[dev]]
                    per_dev.append(dict(
                        split_min=rel[dev, :, 1].min(), split_med=np.median(rel[dev, :, 1]),
                        start_max=rel[dev, :, 0].max(), split_end=rel[dev, :, 1].max(),
                        merger_arrive=np.median(mm[:, 1]), local_merge=np.median(mm[:, 2] - mm[:, 1]),
                        push=np.median(mm[:, 3] - mm[:, 2]), peers=np.median(mm[:, 4] - mm[:, 3]),
                        peers_max=(mm[:, 4] - mm[:, 3]).max(), store=np.median(mm[:, 5] - mm[:, 4]),
                        end=mm[:, 5].max(), start_vs_first=((t0[dev] - t0.min()) % (1 << 32)) / 1e3))
                rows.append(per_dev)
            for dev in range(w_):
                keys = rows[0][dev].keys()
                print(f"fd_trace world {w_} S/rank={s_rank} dev {dev}: " + " ".join(
                    f"{key}={np.median([r[dev][key] for r in rows]):.1f}" for key in keys),
                    flush=True)


def probe_fd_chain(world: int = 4, layers: int = 8, s_rank: int = 32768) -> None:
    """flash_decode at ``world`` (``s_rank`` positions per rank), ``layers`` traced calls back to back
    in one program, each call's output the next one's query (as the bench's
    ``--layers``): per device and call after the first, us from the previous
    call's last output store: the first program's start (the gap between the two
    kernels, prologue included), the last split's end, and the groups' mergers'
    (medians) local merge, pushes, wait for peers and store; then the call's
    last store (the time per call)."""
    from jaxtdist.bench import flash_decode as fb
    from jaxtdist.ops.flash_decode import flash_decode_kernels

    b, hq, hkv, d = fb.FLASH_DECODE_HEADS
    mesh = fb._mesh(world)
    td.initialize(mesh)

    def chain(q, k, v, n):
        stamps = []
        for _ in range(layers):
            q, st = flash_decode_kernels(q, k, v, n, "sp", trace=True)
            stamps.append(st)
        return jnp.stack(stamps)[None]

    traced = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=fb.SPECS, out_specs=P("sp"),
                                   check_vma=False))
    q, k, v, n = fb._operands(990, b, hq, hkv, d, s_rank * world, jnp.bfloat16)
    args = fb.placed(mesh, q, k, v, n)
    runs = [np.asarray(traced(*args)).astype(np.int64) for _ in range(25)][5:]
    keys = ("start", "split_end", "local_merge", "push", "peers", "store", "end")
    for dev in range(world):
        cells = {key: [] for key in keys}
        for st in runs:  # [world, layers, programs, 6]
            for c in range(1, layers):
                prev = st[dev, c - 1]
                cur = st[dev, c]
                t0 = prev[prev[:, 2] != 0][:, 5].max()
                rel = ((cur - t0) % (1 << 32)) / 1e3
                mm = rel[cur[:, 2] != 0]
                cells["start"].append(rel[:, 0].min())
                cells["split_end"].append(rel[:, 1].max())
                cells["local_merge"].append(np.median(mm[:, 2] - mm[:, 1]))
                cells["push"].append(np.median(mm[:, 3] - mm[:, 2]))
                cells["peers"].append(np.median(mm[:, 4] - mm[:, 3]))
                cells["store"].append(np.median(mm[:, 5] - mm[:, 4]))
                cells["end"].append(mm[:, 5].max())
        print(f"fd_chain world {world} S/rank={s_rank} layers={layers} dev {dev}: " + " ".join(
            f"{key}={np.median(cells[key]):.1f}" for key in keys), flush=True)


def probe_fd_race(world: int = 2, calls: int = 48) -> None:
    """flash_decode's exchange under fresh data, call after call: ``calls`` calls per
    shape at ``world`` (GQA group 3 and multi-head attention, the shapes where a
    single wait for all three parts of the partials mixed calls), each checked
    against a float64 reference; prints the bad calls (rel err > 1e-2) with the
    rows that went wrong. A moving count is a race."""
    from jaxtdist.bench import flash_decode as fb
    from jaxtdist.ops.flash_decode import flash_decode_kernels

    mesh = fb._mesh(world)
    td.initialize(mesh)
    f = jax.jit(jax.shard_map(lambda *a: flash_decode_kernels(*a, "sp"), mesh=mesh,
                              in_specs=fb.SPECS, out_specs=P()))
    rng = np.random.default_rng(1900)
    for b, hq, hkv, d, s_rank, dtype in [(2, 24, 8, 64, 1531, jnp.float16),
                                         (2, 16, 16, 128, 1531, jnp.bfloat16)]:
        total, bad, errs = world * s_rank, [], []
        for call in range(calls):
            q, k, v, _ = fb._operands(1900 + 3 * call, b, hq, hkv, d, total, dtype)
            n = jnp.asarray(rng.integers(1, total + 1, size=b), jnp.int32)
            args = fb.placed(mesh, q, k, v, n)
            out = np.asarray(f(*args), np.float64)
            ref = fb._reference(q, k, v, n)
            err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
            errs.append(err)
            if not err < 1e-2:  # NaN too
                rows = np.argwhere(~(np.abs(out - ref).max(-1) <= 0.05))
                bad.append((call, f"{err:.2g}", np.asarray(n).tolist(), rows[:8].tolist()))
        # np.max: NaN if any call gave one (max() of a list with NaN depends on order).
        print(f"fd_race world {world} B{b} Hq{hq} Hkv{hkv} D{d} S/rank {s_rank} "
              f"{jnp.dtype(dtype).name}: bad {len(bad)}/{calls}, max err {np.max(errs):.2g}",
              flush=True)
        for entry in bad[:6]:
            print("   call, err, lengths, wrong (b, head) rows:", *entry, flush=True)


def probe_grouped_decode() -> None:
    """The grouped GEMM at decode sizes (1-16 rows per expert, a mildly skewed
    routing): the default against its tile with K in 1, 2, 4 and 8 ranges, and
    ragged_dot."""
    variants = {"nosplit": dict(SPLIT_K=1), "split2": dict(SPLIT_K=2),
                "split4": dict(SPLIT_K=4), "split8": dict(SPLIT_K=8)}
    _grouped_shapes(variants, [(16, 2048, 5632, 8), (16, 5632, 2048, 8), (64, 2048, 5632, 8),
                               (16, 4096, 14336, 8), (16, 14336, 4096, 8), (32, 5632, 2048, 8),
                               (128, 7168, 2048, 64), (1024, 4096, 3584, 8),
                               (512, 4096, 7168, 8)])


def probe_grouped_decode_tiles() -> None:
    """Tiles for the grouped GEMM at 1-4 rows per expert, every expert used (Mixtral's
    decode, top-2): the default against its tile unsplit and split, narrower 16-row
    tiles, two programs per SM, and the GEMM core's 64-row tiles (wgmma)."""
    tile = _grouped_tile
    variants = {"nosplit": dict(SPLIT_K=1), "split2": dict(SPLIT_K=2),
                "split4": dict(SPLIT_K=4), "split8": dict(SPLIT_K=8),
                "m16n256s5": tile(16, 256, 4, 5), "m16n128s8": tile(16, 128, 4, 8),
                "m16n64s8x2": tile(16, 64, 4, 8, NUM_PROGRAMS=-2),
                "m64n256s5": tile(64, 256, 4, 5), "m64n128s5": tile(64, 128, 4, 5)}
    _grouped_shapes(variants, [(16, 2048, 5632, 8), (16, 5632, 2048, 8), (16, 4096, 14336, 8),
                               (16, 14336, 4096, 8), (32, 2048, 5632, 8), (32, 5632, 2048, 8),
                               (8, 4096, 14336, 8)], even=True)


def _grouped_tile(bm, bn, warps, stages, **more):
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=64, num_warps=warps, num_stages=stages,
                SUBTILE=4 if bn == 256 else 2, **more)


def _grouped_shapes(variants: dict, shapes, seed: int = 2100, even: bool = False) -> None:
    """Each variant of ``variants`` (NUM_PROGRAMS=-n: n per SM) and ragged_dot on
    [R, H] x [G, H, F] for each (R, H, F, G) of ``shapes`` (bf16 operands from
    ``seed``; ``even``: R / G rows per group, else a mildly skewed routing), 20
    iterations in 4 rounds."""
    from jaxtdist.bench.grouped_matmul import group_sizes

    mesh = _mesh(1, "ep")
    td.initialize(mesh)
    device = jax.devices()[0]
    sms = device.core_count
    variants = {k: dict(v, NUM_PROGRAMS=-v["NUM_PROGRAMS"] * sms)
                if v.get("NUM_PROGRAMS", 0) < 0 else v for k, v in variants.items()}

    def fn(cfg):
        return jax.jit(jax.shard_map(lambda x, w, s: td.grouped_matmul(x, w, s, config=cfg),
                                     mesh=mesh, in_specs=(P(), P(), P()), out_specs=P(),
                                     check_vma=False))

    exact = jax.jit(lambda x, w, s: jax.lax.ragged_dot(
        x.astype(jnp.float32), w.astype(jnp.float32), s, precision=jax.lax.Precision.HIGHEST))
    for i, (r, hid, f, g) in enumerate(shapes):
        x = jax.device_put(h.normal(seed + i, (r, hid), jnp.bfloat16, scale=hid ** -0.5),
                           device)
        w = jax.device_put(h.normal(seed + 50 + i, (g, hid, f), jnp.bfloat16), device)
        sizes = (np.full(g, r // g, np.int32) if even
                 else group_sizes(seed + 90 + i, r, g, 1.0))
        sizes = jax.device_put(jnp.asarray(sizes), device)
        args = (x, w, sizes)
        ref = np.asarray(exact(*args))
        contenders = dict(ragged_dot=h.Contender(jax.jit(jax.lax.ragged_dot), args, 1, ref),
                          default=h.Contender(fn(None), args, 1, ref))
        for name, cfg in variants.items():
            contenders[name] = h.Contender(fn(cfg), args, 1, ref)
        used = int(np.count_nonzero(np.asarray(sizes)))
        peak = {"H100": 3.35e12, "H200": 4.8e12}
        bw = next((v for k, v in peak.items() if k in device.device_kind), 3.35e12)
        _report(f"grouped {r}x{hid}x{f} G={g} used {used} (their weights at HBM peak "
                f"{used * hid * f * 2 / bw * 1e6:.1f} us)", h.interleaved(contenders, 20, 4),
                "ragged_dot")


def probe_grouped() -> None:
    """The grouped GEMM where each group has few rows (moe_tp_mlp at decode sizes:
    the experts' weights dominate the bytes): tiles against ragged_dot, with the
    time the weights take at the HBM peak. 20 iterations in 4 rounds."""
    tile = _grouped_tile
    # Two programs per SM where two fit in shared memory: more loads in flight.
    variants = {"m128n128w8": tile(128, 128, 8, 4), "m64n256": tile(64, 256, 4, 4),
                "m64n128": tile(64, 128, 4, 5), "m128n256s4": tile(128, 256, 8, 4),
                "m64n128x2": tile(64, 128, 4, 4, NUM_PROGRAMS=-2),
                "m64n64x2": tile(64, 64, 4, 6, NUM_PROGRAMS=-2),
                "m128n128s3x2": tile(128, 128, 8, 3, NUM_PROGRAMS=-2),
                "m128n128k128s2": dict(tile(128, 128, 8, 2), BLOCK_K=128),
                "m64n256k128s2": dict(tile(64, 256, 4, 2), BLOCK_K=128)}
    # moe_tp_mlp's expert GEMMs at 128 tokens per rank (Mixtral) over 4, 2 and 1
    # ranks, then 2048 tokens over 4; 64 of DeepSeek-V3's experts.
    _grouped_shapes(variants, [(1024, 4096, 3584, 8), (1024, 3584, 4096, 8),
                               (512, 4096, 7168, 8), (256, 4096, 14336, 8),
                               (256, 14336, 4096, 8), (16384, 4096, 3584, 8),
                               (1024, 7168, 2048, 64)], seed=1900)


PROBES = {"moe": probe_moe, "moe_routing": probe_moe_routing, "moe_trace": probe_moe_trace, "moe_chunks": probe_moe_chunks, "moe_combine_rows": probe_moe_combine_rows, "attention": probe_attention,
          "attention_ws": probe_attention_ws, "attention_bwd": probe_attention_bwd,
          "flash_decode": probe_flash_decode, "gemm": probe_gemm,
          "grouped_decode": probe_grouped_decode,
          "grouped_decode_tiles": probe_grouped_decode_tiles,
          "gemm_one_round": probe_gemm_one_round, "push": probe_push,
          "float32": probe_float32, "rs_loop": probe_rs_loop, "rs_trace": probe_rs_trace,
          "fd_world": probe_fd_world,
          "fd_trace": probe_fd_trace, "fd_chain": probe_fd_chain, "fd_race": probe_fd_race, "fd_f32": probe_fd_f32, "fd_fill": probe_fd_fill, "fd_short": probe_fd_short,
          "grouped": probe_grouped}

if __name__ == "__main__":
    if len(sys.argv) not in (2, 3, 4) or sys.argv[1] not in PROBES:
        sys.exit(f"usage: python3 tests/gpu/probe_defaults.py {{{','.join(PROBES)}}} [world]"
                 " [tokens] (gemm: [\"op MxNxK\"], that case only; tokens: moe_trace,"
                 " moe_chunks, moe_combine_rows)")
    PROBES[sys.argv[1]](*(int(a) if a.isdigit() else a for a in sys.argv[2:]))
