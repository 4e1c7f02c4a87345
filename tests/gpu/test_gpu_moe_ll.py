"""The low-latency MoE pair (``moe_dispatch_ll`` / ``moe_combine_ll``) and the
masked grouped GEMM (``grouped_matmul_masked``) on GPUs.

What runs, against ``tests/test_cpu_moe_ll.py``'s numpy reference (every valid
slot of recv_x, the counts, the tokens' t * K + k, the invalid pairs, the
combined layer) or a float64 one:

- dispatch + combine at DeepSeek-V3's decode shape per rank (T = 128 tokens,
  H = 7168, top 8 of 256 experts: a 940 MB double-buffered inbox), an odd one
  (T, H, K, E none a power of two, M > T, float32), the invalid, skewed and
  empty routings, both call parities;
- the FP8 dispatch at DeepSeek-V3's shape (e4m3 rows and their 1 x 128 scales);
- 20 dispatch + combine pairs in one compiled program with a new routing each
  (a race shows as another call's rows);
- ``grouped_matmul_masked`` at a decode shape (32 experts of 128 slots, H = 7168,
  F = 2048): 0, some and all rows valid, NaN in the padding, both count forms;
- the decode layer dispatch -> grouped_matmul_masked -> combine against the
  dense layer.

At world 1 (the kernels themselves: the pair has no local form) and 2 GPUs
where visible (skipped otherwise). Skipped without GPUs; run with
``JAXTDIST_TEST_GPU=1`` (tests/gpu/run.sh does).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxtdist as td
from jaxtdist.ops.moe import ll_heap_bytes
from tests.conftest import f64, place, rand, rel_err, setup
from tests.test_cpu_moe_ll import (_check, _layer, chained_call_errors, check_two_calls,
                                   ref_layout, routing, valid_mask)

pytestmark = pytest.mark.skipif(
    jax.devices()[0].platform != "gpu", reason="needs CUDA GPUs (none visible)")

BF16, F32 = jnp.bfloat16, jnp.float32
TP = P("tp")
WORLDS = [1, 2]
# A hung kernel fails its test within a minute instead of holding the shard (a
# decode exchange takes microseconds; the default wait is 300 s).
WAIT_TIMEOUT_S = 60.0

CASES = [  # tokens per rank, hidden, top_k, experts, routing, dtype, max_tokens_per_rank
    (128, 7168, 8, 256, "random", BF16, None),  # DeepSeek-V3 decode
    (37, 1000, 3, 12, "random", F32, 40),       # odd sizes, M > T
    (64, 2048, 8, 64, "invalid", BF16, None),   # ids out of range and repeats
    (64, 2048, 8, 64, "skewed", BF16, None),    # 80% of tokens to experts 0 and 1
    (16, 512, 2, 8, "empty", F32, None),        # half the experts (a rank at W = 2) idle
]
CASE_IDS = ["deepseek", "odd", "invalid", "skewed", "empty"]
FP8_SHAPE = (128, 7168, 8, 256)  # T, H, K, E: DeepSeek-V3's FP8 dispatch
CHAIN_SHAPE = (128, 2048, 8, 64, 20)  # T, H, K, E, calls
LAYER_SHAPE = (128, 2048, 1024, 8, 64)  # T, H, F, K, E
GEMM_SHAPE = (32, 128, 7168, 2048)  # G, M, H, F


def _heap_bytes() -> int:
    """Every workspace of this file at once (a runtime keeps each shape's): the
    dispatch's (``ll_heap_bytes``, the same per rank at any W) and the combine's
    (two parities of [T * K, F]), plus room for the flags."""
    shapes = [(t, h, h, k, e, m or t, jnp.dtype(d).itemsize, False)
              for t, h, k, e, _, d, m in CASES]
    t, h, k, e = FP8_SHAPE
    shapes.append((t, h, h, k, e, t, 2, True))
    t, h, k, e, _ = CHAIN_SHAPE
    shapes.append((t, h, h, k, e, t, 4, False))
    t, h, f, k, e = LAYER_SHAPE
    shapes.append((t, h, f, k, e, t, 2, False))
    need = sum(ll_heap_bytes(1, e, m, h, size, fp8=fp8) + 2 * t * k * f * size
               for t, h, f, k, e, m, size, fp8 in shapes)
    return need + (64 << 20)


HEAP_BYTES = _heap_bytes()  # about 1.8 GB (DeepSeek-V3's inbox alone is 940 MB)


def _mesh(world: int):
    """The runtime over the first ``world`` GPUs with this file's heap; skips where
    fewer are visible."""
    return setup(world, heap_bytes=HEAP_BYTES, wait_timeout_s=WAIT_TIMEOUT_S)


@pytest.mark.parametrize("t,h,k,e,kind,dtype,m", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"w{w}")
def test_dispatch_and_combine_match_the_reference(world, t, h, k, e, kind, dtype, m):
    """Two calls (both inbox parities), a new routing and new tokens each."""
    check_two_calls(_mesh(world), world, t, h, k, e, kind, dtype, m,
                    np.random.default_rng(world * 1000 + t * 10 + k))


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"w{w}")
def test_fp8_dispatch_quantizes_in_the_send(world):
    """e4m3 rows (a few percent per row against the tokens) with amax / 448 scales
    per 1 x 128 block in each token's slots; the combine of the dequantized rows."""
    t, h, k, e = FP8_SHAPE
    mesh = _mesh(world)
    rng = np.random.default_rng(world + 7)
    fn = _layer(mesh, e, fp8=True)
    for _ in range(2):
        x = rand((world * t, h), BF16)
        ids = routing("random", world, t, k, e, rng)
        gate = rand((world * t, k), F32)
        outs = fn(place(mesh, x, TP), place(mesh, ids, TP), place(mesh, gate, TP))
        _check(outs, x, ids, gate, world, e, t, BF16, fp8=True)
        scales = np.asarray(outs[5]).reshape(world, e // world, world * t, h // 128)
        amax = np.abs(np.asarray(jnp.asarray(x).astype(F32))).reshape(world, t, h // 128, 128)
        want = amax.max(axis=3) / 448
        rcounts, slots = ref_layout(ids, world, e, t)
        for (d, le, s), pairs in slots.items():
            first = int(rcounts[d, le, :s].sum())
            np.testing.assert_allclose(scales[d, le, first: first + len(pairs)],
                                       want[s, [tt for tt, _ in pairs]], rtol=1e-6,
                                       err_msg=f"rank {d}, expert {le}, source {s}")


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"w{w}")
def test_chained_calls_with_changing_routings(world):
    """20 dispatch + combine pairs in one compiled program (lax.scan), a new routing
    (random, skewed, invalid) and new tokens each call: both parities reused ten
    times, every result checked (float32: a race shows as another call's rows)."""
    t, h, k, e, steps = CHAIN_SHAPE
    kinds = [("random", "skewed", "invalid")[i % 3] for i in range(steps)]
    bad = chained_call_errors(_mesh(world), world, t, h, k, e, kinds,
                              np.random.default_rng(20 + world))
    assert not bad, bad


def test_grouped_matmul_masked_reads_only_valid_rows():
    """Per expert its first valid_rows[g] rows times w[g] at a decode shape: 0, 1,
    some and all 128 rows, a [G] count past M (clipped to M) and [G, W] counts;
    the padding holds NaN, which must not leak into the valid rows."""
    g, m, h, f = GEMM_SHAPE
    mesh = _mesh(1)
    rng = np.random.default_rng(32)
    rows = rng.integers(0, m + 1, g)
    rows[:4] = [0, m, 1, m - 1]
    rows[rng.permutation(np.arange(4, g))[:4]] = 0  # a few more idle experts
    split = rng.integers(0, rows + 1)
    per_source = np.stack([split, rows - split], axis=1).astype(np.int32)  # [G, W = 2]
    total = rows.astype(np.int32)
    total[1] = m + 50  # clipped to M
    kx, kw = jax.random.split(jax.random.key(32))
    x = jax.random.normal(kx, (g, m, h), F32).astype(BF16)
    w = (jax.random.normal(kw, (g, h, f), F32) / np.sqrt(h)).astype(BF16)
    padding = jnp.arange(m)[None, :, None] >= jnp.asarray(rows)[:, None, None]
    x_nan = jnp.where(padding, jnp.nan, x).astype(BF16)
    fn = jax.jit(jax.shard_map(lambda a, b, c: td.grouped_matmul_masked(a, b, c), mesh=mesh,
                               in_specs=(P(), P(), P()), out_specs=P()))
    outs = [np.asarray(fn(x_nan, w, counts).astype(F32), np.float64)
            for counts in (per_source, total)]
    xh = np.asarray(x.astype(F32), np.float64)
    for gg in np.nonzero(rows)[0]:
        ref = xh[gg, :rows[gg]] @ np.asarray(w[gg].astype(F32), np.float64)
        for out, form in zip(outs, ("[G, W]", "[G]")):
            err = rel_err(out[gg, :rows[gg]], ref)  # also: every valid row finite
            assert err < 2e-2, (form, int(gg), int(rows[gg]), err)


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"w{w}")
def test_decode_layer_end_to_end(world):
    """dispatch_ll -> masked grouped GEMM (the experts) -> combine_ll, against the
    dense layer sum_k gate[t, k] * x[t] @ w[ids[t, k]] over the valid pairs."""
    t, h, f, k, e = LAYER_SHAPE
    mesh = _mesh(world)
    rng = np.random.default_rng(40 + world)

    def layer(x, ids, gate, w):
        recv, counts, handle = td.moe_dispatch_ll(x, ids, "tp", num_experts=e)
        y = td.grouped_matmul_masked(recv, w, counts)        # [E / W, W * T, F]
        return td.moe_combine_ll(y, handle, gate, "tp")

    fn = jax.jit(jax.shard_map(layer, mesh=mesh, in_specs=(TP, TP, TP, TP), out_specs=TP))
    w = (jax.random.normal(jax.random.key(40 + world), (e, h, f), F32) / np.sqrt(h)).astype(BF16)
    w_sharded = place(mesh, w, TP)
    w64 = [np.asarray(w[ex].astype(F32), np.float64) for ex in range(e)]
    for kind in ("random", "skewed", "invalid"):
        x = rand((world * t, h), BF16)
        ids = routing(kind, world, t, k, e, rng)
        gate = rand((world * t, k), F32)
        out = fn(place(mesh, x, TP), place(mesh, ids, TP), place(mesh, gate, TP), w_sharded)
        xs, valid = f64(x), valid_mask(ids, e)
        ref = np.zeros((world * t, f))
        for ex in range(e):  # a token holds an expert at most once among its valid pairs
            tok, kk = np.nonzero((ids == ex) & valid)
            if len(tok):
                ref[tok] += gate[tok, kk][:, None] * (xs[tok] @ w64[ex])
        err = rel_err(f64(out), ref)
        assert err < 2e-2, (kind, err)
