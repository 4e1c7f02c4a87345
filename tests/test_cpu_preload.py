"""The pointer kernel's w preload (PRELOAD_K), under the interpreter (CPU).

With PRELOAD_K > 0 each GEMM program loads the first PRELOAD_K rows of its w
slice before it waits for its chunks, and multiplies them once the rows have
arrived; the loop then starts after them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from jaxtdist.ops.ag_matmul import ag_matmul_with_gathered
from tests.conftest import assert_close, cpu_only, f64, place, rand, setup

pytestmark = cpu_only()

BF16, F32 = jnp.bfloat16, jnp.float32


def _fn(mesh, config):
    return jax.jit(jax.shard_map(
        lambda x, w: ag_matmul_with_gathered(x, w, "tp", config=config)[0], mesh=mesh,
        in_specs=(P("tp", None), P(None, "tp")), out_specs=P(None, "tp")))


# (world, dtype, (m_shard, k, n_shard), config): one tile over all rows (decode)
# with SM pushes or pulls, split K with the preload covering part of a split, all
# of it, or reaching past K in the last split; row tiles of one rank (not ALL_ROWS).
PRELOAD_CASES = [
    (4, BF16, (1, 128, 32), dict(ALL_ROWS=True, BLOCK_M=16, PRODUCER="push", CHUNK_ROWS=1,
                                 SPLIT_K=2, BLOCK_K=16, PRELOAD_K=32)),
    (2, F32, (4, 96, 32), dict(ALL_ROWS=True, BLOCK_M=16, PRODUCER="push", CHUNK_ROWS=4,
                               SPLIT_K=2, BLOCK_K=32, PRELOAD_K=64)),     # K=96: last split 32
    (4, F32, (3, 80, 16), dict(ALL_ROWS=True, BLOCK_M=16, PRODUCER="sm", SPLIT_K=1,
                               BLOCK_K=16, PRELOAD_K=16)),
    (8, BF16, (2, 64, 16), dict(ALL_ROWS=True, BLOCK_M=16, PRODUCER="push", CHUNK_ROWS=2,
                                SPLIT_K=4, BLOCK_K=16, PRELOAD_K=16)),    # the whole split
    (2, F32, (32, 64, 32), dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, PRELOAD_K=32, TMA=False)),
]


@pytest.mark.parametrize("world,dtype,shape,config", PRELOAD_CASES, ids=lambda c: str(c))
def test_preload_is_exact(world, dtype, shape, config):
    mesh = setup(world)
    m, k, n = shape
    f = _fn(mesh, config)
    for _ in range(3):  # inboxes and flags are reused between calls
        x = rand((world * m, k), dtype)
        w = rand((k, world * n), dtype)
        out = f(place(mesh, x, P("tp", None)), place(mesh, w, P(None, "tp")))
        assert_close(out, f64(x) @ f64(w), dtype)


def test_preload_and_plain_calls_interleaved():
    world, m, k, n = 4, 2, 64, 32
    mesh = setup(world)
    base = dict(ALL_ROWS=True, BLOCK_M=16, PRODUCER="push", CHUNK_ROWS=2, SPLIT_K=2,
                BLOCK_K=16)
    pre, plain = _fn(mesh, dict(base, PRELOAD_K=32)), _fn(mesh, base)
    for f in (pre, plain, pre, pre, plain):
        x = rand((world * m, k), F32)
        w = rand((k, world * n), F32)
        out = f(place(mesh, x, P("tp", None)), place(mesh, w, P(None, "tp")))
        assert_close(out, f64(x) @ f64(w), F32)


def test_preload_config_errors():
    mesh = setup(2)
    x = place(mesh, rand((8, 64), F32), P("tp", None))
    w = place(mesh, rand((64, 32), F32), P(None, "tp"))
    base = dict(ALL_ROWS=True, BLOCK_M=16, BLOCK_K=16, SPLIT_K=2)
    for config, match in [
            (dict(base, PRELOAD_K=24), r"PRELOAD_K=24 must be 0 or a power-of-2 multiple of "
                                       r"BLOCK_K=16"),
            (dict(base, PRELOAD_K=8), r"PRELOAD_K=8 must be 0 or a power-of-2 multiple"),
            (dict(base, PRELOAD_K=-16), r"PRELOAD_K=-16 must be 0 or"),
            (dict(base, PRELOAD_K=64), r"PRELOAD_K=64 exceeds the 32 rows of K each of the "
                                       r"SPLIT_K=2 programs"),
            (dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, TMA=True, PRELOAD_K=16),
             r"PRELOAD_K=16 needs TMA=False")]:
        with pytest.raises(ValueError, match=match):
            _fn(mesh, config)(x, w)
