"""The benchmark and tuning problem sizes, written once.

Plain data, importing nothing from jaxtdist (nor JAX): the benchmarks
(``python -m jaxtdist.bench``) and the tuner's CLI (``python -m jaxtdist.tune``)
both take their shapes from here.
"""

# ag_matmul at world W, (m_shard, n_shard, k): x is [W * m_shard, k] with rows
# sharded over the W ranks, w is [k, W * n_shard] with columns sharded. The
# large rows are Llama-style projections at tp=4 (N = 11008, 14336, 28672 split
# four ways); the last three are decode sizes.
AG_MATMUL_SHAPES = [
    (1024, 4096, 4096), (2048, 3072, 4096), (2048, 7168, 8192),
    (2048, 11008 // 4, 4096), (2048, 14336 // 4, 4096),
    (1, 4096, 8192), (16, 4096, 8192), (128, 4096, 8192),
]

# ag_matmul at world 1 against jnp.dot of the same operands, with the default
# configs (no tuning cache): (m, n, k, dtype). m is the rows of one rank, which
# at world 1 is the whole M. Shapes nobody tuned, and the tuned shapes' sizes.
AG_MATMUL_UNTUNED_SHAPES = [
    (1024, 4096, 4096, "bfloat16"),
    (2048, 3072, 4096, "bfloat16"),
    (2048, 7168, 8192, "bfloat16"),
    (512, 5120, 5120, "bfloat16"),
    (1536, 2816, 6144, "float16"),
    (128, 4096, 8192, "bfloat16"),
    (16, 4096, 8192, "bfloat16"),
    (1000, 1000, 1000, "bfloat16"),
]

# all_gather: bytes per rank (bf16 rows of 1024 columns).
ALL_GATHER_BYTES = [16 << 10, 256 << 10, 1 << 20, 8 << 20, 64 << 20]

# matmul_rs, (M, N, K): x is [M, K] with K split over the world, w is [K, N]; each
# rank gets M / W rows of the sum. The 4 x H200 targets (local GEMM 258 and
# 1216 us, dot + psum_scatter 445 and 1580 us at K / 4).
MATMUL_RS_SHAPES = [(8192, 4096, 12288), (8192, 8192, 29568)]
# matmul_ar: M rows (decode), K = 8192 split over the world, N = 8192.
MATMUL_AR_ROWS = [1, 16, 128]
MATMUL_AR_NK = (8192, 8192)
# World 1 against jnp.dot: (op, m, n, k, dtype), the per-rank problems of the
# tables above at W = 4 and one more shape.
MATMUL_RS_UNTUNED_SHAPES = [
    ("matmul_rs", 8192, 4096, 3072, "bfloat16"),
    ("matmul_rs", 8192, 8192, 7392, "bfloat16"),
    ("matmul_rs", 2048, 4096, 4096, "bfloat16"),
    ("matmul_ar", 1, 8192, 2048, "bfloat16"),
    ("matmul_ar", 16, 8192, 2048, "bfloat16"),
    ("matmul_ar", 128, 8192, 2048, "bfloat16"),
]

# moe (expert-parallel dispatch + combine): (tokens per rank, hidden, top_k,
# experts), bf16. Decode (128 tokens) and prefill (4096) at DeepSeek-V3's sizes.
MOE_SHAPES = [(128, 7168, 8, 256), (4096, 7168, 8, 256)]
