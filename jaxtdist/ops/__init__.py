"""jaxtdist.ops: JAX-side ops (shapes, dtypes, autodiff, dispatch)."""

from jaxtdist.ops.ag_attention import ag_attention, ag_attention_kernels, ag_attention_sharded
from jaxtdist.ops.ag_matmul import ag_matmul, ag_matmul_sharded
from jaxtdist.ops.all_gather import all_gather
from jaxtdist.ops.all_reduce import all_reduce
from jaxtdist.ops._explain import explain
from jaxtdist.ops.flash_decode import flash_decode, flash_decode_kernels, flash_decode_sharded
from jaxtdist.ops.grouped_matmul import grouped_matmul
from jaxtdist.ops.moe import (moe_combine, moe_combine_sharded, moe_dispatch,
                              moe_dispatch_sharded)
from jaxtdist.ops.moe_tp import moe_tp_mlp, moe_tp_mlp_sharded
from jaxtdist.ops.matmul_rs import matmul_ar, matmul_ar_sharded, matmul_rs, matmul_rs_sharded
from jaxtdist.ops.reduce_scatter import reduce_scatter
from jaxtdist.ops.user import triton_call

__all__ = ["ag_attention", "ag_attention_kernels", "ag_attention_sharded", "ag_matmul",
           "ag_matmul_sharded", "all_gather", "all_reduce", "explain", "flash_decode",
           "flash_decode_kernels", "flash_decode_sharded", "grouped_matmul", "matmul_ar",
           "matmul_ar_sharded",
           "matmul_rs", "matmul_rs_sharded", "moe_combine", "moe_combine_sharded",
           "moe_dispatch", "moe_dispatch_sharded", "moe_tp_mlp", "moe_tp_mlp_sharded",
           "reduce_scatter",
           "triton_call"]
