"""Compiles jaxtdist's kernels for Hopper (sm_90) on any machine, GPU or not.

Catches what the interpreter cannot: Triton compile errors on the GPU path,
and regressions in the generated code that cost real time on GPUs (heap
accesses that lose 16-byte vectorization, a GEMM that stops using wgmma).
"""

import collections
import contextlib
import re

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from jaxtdist.kernels.ag_matmul import ag_matmul_kernel  # noqa: E402
from jaxtdist.kernels.all_gather import all_gather_kernel  # noqa: E402
from tests.conftest import slow  # noqa: E402


@contextlib.contextmanager
def _skip_without_ptxas():
    try:
        yield
    except RuntimeError as e:  # no ptxas usable here
        if "ptxas" in str(e).lower():
            pytest.skip(f"cannot assemble for sm_90 here: {e}")
        raise


def _gemm_defaults(fn, constexprs: dict) -> dict:
    """The GEMM kernels' DOT_PRECISION (the backend's), B_T (w [K, N] as given),
    SCALING (no FP8 scales) and matmul_rs's pushes (SM stores) at their defaults
    unless given."""
    defaults = {name: value for name, value in (("DOT_PRECISION", None), ("B_T", False),
                                                ("PUSH_TMA", False), ("PUSH_SUBTILE", 1),
                                                ("TRACE_TILES", 0), ("TRACE", 0),
                                                ("SCALING", None), ("MASKED_M", 0))
                if name in fn.arg_names}
    return dict(defaults, **constexprs)


def _compile(fn, pointers: dict, constexprs: dict, **options):
    constexprs = _gemm_defaults(fn, constexprs)
    signature = dict(pointers)
    signature.update({name: "constexpr" for name in constexprs})
    # jax-triton passes XLA buffers as 16-byte divisible pointers.
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in pointers}
    consts = {(fn.arg_names.index(n),): v for n, v in constexprs.items()}
    src = ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs)
    with _skip_without_ptxas():
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def _compile_native(fn, pointer_types: list, constexprs: dict, **options):
    """Compiles a kernel for jaxtdist's own launcher (TMA kernels: global scratch)."""
    from jaxtdist.runtime._cuda_launch import compile_kernel
    with _skip_without_ptxas():
        return compile_kernel(fn, [f"*{t}" for t in pointer_types],
                              _gemm_defaults(fn, constexprs), capability=90, **options)


def _ops(kernel) -> collections.Counter:
    ptx = kernel.asm["ptx"]
    return collections.Counter(re.findall(
        r"(ld\.global[\w.]*|st\.global[\w.]*|cp\.async\.cg[\w.]*|wgmma\.mma_async[\w.]*|mma\.sync[\w.]*)", ptx))


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_all_gather_vectorized(dtype):
    k = _compile(all_gather_kernel, {"ctx": "*i32", "x_ptr": f"*{dtype}", "out_ptr": f"*{dtype}"},
                 dict(ROWS=1024, COLS=4096, STAGE_OFF=65536, SLOT_BYTES=1 << 23, READY_OFF=0,
                      NUM_WORKERS=16, CHUNK_ROWS=64, BLOCK_C=256, SCOPE="sys"),
                 num_warps=4, num_stages=1)
    ops = _ops(k)
    narrow = {op: n for op, n in ops.items() if op.endswith((".b16", ".b8"))}
    assert not narrow, f"heap copies lost vectorization: {dict(ops)}"
    assert ops["ld.global.v4.b32"] > 0 and ops["st.global.v4.b32"] > 0


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_all_reduce_push_sends_tagged_words_16_bytes_at_a_time(dtype):
    """all_reduce one-shot push: the tagged words go out as 16-byte stores
    (two 8-byte words, each single-copy atomic) and are re-read volatile; no
    fence, no flag."""
    from jaxtdist.kernels.all_reduce import all_reduce_push_kernel
    k = _compile(all_reduce_push_kernel, {"ctx": "*i32", "x_ptr": f"*{dtype}",
                                          "out_ptr": f"*{dtype}"},
                 dict(N=8192, INBOX_OFF=65536, PARITY_BYTES=1 << 20, NUM_PROGRAMS=4,
                      BLOCK=1024, SCOPE="sys"), num_warps=4, num_stages=1)
    ptx = k.asm["ptx"]
    ops = _ops(k)
    assert ops["st.global.v2.b64"] > 0, dict(ops)
    assert re.search(r"ld\.volatile\.global\.v2\.b64", ptx), dict(ops)
    assert "fence.acq_rel.sys" not in ptx, dict(ops)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_all_reduce_push_flags_stores_16_bytes_then_one_fence(dtype):
    """all_reduce one-shot push behind flags: the values go to the peers as 16-byte
    stores, then one system-scope fence, relaxed flags and acquire waits; the sum
    reads the inbox 16 bytes at a time."""
    from jaxtdist.kernels.all_reduce import all_reduce_push_flags_kernel
    k = _compile(all_reduce_push_flags_kernel, {"ctx": "*i32", "x_ptr": f"*{dtype}",
                                                "out_ptr": f"*{dtype}"},
                 dict(N=8192, INBOX_OFF=65536, SLOT_BYTES=1 << 20, READY_OFF=0,
                      NUM_PROGRAMS=4, BLOCK=1024, SCOPE="sys"), num_warps=4, num_stages=1)
    ptx = k.asm["ptx"]
    ops = _ops(k)
    assert ops["st.global.v4.b32"] > 0 and ops["ld.global.v4.b32"] > 0, dict(ops)
    assert ptx.count("fence.acq_rel.sys") == 1, dict(ops)
    assert "ld.global.sys.acquire" in ptx or "ld.acquire.sys" in ptx, dict(ops)


@pytest.mark.parametrize("all_rows,split_k,push", [(False, 1, False), (True, 1, False),
                                                   (False, 2, False), (True, 8, False),
                                                   (True, 4, True), (False, 1, True)])
def test_ag_matmul_uses_tensor_cores_and_cp_async(all_rows, split_k, push):
    block_m = 16 if all_rows else 128
    k = _compile(ag_matmul_kernel,
                 {"ctx": "*i32", "x_ptr": "*bf16", "w_ptr": "*bf16", "xs_ptr": "*bf16",
                  "ws_ptr": "*bf16", "out_ptr": "*bf16", "gathered_ptr": "*bf16"},
                 dict(M_SHARD=4 if all_rows else 1024, N=4096, K=4096, STAGE_OFF=65536,
                      SLOT_BYTES=1 << 23, READY_OFF=0, FLAGS_OFF=4096, NUM_COMM=16,
                      COPY_BLOCK_C=4096 if all_rows else 128, BLOCK_M=block_m,
                      BLOCK_N=32 if all_rows else 256,
                      BLOCK_K=256 if all_rows else 64, GROUP_M=8, SCOPE="sys",
                      ALL_ROWS=all_rows, SPLIT_K=split_k, K_SPLIT=4096 // split_k,
                      CHUNK_ROWS=1 if all_rows else (block_m if split_k == 1 else 32),
                      PARTIALS_OFF=1 << 24 if split_k > 1 else -1,
                      COUNTERS_OFF=1 << 25 if split_k > 1 else -1, PUSH=push,
                      FLAG_SCOPE="sys" if push else "gpu"),
                 num_warps=4 if all_rows else 8, num_stages=3)
    ops = _ops(k)
    # Skinny tiles (BLOCK_M=16) are below a warpgroup's 64 rows: mma.sync there.
    tensor_op = "mma.sync" if all_rows else "wgmma"
    assert any(op.startswith(tensor_op) for op in ops), dict(ops)
    assert ops["cp.async.cg.shared.global"] > 0, dict(ops)
    narrow = {op: n for op, n in ops.items() if op.endswith((".b16", ".b8"))}
    assert not narrow, f"copies lost vectorization: {dict(ops)}"
    if push:  # peers raise the chunk flags: system-scope acquire polls
        assert "ld.global.sys.acquire" in k.asm["ptx"] or "ld.acquire.sys" in k.asm["ptx"]
    if split_k > 1:  # the arrival counter: one acq_rel atomic at GPU scope
        counter = re.search(r"atom\.global\.gpu\.acq_rel\.add|atom\.acq_rel\.gpu\.global\.add",
                            k.asm["ptx"])
        assert counter, "split-K counter is not an acq_rel GPU-scope atomic"
        # The last arrival's loads of the SPLIT_K planes go out back to back: no
        # barrier between them (a layout change per plane held each load back until
        # the previous one had arrived).
        tail = k.asm["ptx"][counter.end():]
        loads = [m.start() for m in re.finditer(r"ld\.global\.cg", tail)]
        assert len(loads) >= split_k, len(loads)
        assert "bar.sync" not in tail[loads[0]:loads[-1]]


