"""User kernels written with jaxtdist.language, run through jaxtdist.triton_call on CPU."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxtdist as td
from tests import kernels_for_tests as K
from tests.conftest import cpu_only, place, rand, setup

pytestmark = cpu_only()

_names = itertools.count()


def _fresh_name(base: str) -> str:
    """A workspace name no other call used: its epochs start at 1."""
    return f"{base}_{next(_names)}"


def _ids_fn(mesh, name, axis="tp"):
    def body():
        out = td.triton_call(kernel=K.ids_kernel, out_shape=jax.ShapeDtypeStruct((3,), jnp.int32),
                             grid=(1,), axis_name=axis, name=name)
        return out[None]

    spec = P(tuple(mesh.axis_names), None)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(), out_specs=spec))


@pytest.mark.parametrize("world", [2, 4, 8])
def test_ring(world):
    """Each rank receives the previous rank's x; epochs advance over calls."""
    mesh = setup(world)
    n = 37  # not a multiple of BLOCK: masked tails in store_peer and put
    name = _fresh_name("ring")

    def body(x):
        out = td.triton_call(x[0], kernel=K.ring_kernel,
                             out_shape=jax.ShapeDtypeStruct((n,), jnp.float32), grid=(1,),
                             axis_name="tp", workspace_bytes=256 + 2 * 4 * n, name=name,
                             N=n, BLOCK=16)
        return out[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp", None), out_specs=P("tp", None)))
    for _ in range(4):  # both parities, twice
        x = rand((world, n))
        out = np.asarray(f(place(mesh, x, P("tp", None))))
        np.testing.assert_array_equal(out, np.roll(x, 1, axis=0))


@pytest.mark.parametrize("kwargs,message", [
    (dict(N=None), r"kernel ring_kernel needs N: pass them as keyword arguments"),
    (dict(FOO=8), r"kernel ring_kernel has no parameter FOO after its 1 argument\(s\) and 1 "
                  r"output\(s\); its parameters there: \['N', 'BLOCK', 'WORKSPACE'\]"),
    (dict(workspace_bytes=0),
     r"kernel ring_kernel needs WORKSPACE: .*\(WORKSPACE: pass workspace_bytes > 0\)"),
    (dict(workspace_bytes=-5),
     r"workspace_bytes=-5 must be an int >= 0 \(kernel ring_kernel\)"),
])
def test_triton_call_arguments_checked_at_trace_time(kwargs, message):
    """Keyword arguments the kernel lacks, parameters left without a value and a
    negative workspace: a ValueError when traced (they failed inside the interpreter's
    worker, or a misspelt one was ignored)."""
    mesh = setup(2)
    n = 8
    args = dict(kernel=K.ring_kernel, out_shape=jax.ShapeDtypeStruct((n,), jnp.float32),
                grid=(1,), axis_name="tp", workspace_bytes=256 + 2 * 4 * n, N=n, BLOCK=8)
    args = {k: v for k, v in dict(args, **kwargs).items() if v is not None}
    f = jax.shard_map(lambda x: td.triton_call(x[0], **args)[None], mesh=mesh,
                      in_specs=P("tp", None), out_specs=P("tp", None))
    with pytest.raises(ValueError, match=r"jaxtdist\.triton_call: " + message):
        jax.jit(f).lower(place(mesh, rand((2, n)), P("tp", None)))


def test_triton_call_offsets_need_their_parameters():
    """workspace_bytes > 0 for a kernel without a WORKSPACE parameter: a ValueError at
    trace time naming the parameter the offset would go to."""
    mesh = setup(2)
    n = 8
    f = jax.shard_map(
        lambda x: td.triton_call(x[0], 2.0, kernel=K.scaled_rank_kernel,
                                 out_shape=jax.ShapeDtypeStruct((n,), jnp.float32), grid=(1,),
                                 axis_name="tp", workspace_bytes=64, N=n, BLOCK=8)[None],
        mesh=mesh, in_specs=P("tp", None), out_specs=P("tp", None))
    with pytest.raises(ValueError, match=r"kernel scaled_rank_kernel needs a constexpr "
                                         r"parameter WORKSPACE to receive its offset"):
        jax.jit(f).lower(place(mesh, rand((2, n)), P("tp", None)))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("scale", [2.5, -3])
def test_scalar_argument(world, scale):
    """A Python scalar among the kernel's arguments (on GPUs: jax-triton launches it)."""
    mesh = setup(world)
    n = 21

    def body(x):
        out = td.triton_call(x[0], scale, kernel=K.scaled_rank_kernel,
                             out_shape=jax.ShapeDtypeStruct((n,), jnp.float32), grid=(1,),
                             axis_name="tp", N=n, BLOCK=32)
        return out[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp", None), out_specs=P("tp", None)))
    x = rand((world, n))
    out = np.asarray(f(place(mesh, x, P("tp", None))))
    np.testing.assert_allclose(out, x * scale + np.arange(world, dtype=np.float32)[:, None],
                               rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_outputs_round_trip_and_unwritten_elements_are_nan(dtype):
    """Arguments and outputs cross to the interpreter workers intact in every float
    type (bfloat16 as its bits: workers never import ml_dtypes); what a kernel
    leaves unwritten comes back NaN, never stale or zero."""
    mesh = setup(2)
    n = 10

    def body(x):
        return td.triton_call(x[0], kernel=K.half_doubled_kernel,
                              out_shape=jax.ShapeDtypeStruct((n,), dtype), grid=(1,),
                              axis_name="tp", N=n, BLOCK=16)[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp", None), out_specs=P("tp", None)))
    x = rand((2, n), dtype)
    out = np.asarray(f(place(mesh, x, P("tp", None)))).astype(np.float32)
    np.testing.assert_array_equal(out[:, :n // 2], 2 * np.asarray(x).astype(np.float32)[:, :n // 2])
    assert np.isnan(out[:, n // 2:]).all()


@pytest.mark.parametrize("world", [2, 4, 8])
def test_ids_and_epochs(world):
    """rank, num_ranks and epoch as the kernel sees them; epochs are per workspace."""
    mesh = setup(world)
    name = _fresh_name("ids")
    f = _ids_fn(mesh, name)
    for e in (1, 2, 3):
        out = np.asarray(f())
        np.testing.assert_array_equal(out[:, 0], np.arange(world))
        np.testing.assert_array_equal(out[:, 1], world)
        np.testing.assert_array_equal(out[:, 2], e)
    # Another workspace (another name) counts its own epochs from 1.
    out = np.asarray(_ids_fn(mesh, _fresh_name("ids"))())
    np.testing.assert_array_equal(out[:, 2], 1)
    # The first one continues where it stopped.
    np.testing.assert_array_equal(np.asarray(f())[:, 2], 4)


def test_ids_on_2d_mesh():
    """Ranks and group sizes per axis (group) of a (2, 2) mesh."""
    mesh = setup((2, 2), ("dp", "tp"))
    for axis, rank, world in [("tp", [0, 1, 0, 1], 2), ("dp", [0, 0, 1, 1], 2),
                              (("dp", "tp"), [0, 1, 2, 3], 4), (("tp", "dp"), [0, 2, 1, 3], 4)]:
        out = np.asarray(_ids_fn(mesh, _fresh_name("ids2d"), axis)())
        np.testing.assert_array_equal(out[:, 0], rank, err_msg=str(axis))
        np.testing.assert_array_equal(out[:, 1], world, err_msg=str(axis))
        np.testing.assert_array_equal(out[:, 2], 1, err_msg=str(axis))


@pytest.mark.parametrize("world", [2, 4, 8])
def test_staged_load_peer(world):
    """barrier_all + load_peer of the previous rank's ``stage=`` copy."""
    mesh = setup(world)
    n = 21
    name = _fresh_name("staged")

    def body(s):
        out = td.triton_call(kernel=K.staged_prev_kernel,
                             out_shape=jax.ShapeDtypeStruct((n,), jnp.float32), grid=(1,),
                             axis_name="tp", workspace_bytes=4 * world, stage=s[0], name=name,
                             N=n, BLOCK=16)
        return out[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp", None), out_specs=P("tp", None)))
    for _ in range(4):
        s = rand((world, n))
        out = np.asarray(f(place(mesh, s, P("tp", None))))
        np.testing.assert_array_equal(out, np.roll(s, 1, axis=0))


def test_ring_and_ids_interleaved():
    """Two kernels with their own workspaces in one jit, called repeatedly."""
    world, n = 4, 8
    mesh = setup(world)
    ring_name, ids_name = _fresh_name("ring"), _fresh_name("ids")

    def body(x):
        ids = td.triton_call(kernel=K.ids_kernel, out_shape=jax.ShapeDtypeStruct((3,), jnp.int32),
                             grid=(1,), axis_name="tp", name=ids_name)
        out = td.triton_call(x[0], kernel=K.ring_kernel,
                             out_shape=jax.ShapeDtypeStruct((n,), jnp.float32), grid=(1,),
                             axis_name="tp", workspace_bytes=256 + 2 * 4 * n, name=ring_name,
                             N=n, BLOCK=8)
        return out[None], ids[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp", None),
                              out_specs=(P("tp", None), P("tp", None))))
    for e in (1, 2, 3):
        x = rand((world, n))
        out, ids = f(place(mesh, x, P("tp", None)))
        np.testing.assert_array_equal(np.asarray(out), np.roll(x, 1, axis=0))
        np.testing.assert_array_equal(np.asarray(ids)[:, 2], e)


@pytest.mark.parametrize("world", [2, 4])
def test_fence_and_consume_token_broadcast(world):
    """dl.fence + dl.notify publish plain stores; dl.consume_token orders the reads."""
    mesh = setup(world)
    n = 40

    def body(x):
        out = td.triton_call(x, kernel=K.fenced_broadcast_kernel,
                             out_shape=jax.ShapeDtypeStruct((n,), jnp.float32), grid=(1,),
                             axis_name="tp", workspace_bytes=256 + 2 * 4 * n, N=n, BLOCK=16,
                             name=_fresh_name("bcast"))
        return out

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))
    for _ in range(3):
        x = rand((world * n,))
        out = np.asarray(f(place(mesh, x, P("tp"))))
        np.testing.assert_array_equal(out.reshape(world, n), np.tile(x[:n], (world, 1)))


@pytest.mark.parametrize("world,peer_major,tma_rows", [(2, False, 0), (3, True, 0), (2, True, 2)])
def test_push_probe_kernel_lands_every_row(world, peer_major, tma_rows):
    """The GPU probe of pushes (``probe_defaults.py push``) times a kernel that
    must move what XLA's all_gather moves: with CHECK, every rank's inbox holds
    every source's rows, on two calls (both parities), through SM stores and
    through TMA stores of [tma_rows, block] tiles."""
    from tests.gpu.probe_defaults import push_fn

    mesh = setup(world, ("ep",))
    rows, cols = (6 if tma_rows else 5), 32
    f = push_fn(mesh, rows, cols, programs=2, block=16, peer_major=peer_major, check=True,
                tma_rows=tma_rows)
    for _ in range(2):
        x = rand((world * rows, cols), jnp.bfloat16)
        out = np.asarray(f(place(mesh, x, P("ep"))).astype(jnp.float32))
        want = np.asarray(x.astype(jnp.float32))
        for r in range(world):
            np.testing.assert_array_equal(out[r * world * rows:(r + 1) * world * rows], want)
