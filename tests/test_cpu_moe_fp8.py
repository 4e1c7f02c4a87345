"""fp8 expert-parallel dispatch (``moe_dispatch(..., x_scale=...)``) under the
interpreter: the fp8 rows and their float32 scales reach the same rows of
recv_x that dispatching the dequantized float32 tokens reaches, bit for bit,
then a bfloat16 combine of the experts' output; errors and the refusal to
differentiate."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxtdist as td
from jaxtdist.bench.moe import fp8_dequantize, fp8_tokens
from tests.conftest import cpu_only, place, setup
from tests.test_cpu_moe import routing

pytestmark = cpu_only()

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
EP = P("ep")


@pytest.mark.parametrize("world,t,h,k,e,scales,dtype,rows", [
    (1, 7, 64, 2, 4, 1, E4M3, None),
    (2, 6, 64, 2, 4, 2, E4M3, None),
    (2, 5, 96, 3, 8, 3, E5M2, 9),        # rows past max_recv_rows dropped
    (4, 3, 32, 4, 8, 1, E4M3, None),
    (2, 4, 40, 2, 4, 5, E4M3, None),     # token bytes not a multiple of 16 (recv's pitch)
])
def test_fp8_dispatch_matches_the_dequantized_dispatch(world, t, h, k, e, scales, dtype, rows):
    mesh = setup(world, ("ep",))
    rng = np.random.default_rng(world * 100 + h)
    q, scale = fp8_tokens(rng.standard_normal((world * t, h)).astype(np.float32), scales, dtype)
    ids = routing("random", world, t, k, e, rng)
    w = rng.random((world * t, k)).astype(np.float32)

    def layer(q, scale, ids, w):
        (rx, rs), sizes, handle = td.moe_dispatch(q, ids, "ep", num_experts=e,
                                                  max_recv_rows=rows, x_scale=scale)
        deq = fp8_dequantize(rx, rs)
        ref, ref_sizes, ref_handle = td.moe_dispatch(fp8_dequantize(q, scale), ids, "ep",
                                                     num_experts=e, max_recv_rows=rows)
        # The experts' bfloat16 output, combined as usual.
        out = td.moe_combine(deq.astype(jnp.bfloat16), handle, w, "ep")
        ref_out = td.moe_combine(ref.astype(jnp.bfloat16), ref_handle, w, "ep")
        return (rx, rs, deq, ref, sizes, ref_sizes, handle.dropped[None],
                ref_handle.dropped[None], out, ref_out)

    f = jax.jit(jax.shard_map(layer, mesh=mesh, in_specs=(EP,) * 4, out_specs=(EP,) * 10))
    (rx, rs, deq, ref, sizes, ref_sizes, dropped, ref_dropped, out,
     ref_out) = f(*(place(mesh, a, EP) for a in (q, scale, ids, w)))
    assert rx.dtype == jnp.dtype(dtype) and rs.dtype == jnp.float32
    assert rx.shape[1] == h and rs.shape == (rx.shape[0], scales)
    np.testing.assert_array_equal(np.asarray(deq), np.asarray(ref))
    np.testing.assert_array_equal(np.asarray(sizes), np.asarray(ref_sizes))
    np.testing.assert_array_equal(np.asarray(dropped), np.asarray(ref_dropped))
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref_out, np.float32))
    if rows is not None:
        assert int(np.sum(dropped)) > 0, "no row was dropped: the case tests nothing"


def test_fp8_dispatch_errors_and_no_gradient():
    mesh = setup(2, ("ep",))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 32)).astype(np.float32)
    q, scale = fp8_tokens(x, 2, E4M3)
    ids = place(mesh, routing("random", 2, 4, 2, 4, rng), EP)

    def call(x, scale):
        fn = (lambda x, ids: td.moe_dispatch(x, ids, "ep", num_experts=4)[1]) if scale is None \
            else (lambda x, ids, s: td.moe_dispatch(x, ids, "ep", num_experts=4, x_scale=s)[1])
        args = (x, ids) if scale is None else (x, ids, scale)
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(EP,) * len(args),
                                     out_specs=EP))(*args)

    with pytest.raises(ValueError, match="fp8 tokens need their scales"):
        call(place(mesh, q, EP), None)
    with pytest.raises(ValueError, match="x must be fp8"):
        call(place(mesh, x, EP), place(mesh, scale, EP))
    with pytest.raises(ValueError, match="S >= 1 dividing H = 32"):
        call(place(mesh, q, EP), place(mesh, np.ones((8, 3), np.float32), EP))
    with pytest.raises(ValueError, match="x_scale has dtype bfloat16"):
        call(place(mesh, q, EP), place(mesh, np.ones((8, 2), jnp.bfloat16), EP))
    with pytest.raises(ValueError, match="supported dtypes"):
        call(place(mesh, np.zeros((8, 32), np.uint8), EP), None)

    def loss(x):
        q = (x / jnp.repeat(jnp.asarray(scale), 16, axis=1)).astype(E4M3)
        recv = jax.shard_map(lambda q, s, ids: td.moe_dispatch(q, ids, "ep", num_experts=4,
                                                               x_scale=s)[0][0],
                             mesh=mesh, in_specs=(EP,) * 3, out_specs=EP)(
            q, place(mesh, scale, EP), ids)
        return jnp.sum(recv.astype(jnp.float32))

    with pytest.raises(TypeError, match="fp8 path .* is not differentiable"):
        jax.grad(loss)(place(mesh, x, EP))
