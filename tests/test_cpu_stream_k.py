"""The copy-engine kernel's stream-K tail, under the interpreter (CPU).

The CPU backend runs the persistent kernels with three programs, so most tile
counts leave a partial last wave; with STREAM_K its K blocks are cut into
equal runs, one per program, and programs that share a tile sum their
partials in the heap.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jaxtdist as td
from jaxtdist.ops._ag_matmul_config import stream_k_tail
from tests.conftest import (ag_matmul_fn, assert_close, check_ag_matmul_call, check_config_errors,
                            cpu_only, f64, place, rand, setup)

pytestmark = cpu_only()

BF16, F32 = jnp.bfloat16, jnp.float32


@pytest.mark.parametrize("tiles,programs,k_blocks", [
    (704, 132, 64), (1792, 132, 128), (896, 132, 64), (512, 132, 64), (8, 3, 3), (4, 3, 6),
    (16, 3, 4), (10, 4, 7), (133, 132, 64), (260, 132, 5)])
def test_stream_k_runs_cover_every_k_block_once(tiles, programs, k_blocks):
    """The kernel's arithmetic, replayed: every K block of every tail tile is computed
    by exactly one program, a tile's programs are consecutive (their slots too), and
    the kernel's count of a tile's parts is the true one."""
    tail, run = stream_k_tail(tiles, programs, k_blocks, peer_tiles=tiles, mode=True)
    if tail == 0:
        assert tiles % programs == 0 or -(-k_blocks // 4) >= k_blocks or \
            -(-(tiles % programs) * k_blocks // programs) >= k_blocks
        return
    assert tail == tiles % programs and run >= -(-k_blocks // 4) and run < k_blocks
    covered = {t: [] for t in range(tail)}
    slots = set()
    for pid in range(programs):
        unit, unit_end = pid * run, min(pid * run + run, tail * k_blocks)
        while unit < unit_end:
            t = unit // k_blocks
            run_end = min(unit_end, (t + 1) * k_blocks)
            covered[t].append((pid, unit - t * k_blocks, run_end - t * k_blocks))
            assert pid + t not in slots
            slots.add(pid + t)
            unit = run_end
    assert max(slots) < programs + tail - 1 + 1
    for t, parts in covered.items():
        blocks = sorted(b for _, lo, hi in parts for b in range(lo, hi))
        assert blocks == list(range(k_blocks)), (t, parts)
        first = t * k_blocks // run
        assert [p for p, _, _ in parts] == list(range(first, first + len(parts)))
        assert len(parts) == ((t + 1) * k_blocks - 1) // run - first + 1
        assert len(parts) <= 5


def test_stream_k_auto_cuts_only_short_runs():
    # 2048 x 2752 (K=4096) in 128 x 256 tiles on 132 SMs: a third of a wave left.
    assert stream_k_tail(704, 132, 64, 528, mode="auto") == (44, 22)
    # 2048 x 7168 (K=8192): runs of 74/128 blocks, measured slower than whole tiles.
    assert stream_k_tail(1792, 132, 128, 1344, mode="auto") == (0, 0)
    assert stream_k_tail(1792, 132, 128, 1344, mode=True) == (76, 74)
    # 1024 x 4096: 116 of 132 tiles in the last wave, runs of 57/64 blocks.
    assert stream_k_tail(512, 132, 64, 384, mode="auto") == (0, 0)
    assert stream_k_tail(512, 132, 64, 384, mode=True) == (116, 57)
    assert stream_k_tail(512, 132, 64, 384, mode=False) == (0, 0)
    # A tail that reaches into the local tiles (dealt first) is not cut.
    assert stream_k_tail(128, 132, 128, 96, mode=True) == (0, 0)


# (world, dtype, (m_shard, k, n_shard), config): tails of 1 and 2 tiles, 2 and 3
# programs per tile, a tile's K not a multiple of the runs, N clipped by the tile.
STREAM_K_CASES = [
    (2, F32, (32, 128, 32), dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16)),     # 8 tiles, runs of 6
    (4, BF16, (16, 96, 16), dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16)),     # 4 tiles, 3 parts
    (4, F32, (16, 96, 20), dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, CHUNK_ROWS=8)),
    (8, F32, (16, 64, 24), dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16)),
    (2, BF16, (32, 72, 16), dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32)),     # K=72: 3 blocks
]


@pytest.mark.parametrize("world,dtype,shape,config", STREAM_K_CASES, ids=lambda c: str(c))
def test_stream_k_tail_is_exact(world, dtype, shape, config):
    mesh = setup(world)
    m, k, n = shape
    f = ag_matmul_fn(mesh, dict(config, TMA=True, PRODUCER="ce", STREAM_K=True))
    for _ in range(3):  # the arrival counters carry over between calls
        x = rand((world * m, k), dtype)
        w = rand((k, world * n), dtype)
        out = f(place(mesh, x, P("tp", None)), place(mesh, w, P(None, "tp")))
        assert_close(out, f64(x) @ f64(w), dtype)
    kinds = {key[0] for key in td.runtime.runtime()._workspaces}
    assert "ag_matmul/stream_k" in kinds, kinds  # the tail was cut


def test_stream_k_on_and_off_interleaved():
    """Cut and uncut calls of one shape, interleaved: separate counters, same result."""
    world, m, k, n = 4, 16, 96, 16
    mesh = setup(world)
    base = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, TMA=True, PRODUCER="ce")
    cut = ag_matmul_fn(mesh, dict(base, STREAM_K=True))
    uncut = ag_matmul_fn(mesh, dict(base, STREAM_K=False, TAIL_SPLIT_N=1))
    for f in (cut, uncut, cut, uncut, cut):
        check_ag_matmul_call(mesh, f, world, m, k, n, F32)


def test_stream_k_config_errors():
    base = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, TMA=True)
    check_config_errors([
        (dict(base, PRODUCER="ce", STREAM_K="yes"), "STREAM_K='yes'; allowed: True, False"),
        (dict(base, PRODUCER="sm", STREAM_K=True), "STREAM_K=True needs PRODUCER='ce'"),
        (dict(PRODUCER="push", STREAM_K=True), "STREAM_K=True needs PRODUCER='ce'"),
        (dict(base, PRODUCER="ce", PUSH_ORDER="ring"),
         "PUSH_ORDER='ring'; allowed: 'parallel', 'serial'"),
        (dict(base, PRODUCER="sm", PUSH_ORDER="serial"),
         "PUSH_ORDER='serial' needs PRODUCER='ce'")], w_shape=(64, 32))


def test_stream_k_workspace_that_does_not_fit():
    """'auto' leaves the tail whole when its partials do not fit the heap and still
    computes correctly; an explicit STREAM_K=True raises HeapExhaustedError instead."""
    world, m, k, n = 2, 32, 192, 64  # 4 tiles on 3 programs: a 1-tile tail, runs of 4/12
    base = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=16, TMA=True, PRODUCER="ce", TAIL_SPLIT_N=1)
    x = rand((world * m, k), F32)
    w = rand((k, world * n), F32)
    mesh = setup(world)
    rt = td.runtime.runtime()
    reserved = rt.bytes_in_use
    assert_close(ag_matmul_fn(mesh, base)(place(mesh, x, P("tp", None)), place(mesh, w, P(None, "tp"))),
                 f64(x) @ f64(w), F32)
    sizes = {ws.key[0]: ws.nbytes for ws in rt._workspaces.values()}
    assert "ag_matmul/stream_k" in sizes, sizes  # "auto" cuts this tail
    # Room for the inboxes but not for the partials.
    mesh = setup(world, heap_bytes=reserved + sizes["ag_matmul/inbox"] + 1024)
    rt = td.runtime.runtime()
    xs, ws = place(mesh, x, P("tp", None)), place(mesh, w, P(None, "tp"))
    assert_close(ag_matmul_fn(mesh, base)(xs, ws), f64(x) @ f64(w), F32)
    assert "ag_matmul/stream_k" not in {key[0] for key in rt._workspaces}
    with pytest.raises(td.HeapExhaustedError, match="ag_matmul/stream_k needs a workspace"):
        ag_matmul_fn(mesh, dict(base, STREAM_K=True))(xs, ws)
