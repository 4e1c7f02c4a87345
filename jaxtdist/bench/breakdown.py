"""Where a step's device time goes: CUPTI kernel names sorted into kinds of work.

``harness.profile`` keeps each kernel name's median time per iteration and device
(``stats["kernel_us"]``); :func:`breakdown` sums it into :data:`CATEGORIES` by
:func:`classify_kernel`, a pure function of the name, so that a table shows what
is exposed (attention, GEMMs, communication) in each contender's step.

Example:
  >>> breakdown({"ncclDevKernel_AllGather_RING_LL": 12.0, "nvjet_tst_128x256": 30.0})
  {'attention fwd': 0.0, 'attention bwd': 0.0, 'GEMM': 30.0, 'GEMM + comm (fused)': 0.0, \
'comm': 12.0, 'other': 0.0}
"""

from __future__ import annotations

import re
from collections.abc import Mapping

__all__ = ["CATEGORIES", "breakdown", "breakdown_cell", "classify_kernel"]

CATEGORIES = ("attention fwd", "attention bwd", "GEMM", "GEMM + comm (fused)", "comm", "other")

# Attention kernels: cuDNN's flash attention (cudnn_generated_..._sdpa_..._flash_fprop /
# _bprop), FlashAttention / cutlass fmha, jaxtdist's ag_attention, attention_ws,
# attention_bwd_* and flash_decode. XLA's unfused attention has none: its score
# GEMMs count as GEMM, its softmax fusions as other.
_ATTENTION = re.compile(r"sdpa|fmha|flash|attention|attn|mha_")
_BACKWARD = re.compile(r"bprop|bwd|backward|dgrad|_dq|dkdv|dkv")
# jaxtdist's kernels that multiply while they gather, scatter or reduce.
_FUSED = re.compile(r"ag_matmul|matmul_rs|matmul_ar|ag_grouped_gemm|grouped_gemm_rs")
# NCCL, XLA's own collective kernels and jaxtdist's communication kernels.
_COMM = re.compile(r"nccl|all_?gather|reduce_?scatter|all_?reduce|all_?to_?all|"
                   r"collective|permute|sendrecv|send_recv|moe_dispatch|moe_combine|"
                   r"push_shards|copy_gathered")
# cuBLAS (sm90_xmma_gemm_..., nvjet_...), CUTLASS, XLA's Triton GEMM fusions
# (gemm_fusion_dot...), jaxtdist's GEMM kernels (grouped_gemm_kernel, ...).
_GEMM = re.compile(r"gemm|gemv|cublas|nvjet|xmma|cutlass|matmul|grouped_dw|ragged_dot|dot_general|"
                   r"triton_dot|_dot_")


def classify_kernel(name: str) -> str:
    """The category (of ``CATEGORIES``) of one CUPTI kernel name.

    Attention first (a cuDNN flash kernel's name also says wgmma), then jaxtdist's
    fused GEMM + communication kernels, communication, GEMMs; the rest (XLA's
    elementwise and reduction fusions, copies, softmax) is "other".

    Example:
      >>> classify_kernel("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16")
      'attention bwd'
    """
    lower = name.lower()
    if _ATTENTION.search(lower):
        return "attention bwd" if _BACKWARD.search(lower) else "attention fwd"
    if _FUSED.search(lower):
        return "GEMM + comm (fused)"
    if _COMM.search(lower):
        return "comm"
    if _GEMM.search(lower):
        return "GEMM"
    return "other"


def breakdown(kernel_us: Mapping[str, float]) -> dict[str, float]:
    """Microseconds per category (every one of ``CATEGORIES``, 0.0 where none ran)
    from kernel name -> time (``stats["kernel_us"]``: median per iteration, per device).

    Example:
      >>> breakdown({"attention_bwd_dq_kernel": 5.0, "loop_add_fusion": 1.0})["other"]
      1.0
    """
    out = dict.fromkeys(CATEGORIES, 0.0)
    for name, us in kernel_us.items():
        out[classify_kernel(name)] += float(us)
    return {k: round(v, 3) for k, v in out.items()}


def breakdown_cell(entry: Mapping | None) -> str:
    """A table cell: each non-zero category's share of a contender's kernel time
    ("GEMM 61%, attention fwd 20%, ..."), or n/a without kernel records."""
    if not entry or not entry.get("kernel_us"):
        return "n/a"
    parts = breakdown(entry["kernel_us"])
    total = sum(parts.values())
    if total <= 0:
        return "n/a"
    ranked = sorted(((v, k) for k, v in parts.items() if v > 0), reverse=True)
    return ", ".join(f"{k} {100 * v / total:.0f}%" for v, k in ranked)
