"""jaxtdist.moe_dispatch / jaxtdist.moe_combine: expert-parallel all-to-all for MoE.

Experts are split evenly over the ranks of ``axis_name``: with E experts and W
ranks, rank r owns experts ``[r * E / W, (r + 1) * E / W)``. ``moe_dispatch``
sends every (token, expert) pair to its expert's rank, grouped by local
expert; ``moe_combine`` brings the experts' rows back and sums them with the
routing weights. Routing metadata is computed on the device (counts are data:
one compiled program serves every routing); the kernels (kernels/moe.py) push
rows into peers' heap inboxes. Both are differentiable: dispatch's backward is
a combine (weights 1), combine's is a dispatch of the output's cotangent scaled
by the weights, plus the weights' cotangent (the combine kernel's dot
products). At world 1 both are their local computation (a scatter and a gather
in pure JAX); ``moe_dispatch_kernels`` / ``moe_combine_kernels`` run the
kernels at any world (benchmarks, tests). ``moe_dispatch_sharded`` /
``moe_combine_sharded`` are the pjit-style forms (``pjit_wrapper``): global
arrays sharded on rows, the handle's arrays too. ``moe_dispatch_ll`` /
``moe_combine_ll``: the low-latency (decode) pair, expert-major padded layout
(``_ll``).
"""

from jaxtdist.ops.moe._checks import default_recv_rows
from jaxtdist.ops.moe._combine import moe_combine, moe_combine_kernels
from jaxtdist.ops.moe._config import MoeConfig
from jaxtdist.ops.moe._dispatch import moe_dispatch, moe_dispatch_kernels
from jaxtdist.ops.moe._handle import MoeHandle
from jaxtdist.ops.moe._launch import CombineWorkspace, DispatchWorkspace
from jaxtdist.ops.moe._ll import moe_combine_ll, moe_dispatch_ll
from jaxtdist.ops.moe._ll_config import MoeLLConfig
from jaxtdist.ops.moe._ll_handle import MoeLLHandle
from jaxtdist.ops.moe._ll_launch import ll_heap_bytes
from jaxtdist.ops.moe._sharded import moe_combine_sharded, moe_dispatch_sharded

__all__ = ["CombineWorkspace", "DispatchWorkspace", "MoeConfig", "MoeHandle", "MoeLLConfig",
           "MoeLLHandle", "default_recv_rows", "ll_heap_bytes", "moe_combine",
           "moe_combine_kernels", "moe_combine_ll", "moe_combine_sharded", "moe_dispatch",
           "moe_dispatch_kernels", "moe_dispatch_ll", "moe_dispatch_sharded"]
