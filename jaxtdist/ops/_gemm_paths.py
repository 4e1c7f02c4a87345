"""The path rules of the GEMM ops at world > 1: the fused kernels, or XLA's
collective and cuBLAS's dot, by the bytes the collective moves per rank.

At world 1 every GEMM op runs its local computation (``jnp.dot``), the
mechanism's default; these rules decide above it (``_path.gemm_rule`` states
the model: fused wins where ``T_xla(bytes) > t_sync + (r - 1) * T_dot``).

Numbers (CUPTI kernel time, bfloat16; docs/perf and docs/design.md):

- t_sync, the fused kernels' own cost beside the GEMM: matmul_ar at one row
  (1 x 8192 x 8192) took 15.7 us against 8.2 for the local GEMM on 4 x H200
  (18.0 / 8.7 on 4 x H100), plus jaxtdist's prologue kernel (1.3-1.4 us on
  H200, 1.5-1.8 on H100, ``prologue_us`` in the attention JSONs): about
  8.8 us on H200 (10.8 on H100).
- T_xla, XLA's collective alone on 4 x H200 (design.md), per-rank bytes 16 KiB
  / 256 KiB / 1 MiB / 8 MiB: all_gather 7.1 / 11.2 / 34.4 / 101.7 us,
  psum_scatter 5.6 / 5.8 / 8.9 / 35.4 us.
- So all_gather costs XLA more than t_sync from about 116 KiB per rank
  (linear between 16 and 256 KiB; 232 KiB with H100's t_sync): ag_matmul's
  threshold, 128 KiB of x per rank. psum_scatter does from about 1000 KiB
  (1.5 MiB with H100's): matmul_rs's, 1 MiB of the product per rank.
- Where the decomposed form was measured beside the kernels, the kernels won
  everywhere, and these thresholds keep them there: ag_matmul 0.61-0.78x
  all_gather + dot from 8 MiB of x per rank (1.4e11 FLOPs per rank; 4 x
  H200); matmul_rs 0.78-0.90x dot + psum_scatter from 64 MiB per rank (2.1e11
  FLOPs; 4 x H100 and H200), 0.88-0.95x on 2 x H100; matmul_ar 0.49-0.88x
  dot + psum at every size measured, 1 to 512 rows (16 KiB-8 MiB, 3.4e7-1.7e10
  FLOPs per rank; 4 x H100): in that table XLA's psum cost 20-28 us beside
  its dot at one row, not the 4.3 us it takes alone, so matmul_ar keeps its
  kernels at every size (threshold 0).
- Triton-distributed falls back to cuBLAS + NCCL below about 1e11 FLOPs; that
  boundary does not carry over: jaxtdist's kernels synchronise through flags
  in peer memory in one launch, and matmul_ar wins at 3.4e7 FLOPs.

Not measured: ag_matmul and matmul_rs at world > 1 near their thresholds (the
smallest measured sizes are the ones above), and any world > 1 shape where the
kernels' GEMM core is much slower than cuBLAS (issue 82: 1.09-2.41x on untuned
shapes at world 1). A GPU run of ``bench ag_matmul`` / ``bench matmul_rs``
around the thresholds is what would confirm or move them.
"""

from __future__ import annotations

from jaxtdist.ops._ag_matmul_config import AgMatmulConfig
from jaxtdist.ops._partial_sums import MatmulArConfig, MatmulRsConfig
from jaxtdist.ops._path import PathRule, gemm_rule

__all__ = ["AG_MATMUL_MIN_BYTES", "AG_MATMUL_PATH", "MATMUL_AR_PATH", "MATMUL_RS_MIN_BYTES",
           "MATMUL_RS_PATH"]

# Bytes of x per rank (the all_gather's) from which ag_matmul's kernels run.
AG_MATMUL_MIN_BYTES = 128 << 10
# Bytes of x @ w per rank (the psum_scatter's) from which matmul_rs's kernels run.
MATMUL_RS_MIN_BYTES = 1 << 20

AG_MATMUL_PATH: PathRule = gemm_rule(
    "all_gather", min_bytes=AG_MATMUL_MIN_BYTES, bytes_of=lambda m, n, k: m * k,
    flops_of=lambda m, n, k, world: 2 * world * m * n * k,
    runs="jax.lax.all_gather + jnp.dot", config_type=AgMatmulConfig,
    basis="XLA's all_gather reaches the kernels' ~8.8 us of synchronisation at about "
          "116 KiB per rank on 4 x H200")

MATMUL_RS_PATH: PathRule = gemm_rule(
    "psum_scatter", min_bytes=MATMUL_RS_MIN_BYTES, bytes_of=lambda m, n, k: m * n,
    flops_of=lambda m, n, k, world: 2 * m * n * k,
    runs="jnp.dot + jax.lax.psum_scatter", config_type=MatmulRsConfig,
    basis="XLA's psum_scatter reaches the kernels' ~8.8 us of synchronisation at about "
          "1 MiB per rank on 4 x H200")

MATMUL_AR_PATH: PathRule = gemm_rule(
    "psum", min_bytes=0, bytes_of=lambda m, n, k: m * n,
    flops_of=lambda m, n, k, world: 2 * m * n * k,
    runs="jnp.dot + jax.lax.psum", config_type=MatmulArConfig,
    basis="the kernels beat dot + psum at every size measured, 1-512 rows on 4 x H100")
