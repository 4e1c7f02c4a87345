"""jaxtdist.kernels: pure Triton kernels (no JAX imports), one family per file."""
