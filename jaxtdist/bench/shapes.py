"""The benchmarks' problem sizes, written once.

Plain data, importing nothing from jaxtdist (nor JAX): the benchmarks
(``python -m jaxtdist.bench``) take their shapes from here; the ag_matmul shapes
the tuner tunes are its own (``jaxtdist/tune/shapes.py``).
"""

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
MATMUL_AR_ROWS = [1, 16, 64, 128, 512]
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

# The GEMM core at world 1 (``python -m jaxtdist.bench gemm``): (op, m, n, k), bf16,
# the per-rank problems of real models' tensor-parallel layers. ag_matmul: column
# parallel (n = N / tp, k = d_model); matmul_rs: row parallel (k = F / tp or
# d / tp, n = d_model); matmul_ar: decode rows. Llama-3 8B (d 4096, F 14336,
# QKV 6144), 70B (d 8192, F 28672, QKV 10240), Qwen2.5-7B (d 3584, F 18944,
# QKV 4608), Mixtral 8x7B (d 4096, F 14336).
GEMM_SHAPES = [
    ("ag_matmul", 4096, 3072, 4096),     # 8B QKV, tp 2, prefill 4096
    ("ag_matmul", 2048, 7168, 4096),     # 8B gate+up, tp 4
    ("ag_matmul", 4096, 7168, 8192),     # 70B gate+up, tp 8
    ("ag_matmul", 8192, 1280, 8192),     # 70B QKV, tp 8, prefill 8192
    ("ag_matmul", 1024, 9472, 3584),     # Qwen-7B gate+up, tp 4
    ("ag_matmul", 16384, 1536, 4096),    # 8B QKV, tp 4, prefill 16384
    ("ag_matmul", 512, 3584, 4096),      # Mixtral expert gate+up, tp 8 (2 x 14336 / 8)
    ("ag_matmul", 64, 7168, 8192),       # 70B gate+up, tp 8, decode 64
    ("ag_matmul", 16, 3072, 4096),       # 8B QKV, tp 2, decode 16
    ("matmul_rs", 2048, 4096, 3584),     # 8B down, tp 4
    ("matmul_rs", 8192, 8192, 3584),     # 70B down, tp 8
    ("matmul_rs", 4096, 4096, 2048),     # 8B o_proj, tp 2
    ("matmul_rs", 16384, 3584, 9472),    # Qwen-7B down, tp 2
    ("matmul_rs", 512, 8192, 2048),      # 70B o_proj, tp 4
    ("matmul_rs", 1024, 4096, 1792),     # 8B down, tp 8
    ("matmul_ar", 1, 8192, 3584),        # 70B down, tp 8, decode 1
    ("matmul_ar", 32, 4096, 7168),       # 8B down, tp 2, decode 32
    ("matmul_ar", 128, 8192, 2048),      # 70B o_proj, tp 4, decode 128
    ("matmul_ar", 256, 4096, 512),       # 8B o_proj, tp 8, decode 256
]
# flash_decode: (B, Hq, Hkv, D) and the total sequence lengths S (bf16). At world 1
# one GPU holds the whole cache; at world W each rank holds S / W positions.
FLASH_DECODE_HEADS = (1, 32, 8, 128)
FLASH_DECODE_SEQS = [8192, 32768, 131072, 262144]

# ag_attention: (B, H, D) (multi-head, causal, bf16) and total sequence lengths S.
# At world 1 one GPU holds the whole sequence; at world W each rank S / W positions.
AG_ATTENTION_HEADS = (1, 32, 128)
AG_ATTENTION_SEQS = [4096, 8192, 16384, 32768]
AG_ATTENTION_SEQS_MULTI = [32768, 131072]
# moe (expert-parallel dispatch + combine): (tokens per rank, hidden, top_k,
# experts), bf16. Decode (128 tokens) and prefill (4096) at DeepSeek-V3's sizes.
MOE_SHAPES = [(128, 7168, 8, 256), (4096, 7168, 8, 256)]
# moe_tp_mlp: (tokens per rank, H, F over all ranks, E, K): Mixtral 8x7B (SwiGLU),
# decode-sized and prefill-sized token counts.
MOE_TP_SHAPES = [(128, 4096, 14336, 8, 2), (512, 4096, 14336, 8, 2),
                 (2048, 4096, 14336, 8, 2)]
# grouped_matmul (the local grouped GEMM against jax.lax.ragged_dot): (rows R, H, F,
# groups G, rows used / R), bf16. Mixtral 8x7B experts (top-2 of 8; up and down
# projections) for 2048 and 128 tokens; DeepSeek-V3 experts (top-8 of 256, F = 2048)
# on an EP-8 rank (32 local experts, 4096 tokens) and all 256 at decode (128 tokens).
# A used fraction below 1: the dispatch's padding rows past the groups.
GROUPED_MATMUL_SHAPES = [(4096, 4096, 14336, 8, 1.0), (4096, 14336, 4096, 8, 1.0),
                         (256, 4096, 14336, 8, 1.0), (4096, 7168, 2048, 32, 0.9),
                         (4096, 2048, 7168, 32, 0.9), (1024, 7168, 2048, 256, 1.0)]
# grouped_matmul --dtype fp8: (rows R, H, F, groups G, rows used / R), expert shapes
# at prefill and decode. Mixtral 8x7B up projection (prefill); DeepSeek-V3 on an EP-8
# rank (32 experts, prefill) and all 256 experts at decode (128 tokens, top-8);
# Qwen3-30B-A3B (H 2048, F 768, 128 experts) at prefill and decode.
GROUPED_FP8_SHAPES = [(4096, 7168, 2048, 32, 0.9), (1024, 2048, 768, 128, 1.0),
                      (4096, 4096, 14336, 8, 1.0), (1024, 7168, 2048, 256, 1.0),
                      (8192, 2048, 768, 128, 1.0)]
# moe_ll's dispatch / combine: (tokens per rank T, H, top-K, experts E) at decode:
# DeepSeek-V3 at 128 tokens per rank, Qwen3-30B-A3B at 1, 32 and 128.
MOE_LL_SHAPES = [(128, 7168, 8, 256), (1, 2048, 8, 128), (32, 2048, 8, 128),
                 (128, 2048, 8, 128)]
# moe_ll's masked grouped GEMM: (model, H, F, experts E, top-K); the experts of one
# rank (E / W) at MOE_LL_GEMM_TOKENS tokens routed in all (random top-K).
MOE_LL_GEMM_MODELS = [("Qwen3-30B-A3B", 2048, 768, 128, 8), ("DeepSeek-V3", 7168, 2048, 256, 8)]
MOE_LL_GEMM_TOKENS = (1, 8, 32, 128, 256)
