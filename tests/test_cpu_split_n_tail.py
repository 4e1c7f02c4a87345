"""The copy-engine kernel's split-N tail and flattened loops, under the interpreter (CPU).

The last, partial wave of tiles can be cut along N instead of K: each tail
tile becomes TAIL_SPLIT_N narrower pieces, one per program, with no partial
sums. The CPU backend runs three programs, so a tile count of 1 mod 3 leaves
one tail tile, cut in two.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from jaxtdist.ops._ag_matmul_config import flattens, split_n_tail, tail_stages
from tests.conftest import (ag_matmul_fn, check_ag_matmul_call, check_config_errors, cpu_only,
                            setup)

pytestmark = cpu_only()

BF16, F32 = jnp.bfloat16, jnp.float32


@pytest.mark.parametrize("tiles,programs,peer_tiles,block_n,mode,expected", [
    (704, 132, 528, 256, "auto", (44, 2)),     # 2048 x 2752 on 132 SMs: a third of a wave
    (704, 132, 528, 256, 1, (0, 1)),           # asked for whole tiles
    (704, 132, 528, 256, 4, (0, 1)),           # 176 pieces do not fit in one wave
    (680, 132, 510, 256, 4, (20, 4)),          # 80 pieces do
    (1792, 132, 1344, 256, "auto", (0, 1)),    # 76 tiles left: 152 halves > 132
    (512, 132, 384, 256, "auto", (0, 1)),      # 116 tiles left
    (660, 132, 495, 256, "auto", (0, 1)),      # whole waves: nothing to cut
    (128, 132, 96, 128, "auto", (0, 1)),       # the tail reaches into the local tiles
    (4, 3, 2, 32, "auto", (1, 2)),             # the interpreter's three programs
    (4, 3, 2, 16, "auto", (0, 1)),             # pieces would be 8 columns wide
])
def test_split_n_tail_arithmetic(tiles, programs, peer_tiles, block_n, mode, expected):
    assert split_n_tail(tiles, programs, peer_tiles, block_n, mode) == expected
    tail, pieces = expected
    assert tail * pieces <= programs and (tail == 0 or block_n // pieces >= 16)


@pytest.mark.parametrize("blocks,num_stages,pieces,mode,expected", [
    ((128, 256, 64), 3, 2, "auto", 6),   # 2048/2752 on H200: 6 x 32 KB in 3 x 48 + 64 KB
    ((128, 256, 64), 3, 4, "auto", 8),   # 64-wide pieces: 24 KB a stage
    ((128, 256, 64), 4, 2, "auto", 8),
    ((256, 32, 64), 3, 2, "auto", 3),    # pieces hardly narrower: never below num_stages
    ((16, 32, 16), 1, 2, "auto", 2),
    ((128, 256, 64), 3, 2, 4, 4),        # asked for
    ((128, 256, 64), 3, 2, 1, 1),
])
def test_tail_stages_rule(blocks, num_stages, pieces, mode, expected):
    block_m, block_n, block_k = blocks
    cfg = dict(TAIL_STAGES=mode, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    assert tail_stages(cfg, num_stages, pieces) == expected
    if mode == "auto":  # the pieces' stages fit where the whole tiles' pipeline and epilogue do
        assert (expected * (block_m + block_n // pieces) * block_k
                <= max(num_stages * (block_m + block_n) * block_k + block_m * block_n,
                       num_stages * (block_m + block_n // pieces) * block_k))


_CE_BASE = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, TMA=True, PRODUCER="ce")

# (world, dtype, (m_shard, k, n_shard), config): one tail tile in two 16-wide
# pieces; the second piece whole, clipped by N, or wholly past N (skipped).
SPLIT_CASES = [
    (2, F32, (32, 64, 32), dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16)),   # 4 tiles
    (4, BF16, (16, 96, 24), dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32)),  # second piece clipped
    (4, F32, (16, 48, 12), dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16)),   # second piece past N
    (8, F32, (16, 32, 64), dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, CHUNK_ROWS=8)),  # 16 tiles
    (4, F32, (16, 40, 32), dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16)),   # K=40: a clipped block
]


@pytest.mark.parametrize("world,dtype,shape,config", SPLIT_CASES, ids=lambda c: str(c))
def test_split_n_tail_is_exact(world, dtype, shape, config, ce_launches):
    mesh = setup(world)
    m, k, n = shape
    f = ag_matmul_fn(mesh, dict(config, TMA=True, PRODUCER="ce"))  # TAIL_SPLIT_N: "auto"
    for _ in range(3):  # flags and inboxes carry over between calls
        check_ag_matmul_call(mesh, f, world, m, k, n, dtype)
    tails = [(c["TAIL_TILES"], c["TAIL_SPLIT_N"], c["TAIL_UNITS"]) for c in ce_launches]
    assert tails == [(1, 2, 0)], tails  # one tail tile, two pieces
    assert ce_launches[0]["TAIL_STAGES"] >= 1


@pytest.mark.parametrize("stages", [1, 5])
def test_split_n_tail_stages_asked_for(stages, ce_launches):
    """An explicit TAIL_STAGES reaches the kernel, and the pieces stay exact."""
    world, m, k, n = 2, 32, 64, 32
    mesh = setup(world)
    check_ag_matmul_call(mesh, ag_matmul_fn(mesh, dict(_CE_BASE, TAIL_STAGES=stages)), world, m, k, n, F32)
    assert [(c["TAIL_SPLIT_N"], c["TAIL_STAGES"]) for c in ce_launches] == [(2, stages)]


def test_tail_modes_interleaved(ce_launches):
    """Whole, split-N and stream-K tails of one shape, interleaved: same results."""
    world, m, k, n = 2, 32, 64, 32
    mesh = setup(world)
    fns = [ag_matmul_fn(mesh, dict(_CE_BASE, TAIL_SPLIT_N=2)),
           ag_matmul_fn(mesh, dict(_CE_BASE, TAIL_SPLIT_N=1, STREAM_K=False)),
           ag_matmul_fn(mesh, dict(_CE_BASE, STREAM_K=True))]
    for f in fns + fns:
        check_ag_matmul_call(mesh, f, world, m, k, n, F32)
    assert [(c["TAIL_TILES"], c["TAIL_SPLIT_N"]) for c in ce_launches] == [(1, 2), (0, 1), (1, 1)]
    assert ce_launches[2]["TAIL_UNITS"] > 0  # stream-K runs


def test_split_n_tail_config_errors():
    base = _CE_BASE
    check_config_errors([
            (dict(base, TAIL_SPLIT_N=3), "TAIL_SPLIT_N=3; allowed: 'auto' or a power of 2"),
            (dict(base, TAIL_SPLIT_N=0), "TAIL_SPLIT_N=0; allowed"),
            (dict(base, TAIL_SPLIT_N=True), "TAIL_SPLIT_N=True; allowed"),
            (dict(base, TAIL_SPLIT_N="n"), "TAIL_SPLIT_N='n'; allowed"),
            (dict(base, TAIL_SPLIT_N=4), "narrower than 16 columns"),
            (dict(base, TAIL_SPLIT_N=2, STREAM_K=True), "both cut the last wave"),
            (dict(base, PRODUCER="sm", TAIL_SPLIT_N=2), "TAIL_SPLIT_N=2 needs PRODUCER='ce'"),
            (dict(base, TAIL_STAGES=0), "TAIL_STAGES=0; allowed: 'auto' or an int >= 1"),
            (dict(base, TAIL_STAGES=True), "TAIL_STAGES=True; allowed"),
            (dict(base, TAIL_STAGES="deep"), "TAIL_STAGES='deep'; allowed"),
            (dict(base, PRODUCER="sm", TAIL_STAGES=4), "TAIL_STAGES=4 needs PRODUCER='ce'")])


@pytest.mark.parametrize("tiles,programs,chunk_rows,mode,expected", [
    (704, 132, 128, "auto", True),     # 2048/2752: 5.3 tiles per SM
    (512, 132, 256, "auto", True),     # 1024/4096: 3.9
    (128, 128, 128, "auto", False),    # decode 128/4096/8192: one tile per SM
    (704, 132, 64, "auto", False),     # chunks finer than tiles: the wait needs a loop
    (128, 128, 128, True, True),
    (704, 132, 128, False, False),
])
def test_flatten_auto_rule(tiles, programs, chunk_rows, mode, expected):
    cfg = dict(FLATTEN=mode, CHUNK_ROWS=chunk_rows, BLOCK_M=128)
    assert flattens(cfg, tiles, programs) is expected


@pytest.mark.parametrize("world,dtype,shape,config,flattened", [
    # 16 tiles on 3 programs: "auto" flattens.
    (4, F32, (32, 64, 32), dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16), True),
    (4, BF16, (32, 48, 24), dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, CHUNK_ROWS=32), True),
    (4, F32, (32, 48, 24), dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, CHUNK_ROWS=8), False),
    (2, F32, (32, 64, 32), dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16), False),  # 4 tiles
    (2, F32, (32, 64, 32), dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, FLATTEN=True), True),
    (4, F32, (32, 64, 32), dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, FLATTEN=False), False),
])
def test_flatten_choice_and_results(world, dtype, shape, config, flattened, ce_launches):
    """FLATTEN="auto" flattens where chunks are no finer than tiles and programs
    have two tiles or more; flattened or not, the results are exact (under the
    interpreter ``wait_for_tma`` is ``wait``)."""
    mesh = setup(world)
    m, k, n = shape
    f = ag_matmul_fn(mesh, dict(config, TMA=True, PRODUCER="ce"))
    for _ in range(2):
        check_ag_matmul_call(mesh, f, world, m, k, n, dtype)
    assert [c["FLATTEN"] for c in ce_launches] == [flattened]


def test_flatten_config_errors():
    base = _CE_BASE
    check_config_errors([
            (dict(base, FLATTEN="yes"), "FLATTEN='yes'; allowed: True, False or 'auto'"),
            (dict(base, FLATTEN=True, CHUNK_ROWS=8), "FLATTEN=True needs CHUNK_ROWS >= BLOCK_M"),
            (dict(base, PRODUCER="sm", FLATTEN=True), "FLATTEN=True needs PRODUCER='ce'")])
