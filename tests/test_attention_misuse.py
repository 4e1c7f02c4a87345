"""Misuse and edge inputs of jaxtdist.flash_decode and jaxtdist.ag_attention that the
other test files leave out, each a bug found this way (regression tests), at world 2
(the kernels) and world 1 (plain JAX):

- flash_decode with a paged cache of 0 pages (or 0-position pages) was accepted:
  the id clamp into [0, num_pages) then aimed at page -1, memory outside the pool
  (zeros under the interpreter; at world 1 XLA's "Slice size at index 0 in gather
  op is out of range"). Fixed in ops/flash_decode.py (_check_pages): a ValueError.
- flash_decode's kv_len of uint32 or int64 past int32's range wrapped around on
  its cast to int32 (2**31 + 5 -> negative: zeros instead of the whole cache;
  2**32 + 3 -> 3 positions; -2**32 + 3 -> 3 instead of none), and an int32 length
  near -2**31 wrapped to a large one in the kernel's ``kv_len - rank * S_shard`` on
  ranks past 0. Fixed in ops/flash_decode.py (_int32_lengths): lengths are clamped
  to [0, 2**31 - 1] before the cast, as other past-the-cache lengths.
- ag_attention with k, v of 0 KV heads raised "ZeroDivisionError: integer modulo by
  zero". Fixed in ops/ag_attention.py (_check): "empty operand".
- ag_attention(causal=np.True_) (what NumPy comparisons give) was refused with
  "causal=np.True_ must be True or False". Fixed in ops/ag_attention.py: NumPy
  bools are taken as the Python bools they equal.

- NaN or inf left in the cache past kv_len (or in pages past a sequence's length)
  reached the output at world 1 (plain JAX, ``decode_attention``: zero weights
  times inf): those positions are zeroed there now, as the kernels never load them.
- NaN or inf in q or at a valid position of the cache gave a plausible wrong
  answer where jax.nn.dot_product_attention gives NaN: at world 1 zeros (the NaN
  softmax weight failed ``l > 0``), at world 2 the attention over the other
  rank's positions only (the kernel took the NaN partial for an empty one). Fixed
  in both: only ``l == 0`` (nothing valid) means zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxtdist as td
from jaxtdist.ops.ag_attention import attention
from jaxtdist.ops.flash_decode import decode_attention
from tests.conftest import cpu_only, place, rand, rel_err, setup

pytestmark = cpu_only()

SP = P(None, "sp")
DECODE_SPECS = (P(), SP, SP, P())


def _decode(mesh):
    return jax.jit(jax.shard_map(lambda q, k, v, n: td.flash_decode(q, k, v, n, "sp"),
                                 mesh=mesh, in_specs=DECODE_SPECS, out_specs=P()))


def _paged(mesh):
    return jax.jit(jax.shard_map(
        lambda q, k, v, n, t: td.flash_decode(q, k, v, n, "sp", block_table=t), mesh=mesh,
        in_specs=(P(), P("sp"), P("sp"), P(), P(None, "sp")), out_specs=P()))


@pytest.mark.parametrize("world", [2, 1])
@pytest.mark.parametrize("pool_shape", [(0, 4, 2, 16), (2, 0, 2, 16)],
                         ids=["no-pages", "empty-pages"])
def test_flash_decode_empty_page_pool_is_refused(world, pool_shape):
    mesh = setup(world, ("sp",))
    pool = jnp.zeros((world * pool_shape[0],) + pool_shape[1:], jnp.float32)
    table = np.zeros((2, world * 2), np.int32)
    with pytest.raises(ValueError, match=r"flash_decode: empty page pool k\(.*\); \[num_pages, "
                                         r"page, Hkv, D\] needs at least one page"):
        _paged(mesh)(rand((2, 4, 16)), pool, pool, np.array([3, 3], np.int32), table)


def test_flash_decode_sharded_empty_page_pool_is_refused():
    setup(2, ("sp",))
    pool = jnp.zeros((0, 4, 2, 16), jnp.float32)
    with pytest.raises(ValueError, match="empty page pool"):
        td.flash_decode_sharded(rand((2, 4, 16)), pool, pool, np.array([3, 3], np.int32),
                                axis_name="sp", block_table=np.zeros((2, 2), np.int32))


@pytest.mark.parametrize("world", [2, 1])
@pytest.mark.parametrize("lens,dtype,x64,whole", [
    ([2 ** 31 + 5, 2 ** 32 - 1], np.uint32, False, [True, True]),
    ([2 ** 32 + 3, 2 ** 40], np.int64, True, [True, True]),
    ([-2 ** 32 + 3, 2 ** 33], np.int64, True, [False, True]),
    ([-2 ** 31, -2 ** 31 + 3], np.int32, False, [False, False]),
], ids=["uint32", "int64-big", "int64-negative", "int32-min"])
def test_flash_decode_lengths_past_int32_saturate(world, lens, dtype, x64, whole):
    """Lengths past int32's range read the whole cache (or, negative, none: zeros),
    as the lengths past the cache inside it do."""
    mesh = setup(world, ("sp",))
    s = world * 5
    q, k, v = rand((2, 4, 16)), rand((2, s, 2, 16)), rand((2, s, 2, 16))
    expect = np.asarray(decode_attention(q, k, v, np.where(whole, s, 0).astype(np.int32)))
    with jax.enable_x64(x64):
        n = jnp.asarray(np.array(lens, dtype))
        assert n.dtype == dtype
        out = _decode(mesh)(place(mesh, q, P()), place(mesh, k, SP), place(mesh, v, SP), n)
    out = np.asarray(out)
    for i, w in enumerate(whole):
        if w:
            assert rel_err(out[i], expect[i]) < 1e-5, (i, lens[i])
        else:
            np.testing.assert_array_equal(out[i], 0.0)


@pytest.mark.parametrize("world", [2, 1])
def test_ag_attention_zero_kv_heads_is_a_clear_error(world):
    mesh = setup(world, ("sp",))
    q, kv = rand((1, world * 4, 2, 16)), jnp.zeros((1, world * 4, 0, 16), jnp.float32)
    f = jax.jit(jax.shard_map(lambda q, k, v: td.ag_attention(q, k, v, "sp"), mesh=mesh,
                              in_specs=(SP,) * 3, out_specs=SP))
    with pytest.raises(ValueError, match=r"ag_attention: empty operand q\(1, 4, 2, 16\) "
                                         r"k\(1, 4, 0, 16\)"):
        f(q, kv, kv)


@pytest.mark.parametrize("kernels", [False, True])
@pytest.mark.parametrize("causal", [np.True_, np.False_])
def test_ag_attention_takes_numpy_bools(causal, kernels):
    world = 2
    mesh = setup(world, ("sp",))
    op = td.ops.ag_attention_kernels if kernels else td.ag_attention
    q, k, v = rand((1, world * 5, 4, 16)), rand((1, world * 5, 2, 16)), rand((1, world * 5, 2, 16))
    f = jax.jit(jax.shard_map(lambda q, k, v: op(q, k, v, "sp", causal=causal), mesh=mesh,
                              in_specs=(SP,) * 3, out_specs=SP))
    out = f(*(place(mesh, a, SP) for a in (q, k, v)))
    assert rel_err(out, attention(q, k, v, causal=bool(causal))) < 1e-5
    sharded = td.ag_attention_sharded(q, k, v, axis_name="sp", causal=causal)
    assert rel_err(sharded, attention(q, k, v, causal=bool(causal))) < 1e-5


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("paged", [False, True])
def test_flash_decode_ignores_garbage_past_the_length(world, paged):
    """NaN and inf in the cache past kv_len (stale or never written slots, reused pages)
    never reach the output: those positions are masked, pages past a sequence's
    length never read."""
    mesh = setup(world, ("sp",))
    s_shard, page = 8, 4
    s = world * s_shard
    q = rand((2, 4, 16))
    k, v = np.array(rand((2, s, 2, 16))), np.array(rand((2, s, 2, 16)))
    lens = np.array([3, s_shard + 1 if world > 1 else 6], np.int32)
    expect = decode_attention(q, jnp.asarray(k), jnp.asarray(v), lens)
    for i, n in enumerate(lens):
        k[i, n:], v[i, n:] = np.nan, np.inf
    if not paged:
        out = _decode(mesh)(place(mesh, q, P()), place(mesh, k, SP), place(mesh, v, SP), lens)
    else:
        # Each rank's pool: page i of sequence b's positions at id b * pages + i, and
        # the positions past the length as they are (NaN, inf).
        pages = s_shard // page
        per_rank = [a.reshape(2, world, pages, page, 2, 16).transpose(1, 0, 2, 3, 4, 5)
                    .reshape(world * 2 * pages, page, 2, 16) for a in (k, v)]
        table = np.tile(np.arange(2 * pages, dtype=np.int32).reshape(2, pages), (1, world))
        out = _paged(mesh)(place(mesh, q, P()), place(mesh, per_rank[0], P("sp")),
                           place(mesh, per_rank[1], P("sp")), lens, place(mesh, table, SP))
    assert rel_err(out, expect) < 1e-5


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("where", ["q", "k", "k_inf", "v"])
def test_flash_decode_carries_nan_from_valid_inputs(world, where):
    """NaN or inf in q or at a valid position of k or v (rank 0's shard) gives NaN
    where jax.nn.dot_product_attention gives NaN (a whole head through q or k, one
    column through v), on every rank; every other value as the reference."""
    mesh = setup(world, ("sp",))
    s = world * 8
    q, k, v = (np.array(rand(shape)) for shape in ((2, 4, 16), (2, s, 2, 16), (2, s, 2, 16)))
    lens = np.array([s - 1, s], np.int32)
    if where == "q":
        q[0, 1, 3] = np.nan
    else:  # position 2 of sequence 0, KV head 0 (query heads 0 and 1), below the length
        {"k": k, "k_inf": k, "v": v}[where][0, 2, 0, 5] = np.inf if where == "k_inf" else np.nan
        q[0, :2, 5] = np.abs(q[0, :2, 5]) + 0.5  # k_inf: a score of +inf (inf - inf: NaN)
    out = np.asarray(_decode(mesh)(place(mesh, q, P()), place(mesh, k, SP),
                                   place(mesh, v, SP), lens))
    ref = np.asarray(jax.nn.dot_product_attention(
        jnp.asarray(q)[:, None], jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2),
        key_value_seq_lengths=jnp.asarray(lens))[:, 0])
    assert np.isnan(ref).any()  # the case is one that poisons the reference
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    kept = ~np.isnan(ref)
    assert rel_err(out[kept], ref[kept]) < 1e-5


def test_the_warp_specialized_kernel_is_refused_where_it_cannot_run():
    """KERNEL='ws' off Hopper GPUs (here the interpreter) names why; an unknown
    KERNEL names the choices."""
    mesh = setup(2, names=("sp",))
    q = place(mesh, rand((1, 256, 2, 128)), P(None, "sp"))
    for config, match in ((dict(KERNEL="ws"), r"KERNEL='ws' \(the warp-specialized kernel\) "
                                               r"cannot run this call: it runs on NVIDIA GPUs"),
                          (dict(KERNEL="gluon"), r"KERNEL='gluon'; allowed: 'auto', 'triton', "
                                                 r"'ws'")):
        f = jax.jit(jax.shard_map(lambda a: td.ag_attention(a, a, a, "sp", config=config),
                                  mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp")))
        with pytest.raises(ValueError, match=match):
            f(q)
