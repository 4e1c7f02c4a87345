"""The problem sizes ``python -m jaxtdist.tune`` tunes by default, written once.

Plain data, importing nothing: the ag_matmul benchmark
(``python -m jaxtdist.bench ag_matmul``) times the same shapes, so a table
shows the tuned configs.
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
