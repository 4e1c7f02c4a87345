"""Waits of the kernels that copy engines feed through a heap inbox (ag_matmul's
copy-engine kernel, ag_attention's INBOX, moe_tp's gathering grouped GEMM).

The copy engines' side streams (``csrc/ce_gather.cc``) raise this rank's
"sent" word of each peer step to the epoch once its pushes of that step have
ended; ``_gather.push_shards_kernel`` raises them in the CPU backend.
"""

import triton
import triton.language as tl

import jaxtdist.language as dl


@triton.jit
def wait_pushes_sent(ctx, SENT_OFF: tl.constexpr, me, world, e):
    """Waits until this rank's copy-engine pushes of epoch ``e`` to every peer have
    ended (the "sent" words at SENT_OFF): the pushes' source (the kernel's operand
    x) is no longer read, so it may die with the kernel."""
    sent = dl.heap_ptr(ctx, SENT_OFF, tl.int32)
    for step in range(1, world):
        dl.wait(ctx, sent + step, e, "ge", me, "gpu")
