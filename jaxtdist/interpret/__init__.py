"""jaxtdist.interpret: the CPU backend, real Triton kernels under Triton's interpreter."""

from jaxtdist.interpret._pool import KernelFailed, WorkerPool, kernel_reference

__all__ = ["KernelFailed", "WorkerPool", "kernel_reference"]
