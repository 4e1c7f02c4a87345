"""Compiles the built-in kernels for AMD CDNA3 (gfx942: MI300X, MI325X) on any machine
(not yet the grouped GEMM).

Triton compiles for ``GPUTarget("hip", "gfx942", 64)`` with no ROCm installed.
The language picks its AMD lowering when imported with ``JAXTDIST_TARGET=hip``,
so the kernels are compiled in a child process of their own (this process
has imported the NVIDIA lowering). Each kernel gets the config its op would
pick on a 4-rank MI300X group (``Problem(vendor="amd", sms=304)``): the
pointer kernels, never the NVIDIA-only TMA and copy-engine variants (nor
``push_shards_kernel``, the CPU backend's stand-in for the copy engines).

The assertions are what the AMD code must show: system-scope release before
every notify (``buffer_wbl2 sc0 sc1``), system-scope acquire in every wait
(``buffer_inv sc0 sc1``), the waits bounded by the real-time counter
(``s_memrealtime``), matrix cores (``v_mfma``) in the GEMMs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

WORLD, CUS = 4, 304  # a 4-rank MI300X group

# name -> (kernel module, kernel, pointer dtypes, what the amdgcn must hold)
KERNELS = {
    "all_gather": ("all_gather", "all_gather_kernel", ["i32", "bf16", "bf16"],
                   ["wait", "notify"]),
    "ag_matmul_large": ("ag_matmul", "ag_matmul_kernel", ["i32"] + ["bf16"] * 6,
                        ["wait", "notify", "mfma"]),
    "ag_matmul_decode": ("ag_matmul", "ag_matmul_kernel", ["i32"] + ["bf16"] * 6,
                         ["wait", "notify", "mfma"]),
    "ag_matmul_split_k": ("ag_matmul", "ag_matmul_kernel", ["i32"] + ["bf16"] * 6,
                          ["wait", "notify", "mfma"]),
    "reduce_scatter": ("reduce_scatter", "reduce_scatter_kernel", ["i32", "bf16", "bf16"],
                       ["wait", "notify"]),
    "all_reduce_one_shot": ("all_reduce", "all_reduce_one_shot_kernel",
                            ["i32", "bf16", "bf16"], ["wait", "notify"]),
    "all_reduce_two_shot": ("all_reduce", "all_reduce_two_shot_kernel",
                            ["i32", "bf16", "bf16"], ["wait", "notify"]),
    # Tagged words: no flag, so neither release nor acquire to look for.
    "all_reduce_one_shot_push": ("all_reduce", "all_reduce_push_kernel",
                                 ["i32", "bf16", "bf16"], []),
    "all_reduce_one_shot_push_flags": ("all_reduce", "all_reduce_push_flags_kernel",
                                       ["i32", "bf16", "bf16"], ["wait", "notify"]),
    "matmul_rs": ("matmul_rs", "matmul_rs_kernel", ["i32"] + ["bf16"] * 5 + ["i32"],
                  ["wait", "notify", "mfma"]),
    "matmul_ar": ("matmul_ar", "matmul_ar_kernel", ["i32"] + ["bf16"] * 5,
                  ["wait", "notify", "mfma"]),
    # The routing words computed in the kernel (ROUTING="fused": histograms, a CTA barrier).
    "moe_dispatch": ("moe", "moe_dispatch_kernel",
                     ["i32", "bf16"] + ["i32"] * 5 + ["fp32", "bf16"] + ["i32"] * 4
                     + ["bf16", "i32", "i32"], ["wait", "notify"]),
    "moe_combine": ("moe", "moe_combine_kernel",
                    ["i32", "bf16", "fp32", "i32", "i32", "bf16", "i32", "i32", "i32", "bf16",
                     "fp32", "i32"], ["wait", "notify"]),
    # Tagged words, as the push all-reduce.
    "flash_decode": ("flash_decode", "flash_decode_kernel",
                     ["i32", "bf16", "bf16", "bf16", "i32", "i32", "bf16", "i32"], []),
    "ag_attention": ("ag_attention", "ag_attention_kernel", ["i32"] + ["bf16"] * 4 + ["fp32"],
                     ["wait", "notify"]),
    # fence, consume_token, notify and wait of jaxtdist.language in a user kernel.
    "language_primitives": ("tests.kernels_for_tests", "fenced_broadcast_kernel",
                            ["i32", "fp32", "fp32"], ["wait", "notify"]),
}

# What each feature looks like in gfx942 assembly.
FEATURES = {
    "notify": "buffer_wbl2 sc0 sc1",   # release at system scope: write back L2
    "wait": "buffer_inv sc0 sc1",      # acquire at system scope: invalidate caches
    "mfma": "v_mfma",                  # matrix cores
}


def _problems():
    """(name -> (kernel constexprs, launch options)): each op's own config choice."""
    from jaxtdist.ops._ag_matmul_config import AgMatmulConfig
    from jaxtdist.ops._config import Problem
    from jaxtdist.ops.all_gather import AllGatherConfig
    from jaxtdist.ops.all_reduce import AllReduceConfig, two_shot_chunk
    from jaxtdist.ops.matmul_rs import MatmulArConfig, MatmulRsConfig
    from jaxtdist.ops.reduce_scatter import ReduceScatterConfig

    def problem(shape):
        return Problem("gpu", WORLD, shape, "bfloat16", CUS, vendor="amd")

    def pick(cls, shape, **asked):
        p = problem(shape)
        cfg = cls.default(p).replace(**asked) if asked else cls.default(p)
        cfg = cfg.settled(p) if hasattr(cfg, "settled") else cfg
        cfg.validate(p)
        return cfg

    heap = dict(STAGE_OFF=1 << 16, SLOT_BYTES=1 << 24, READY_OFF=0, FLAGS_OFF=4096,
                INBOX_OFF=1 << 20, PARITY_BYTES=1 << 26, SENT_OFF=8192, DONE_OFF=12288,
                PARTIALS_OFF=-1, COUNTERS_OFF=-1, DOT_PRECISION=None, B_T=False, SCALING=None)
    out = {}

    cfg = pick(AllGatherConfig, (1024, 4096))
    out["all_gather"] = (dict(heap, ROWS=1024, COLS=4096, **cfg.kernel_args()),
                         cfg.launch_options())

    for name, shape, asked in (("ag_matmul_large", (1024, 4096, 4096), {}),
                               ("ag_matmul_decode", (4, 4096, 4096), {}),
                               ("ag_matmul_split_k", (64, 4096, 8192), dict(SPLIT_K=4))):
        cfg = pick(AgMatmulConfig, shape, **asked)
        assert cfg.variant == "pointer", (name, cfg.variant)
        m_shard, n, k = shape
        split_k = getattr(cfg, "SPLIT_K", 1)
        split_k = split_k if isinstance(split_k, int) else 1
        push = cfg.PRODUCER == "push"
        out[name] = (_ag_args(heap, m_shard, n, k, split_k, push, cfg),
                     cfg.launch_options())

    n = 1 << 20  # elements per rank
    cfg = pick(ReduceScatterConfig, (n,))
    out["reduce_scatter"] = (dict(CHUNK=n // WORLD, STAGE_OFF=heap["STAGE_OFF"],
                                  SLOT_BYTES=heap["SLOT_BYTES"], READY_OFF=0,
                                  **cfg.kernel_args()), cfg.launch_options())
    for algorithm in ("one_shot_push", "one_shot_push_flags", "one_shot", "two_shot"):
        cfg = pick(AllReduceConfig, (n,), ALGORITHM=algorithm)
        args = {k: v for k, v in cfg.kernel_args().items()
                if k not in ("ALGORITHM", "PUSH_MAX_BYTES", "ONE_SHOT_MAX_BYTES")}
        if algorithm == "one_shot_push":
            args.update(N=n, INBOX_OFF=heap["STAGE_OFF"], PARITY_BYTES=heap["SLOT_BYTES"])
        elif algorithm == "one_shot_push_flags":
            args.update(N=n, INBOX_OFF=heap["STAGE_OFF"], SLOT_BYTES=heap["SLOT_BYTES"],
                        READY_OFF=0)
        else:
            args.update(N=n, STAGE_OFF=heap["STAGE_OFF"], SLOT_BYTES=heap["SLOT_BYTES"],
                        READY_OFF=0)
        if algorithm == "two_shot":
            args.update(CHUNK=two_shot_chunk(n, WORLD), DONE_OFF=heap["DONE_OFF"])
        out[f"all_reduce_{algorithm}"] = (args, cfg.launch_options())

    m, n, k_shard = 8192, 4096, 3072
    cfg = pick(MatmulRsConfig, (m, n, k_shard))
    p = problem((m, n, k_shard))
    tiles = WORLD * -(-(m // WORLD) // cfg.BLOCK_M) * -(-n // cfg.BLOCK_N)
    args = {k: v for k, v in cfg.kernel_args().items()
            if k not in ("PARTIAL", "NUM_PROGRAMS", "PUSH")}
    # No TMA on AMD: peer tiles leave as SM stores.
    out["matmul_rs"] = (dict(args, M_SHARD=m // WORLD, N=n, K=k_shard, INBOX_OFF=1 << 20,
                             PARITY_BYTES=1 << 28, FLAGS_OFF=4096, DOT_PRECISION=None, B_T=False,
                             SCALING=None,
                             PUSH_TMA=False, PUSH_SUBTILE=1, TRACE_TILES=0,
                             PARTIAL_INPUT=cfg.PARTIAL == "input", WORLD=WORLD,
                             NUM_PROGRAMS=cfg.programs(p, tiles), INTERLEAVE=True),
                        cfg.launch_options())
    cfg = pick(MatmulArConfig, (16, 8192, 2048))
    args = {k: v for k, v in cfg.kernel_args().items() if k != "PARTIAL"}
    out["matmul_ar"] = (dict(args, M=16, N=8192, K=2048, INBOX_OFF=1 << 20,
                             PARITY_BYTES=1 << 24, FLAGS_OFF=4096, PARTIALS_OFF=1 << 27,
                             COUNTERS_OFF=1 << 28, RESULTS_OFF=-1, RFLAGS_OFF=-1, OWN_OFF=1 << 29,
                             PARK=False,
                             PARTIAL_INPUT=cfg.PARTIAL == "input", DOT_PRECISION=None, B_T=False,
                             SCALING=None,
                             K_SPLIT=-(-2048 // (cfg.SPLIT_K * cfg.BLOCK_K)) * cfg.BLOCK_K),
                        cfg.launch_options())
    out.update(_attention_and_moe(problem))
    out["language_primitives"] = (dict(N=4096, BLOCK=1024, WORKSPACE=65536),
                                  dict(num_warps=4))
    return out


def _attention_and_moe(problem) -> dict:
    """MoE dispatch and combine at DeepSeek-V3's decode size (128 tokens, H 7168,
    top-8 of 256 experts), flash_decode at 32K positions per rank (Hq 32, Hkv 8,
    D 128) and ag_attention at 8K per rank, each at its op's default config."""
    from jaxtdist.ops._shapes import next_pow2
    from jaxtdist.ops.ag_attention import AgAttentionConfig
    from jaxtdist.ops.flash_decode import FlashDecodeConfig
    from jaxtdist.ops.moe import MoeConfig
    from jaxtdist.ops.moe._routing import route_scan_tokens, route_tokens_per_step

    out = {}
    t, h, k, e = 128, 7168, 8, 256
    cfg = MoeConfig.default(problem((t, h)))
    assert cfg.ROUTING == "fused"
    e_loc, kl, programs = e // WORLD, min(k, e // WORLD), min(cfg.NUM_PROGRAMS, t)
    meta_words = 1 + 4 * kl
    out["moe_dispatch"] = (dict(
        T=t, H=h, K=k, E_LOC=e_loc, KL=kl, R=WORLD * t * kl, W=WORLD, P=programs,
        TP=-(-t // programs), FLAGS_OFF=0, HDR_OFF=4096, META_OFF=1 << 16, ROWS_OFF=1 << 20,
        PARITY_BYTES=1 << 24, HDR_WORDS=e_loc + 2 * programs + 1, META_WORDS=meta_words,
        SCALED=False, WP=next_pow2(WORLD), EP=next_pow2(e_loc), MP=next_pow2(meta_words),
        KLP=next_pow2(kl), BLOCK_H=cfg.BLOCK_H, SPLIT=0, TRACE=False, ROUTE=True,
        ROUTE_OFF=1 << 26, KP=next_pow2(k), EPG=next_pow2(e),
        BT=route_tokens_per_step(-(-t // programs), k, e), BS=route_scan_tokens(t, k),
        ZERO_TAIL=True, CT=1, NCH=1),
        dict(num_warps=cfg.num_warps, num_stages=1))
    out["moe_combine"] = (dict(
        T=t, F=h, K=k, KL=kl, W=WORLD, P=programs, TP=-(-t // programs), E_LOC=e_loc,
        FLAGS_OFF=0, INBOX_OFF=4096, WBOX_OFF=4096 + (1 << 23),
        PARITY_BYTES=1 << 24, DOTS=False, KP=next_pow2(k), KLP=next_pow2(kl),
        WP=next_pow2(WORLD), BLOCK_F=cfg.BLOCK_H, SEND_ROWS=cfg.COMBINE_SEND == "rows",
        TRACE=False, CT=1, NCH=1), dict(num_warps=cfg.num_warps, num_stages=1))
    s_shard, group = 32768, 4
    p = problem((1, 8 * group, 8, 128, s_shard))
    cfg = FlashDecodeConfig.default(p)
    splits = cfg.splits(p)
    out["flash_decode"] = (dict(
        QK_SCALE=0.1275, HQ=8 * group, HKV=8, GROUP=group, D=128, S_SHARD=s_shard, GROUPS=8,
        NSPLIT=splits, CHUNK=-(-s_shard // splits), LOCAL_OFF=0, LSE_OFF=1 << 20,
        COUNT_OFF=1 << 21, INBOX_OFF=1 << 22, INBOX_LSE=1 << 18, INBOX_LEN=3 << 17,
        PARITY_BYTES=1 << 19, BLOCK_N=cfg.BLOCK_N, BLOCK_G=16, BLOCK_D=128, DOT_PRECISION=None,
        PAGE=0, NUM_PAGES=0, TRACE=0, GP=group, WP=next_pow2(WORLD)), cfg.launch_options())
    s_rank, d = 8192, 128
    cfg = AgAttentionConfig.default(problem((1, s_rank, 32, 8, d)))
    out["ag_attention"] = (dict(
        B=1, S=s_rank, HQ=32, HKV=8, D=d, CAUSAL=True, QK_SCALE=0.1275, INBOX=False,
        STAGE_OFF=4096, PARITY_BYTES=1 << 26, KV_ELEMS=s_rank * 8 * d, READY_OFF=0,
        FLAGS_OFF=0, SENT_OFF=512, CHUNK_ROWS=1, KV_STRIDE=8 * d, V_OFF=0, FLAG_SCOPE="sys",
        BLOCK_D=d, DOT_PRECISION=None, **cfg.kernel_args()), cfg.launch_options())
    return out


def _ag_args(heap, m_shard, n, k, split_k, push, cfg) -> dict:
    args = dict(heap, M_SHARD=m_shard, N=n, K=k, SPLIT_K=split_k, K_SPLIT=k // split_k,
                ALL_ROWS=bool(cfg.ALL_ROWS), PUSH=push, FLAG_SCOPE="sys" if push else "gpu")
    if split_k > 1:
        args.update(PARTIALS_OFF=1 << 27, COUNTERS_OFF=1 << 28)
    args.update(cfg.kernel_args())
    return args


def compile_all() -> dict:
    """Compiles every kernel of ``KERNELS`` for gfx942 (run with JAXTDIST_TARGET=hip)."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from jaxtdist.language import _lowering
    assert _lowering.TARGET == "hip", _lowering.TARGET
    results = {}
    for name, (args, options) in _problems().items():
        module, kernel_name, pointers, _ = KERNELS[name]
        module = module if "." in module else f"jaxtdist.kernels.{module}"
        fn = getattr(importlib.import_module(module), kernel_name)
        ptr_names = [a for i, a in enumerate(fn.arg_names) if i not in fn.constexprs]
        const_names = [fn.arg_names[i] for i in fn.constexprs]
        missing = set(const_names) - set(args)
        try:
            if missing:
                raise KeyError(f"no value for constexprs {sorted(missing)}")
            signature = {a: f"*{t}" for a, t in zip(ptr_names, pointers)}
            signature.update({c: "constexpr" for c in const_names})
            attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in ptr_names}
            consts = {(fn.arg_names.index(c),): args[c] for c in const_names}
            src = ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs)
            compiled = triton.compile(src, target=GPUTarget("hip", "gfx942", 64),
                                      options=dict(options))
            asm = compiled.asm["amdgcn"]
            results[name] = dict(ok=True, hsaco=len(compiled.asm["hsaco"]),
                                 features={f: asm.count(s) for f, s in FEATURES.items()},
                                 memrealtime=asm.count("s_memrealtime"),
                                 options=options)
        except Exception as e:  # noqa: BLE001 - reported per kernel
            results[name] = dict(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
    return results


@pytest.fixture(scope="module")
def compiled() -> dict:
    env = dict(os.environ, JAXTDIST_TARGET="hip", TRITON_INTERPRET="0")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-c", "import json, tests.test_compile_gfx942 as t; "
         "print('RESULTS' + json.dumps(t.compile_all()))"],
        cwd=root, env=env, capture_output=True, text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULTS"):])


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_compiles_for_gfx942(compiled, name):
    result = compiled[name]
    assert result["ok"], result.get("error")
    assert result["hsaco"] > 0
    for feature in KERNELS[name][3]:
        assert result["features"][feature] > 0, (name, feature, result["features"])
    if "wait" in KERNELS[name][3]:
        assert result["memrealtime"] > 0, "waits must be bounded by the real-time counter"


def test_amd_configs_never_pick_nvidia_only_variants():
    """On AMD the ag_matmul defaults are the pointer kernel at every size, and asking
    for TMA or the copy engines is a ValueError naming the reason."""
    from jaxtdist.ops._ag_matmul_config import AgMatmulConfig
    from jaxtdist.ops._config import Problem

    for shape in [(4, 4096, 4096), (256, 4096, 8192), (1024, 4096, 4096), (2048, 7168, 8192)]:
        p = Problem("gpu", WORLD, shape, "bfloat16", CUS, vendor="amd")
        assert AgMatmulConfig.default(p).variant == "pointer", shape
        assert all(AgMatmulConfig.default(p).replace(**c).variant == "pointer"
                   for c in AgMatmulConfig.search_space(p)), shape
    p = Problem("gpu", WORLD, (1024, 4096, 4096), "bfloat16", CUS, vendor="amd")
    with pytest.raises(ValueError, match="NVIDIA features"):
        AgMatmulConfig.default(p).replace(TMA=True, PRODUCER="ce").validate(p)


def test_language_target_is_validated():
    env = dict(os.environ, JAXTDIST_TARGET="rocm", TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-c", "import jaxtdist.language"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "JAXTDIST_TARGET='rocm'" in proc.stderr
