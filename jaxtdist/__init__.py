"""jaxtdist: compute-communication overlapped distributed Triton kernels for JAX.

Example:
  >>> import functools, jax, jaxtdist as td
  >>> from jax.sharding import PartitionSpec as P
  >>> mesh = jax.make_mesh((jax.device_count(),), ("tp",))
  >>> td.initialize(mesh)
  >>> @jax.jit
  ... @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("tp", None), P(None, "tp")),
  ...                    out_specs=P(None, "tp"))
  ... def f(x, w):
  ...     return td.ag_matmul(x, w, axis_name="tp")
"""

import os as _os

from jaxtdist._version import __version__

# Interpreter workers import kernels only: keep JAX out of those processes.
if _os.environ.get("_JAXTDIST_INTERPRETER_WORKER") != "1":
    from jaxtdist._errors import (
        HeapExhaustedError,
        JaxtdistError,
        NotInitializedError,
        WaitTimeoutError,
        WorkerDiedError,
        errors,
    )
    from jaxtdist import runtime  # the subpackage; runtime.runtime() is the object
    from jaxtdist.runtime._bootstrap import BootstrapTimeoutError
    from jaxtdist import tune
    from jaxtdist.ops import (ag_attention, ag_attention_sharded, ag_matmul,
                              ag_matmul_sharded, all_gather, all_reduce, explain, flash_decode,
                              flash_decode_sharded, grouped_matmul, matmul_ar,
                              matmul_ar_sharded, matmul_rs, matmul_rs_sharded, moe_combine,
                              moe_combine_sharded, moe_dispatch,
                              moe_dispatch_sharded, moe_tp_mlp, moe_tp_mlp_sharded,
                              reduce_scatter,
                              triton_call)
    from jaxtdist.ops._op import run_once
    from jaxtdist.runtime import initialize, is_initialized, shutdown

    def check_errors() -> None:
        """Raises ``WaitTimeoutError`` if a kernel's wait timed out (GPU kernels record
        timeouts without stopping the host; the next jaxtdist op raises too)."""
        runtime.runtime().check_errors()

__all__ = [
    "BootstrapTimeoutError",
    "HeapExhaustedError",
    "JaxtdistError",
    "NotInitializedError",
    "WaitTimeoutError",
    "WorkerDiedError",
    "ag_attention",
    "ag_attention_sharded",
    "ag_matmul",
    "ag_matmul_sharded",
    "all_gather",
    "all_reduce",
    "check_errors",
    "errors",
    "explain",
    "flash_decode",
    "flash_decode_sharded",
    "grouped_matmul",
    "initialize",
    "is_initialized",
    "matmul_ar",
    "matmul_ar_sharded",
    "matmul_rs",
    "matmul_rs_sharded",
    "moe_combine",
    "moe_combine_sharded",
    "moe_dispatch",
    "moe_dispatch_sharded",
    "moe_tp_mlp",
    "moe_tp_mlp_sharded",
    "reduce_scatter",
    "run_once",
    "runtime",
    "shutdown",
    "triton_call",
    "tune",
]