def test_language_primitives_compile():
    """fence, consume_token (inline PTX on GPUs), notify and wait compile for sm_90."""
    from tests.kernels_for_tests import fenced_broadcast_kernel
    k = _compile(fenced_broadcast_kernel, {"ctx": "*i32", "x_ptr": "*fp32", "out_ptr": "*fp32"},
                 dict(N=4096, BLOCK=1024, WORKSPACE=65536), num_warps=4, num_stages=1)
    ptx = k.asm["ptx"]
    assert "fence.acq_rel.sys" in ptx, "fence missing"
    assert "atom.global.sys.relaxed.exch" in ptx  # notify_peers' signals after the fence
    assert "mov.b64" in ptx  # consume_token's data dependence
    assert "ld.global.sys.acquire" in ptx and "release" in ptx


@pytest.mark.parametrize("dtype,block_k", [("bf16", 64), ("fp32", 32)])
def test_ag_matmul_tma_uses_tma_and_scratch(dtype, block_k):
    """The persistent kernel loads with TMA, orders them after the waits with a proxy
    fence, and needs global scratch (which jaxtdist's launcher provides)."""
    from jaxtdist.kernels.ag_matmul import ag_matmul_tma_kernel
    k = _compile_native(ag_matmul_tma_kernel, ["i32"] + [dtype] * 6,
                        dict(M_SHARD=1024, N=4096, K=4096, STAGE_OFF=65536,
                             SLOT_BYTES=1 << 23, READY_OFF=0, FLAGS_OFF=4096,
                             SCHEDULE_OFF=8192, NUM_COMM=16, CHUNK_ROWS=32,
                             COPY_BLOCK_C=128, BLOCK_M=128, BLOCK_N=256 if dtype == "bf16"
                             else 128, BLOCK_K=block_k, GROUP_M=8, SCOPE="sys",
                             NUM_PROGRAMS=132, PRODUCERS_JOIN=True, SUBTILE=2),
                        num_warps=8, num_stages=3)
    ptx = k.asm["ptx"]
    assert "cp.async.bulk.tensor.2d.shared" in ptx, "A/B tiles are not TMA loads"
    assert "wgmma.mma_async" in ptx
    assert "fence.proxy.async.global" in ptx
    assert k.metadata.global_scratch_size > 0 and k.metadata.shared <= 227 * 1024
    # Triton's ABI: 7 buffers (x's and w's scales: unused, the operands, without
    # SCALING), then the global and profile scratch pointers.
    assert len(re.findall(r"ag_matmul_tma_kernel_param_\d+", ptx.split(")")[0])) == 9


def _compile_ce(**tail):
    from jaxtdist.kernels.ag_matmul import ag_matmul_ce_kernel
    tail = dict(dict(TAIL_TILES=0, TAIL_UNITS=0, PARTIALS_OFF=-1, COUNTERS_OFF=-1,
                     TAIL_SPLIT_N=1, TAIL_STAGES=3, FLATTEN=False, SUBTILE=1), **tail)
    return _compile_native(ag_matmul_ce_kernel, ["i32"] + ["bf16"] * 5,
                           dict(M_SHARD=2048, N=2752, K=4096, INBOX_OFF=1 << 20,
                                PARITY_BYTES=1 << 26, FLAGS_OFF=4096, SENT_OFF=8192,
                                CHUNK_ROWS=256, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64,
                                GROUP_M=8, NUM_PROGRAMS=132, **tail),
                           num_warps=8, num_stages=3)


def test_ag_matmul_ce_kernel_uses_tma_and_no_producers():
    """The copy-engine variant: TMA loads from x and the heap inbox, wgmma, a proxy
    fence after each flag wait, no counter (static schedule: no atomics but the waits)."""
    k = _compile_ce()
    ptx = k.asm["ptx"]
    assert "cp.async.bulk.tensor.2d.shared" in ptx and "wgmma.mma_async" in ptx
    assert "fence.proxy.async.global" in ptx
    assert "atom.global.gpu.relaxed.add" not in ptx  # no tile counter
    assert "atom.global.gpu.acq_rel.add" not in ptx  # no stream-K tail
    assert k.metadata.global_scratch_size > 0 and k.metadata.shared <= 227 * 1024
    assert len(re.findall(r"ag_matmul_ce_kernel_param_\d+", ptx.split(")")[0])) == 8


def test_ag_matmul_ce_kernel_stream_k_tail():
    """The stream-K tail (2048 x 2752, K=4096 on 132 SMs: 44 tiles in runs of 22 K
    blocks): its tiles use wgmma too, the partials meet on an acq_rel counter, and the
    shared memory stays that of the pipeline (the sum runs in registers)."""
    plain = _compile_ce()
    k = _compile_ce(TAIL_TILES=44, TAIL_UNITS=22, PARTIALS_OFF=1 << 28, COUNTERS_OFF=1 << 27)
    ptx = k.asm["ptx"]
    assert ptx.count("wgmma.mma_async") > plain.asm["ptx"].count("wgmma.mma_async")
    assert "atom.global.gpu.acq_rel.add" in ptx
    assert "ld.global.cg" in ptx  # partials read from L2
    assert k.metadata.shared == plain.metadata.shared


def test_ag_matmul_ce_kernel_split_n_tail():
    """The split-N tail (the same 44 tiles, each in two 128-wide pieces on 88
    programs): wgmma tiles of their own, no partial sums (no arrival counter), and
    shared memory no larger than the whole tiles' pipeline needs."""
    plain = _compile_ce()
    k = _compile_ce(TAIL_TILES=44, TAIL_SPLIT_N=2)
    ptx = k.asm["ptx"]
    assert ptx.count("wgmma.mma_async") > plain.asm["ptx"].count("wgmma.mma_async")
    assert "atom.global.gpu.acq_rel.add" not in ptx
    assert k.metadata.shared == plain.metadata.shared
    assert k.metadata.num_warps == plain.metadata.num_warps == 8


def test_ag_matmul_ce_kernel_split_n_tail_stages():
    """TAIL_STAGES deepens only the pieces' pipeline: more TMA loads issued ahead,
    no more shared memory than the whole tiles take, up to the 6 stages that
    "auto" picks for these 128-wide pieces."""
    shallow = _compile_ce(TAIL_TILES=44, TAIL_SPLIT_N=2, TAIL_STAGES=3)
    deep = _compile_ce(TAIL_TILES=44, TAIL_SPLIT_N=2, TAIL_STAGES=6)
    loads = "cp.async.bulk.tensor.2d.shared"
    assert deep.asm["ptx"].count(loads) > shallow.asm["ptx"].count(loads)
    assert deep.metadata.shared == shallow.metadata.shared == _compile_ce().metadata.shared


@pytest.mark.parametrize("tail", [{}, dict(TAIL_TILES=44, TAIL_SPLIT_N=2)])
def test_ag_matmul_ce_kernel_flattened(tail):
    """FLATTEN: each tile loop and its K loop become one loop (Triton fuses them only
    if the peers' wait has no loop of its own: ``dl.wait_for_tma`` is one inline-asm
    spin), the wait is a GPU-scope acquire load followed by an async-proxy fence, and
    inside the fused loop the TMA loads take their row from the wait's token."""
    plain = _compile_ce(**tail)
    flat = _compile_ce(FLATTEN=True, **tail)
    loops = flat.asm["ttgir"].count("scf.for")
    # Both K loops fused into their tile loops, and the wait's loop over chunks gone.
    assert loops == plain.asm["ttgir"].count("scf.for") - 3, loops
    ptx = flat.asm["ptx"]
    assert re.search(r"ld\.acquire\.gpu\.global\.b32[^\n]*\n[^@]*setp\.ge\.s32", ptx)
    assert "fence.proxy.async.global" in ptx and "wgmma.mma_async" in ptx
    assert flat.metadata.shared == plain.metadata.shared
    # In the fused peers' loop the wait's token feeds the inbox loads' row.
    ttgir = flat.asm["ttgir"]
    # The tile loops' induction variables: the first number after the kernel's arguments.
    first = re.search(r"scf\.for (%arg\d+) ", ttgir).group(1)
    loops = [m.start() for m in re.finditer(rf"scf\.for {first} ", ttgir)]
    peers_loop = ttgir[loops[1]:]
    assert peers_loop.index("elementwise_inline_asm") < peers_loop.index(
        "async_tma_copy_global_to_local")
    # Two spins: before the peers' loop (its first tile) and in it; local tiles wait for none.
    assert ttgir.count("ld.acquire.gpu.global.b32") == 2


