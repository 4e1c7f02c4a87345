"""FP8 grouped GEMMs (issue 83, item 2) on GPUs: grouped_matmul and
grouped_matmul_masked with FP8 x and K-major w [G, F, H] on their default
configs (decode and prefill rows, per-tensor and blockwise scales, both
formats, split K where the default takes it, the pointer mainloop for F not a
multiple of 16), and moe_tp_mlp with FP8 experts at world 1; each against the
float64 product of the dequantized operands (``tests/test_cpu_fp8_grouped.py``'s
helpers). The bound is 1e-2 (bfloat16 rounding of the output: about 2e-3).
Skipped without GPUs; run with ``JAXTDIST_TEST_GPU=1``.
"""

from __future__ import annotations

import jax
import pytest

from tests.test_cpu_fp8_grouped import (E4M3, E5M2, _grouped, test_grouped_matmul_masked_fp8,
                                        test_moe_tp_mlp_fp8)

pytestmark = pytest.mark.skipif(
    jax.devices()[0].platform != "gpu", reason="needs CUDA GPUs (none visible)")

BOUND = 1e-2


@pytest.mark.parametrize("r,h,f,sizes,dtype,scaling", [
    (16, 2048, 1536, [2, 0, 5, 1, 3, 0, 4, 1], E4M3, "block"),      # decode rows
    (16, 2048, 1536, [2, 0, 5, 1, 3, 0, 4, 1], E4M3, "tensor"),
    (1024, 2048, 1536, [200, 0, 130, 77, 300, 17, 250, 50], E4M3, "block"),  # prefill
    (1024, 2048, 1536, [200, 0, 130, 77, 300, 17, 250, 50], E5M2, "group"),
    (1000, 1024, 1000, [400, 0, 500, 150], E4M3, "block"),  # clipped; F % 16: pointer loads
    (333, 1024, 1040, [100, 100, 133], E4M3, "block"),      # TMA, F past the last 128 block
])
def test_grouped_matmul_fp8_on_gpu(r, h, f, sizes, dtype, scaling):
    assert _grouped(r, h, f, sizes, dtype, scaling) < BOUND


@pytest.mark.parametrize("config", [dict(SPLIT_K=4), dict(BLOCK_M=64, BLOCK_N=128,
                                                          BLOCK_K=128, num_stages=4)])
def test_grouped_matmul_fp8_configs_on_gpu(config):
    assert _grouped(64, 4096, 2048, [10, 20, 0, 34], E4M3, "block", config=config) < BOUND


@pytest.mark.parametrize("world,gated,dtype,scaling", [(1, True, E4M3, "block"),
                                                       (1, False, E5M2, "tensor")])
def test_moe_tp_mlp_fp8_on_gpu(world, gated, dtype, scaling):
    test_moe_tp_mlp_fp8(world, gated, dtype, scaling)


@pytest.mark.parametrize("scaling,f", [("block", 48), ("tensor", 40)])
def test_grouped_matmul_masked_fp8_on_gpu(scaling, f):
    test_grouped_matmul_masked_fp8(scaling, f)
