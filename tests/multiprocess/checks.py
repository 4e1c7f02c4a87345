"""The names tests/multiprocess/ops_check.py and cases_check.py report (``CHECK name relerr``), in
its order; the tests that start it assert these sets. No side effects: safe to
import from a test process."""

# Every op on a mesh spanning processes (--ops).
OPS = ("ag_matmul", "all_gather", "all_reduce", "reduce_scatter", "matmul_rs", "matmul_ar",
       "triton_call", "shmem_all_gather", "flash_decode", "flash_decode_nan", "ag_attention",
       "ag_attention_d128",
       "moe", "moe_unzeroed", "moe_routing_fused", "moe_fp8", "moe_tp", "moe_tp_overlapped")
# vmap of every built-in op (--ops --transforms).
TRANSFORMS = tuple(f"vmap_{op}" for op in OPS[:6])
# remat + grad of the two matmuls (--ops --grads): their backward runs on jaxtdist's
# kernels only (no XLA collective).
GRADS = ("remat_grad_ag_matmul", "remat_grad_matmul_rs")

# tests/multiprocess/cases_check.py: the MoE and attention ops' cases.
CASES = ("moe_random_top2", "moe_top1_one_expert_per_rank", "moe_top8_of_many",
         "moe_all_to_rank0", "moe_an_empty_expert", "moe_all_to_one_expert", "moe_chained_50",
         "moe_grads", "fd_gqa1", "fd_gqa4", "fd_gqa8", "fd_d128", "fd_chained_50",
         "ag_causal_gqa1", "ag_causal_gqa4", "ag_causal_gqa8", "ag_noncausal_gqa4",
         "ag_causal_d128", "ag_noncausal_d128")
# With --xla-grads: ag_attention's gradients (XLA's collectives gather k and v).
XLA_GRAD_CASES = ("ag_grads_causal", "ag_grads_noncausal")
# With --ll: the low-latency MoE layout (moe_dispatch_ll -> experts -> moe_combine_ll,
# the experts a masked grouped GEMM in moe_ll_fp8 and moe_ll_layer).
LL_CASES = ("moe_ll_random", "moe_ll_skewed_invalid", "moe_ll_fp8", "moe_ll_layer",
            "moe_ll_chained_20")
# With --overlap-grads: ag_attention's gradients through its overlapped backward
# (config BACKWARD="overlap": jaxtdist's kernels only, so processes sharing a GPU run it).
OVERLAP_GRAD_CASES = ("ag_grads_overlap_causal", "ag_grads_overlap_noncausal")

# Cases in bfloat16 (moe_ll_fp8: e4m3 tokens, then bfloat16) are held to this bound on
# every platform; the others to float32's (the caller's: 1e-5 on CPU, TF32's on GPUs).
BF16_TOL = 2e-2
BF16_CASES = ("moe_ll_skewed_invalid", "moe_ll_fp8", "moe_ll_layer")


def tolerance(name: str, f32_tol: float) -> float:
    """The bound of case ``name`` where float32 cases get ``f32_tol``."""
    return BF16_TOL if name in BF16_CASES else f32_tol