@pytest.mark.parametrize("num_warps", [4, 8])
def test_launch_warps_of_warp_specialized_kernel(num_warps):
    """A warp-specialized loop compiles to more warps than asked for (producer
    warps) and its cubin requires exactly that many threads: the native launcher
    must launch the compiled count, not the requested one."""
    from jaxtdist.runtime._cuda_launch import launch_warps
    from tests.kernels_for_tests import warp_specialized_matmul_kernel
    k = _compile_native(warp_specialized_matmul_kernel, ["i32", "bf16", "bf16", "bf16"],
                        dict(M=1024, N=1024, K=1024, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64,
                             GROUP_M=8, NUM_PROGRAMS=132, WS=True),
                        num_warps=num_warps, num_stages=3)
    required = re.findall(r"\.reqntid (\d+)", k.asm["ptx"])
    assert required, "the kernel should pin its thread count"
    assert launch_warps(k.metadata) * 32 == int(required[0])
    assert launch_warps(k.metadata) >= num_warps
    if num_warps == 4:  # Triton 3.6 specializes this loop at 4 warps (12 in all)
        assert launch_warps(k.metadata) > num_warps


@pytest.mark.parametrize("dtype,d,group,page", [("bf16", 128, 4, 0), ("fp16", 64, 8, 0),
                                               ("fp32", 128, 1, 0), ("bf16", 128, 4, 16),
                                               ("bf16", 256, 8, 0),
                                               pytest.param("fp32", 256, 4, 0, marks=slow())])
