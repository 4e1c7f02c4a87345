"""Plain GEMM variants that isolate what the persistent ag_matmul kernel pays for.

Used by ``probe_perf.py --gemm`` on one GPU: each variant adds one of the
ag_matmul kernel's features (dynamic tile counter, per-tile flag wait and
proxy fence) to a plain persistent TMA GEMM, with and without Triton's loop
flattening (which pipelines across tile boundaries). ``probe_perf.py --balance
--edge`` times ``gemm_edge_kernel`` (narrow tiles leveling the last wave) beside
``tests.kernels_for_tests.warp_specialized_matmul_kernel``.
"""

import triton
import triton.language as tl

import jaxtdist.language as dl
from jaxtdist.kernels._tiles import grouped_tile
from jaxtdist.kernels._gemm import tile_acc as _tma_tile
from tests.kernels_for_tests import matmul_descriptors


@triton.jit
def _store_tile(a_desc, b_desc, c_desc, row0, col0, K: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C[row0:, col0:] = A[row0:, :] @ B[:, col0:] for one tile."""
    acc = _tma_tile(a_desc, b_desc, row0, col0, 0, K, BLOCK_M, BLOCK_N, BLOCK_K, None)
    c_desc.store([row0, col0], acc.to(c_desc.dtype))


@triton.jit
def _wait_fence_token(addr, expected):
    """Spins until the int32 at ``addr`` is >= ``expected``, then fences the async proxy.

    One inline-asm op (no loop in Triton's IR, so loop flattening still
    applies); its result (always 0) is added to TMA coordinates so that the
    loads cannot be scheduled above it.
    """
    return tl.inline_asm_elementwise(
        """{
        .reg .pred %p_wait;
        .reg .b32 %seen;
        WAIT_${:uid}:
        ld.acquire.gpu.global.b32 %seen, [$1];
        setp.lt.s32 %p_wait, %seen, $2;
        @%p_wait bra WAIT_${:uid};
        fence.proxy.async.global;
        mov.b32 $0, 0;
        }""", "=r,l,r", [addr.to(tl.int64, bitcast=True), expected], dtype=tl.int32,
        is_pure=False, pack=1)


@triton.jit
def gemm_static_kernel(ctx, a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr,
                       K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                       NUM_PROGRAMS: tl.constexpr, FLATTEN: tl.constexpr, WAIT: tl.constexpr,
                       WORKSPACE: tl.constexpr):
    """Persistent TMA GEMM, tiles round-robin over programs; WAIT adds a flag
    wait + proxy fence per tile (flags at WORKSPACE are >= 0: never blocks)."""
    pid = tl.program_id(0)
    m_tiles = M // BLOCK_M
    n_tiles = N // BLOCK_N
    flags = dl.heap_ptr(ctx, WORKSPACE, tl.int32)
    a_desc, b_desc, c_desc = matmul_descriptors(a_ptr, b_ptr, c_ptr, M, N, K, BLOCK_M,
                                                BLOCK_N, BLOCK_K)
    for tile in tl.range(pid, m_tiles * n_tiles, NUM_PROGRAMS, flatten=FLATTEN):
        tm, tn = grouped_tile(tile, m_tiles, n_tiles, GROUP_M)
        row0 = tm * BLOCK_M
        if WAIT:
            row0 += _wait_fence_token(flags + tm, 0)
        _store_tile(a_desc, b_desc, c_desc, row0, tn * BLOCK_N, K, BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def gemm_dynamic_kernel(ctx, a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr,
                        K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                        NUM_PROGRAMS: tl.constexpr, WAIT: tl.constexpr,
                        WORKSPACE: tl.constexpr):
    """The ag_matmul TMA kernel's loop without the gather: tiles from a heap
    counter (WORKSPACE + 64), WAIT adds its dl.wait + proxy fence per tile."""
    m_tiles = M // BLOCK_M
    n_tiles = N // BLOCK_N
    total = m_tiles * n_tiles
    flags = dl.heap_ptr(ctx, WORKSPACE, tl.int32)
    schedule = dl.heap_ptr(ctx, WORKSPACE + 256, tl.int32)
    a_desc, b_desc, c_desc = matmul_descriptors(a_ptr, b_ptr, c_ptr, M, N, K, BLOCK_M,
                                                BLOCK_N, BLOCK_K)
    tile = tl.atomic_add(schedule, 1, sem="relaxed", scope="gpu")
    while tile < total:
        tm, tn = grouped_tile(tile, m_tiles, n_tiles, GROUP_M)
        if WAIT:
            dl.wait(ctx, flags + tm, 0, "ge", 0, "gpu")
            dl.fence_async_proxy()
        _store_tile(a_desc, b_desc, c_desc, tm * BLOCK_M, tn * BLOCK_N, K, BLOCK_M, BLOCK_N,
                    BLOCK_K)
        tile = tl.atomic_add(schedule, 1, sem="relaxed", scope="gpu")
    finished = tl.atomic_add(schedule + 1, 1, sem="acq_rel", scope="gpu")
    if finished == NUM_PROGRAMS - 1:
        tl.atomic_xchg(schedule, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(schedule + 1, 0, sem="relaxed", scope="gpu")


@triton.jit
def gemm_edge_kernel(ctx, a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr,
                     K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                     NUM_PROGRAMS: tl.constexpr, EDGE_N: tl.constexpr, LEVEL: tl.constexpr):
    """Static persistent TMA GEMM whose columns past the last whole BLOCK_N tile
    are cut into BLOCK_M x EDGE_N "edge" tiles, dealt to level the last wave:
    programs left one whole tile short take LEVEL edge tiles each first, the
    rest go round-robin."""
    pid = tl.program_id(0)
    m_tiles = M // BLOCK_M
    n_main = N // BLOCK_N
    a_desc, b_desc, c_desc = matmul_descriptors(a_ptr, b_ptr, c_ptr, M, N, K, BLOCK_M,
                                                BLOCK_N, BLOCK_K)
    main_tiles = m_tiles * n_main
    for tile in tl.range(pid, main_tiles, NUM_PROGRAMS):
        tm, tn = grouped_tile(tile, m_tiles, n_main, GROUP_M)
        _store_tile(a_desc, b_desc, c_desc, tm * BLOCK_M, tn * BLOCK_N, K, BLOCK_M, BLOCK_N,
                    BLOCK_K)
    b_edge = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[N, 1],
                                       block_shape=[BLOCK_K, EDGE_N])
    c_edge = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[N, 1],
                                       block_shape=[BLOCK_M, EDGE_N])
    edge_n = tl.cdiv(N - n_main * BLOCK_N, EDGE_N)
    edge_tiles = m_tiles * edge_n
    extra = main_tiles % NUM_PROGRAMS
    leveled = 0
    if extra > 0:
        leveled = (NUM_PROGRAMS - extra) * LEVEL
    lo = edge_tiles
    if extra > 0 and pid >= extra:
        lo = (pid - extra) * LEVEL
    for j in range(lo, tl.minimum(lo + LEVEL, edge_tiles)):
        _store_tile(a_desc, b_edge, c_edge, (j // edge_n) * BLOCK_M,
                    n_main * BLOCK_N + (j % edge_n) * EDGE_N, K, BLOCK_M, EDGE_N, BLOCK_K)
    for j in range(leveled + pid, edge_tiles, NUM_PROGRAMS):
        _store_tile(a_desc, b_edge, c_edge, (j // edge_n) * BLOCK_M,
                    n_main * BLOCK_N + (j % edge_n) * EDGE_N, K, BLOCK_M, EDGE_N, BLOCK_K)
