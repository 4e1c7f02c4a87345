"""The names tests/multiprocess/ops_check.py reports (``CHECK name relerr``), in
its order; the tests that start it assert these sets. No side effects: safe to
import from a test process."""

# Every op on a mesh spanning processes (--ops).
OPS = ("ag_matmul", "all_gather", "all_reduce", "reduce_scatter", "matmul_rs", "matmul_ar",
       "triton_call", "shmem_all_gather", "flash_decode", "flash_decode_nan", "ag_attention",
       "ag_attention_d128",
       "moe", "moe_unzeroed", "moe_routing_kernels", "moe_routing_fused", "moe_fp8", "moe_tp", "moe_tp_overlapped")
# vmap of every built-in op (--ops --transforms).
TRANSFORMS = tuple(f"vmap_{op}" for op in OPS[:6])
# remat + grad of the two matmuls (--ops --grads): their backward runs on jaxtdist's
# kernels only (no XLA collective). With processes sharing one GPU the gradients
# are still wrong and a wait times out (seen on H100, no MPS): a known defect, see
# tests/gpu/test_gpu_multiprocess.py's xfail.
GRADS = ("remat_grad_ag_matmul", "remat_grad_matmul_rs")
