"""FP8 GEMMs (issue 83) on GPUs: ag_matmul, matmul_rs and matmul_ar with FP8
operands (``jaxtdist.quantize`` / ``quantize_weight``, ``x_scale=``, ``w_scale=``).

What runs, each against the float64 product of the dequantized operands
(``tests/test_cpu_fp8.py``'s helpers, with the GPU heap):

- world 1, the kernels forced (``fp8_matmul_kernels``): every op x per-tensor
  and blockwise (1 x 128 / 128 x 128) scales at M = 7 (decode), 256 and 2048 of
  a 4096 x 4096 weight, on each op's default kernel; then the kernels the
  defaults do not take there (pointer loads, SM producers, the TMA mainloop of
  matmul_ar, split K), float32 output and float8_e5m2;
- world 1, not forced: XLA's FP8 dot (per tensor) and the dequantized dot
  (blockwise), one shape per op;
- 2 and 4 GPUs where that many are visible (skipped otherwise).

The bound is 1e-2: the bfloat16 rounding of the output is about 2e-3 (the
interpreter measured 1.6e-3 to 1.7e-3 on every case). Skipped without GPUs; run
with ``JAXTDIST_TEST_GPU=1`` (tests/gpu/run.sh does).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

import tests.test_cpu_fp8 as cpu_fp8
from jaxtdist.runtime import DEFAULT_HEAP_BYTES
from tests.conftest import setup
from tests.test_cpu_fp8 import E4M3, E5M2, _run

pytestmark = pytest.mark.skipif(
    jax.devices()[0].platform != "gpu", reason="needs CUDA GPUs (none visible)")

BOUND = 1e-2
N, K = 4096, 4096  # a 4096 x 4096 weight (a 7-8B model's projection)
OPS = ["ag_matmul", "matmul_rs", "matmul_ar"]
# A hung kernel fails its test within a minute instead of holding the shard
# (every op here finishes in milliseconds; the default wait is 300 s).
WAIT_TIMEOUT_S = 60.0

_make_shards = cpu_fp8._shards


@functools.lru_cache(maxsize=None)
def _cached_shards(layout: str, world: int, m: int, n: int, k: int, dtype, block: bool,
                   seed: int):
    return _make_shards(layout, world, m, n, k, dtype, block, seed)


def _shards(op: str, world: int, m: int, n: int, k: int, dtype, block: bool, seed: int):
    """``test_cpu_fp8._shards``, memoized: the quantization and the float64
    reference (about a second at M = 2048) are made once per problem. At world 1
    every op takes the same operands and reference (one rank: nothing gathered
    or summed), so the ops share them."""
    return _cached_shards(op if world > 1 else "matmul_rs", world, m, n, k, dtype, block, seed)


@pytest.fixture(autouse=True)
def _gpu_runtime(monkeypatch):
    """``_run`` sets up its mesh with the GPU heap and a short wait, and takes the
    shared operands. The heap: 1 GiB (``gpu_mesh``'s), where the CPU suite's 32
    MiB is too tight: every shape keeps its workspaces, and at M = 2048 x alone
    is 8 MB a parity, the multi-GPU cases' float32 partials several MB each."""
    monkeypatch.setattr(cpu_fp8, "setup", functools.partial(
        setup, heap_bytes=DEFAULT_HEAP_BYTES["gpu"], wait_timeout_s=WAIT_TIMEOUT_S))
    monkeypatch.setattr(cpu_fp8, "_shards", _shards)


@pytest.fixture(scope="module", autouse=True)
def _drop_shared_operands():
    """The memoized operands and references (a few hundred MB of host and device
    memory) go with this file: later files of the shard run in the same process."""
    yield
    _cached_shards.cache_clear()


# -- world 1, the kernels forced ---------------------------------------------------------

@pytest.mark.parametrize("m", [7, 256, 2048], ids=lambda m: f"m{m}")
@pytest.mark.parametrize("block", [False, True], ids=["tensor", "block"])
@pytest.mark.parametrize("op", OPS)
def test_fp8_kernels_at_world_1(op, block, m):
    """Each op's default kernel for the shape (on one H100: ag_matmul pushes and
    splits K at M = 7 and runs the copy-engine TMA kernel above; matmul_rs the
    TMA mainloop; matmul_ar pointer loads, split K at M = 7)."""
    err = _run(op, 1, m, N, K, E4M3, block, forced=True, seed=m)
    assert err < BOUND, (op, m, block, err)


CONFIGS = [  # op, M, format, blockwise, out_dtype, config: what the defaults do not run
    ("ag_matmul", 256, E4M3, False, None, dict(TMA=False)),                # pointer, SM
    ("ag_matmul", 256, E4M3, True, None, dict(TMA=True, PRODUCER="sm")),   # TMA, SM
    ("ag_matmul", 256, E4M3, True, None, dict(TMA=False, SPLIT_K=2)),      # pointer, split K
    ("matmul_rs", 256, E4M3, True, None, dict(TMA=False)),                 # pointer loads
    ("matmul_ar", 7, E4M3, False, jnp.float32, dict(TMA=True)),            # TMA mainloop
    ("matmul_ar", 256, E4M3, True, None, dict(SPLIT_K=2)),                 # split K
    ("matmul_rs", 256, E5M2, True, None, None),                            # e5m2 wgmma
]


@pytest.mark.parametrize(
    "op,m,dtype,block,out_dtype,config", CONFIGS,
    ids=["ag-pointer", "ag-tma-sm", "ag-split-k", "rs-pointer", "ar-tma-f32", "ar-split-k",
         "rs-e5m2"])
def test_fp8_kernel_configs_at_world_1(op, m, dtype, block, out_dtype, config):
    err = _run(op, 1, m, N, K, dtype, block, forced=True, out_dtype=out_dtype, config=config,
               seed=m)
    assert err < BOUND, (op, m, config, err)


# -- world 1, XLA ------------------------------------------------------------------------

@pytest.mark.parametrize("block", [False, True], ids=["tensor", "block"])
@pytest.mark.parametrize("op", OPS)
def test_fp8_world_1_runs_xla(op, block):
    """A group of one rank: XLA's FP8 dot (per tensor: cuBLASLt's FP8 GEMM on
    Hopper) or the float32 dot of the dequantized operands (blockwise)."""
    assert _run(op, 1, 256, N, K, E4M3, block, seed=256) < BOUND


# -- 2 and 4 GPUs ------------------------------------------------------------------------

# ag_matmul: M and N per rank; matmul_rs and matmul_ar: M of the result, K per rank.
RANKS = [  # op, world, M, N, K, format, blockwise, out_dtype
    ("ag_matmul", 2, 256, 2048, 4096, E4M3, True, None),          # copy-engine TMA
    ("ag_matmul", 2, 7, 2048, 4096, E4M3, False, None),           # decode: pushes, split K
    ("matmul_rs", 2, 512, 4096, 2048, E4M3, True, jnp.float32),
    ("matmul_rs", 4, 256, 4096, 1024, E5M2, False, None),
    ("matmul_ar", 2, 7, 4096, 2048, E4M3, True, None),            # one shot
    ("matmul_ar", 2, 256, 4096, 2048, E4M3, False, jnp.float16),  # two shot
    ("matmul_ar", 4, 64, 4096, 1024, E4M3, True, None),
]


@pytest.mark.parametrize(
    "op,world,m,n,k,dtype,block,out_dtype", RANKS,
    ids=["ag-w2-m256", "ag-w2-m7", "rs-w2-f32", "rs-w4-e5m2", "ar-w2-m7", "ar-w2-f16",
         "ar-w4-m64"])
def test_fp8_ops_over_gpus(op, world, m, n, k, dtype, block, out_dtype):
    """Each rank's shards quantized on their own (per-rank scales); skipped where
    fewer than ``world`` GPUs are visible."""
    err = _run(op, world, m, n, k, dtype, block, out_dtype=out_dtype, seed=world * 1000 + m)
    assert err < BOUND, (op, world, m, err)