def test_flash_decode_compiles_with_tensor_cores_and_its_protocol(dtype, d, group, page):
    """flash_decode with its GPU default config: the split-KV dots on tensor cores
    (mma.sync for the 16-row query tile), 16-byte K/V loads (paged too: rows
    through the block table), the arrival counter as one acq_rel GPU-scope atomic,
    partials read from L2 (.cg), the peers' flags with system-scope
    release/acquire, within the shared memory of an SM."""
    from jaxtdist.kernels.flash_decode import flash_decode_kernel
    from jaxtdist.ops._config import Problem
    from jaxtdist.ops.flash_decode import FlashDecodeConfig
    name = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[dtype]
    cfg = FlashDecodeConfig.default(Problem("gpu", 4, (1, 8 * group, 8, d, 32768), name))
    block_d = max(16, d)
    k = _compile(flash_decode_kernel,
                 {"ctx": "*i32", "q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}",
                  "v_ptr": f"*{dtype}", "len_ptr": "*i32", "table_ptr": "*i32",
                  "out_ptr": f"*{dtype}", "trace_ptr": "*i32"},
                 dict(QK_SCALE=0.1275, HQ=8 * group, HKV=8, GROUP=group, D=d, S_SHARD=32768,
                      GROUPS=8, NSPLIT=32, LOCAL_OFF=0, LSE_OFF=1 << 20,
                      COUNT_OFF=1 << 21, INBOX_OFF=1 << 22, INBOX_LSE=1 << 18,
                      INBOX_LEN=3 << 17, PARITY_BYTES=1 << 19, BLOCK_N=cfg.BLOCK_N,
                      BLOCK_G=max(16, group), BLOCK_D=block_d,
                      DOT_PRECISION="tf32_rn" if dtype == "fp32" else None,
                      PAGE=page, NUM_PAGES=4096 if page else 0, GP=group, WP=4),
                 num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    ptx = k.asm["ptx"]
    ops = _ops(k)
    # float32 too (TF32 operands rounded to nearest, JAX's default precision).
    assert any(op.startswith("mma.sync") for op in ops), dict(ops)
    if dtype == "fp32":
        assert "cvt.rna.tf32.f32" in ptx
    assert ops["cp.async.cg.shared.global"] > 0, dict(ops)  # pipelined K/V loads
    # The partials stay in L2 for the merger (evict_last) while K and V stream past.
    assert "createpolicy.fractional.L2::evict_last" in ptx
    assert re.search(r"atom\.global\.gpu\.acq_rel\.add|atom\.acq_rel\.gpu\.global\.add", ptx), \
        "arrival counter is not an acq_rel GPU-scope atomic"
    # Partials from L2, 16 bytes wide (one float per thread where one query row of
    # 128 values is all there is).
    assert ops["ld.global.cg.v4.b32" if group > 1 else "ld.global.cg.b32"] > 0, dict(ops)
    # The exchange: tagged 8-byte words, stored 16 bytes at a time (one word per
    # thread where one query row of 128 words is all there is) and re-read
    # volatile (no flag, no fence).
    assert ops["st.global.v2.b64" if group > 1 else "st.global.b64"] > 0, dict(ops)
    assert re.search(r"ld\.volatile\.global(\.v2)?\.b64", ptx), dict(ops)
    assert "fence.acq_rel.sys" not in ptx
    assert k.metadata.shared <= 227 * 1024
    # No register spills (float32's IEEE dots on CUDA cores, the default before,
    # spilled about 650 bytes).
    assert _stack_bytes(k) == 0


def _compile_ag_attention(dtype: str, d: int, *, s: int = 8192, causal: bool = True,
                          inbox: bool = False, num_warps: int, num_stages: int, **tiles):
    """ag_attention's forward kernel for sm_90 over S = ``s`` (32 query heads, 8 KV
    heads), reading peers through the local inbox or their staged copies;
    ``tiles``: BLOCK_M, BLOCK_N, DOT_PRECISION and optionally HEAD_GROUP."""
    from jaxtdist.kernels.ag_attention import ag_attention_kernel
    return _compile(ag_attention_kernel,
                    {"ctx": "*i32", "q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}",
                     "v_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "lse_ptr": "*fp32"},
                    dict(dict(HEAD_GROUP=1), B=1, S=s, HQ=32, HKV=8, D=d, CAUSAL=causal,
                         QK_SCALE=0.1275, INBOX=inbox, STAGE_OFF=4096, PARITY_BYTES=1 << 26,
                         KV_ELEMS=s * 8 * d, READY_OFF=0, FLAGS_OFF=0, SENT_OFF=512,
                         CHUNK_ROWS=s if inbox else 1, KV_STRIDE=(2 if inbox else 1) * 8 * d,
                         V_OFF=8 * d if inbox else 0, FLAG_SCOPE="gpu" if inbox else "sys",
                         BLOCK_D=d, **tiles),
                    num_warps=num_warps, num_stages=num_stages)


@pytest.mark.parametrize("dtype,d,causal,inbox", [("bf16", 128, True, True),
                                                  pytest.param("bf16", 128, True, False,
                                                               marks=slow()),
                                                  ("fp16", 64, False, True),
                                                  ("fp32", 64, True, False)])
def test_ag_attention_compiles_with_tensor_cores(dtype, d, causal, inbox):
    """ag_attention: the attention tiles on tensor cores (wgmma for 128-row query
    tiles of 16-bit types), pipelined K/V loads, 16 bytes wide from peers' chunks
    too (local inbox or peers' staged copies); peers' flags acquired, the peer
    reads' ready notify a system-scope release."""
    k = _compile_ag_attention(dtype, d, causal=causal, inbox=inbox,
                              BLOCK_M=128 if dtype != "fp32" else 64,
                              BLOCK_N=64 if dtype != "fp32" else 32,
                              DOT_PRECISION="tf32_rn" if dtype == "fp32" else None,
                              num_warps=8 if d > 64 else 4,
                              num_stages=3 if dtype != "fp32" else 2)
    ptx = k.asm["ptx"]
    ops = _ops(k)
    # float32 too (TF32 operands rounded to nearest, JAX's default precision).
    assert any(op.startswith(("wgmma", "mma.sync")) for op in ops), dict(ops)
    if dtype == "fp32":
        assert "cvt.rna.tf32.f32" in ptx
    else:
        assert ops["cp.async.cg.shared.global"] > 0, dict(ops)
    # The peers' chunks too: the wait's token must not cost the loads their width.
    narrow = {op: n for op, n in ops.items() if op.startswith("ld.global")
              and op.endswith((".b16", ".b8"))}
    assert not narrow, f"K/V loads lost vectorization: {dict(ops)}"
    if inbox:
        assert "ld.global.gpu.acquire" in ptx or "ld.acquire.gpu" in ptx, "inbox flags"
    else:
        assert "ld.global.sys.acquire" in ptx or "ld.acquire.sys" in ptx
        assert "release" in ptx
    assert k.metadata.shared <= 227 * 1024


@pytest.mark.parametrize("dtype,causal,hq,hkv,inbox", [("bf16", True, 32, 32, False),
                                                     ("fp16", False, 8, 2, False),
                                                     ("bf16", True, 32, 8, True),
                                                     ("fp16", False, 8, 2, True)])
def test_warp_specialized_attention_compiles(dtype, causal, hq, hkv, inbox):
    """ag_attention's warp-specialized kernel (on Hopper; INBOX: in a group of
    ranks): 12 warps (two consumer warpgroups and a producer warp, rounded to
    warpgroups) within the register file at its launch limit, no spills (the
    producer's inbox waits among them), wgmma with one group left in flight, TMA
    loads, within shared memory; with INBOX the producer's flag waits acquire and
    fence the async proxy."""
    from jaxtdist.kernels import attention_ws
    d = 128
    layout = (dict(KV_STRIDE=2 * hkv * d, V_OFF=hkv * d, STAGE_OFF=4096, PARITY_BYTES=1 << 24,
                   FLAGS_OFF=0, SENT_OFF=256) if inbox else
              dict(KV_STRIDE=hkv * d, V_OFF=0, STAGE_OFF=0, PARITY_BYTES=0, FLAGS_OFF=0,
                   SENT_OFF=0))
    k = _compile_native(attention_ws.attention_ws_kernel, ["i32"] + [dtype] * 4 + ["fp32"],
                        dict(B=2, S=4096, HQ=hq, HKV=hkv, D=d, CAUSAL=causal,
                             QK_SCALE=0.1275, INBOX=inbox, **layout), num_warps=4,
                        num_stages=1, maxnreg=attention_ws.MAX_REGISTERS)
    assert k.metadata.num_warps == 12
    assert 12 * 32 * attention_ws.MAX_REGISTERS <= 65536
    assert (8 * attention_ws.CONSUMER_REGISTERS.value
            + 4 * attention_ws.PRODUCER_REGISTERS.value) * 32 <= 65536
    assert _stack_bytes(k) == 0
    ptx = k.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "wgmma.wait_group.sync.aligned 1" in ptx
    assert "cp.async.bulk.tensor" in ptx and "setmaxnreg" in ptx
    assert k.metadata.shared <= 227 * 1024
    assert ("ld.acquire.gpu" in ptx and "fence.proxy.async.global" in ptx) == inbox


@pytest.mark.parametrize("dtype,d", [("bf16", 128), ("fp16", 64), ("bf16", 256), ("fp32", 128),
                                     ("fp32", 256)])
def test_attention_backward_compiles(dtype, d):
    """ag_attention's fused backward at its default tiles for Hopper: both kernels
    on tensor cores (wgmma for 16-bit types) within shared memory, for every head
    dim the op takes up to 256 and float32 (smaller steps and tiles there)."""
    from jaxtdist.kernels import attention_bwd
    from jaxtdist.ops._config import Problem
    from jaxtdist.ops.ag_attention import _backward_tiles

    tiles = _backward_tiles(Problem("gpu", 1, (1, 4096, 32, 8, d),
                                    "float32" if dtype == "fp32" else "bfloat16", 132))
    shared = dict(SQ=4096, SK=4096, HQ=32, HKV=8, D=d, CAUSAL=True, QK_SCALE=0.1275,
                  SM_SCALE=0.088, BLOCK_D=d, DOT_PRECISION="tf32" if dtype == "fp32" else None)
    ins = ("q_ptr", "k_ptr", "v_ptr", "o_ptr", "do_ptr")
    for fn, names, blocks, (warps, stages) in (
            (attention_bwd.attention_bwd_dq_kernel,
             ("ctx", "q_ptr", "k_ptr", "v_ptr", "o_ptr", "do_ptr", "lse_ptr", "dq_ptr",
              "delta_ptr"), dict(BLOCK_M=tiles["BWD_BLOCK_Q"], BLOCK_N=tiles["BWD_BLOCK_STEP"]),
             (tiles["BWD_WARPS"], tiles["BWD_STAGES"])),
            (attention_bwd.attention_bwd_dkdv_kernel,
             ("ctx", "q_ptr", "k_ptr", "v_ptr", "do_ptr", "lse_ptr", "delta_ptr", "dk_ptr",
              "dv_ptr"), dict(BLOCK_M=tiles["BWD_KV_STEP"], BLOCK_N=tiles["BWD_BLOCK_KV"]),
             (tiles["BWD_KV_WARPS"], tiles["BWD_KV_STAGES"]))):
        pointers = {n: f"*{dtype}" if n in ins else ("*i32" if n == "ctx" else "*fp32")
                    for n in names}
        k = _compile(fn, pointers, dict(shared, **blocks), num_warps=warps, num_stages=stages)
        if dtype != "fp32":
            assert any(op.startswith("wgmma") for op in _ops(k)), fn.__name__
        assert k.metadata.shared <= 227 * 1024, fn.__name__


@pytest.mark.parametrize("dtype,d,causal", [("bf16", 128, True), ("fp16", 64, False)])
def test_overlapped_attention_backward_compiles(dtype, d, causal):
    """ag_attention's backward over several ranks (``kernels/ag_attention_bwd``) at
    its default tiles for Hopper, world 4: the dk/dv and dq kernels on tensor
    cores (wgmma) within shared memory, K/V loads from the
    inbox 16 bytes wide after the flags' acquire (GPU scope: the copy engines
    raise them), the partials' flags raised with a system-scope release; the
    reduce kernel acquires them and loads 16 bytes wide."""
    from jaxtdist.kernels import ag_attention_bwd as bwd
    from jaxtdist.ops._config import Problem
    from jaxtdist.ops.ag_attention import _backward_tiles

    s = 4096
    tiles = _backward_tiles(Problem("gpu", 4, (1, s, 32, 8, d), "bfloat16", 132))
    layout = dict(B=1, S=s, HKV=8, D=d, CAUSAL=causal, WORLD=4, BLOCK_D=d)
    kernel = dict(HQ=32, QK_SCALE=0.1275, SM_SCALE=0.088, INBOX_OFF=4096,
                  PARITY_BYTES=1 << 26, FLAGS_OFF=0, CHUNK_ROWS=s, FLAG_SCOPE="gpu",
                  DOT_PRECISION=None)
    parts = dict(PART_OFF=1 << 28, PART_PARITY_BYTES=1 << 26, PART_FLAGS_OFF=1 << 27)
    io = {"ctx": "*i32", "q_ptr": f"*{dtype}", "kv_ptr": f"*{dtype}", "do_ptr": f"*{dtype}",
          "lse_ptr": "*fp32", "delta_ptr": "*fp32"}
    dkdv = _compile(bwd.ag_attention_bwd_dkdv_kernel,
                    dict(io, dk_ptr="*fp32", dv_ptr="*fp32"),
                    dict(layout, **kernel, **parts, BLOCK_M=tiles["BWD_KV_STEP"],
                         BLOCK_N=tiles["BWD_BLOCK_KV"]),
                    num_warps=tiles["BWD_KV_WARPS"], num_stages=tiles["BWD_KV_STAGES"])
    dq = _compile(bwd.ag_attention_bwd_dq_kernel,
                  dict(io, after_ptr="*fp32", dq_ptr=f"*{dtype}"),
                  dict(layout, **kernel, SENT_OFF=512, BLOCK_M=tiles["BWD_BLOCK_Q"],
                       BLOCK_N=tiles["BWD_BLOCK_STEP"]),
                  num_warps=tiles["BWD_WARPS"], num_stages=tiles["BWD_STAGES"])
    for k in (dkdv, dq):
        ops, ptx = _ops(k), k.asm["ptx"]
        assert any(op.startswith("wgmma") for op in ops), dict(ops)
        narrow = {op: n for op, n in ops.items() if op.startswith("ld.global")
                  and op.endswith((".b16", ".b8"))}
        assert not narrow, f"K/V loads lost vectorization: {dict(ops)}"
        assert "ld.global.gpu.acquire" in ptx or "ld.acquire.gpu" in ptx, "inbox flags"
        assert k.metadata.shared <= 227 * 1024
    assert "sys.release" in dkdv.asm["ptx"] or "release.sys" in dkdv.asm["ptx"]
    reduce = _compile(bwd.ag_attention_bwd_reduce_kernel,
                      {"ctx": "*i32", "dk_own_ptr": "*fp32", "dv_own_ptr": "*fp32",
                       "after_ptr": f"*{dtype}", "dk_ptr": f"*{dtype}", "dv_ptr": f"*{dtype}"},
                      dict(layout, **parts, BLOCK_N=tiles["BWD_BLOCK_KV"]),
                      num_warps=4, num_stages=1)
    ops, ptx = _ops(reduce), reduce.asm["ptx"]
    assert "sys.acquire" in ptx or "acquire.sys" in ptx, "the partials' flags"
    assert any(op.startswith("ld.global") and op.endswith(".v4.b32") for op in ops), dict(ops)


@pytest.mark.parametrize("head_group,block_n", [(32, 128), (4, 64)])
def test_ag_attention_head_groups_compile(head_group, block_n):
    """ag_attention's head-grouped causal order (HEAD_GROUP) for Hopper: wgmma,
    cp.async K/V loads 16 bytes wide, and within shared memory."""
    from jaxtdist.kernels.ag_attention import ag_attention_kernel
    k = _compile(ag_attention_kernel,
                 {"ctx": "*i32", "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16",
                  "out_ptr": "*bf16", "lse_ptr": "*fp32"},
                 dict(B=1, S=16384, HQ=32, HKV=32, D=128, CAUSAL=True, QK_SCALE=0.1275,
                      INBOX=True, STAGE_OFF=4096, PARITY_BYTES=1 << 28,
                      KV_ELEMS=16384 * 32 * 128, READY_OFF=0, FLAGS_OFF=0, SENT_OFF=512,
                      CHUNK_ROWS=16384, KV_STRIDE=2 * 32 * 128, V_OFF=32 * 128,
                      FLAG_SCOPE="gpu", BLOCK_M=128, BLOCK_N=block_n,
                      BLOCK_D=128, DOT_PRECISION=None, HEAD_GROUP=head_group),
                 num_warps=8, num_stages=3)
    ops = _ops(k)
    assert any(op.startswith("wgmma") for op in ops), dict(ops)
    assert ops["cp.async.cg.shared.global"] > 0, dict(ops)
    narrow = {op: n for op, n in ops.items() if op.startswith("ld.global")
              and op.endswith((".b16", ".b8"))}
    assert not narrow, f"K/V loads lost vectorization: {dict(ops)}"
    assert k.metadata.shared <= 227 * 1024


def test_parities_past_2_gib_compile():
    """A double-buffered region whose parity is over 2 GiB: ag_attention's inboxes at
    S_shard 32768 with 32 KV heads over 4 ranks (a 32-bit ``(e % 2) * PARITY_BYTES``
    failed to compile there: "Scalar 2147487744 is out of range for type int32")."""
    from jaxtdist.kernels.ag_attention import ag_attention_kernel
    s, hkv, d = 32768, 32, 128
    _compile(ag_attention_kernel,
             {"ctx": "*i32", "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16",
              "out_ptr": "*bf16", "lse_ptr": "*fp32"},
             dict(B=1, S=s, HQ=32, HKV=hkv, D=d, CAUSAL=True, QK_SCALE=0.1275, INBOX=True,
                  STAGE_OFF=4096, PARITY_BYTES=4 * s * 2 * hkv * d * 2 + 4096,
                  KV_ELEMS=s * hkv * d, READY_OFF=0, FLAGS_OFF=0, SENT_OFF=512, CHUNK_ROWS=s,
                  KV_STRIDE=2 * hkv * d, V_OFF=hkv * d, FLAG_SCOPE="gpu", BLOCK_M=128,
                  BLOCK_N=64, BLOCK_D=d, DOT_PRECISION=None, HEAD_GROUP=1),
             num_warps=8, num_stages=3)


def _moe_block(h: int, itemsize: int) -> int:
    """The default copy step of the MoE kernels on GPUs (whole rows up to 16 KB)."""
    from jaxtdist.ops._config import Problem
    from jaxtdist.ops.moe import MoeConfig
    return MoeConfig.default(Problem("gpu", 2, (128, h), {1: "uint8", 2: "bfloat16",
                                                          4: "float32"}[itemsize], 132)).BLOCK_H


def _compile_dispatch(dtype, t, h, k, e_loc, world, programs, block, chunk=0, **options):
    from jaxtdist.kernels.moe import moe_dispatch_kernel
    from jaxtdist.ops._shapes import next_pow2
    from jaxtdist.ops.moe._routing import route_scan_tokens, route_tokens_per_step
    i32 = "*i32"
    kl = min(k, e_loc)
    meta_words = 1 + 4 * kl
    tp = -(-t // programs)
    chunk = min(chunk or tp, tp)
    chunks = -(-tp // chunk)
    return _compile(moe_dispatch_kernel,
                    {"ctx": i32, "x_ptr": f"*{dtype}", "slot_ptr": i32, "meta_ptr": i32,
                     "dcounts_ptr": i32, "bounds_ptr": i32, "ids_ptr": i32,
                     "factor_ptr": "*fp32", "recv_ptr": f"*{dtype}", "rcounts_ptr": i32,
                     "spos_ptr": i32, "stk_ptr": i32, "sranges_ptr": i32,
                     "tail_ptr": f"*{dtype}", "trace_ptr": i32, "invalid_ptr": i32},
                    dict(T=t, H=h, K=k, E_LOC=e_loc, KL=kl, R=world * t * kl, W=world,
                         P=programs, TP=tp, FLAGS_OFF=0, HDR_OFF=4096, META_OFF=1 << 16,
                         ROWS_OFF=1 << 20, PARITY_BYTES=1 << 24,
                         HDR_WORDS=e_loc + programs * (chunks + 1) + 1, META_WORDS=meta_words,
                         CT=chunk, NCH=chunks,
                         SCALED=False, WP=next_pow2(world), EP=next_pow2(e_loc),
                         MP=next_pow2(meta_words), KLP=next_pow2(kl), BLOCK_H=block,
                         ROUTE_OFF=1 << 26, KP=next_pow2(k), EPG=next_pow2(world * e_loc),
                         BT=route_tokens_per_step(tp, k, world * e_loc),
                         BS=route_scan_tokens(t, k), **options),
                    num_warps=4, num_stages=1)


@pytest.mark.parametrize("t,world", [(128, 4), (4096, 8)])
def test_moe_fused_routing_compiles(t, world):
    """The dispatch kernel with its routing fused (config ROUTING="fused"), top-8 of
    256 experts, decode and prefill token counts: the histograms and the CTA barrier
    compile, within shared memory."""
    d = _compile_dispatch("bf16", t, 7168, 8, 256 // world, world, 128,
                          _moe_block(7168, 2), SPLIT=0, TRACE=False, ROUTE=True)
    assert d.metadata.shared <= 227 * 1024
    assert "bar.sync" in d.asm["ptx"] or "barrier.sync" in d.asm["ptx"]


def _compile_combine(y_dtype, t, f, k, kl, e_loc, world, programs, dots, send_rows, chunk=0,
                     **options):
    from jaxtdist.kernels.moe import moe_combine_kernel
    i32 = "*i32"
    tp = -(-t // programs)
    chunk = min(chunk or tp, tp)
    return _compile(moe_combine_kernel,
                    {"ctx": i32, "y_ptr": f"*{y_dtype}", "w_ptr": "*fp32", "kmask_ptr": i32,
                     "ids_ptr": i32, "g_ptr": f"*{y_dtype}", "spos_ptr": i32, "stk_ptr": i32,
                     "sranges_ptr": i32, "out_ptr": f"*{y_dtype}", "dots_ptr": "*fp32",
                     "trace_ptr": i32},
                    dict(T=t, F=f, K=k, KL=kl, W=world, P=programs, TP=tp, E_LOC=e_loc,
                         FLAGS_OFF=0, INBOX_OFF=4096, WBOX_OFF=4096 + (1 << 23),
                         PARITY_BYTES=1 << 24, DOTS=dots, KP=8, KLP=8, WP=4,
                         BLOCK_F=_moe_block(f, 2), SEND_ROWS=send_rows, CT=chunk,
                         NCH=-(-tp // chunk), **options),
                    num_warps=4, num_stages=1)


@pytest.mark.parametrize("dots", [False, True])
def test_moe_chunked_combine_compiles(dots):
    """The bulk combine (4096 tokens per rank, 32 per program, the dispatch's chunks
    of 4: each chunk sent, the previous one summed, then flagged) compiles for sm_90
    with 16-byte row copies, system-scope flags and no rows spilling: the forward
    keeps 40 bytes of stack (48 with the trace stamps; one chunk: 8), the pointers
    live across the chunk loop; rows' registers spilling take hundreds (see
    test_moe_kernels_compile)."""
    c = _compile_combine("bf16", 4096, 7168, 8, 8, 64, 4, 128, dots, 2, chunk=4, TRACE=True)
    ops = _ops(c)
    assert not {op: n for op, n in ops.items() if op.endswith((".b16", ".b8"))}, dict(ops)
    ptx = c.asm["ptx"]
    assert ("ld.global.sys.acquire" in ptx or "ld.acquire.sys" in ptx) and "release" in ptx
    assert _stack_bytes(c) <= (0 if dots else 48), "the chunked combine spills"


@pytest.mark.parametrize("zero_tail", [True, pytest.param(False, marks=slow())])
def test_moe_chunked_dispatch_compiles(zero_tail):
    """The bulk dispatch (4096 tokens per rank, 32 per program, chunks of 4: each
    chunk's pushes, flags and layout pipelined) compiles for sm_90 with 16-byte row
    copies, system-scope flags and no spills."""
    d = _compile_dispatch("bf16", 4096, 7168, 8, 64, 4, 128, _moe_block(7168, 2), chunk=4,
                          SPLIT=0, TRACE=True, ROUTE=False, ZERO_TAIL=zero_tail)
    ops = _ops(d)
    assert not {op: n for op, n in ops.items() if op.endswith((".b16", ".b8"))}, dict(ops)
    ptx = d.asm["ptx"]
    assert ("ld.global.sys.acquire" in ptx or "ld.acquire.sys" in ptx) and "release" in ptx
    assert _stack_bytes(d) == 0


@pytest.mark.parametrize("dtype,dots,send_rows", [("bf16", False, 2), ("fp32", False, 2),
                                                  ("u8", False, 2), ("bf16", True, 2),
                                                  ("bf16", False, 0), ("bf16", False, 1),
                                                  ("bf16", False, 4)])
def test_moe_kernels_compile(dtype, dots, send_rows):
    """MoE dispatch and combine compile for sm_90 at DeepSeek-V3's decode size (H=7168,
    top-8, 256 experts over 4 ranks), the combine's both ways of weighing rows; the
    row copies keep 16-byte vectors and the flags are system-scope release/acquire;
    the combine loads send_rows valid pair rows at once (0: as one masked block)
    without spilling (the default: 2)."""
    t, h, k, e_loc, world, programs = 128, 7168, 8, 64, 4, 128
    if dtype == "u8":  # fp8 dispatch: byte rows of 7168 fp8 and 56 float32 scales
        h = 7168 + 4 * 56
    kl = 8
    block = _moe_block(h, 1 if dtype == "u8" else 4 if dtype == "fp32" else 2)
    d = _compile_dispatch(dtype, t, h, k, e_loc, world, programs, block,
                          SPLIT=7168 if dtype == "u8" else 0,
                          TRACE=dtype == "bf16",  # the probes' phase stamps compile too
                          ROUTE=dtype != "fp32")  # the fused routing too
    y_dtype = "bf16" if dtype == "u8" else dtype  # the experts' output: bf16 after fp8
    c = _compile_combine(y_dtype, t, h, k, kl, e_loc, world, programs, dots, send_rows,
                         TRACE=dtype == "bf16")
    for k_ in (d, c):
        ptx = k_.asm["ptx"]
        ops = _ops(k_)
        narrow = {op: n for op, n in ops.items() if op.endswith((".b16", ".b8"))}
        assert not narrow, f"row copies lost vectorization: {k_.name} {dict(ops)}"
        assert "ld.global.sys.acquire" in ptx or "ld.acquire.sys" in ptx
        assert "release" in ptx
    # A few words of stack at most (one row at a time takes 8 bytes, 16 with the
    # trace stamps at two): rows' registers spilling take hundreds (8 rows at once
    # with 4 warps: 384 bytes; 4 fp32 rows of 8192: 336).
    assert _stack_bytes(c) <= 32, f"combine spills with {send_rows} rows at once"


@pytest.mark.parametrize("tma,flatten,world,push_tma", [
    (True, True, 4, False), (True, False, 4, False), (False, False, 4, False),
    (True, True, 1, False), (True, False, 4, True), (True, False, 2, True)])
def test_matmul_rs_kernel_runs_on_the_gemm_core(tma, flatten, world, push_tma):
    """matmul_rs's tiles: TMA loads and wgmma on the GEMM core (a subtiled TMA store of
    the own rows), or the pointer GEMM for rows TMA cannot address; both push
    partials with system-scope releases (PUSH_TMA: as TMA stores, each flag after
    a wait for them)."""
    from jaxtdist.kernels.matmul_rs import matmul_rs_kernel
    k = _compile_native(matmul_rs_kernel, ["i32"] + ["bf16"] * 5 + ["i32"],
                        dict(M_SHARD=2048, N=4096, K=3584, INBOX_OFF=1 << 20,
                             PARITY_BYTES=1 << 26, FLAGS_OFF=4096, PARTIAL_INPUT=push_tma,
                             WORLD=world, NUM_PROGRAMS=132, INTERLEAVE=True, BLOCK_M=128,
                             BLOCK_N=256, BLOCK_K=64, GROUP_M=8, SUBTILE=4, TMA=tma,
                             FLATTEN=flatten, PUSH_TMA=push_tma),
                        num_warps=8, num_stages=3)
    ptx = k.asm["ptx"]
    assert ("cp.async.bulk.wait_group 0;" in ptx) == push_tma
    # The own tiles read the peers' partials 16 bytes at a time: no 2- or 4-byte
    # loads (a token on the block of pointers once made them 2-byte loads, and
    # the reduction took 65 us a tile at world 4 on H100).
    assert "ld.global.b16" not in ptx and "ld.global.b32" not in ptx
    assert "wgmma.mma_async" in ptx
    assert ("cp.async.bulk.tensor.2d.shared" in ptx) == tma
    assert ("cp.async.bulk.tensor.2d.global.shared" in ptx) == tma  # TMA stores
    assert ("release" in ptx or world == 1) and k.metadata.shared <= 227 * 1024
    if tma:
        # Pushes and reductions a column piece at a time: no spills (the whole
        # tile's epilogue took 344 bytes of stack per thread at world 4).
        assert _stack_bytes(k) == 0


@pytest.mark.parametrize("tma,split_k", [(False, 4), (True, 2)])
def test_matmul_ar_split_k_compiles(tma, split_k):
    """matmul_ar's decode tiles split along K (32 x 4096 x 7168 at 128 columns, the
    GPU default's pointer loads, and TMA): tensor cores, the split-K counter's
    acq_rel GPU-scope atomic, system-scope releases for the pushes."""
    from jaxtdist.kernels.matmul_ar import matmul_ar_kernel
    k = _compile_native(matmul_ar_kernel, ["i32"] + ["bf16"] * 5,
                        dict(M=32, N=4096, K=7168, INBOX_OFF=1 << 20, PARITY_BYTES=1 << 22,
                             FLAGS_OFF=4096, PARTIALS_OFF=1 << 24, COUNTERS_OFF=1 << 26,
                             SPLIT_K=split_k, K_SPLIT=7168 // split_k, BLOCK_M=32,
                             BLOCK_N=128, BLOCK_K=128, GROUP_M=1, TMA=tma, TWO_SHOT=False,
                             RESULTS_OFF=-1, RFLAGS_OFF=-1, OWN_OFF=1 << 29, PARK=False,
                             PARTIAL_INPUT=False),
                        num_warps=4, num_stages=4)
    ptx = k.asm["ptx"]
    assert "mma.sync" in ptx or "wgmma.mma_async" in ptx
    assert ("cp.async.bulk.tensor.2d.shared" in ptx) == tma
    assert re.search(r"atom\.global\.gpu\.acq_rel\.add|atom\.acq_rel\.gpu\.global\.add", ptx)
    assert "release" in ptx and k.metadata.shared <= 227 * 1024


@pytest.mark.parametrize("scaling,tma", [("tensor", True), ("block", True), ("block", False)])
def test_fp8_gemm_core_uses_fp8_wgmma(scaling, tma):
    """FP8 on the GEMM core (issue 83): matmul_rs's tiles with e4m3 operands, w
    K-major, float32 scales per tensor or per 128 blocks: 8-bit wgmma (both
    operands from shared memory, K-major), TMA loads, a bf16 output."""
    from jaxtdist.kernels.matmul_rs import matmul_rs_kernel
    k = _compile_native(matmul_rs_kernel,
                        ["i32", "fp8e4nv", "fp8e4nv", "fp32", "fp32", "bf16", "i32"],
                        dict(M_SHARD=2048, N=4096, K=4096, INBOX_OFF=1 << 20,
                             PARITY_BYTES=1 << 26, FLAGS_OFF=4096, PARTIAL_INPUT=False,
                             WORLD=2, NUM_PROGRAMS=132, INTERLEAVE=True, BLOCK_M=128,
                             BLOCK_N=128 if tma else 64, BLOCK_K=128, GROUP_M=8, SUBTILE=2,
                             TMA=tma, FLATTEN=False, B_T=True, SCALING=scaling),
                        num_warps=8 if tma else 4, num_stages=3)
    ptx = k.asm["ptx"]
    assert re.search(r"wgmma\.mma_async[\w.]*\.e4m3\.e4m3", ptx) or not tma, "no FP8 wgmma"
    assert re.search(r"(wgmma\.mma_async|mma\.sync)[\w.]*e4m3", ptx), "no FP8 MMA"
    assert ("cp.async.bulk.tensor.2d.shared" in ptx) == tma
    assert k.metadata.shared <= 227 * 1024


@pytest.mark.parametrize("scaling,tma,split,masked", [
    ("block", True, 1, 0), ("tensor", True, 1, 0), ("block", False, 1, 0),
    ("block", True, 4, 0), ("block", True, 1, 512)])
def test_fp8_grouped_gemm_uses_fp8_wgmma(scaling, tma, split, masked):
    """FP8 grouped GEMM (issue 83, item 2) on the grouped kernel's body and the GEMM
    core: e4m3 x and K-major w [G, F, H] through one stacked TMA descriptor, 8-bit
    wgmma (both operands K-major from shared memory), per-group float32 scales per
    tensor or per 128 blocks; a bf16 output (split K: float32 partials); the masked
    (low-latency decode) layout too; the pointer mainloop feeds e4m3 MMAs."""
    from jaxtdist.kernels.grouped_gemm import grouped_gemm_fp8_kernel

    m = masked or 4096
    k = _compile_native(grouped_gemm_fp8_kernel,
                        ["i32", "fp8e4nv", "fp8e4nv", "i32", "fp32", "fp32",
                         "fp32" if split > 1 else "bf16"],
                        dict(R=8 * m, H=7168 if tma else 7168 + 128, F=2048, G=8, BLOCK_G=16,
                             BLOCK_M=128, BLOCK_N=128 if tma else 64, BLOCK_K=128, GROUP_M=8,
                             NUM_PROGRAMS=132, SUBTILE=2, TMA=tma, SCALING=scaling,
                             SPLIT_K=split, MASKED_M=masked),
                        num_warps=8 if tma else 4, num_stages=3)
    ptx = k.asm["ptx"]
    assert re.search(r"(wgmma\.mma_async|mma\.sync)[\w.]*e4m3", ptx), "no FP8 MMA"
    if tma:
        assert re.search(r"wgmma\.mma_async[\w.]*\.e4m3\.e4m3", ptx), "no FP8 wgmma"
        assert "cp.async.bulk.tensor.2d.shared" in ptx, "x / w tiles are not TMA loads"
        assert len(re.findall(r"tensormap\.cp_fenceproxy", ptx)) == 3  # x, w (stacked), out
    else:
        assert "cp.async.bulk.tensor" not in ptx
    assert k.metadata.shared <= 227 * 1024, k.metadata.shared


def _stack_bytes(kernel) -> int:
    """Per-thread stack (register spills) of a compiled kernel, from cuobjdump."""
    import pathlib
    import subprocess
    import tempfile

    import triton.backends.nvidia as nv
    tool = pathlib.Path(nv.__file__).parent / "bin" / "cuobjdump"
    if not tool.exists():
        pytest.skip("Triton's cuobjdump is not installed")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(tool), "--dump-resource-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
    return int(re.search(r"STACK:(\d+)", usage).group(1))


@pytest.mark.parametrize("m,n,k,bm,bn,warps,stages,tma,two_shot", [
    (256, 4096, 512, 128, 64, 8, 4, False, False),
    (256, 4096, 512, 64, 128, 4, 3, False, False),
    (512, 8192, 4096, 128, 256, 8, 3, True, False),
    (512, 8192, 4096, 128, 256, 8, 3, False, False),
    (512, 8192, 4096, 128, 128, 8, 4, False, True)])
def test_matmul_ar_epilogue_does_not_spill(m, n, k, bm, bn, warps, stages, tma, two_shot):
    """matmul_ar's exchange: large tiles sum a few rows at a time from memory (the
    tile's accumulator, sum, a peer's partial and offsets in registers at once
    spilled: 255 registers and a stack, 1.2-1.6x the GEMM's time at world 1);
    128 x 64 with 8 warps sums in registers without spilling."""
    from jaxtdist.kernels.matmul_ar import matmul_ar_kernel
    k = _compile_native(matmul_ar_kernel, ["i32"] + ["bf16"] * 5,
                        dict(M=m, N=n, K=k, INBOX_OFF=1 << 20, PARITY_BYTES=1 << 26,
                             FLAGS_OFF=4096, PARTIALS_OFF=-1, COUNTERS_OFF=-1, SPLIT_K=1,
                             K_SPLIT=k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=64, GROUP_M=8,
                             TMA=tma, TWO_SHOT=two_shot,
                             RESULTS_OFF=(1 << 20) + (1 << 25) if two_shot else -1,
                             RFLAGS_OFF=8192 if two_shot else -1, OWN_OFF=1 << 29,
                             PARK=bm * bn > 32 * 32 * warps,
                             PARTIAL_INPUT=two_shot),
                        num_warps=warps, num_stages=stages)
    assert _stack_bytes(k) == 0
    # Partials and results read 16 bytes at a time (no 2- or 4-byte loads).
    ptx = k.asm["ptx"]
    assert "ld.global.b16" not in ptx and "ld.global.b32" not in ptx


def test_matmul_ar_two_shot_compiles():
    """matmul_ar's two shot at 128 x 8192 (the default from 3 ranks on there):
    bf16 partials to the tile's owner, the owner's sum broadcast, both under
    system-scope releases and acquires."""
    from jaxtdist.kernels.matmul_ar import matmul_ar_kernel
    from jaxtdist.ops._config import Problem
    from jaxtdist.ops._partial_sums import MatmulArConfig
    cfg = MatmulArConfig.default(Problem("gpu", 4, (128, 8192, 2048), "bfloat16", 132))
    assert cfg.TWO_SHOT
    k = _compile_native(matmul_ar_kernel, ["i32"] + ["bf16"] * 5,
                        dict(M=128, N=8192, K=2048, INBOX_OFF=1 << 20, PARITY_BYTES=1 << 24,
                             FLAGS_OFF=4096, PARTIALS_OFF=-1, COUNTERS_OFF=-1, SPLIT_K=1,
                             K_SPLIT=2048, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N,
                             BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M, TMA=cfg.TMA,
                             TWO_SHOT=True, RESULTS_OFF=(1 << 20) + 3 * (1 << 21),
                             RFLAGS_OFF=8192, OWN_OFF=1 << 29,
                             PARK=cfg.BLOCK_M * cfg.BLOCK_N > 32 * 32 * cfg.num_warps,
                             PARTIAL_INPUT=True),
                        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    ptx = k.asm["ptx"]
    assert "mma.sync" in ptx or "wgmma.mma_async" in ptx
    assert "release" in ptx and "acquire" in ptx and k.metadata.shared <= 227 * 1024


@pytest.mark.parametrize("tma", [False, True])
def test_float32_dots_follow_the_precision(tma):
    """matmul_ar's kernel on float32 under each DOT_PRECISION: the backend's TF32
    (operands truncated by the tensor cores), "tf32_rn" (the NVIDIA default: the
    same MMAs on operands rounded to nearest first), "tf32x3" (JAX's "highest":
    each operand split into two TF32 parts, three products: more MMAs)."""
    from jaxtdist.kernels.matmul_ar import matmul_ar_kernel

    def compiled(precision):
        return _compile_native(
            matmul_ar_kernel, ["i32"] + ["fp32"] * 5,
            dict(M=64, N=4096, K=4096, INBOX_OFF=1 << 20, PARITY_BYTES=1 << 22,
                 FLAGS_OFF=4096, PARTIALS_OFF=-1, COUNTERS_OFF=-1, SPLIT_K=1, K_SPLIT=4096,
                 BLOCK_M=64, BLOCK_N=128, BLOCK_K=32, GROUP_M=1, TMA=tma, TWO_SHOT=False,
                 RESULTS_OFF=-1, RFLAGS_OFF=-1, OWN_OFF=1 << 29, PARK=True,
                 PARTIAL_INPUT=False,
                 DOT_PRECISION=precision),
            num_warps=4, num_stages=3).asm["ptx"]

    def mmas(ptx):
        return len(re.findall(r"wgmma\.mma_async[\w.]*tf32|mma\.sync[\w.]*tf32", ptx))

    truncated, rounded, split = compiled(None), compiled("tf32_rn"), compiled("tf32x3")
    assert "cvt.rna.tf32.f32" not in truncated
    assert "cvt.rna.tf32.f32" in rounded and 0 < mmas(truncated) == mmas(rounded)
    assert "cvt.rna.tf32.f32" in split and mmas(rounded) < mmas(split)


def test_float32_rounded_dots_on_the_persistent_tma_kernel():
    """The persistent TMA GEMM (ag_matmul's) on float32 as its default runs it: w
    read K-major (B_T; XLA rounded it), x's tiles rounded to TF32 in registers
    ("tf32_rn_a"): still TMA loads and wgmma, within shared memory."""
    from jaxtdist.kernels.ag_matmul import ag_matmul_tma_kernel
    k = _compile_native(ag_matmul_tma_kernel, ["i32"] + ["fp32"] * 6,
                        dict(M_SHARD=1024, N=4096, K=4096, STAGE_OFF=65536,
                             SLOT_BYTES=1 << 24, READY_OFF=0, FLAGS_OFF=4096,
                             SCHEDULE_OFF=8192, NUM_COMM=16, CHUNK_ROWS=32,
                             COPY_BLOCK_C=128, BLOCK_M=128, BLOCK_N=128, BLOCK_K=32,
                             GROUP_M=8, SCOPE="sys", NUM_PROGRAMS=132, PRODUCERS_JOIN=True,
                             SUBTILE=2, DOT_PRECISION="tf32_rn_a", B_T=True),
                        num_warps=8, num_stages=3)
    ptx = k.asm["ptx"]
    assert "cp.async.bulk.tensor.2d.shared" in ptx and "cvt.rna.tf32.f32" in ptx
    assert "wgmma.mma_async" in ptx and k.metadata.shared <= 227 * 1024


@pytest.mark.parametrize("b_t", [False, True])
def test_float32_weights_read_k_major(b_t):
    """matmul_rs's TMA GEMM on float32: with w's transpose (B_T, the float32
    default) B's tiles go to wgmma as TMA left them; w [K, N] itself is N-major,
    which TF32 wgmma cannot read, so each K step rewrites B's tile in shared
    memory with scalar stores."""
    from jaxtdist.kernels.matmul_rs import matmul_rs_kernel
    k = _compile_native(matmul_rs_kernel, ["i32"] + ["fp32"] * 5 + ["i32"],
                        dict(M_SHARD=2048, N=4096, K=3584, INBOX_OFF=1 << 20,
                             PARITY_BYTES=1 << 26, FLAGS_OFF=4096, PARTIAL_INPUT=True, WORLD=1,
                             NUM_PROGRAMS=132, INTERLEAVE=True, BLOCK_M=128, BLOCK_N=128,
                             BLOCK_K=32, GROUP_M=8, SUBTILE=2, TMA=True, FLATTEN=True,
                             B_T=b_t), num_warps=8, num_stages=5)
    ptx = k.asm["ptx"]
    assert "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32" in ptx
    # The epilogue's and the flags' few scalar shared stores either way.
    assert (ptx.count("st.shared.b32") > 10) != b_t, ptx.count("st.shared.b32")


@pytest.mark.parametrize("world,up", [(4, True), (2, False), (1, True)])
def test_moe_tp_overlapped_kernels_run_on_the_gemm_core(world, up):
    """moe_tp_mlp's two overlapped kernels for Hopper at Mixtral's expert sizes
    (4096 rows per rank's chunk, H 4096, F 3584 per rank, 8 experts): TMA loads and
    wgmma; the first waits (acquire) for peers' rows and stores by TMA; the second
    pushes partials to peers with system-scope releases, reads the peers' 16 bytes
    at a time and does not spill (its epilogue a column piece at a time); and the
    grouped GEMM they share their tile decode with still compiles the same way."""
    from jaxtdist.kernels.grouped_gemm import grouped_gemm_kernel
    from jaxtdist.kernels.moe_tp import ag_grouped_gemm_kernel, grouped_gemm_rs_kernel

    tiles = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, NUM_PROGRAMS=132,
                 SUBTILE=4, TMA=True, DOT_PRECISION=None, W_T=False)
    ag = _compile_native(ag_grouped_gemm_kernel, ["i32"] + ["bf16"] * 3 + ["i32", "bf16"],
                         dict(R_SHARD=4096, H=4096, F=3584, E=8, BLOCK_G=16, INBOX_OFF=1 << 20,
                              PARITY_BYTES=1 << 28, FLAGS_OFF=4096, SENT_OFF=8192,
                              CHUNK_ROWS=1024, SCOPE="gpu", WORLD=world, UP=up, **tiles),
                         num_warps=8, num_stages=3)
    rs = _compile_native(grouped_gemm_rs_kernel, ["i32", "bf16", "bf16", "i32", "fp32"],
                         dict(R_SHARD=4096, K=3584, N=4096, E=8, BLOCK_G=16, INBOX_OFF=1 << 20,
                              PARITY_BYTES=1 << 28, FLAGS_OFF=4096, CHUNK_TILES=640,
                              PARTIAL_INPUT=True, WORLD=world, INTERLEAVE=True, **tiles),
                         num_warps=8, num_stages=3)
    grouped = _compile_native(grouped_gemm_kernel, ["i32", "bf16", "bf16", "i32", "bf16"],
                              dict(R=4096, H=4096, F=3584, G=8, BLOCK_G=16, SPLIT_K=1, **tiles),
                              num_warps=8, num_stages=3)
    for k in (ag, rs, grouped):
        ptx = k.asm["ptx"]
        assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor.2d.shared" in ptx, k.name
        assert k.metadata.shared <= 227 * 1024, (k.name, k.metadata.shared)
    assert "cp.async.bulk.tensor" in ag.asm["ptx"] and "global.shared" in ag.asm["ptx"]
    if world > 1:
        assert "acquire" in ag.asm["ptx"]
        assert "release" in rs.asm["ptx"] and "acquire" in rs.asm["ptx"]
        # Peers' bf16 partials read 16 bytes at a time; the one 4-byte load is the
        # group table's sizes.
        ops = _ops(rs)
        assert "ld.global.b16" not in ops and ops["ld.global.b32"] <= 1, dict(ops)
        assert ops["ld.global.v4.b32"] > 0, dict(ops)
    assert _stack_bytes(rs) == 0


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_moe_tp_overlapped_kernels_compile_with_a_single_k_step(world, dtype):
    """K == BLOCK_K folds the K loop away, leaving the tile loop innermost: its
    per-group weight descriptor must not make Triton's pipeliner fail ("doesn't
    know how to predicate"; seen on a GPU at world 1, float32, tiny experts)."""
    from jaxtdist.kernels.moe_tp import ag_grouped_gemm_kernel, grouped_gemm_rs_kernel

    w_t = dtype == "fp32"
    tiles = dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=32, GROUP_M=8, NUM_PROGRAMS=132, SUBTILE=1,
                 TMA=True, DOT_PRECISION="tf32" if w_t else None, W_T=w_t)
    ag = _compile_native(ag_grouped_gemm_kernel, ["i32"] + [dtype] * 3 + ["i32", dtype],
                         dict(R_SHARD=64, H=32, F=32, E=4, BLOCK_G=16, INBOX_OFF=1 << 20,
                              PARITY_BYTES=1 << 20, FLAGS_OFF=4096, SENT_OFF=8192,
                              CHUNK_ROWS=16, SCOPE="gpu", WORLD=world, UP=1, **tiles),
                         num_warps=4, num_stages=5)
    rs = _compile_native(grouped_gemm_rs_kernel, ["i32", dtype, dtype, "i32", "fp32"],
                         dict(R_SHARD=64, K=32, N=32, E=4, BLOCK_G=16, INBOX_OFF=1 << 20,
                              PARITY_BYTES=1 << 20, FLAGS_OFF=4096, CHUNK_TILES=8,
                              PARTIAL_INPUT=not w_t, WORLD=world, INTERLEAVE=True, **tiles),
                         num_warps=4, num_stages=5)
    for k in (ag, rs):
        assert "wgmma.mma_async" in k.asm["ptx"], k.name


@pytest.mark.parametrize("h,w_t", [(5632, False), (1000, False), (1000, True)])
@pytest.mark.parametrize("bm", [16, 32])
def test_grouped_gemm_decode_tiles_compile(h, w_t, bm):
    """The grouped GEMM's decode tiles (16 or 32 rows, 256 columns, the default's
    stages) for Hopper: TMA loads into mma.sync (wgmma takes 64 rows), within shared
    memory; the weights through one stacked descriptor (BLOCK_K divides H, or w[g].T)
    or a descriptor per tile (H = 1000)."""
    from jaxtdist.kernels.grouped_gemm import grouped_gemm_kernel
    from jaxtdist.ops._config import Problem
    from jaxtdist.ops.grouped_matmul import GroupedMatmulConfig

    cfg = GroupedMatmulConfig.default(Problem("gpu", 1, (bm, h, 2048, 8), "bfloat16", 132))
    assert (cfg.BLOCK_M, cfg.BLOCK_N, cfg.SPLIT_K) == (bm, 256, 1)
    k = _compile_native(grouped_gemm_kernel, ["i32", "bf16", "bf16", "i32", "bf16"],
                        dict(R=bm, H=h, F=2048, G=8, BLOCK_G=16, BLOCK_M=bm, BLOCK_N=256,
                             BLOCK_K=64, GROUP_M=8, NUM_PROGRAMS=132, SUBTILE=4, TMA=True,
                             DOT_PRECISION=None, W_T=w_t, SPLIT_K=1),
                        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    ptx = k.asm["ptx"]
    assert "mma.sync" in ptx and "wgmma" not in ptx
    assert "cp.async.bulk.tensor.2d.shared" in ptx
    assert k.metadata.shared <= 227 * 1024, k.metadata.shared
    assert _stack_bytes(k) == 0


@pytest.mark.parametrize("dtype,precision", [("bfloat16", None), ("float32", "tf32_rn"),
                                             ("float32", "tf32x3")])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("s", [4096, 16384])
def test_ag_attention_default_tiles_fit_shared_memory(dtype, precision, d, s):
    """ag_attention's forward at its default tiles for Hopper (64-row tiles at S =
    4K, 128-row where programs are many; float32 under JAX's default precision
    and under "highest", three TF32 products) fits the H100's 227 KiB of shared
    memory: float32 at head dim 128 under "highest" and bfloat16 at 256 did not."""
    from jaxtdist.ops._config import Problem
    from jaxtdist.ops.ag_attention import AgAttentionConfig

    cfg = AgAttentionConfig.default(Problem("gpu", 1, (1, s, 32, 8, d), dtype, 132))
    k = _compile_ag_attention({"bfloat16": "bf16", "float32": "fp32"}[dtype], d, s=s,
                              BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N,
                              DOT_PRECISION=precision, HEAD_GROUP=int(cfg.HEAD_GROUP),
                              num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    assert k.metadata.shared <= 227 * 1024, (k.metadata.shared, cfg)
