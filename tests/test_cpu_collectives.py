"""jaxtdist's reduce_scatter and all_reduce on CPU devices (Triton interpreter),
against float64 sums and against jax.lax.psum_scatter / jax.lax.psum (gradients)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxtdist as td
from jaxtdist.ops.all_reduce import all_reduce
from jaxtdist.ops.reduce_scatter import reduce_scatter
from tests.conftest import assert_close, cpu_only, f64, place, rand, setup

pytestmark = cpu_only()

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32


def _per_rank_fn(mesh, body, axes=("tp",)):
    """jit(shard_map) of ``body`` on this rank's block of an array stacked over
    ``axes`` (leading dimensions, one per axis); the results stacked the same way."""
    lead = (0,) * len(axes)
    spec = P(*axes)
    return jax.jit(jax.shard_map(
        lambda x: body(x[lead])[(None,) * len(axes)], mesh=mesh, in_specs=spec,
        out_specs=spec))


def _launched(monkeypatch):
    """The kernels launched while the test traces, by name, in order."""
    from jaxtdist.ops._protocol import Call
    seen = []
    launch = Call.launch

    def record(self, kernel, *args, **kwargs):
        seen.append(kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__)
        return launch(self, kernel, *args, **kwargs)

    monkeypatch.setattr(Call, "launch", record)
    return seen


# -- reduce_scatter ---------------------------------------------------------------

# (world, dtype, per-rank shape, scatter_dimension, config): every world, every
# dtype, sizes no multiple of the interpreter's block, other dimensions than 0.
RS_CASES = [
    (2, F32, (6, 5), 0, None),
    (2, BF16, (2, 300), 0, None),                       # chunk of 300: two blocks of 256
    (4, BF16, (3, 8, 7), 1, None),
    (4, F32, (5, 12), -1, dict(NUM_PROGRAMS=3, BLOCK=64)),
    (8, F16, (16, 33), 0, None),
]


@pytest.mark.parametrize("world,dtype,shape,dim,config", RS_CASES)
def test_reduce_scatter(world, dtype, shape, dim, config):
    mesh = setup(world)
    f = _per_rank_fn(mesh, lambda v: reduce_scatter(v, "tp", scatter_dimension=dim,
                                                    config=config))
    for _ in range(2):  # a second call: the other staging parity
        x = rand((world,) + shape, dtype)
        out = f(place(mesh, x, P("tp")))
        assert out.dtype == jnp.dtype(dtype)
        expect = np.stack(np.split(f64(x).sum(0), world, axis=dim))
        assert_close(out, expect, dtype)


def test_reduce_scatter_over_tp_of_a_dp_tp_mesh():
    """A (2, 2) mesh: the sum runs within each tp group, not over dp."""
    mesh = setup((2, 2), ("dp", "tp"))
    f = _per_rank_fn(mesh, lambda v: reduce_scatter(v, "tp"), axes=("dp", "tp"))
    x = rand((2, 2, 6, 3), BF16)
    out = np.asarray(f(place(mesh, x, P("dp", "tp"))), np.float64)
    for g in range(2):
        expect = np.stack(np.split(f64(x[g]).sum(0), 2, axis=0))
        assert_close(out[g], expect, BF16)


# -- all_reduce -------------------------------------------------------------------

# (world, dtype, per-rank shape, config): scalars, sizes that leave some
# two-shot chunks short or empty (5 elements over 8 ranks), both algorithms
# forced and the default choice.
AR_CASES = [
    (2, F32, (), None),
    (2, BF16, (300,), dict(ALGORITHM="two_shot")),
    (4, F16, (7, 9), dict(ALGORITHM="one_shot")),
    (4, BF16, (7, 9), dict(ALGORITHM="two_shot")),
    (4, F32, (1000,), dict(ALGORITHM="two_shot", NUM_PROGRAMS=3, BLOCK=64)),
    (8, F32, (5,), dict(ALGORITHM="two_shot")),
    (8, BF16, (3, 50), None),
    # Tagged-word pushes: ragged slabs, several programs and blocks.
    (2, BF16, (300,), dict(ALGORITHM="one_shot_push")),
    (4, F32, (1000,), dict(ALGORITHM="one_shot_push", NUM_PROGRAMS=3, BLOCK=64)),
    (8, F16, (5,), dict(ALGORITHM="one_shot_push")),
    # Pushed values behind flags.
    (2, BF16, (300,), dict(ALGORITHM="one_shot_push_flags")),
    (4, F32, (1000,), dict(ALGORITHM="one_shot_push_flags", NUM_PROGRAMS=3, BLOCK=64)),
    (8, F16, (5,), dict(ALGORITHM="one_shot_push_flags")),
]


@pytest.mark.parametrize("world,dtype,shape,config", AR_CASES)
def test_all_reduce(world, dtype, shape, config):
    mesh = setup(world)
    f = _per_rank_fn(mesh, lambda v: all_reduce(v, "tp", config=config))
    for _ in range(2):
        x = rand((world,) + shape, dtype)
        out = np.asarray(f(place(mesh, x, P("tp"))))
        assert out.shape == (world,) + shape and out.dtype == jnp.dtype(dtype)
        assert_close(out[0], f64(x).sum(0), dtype)
        for r in range(1, world):  # every rank holds the same bits
            np.testing.assert_array_equal(out[r], out[0])


def test_all_reduce_over_tp_of_a_dp_tp_mesh():
    mesh = setup((2, 2), ("dp", "tp"))
    for algorithm in ("one_shot", "two_shot"):
        f = _per_rank_fn(mesh, lambda v: all_reduce(v, "tp", config=dict(ALGORITHM=algorithm)),
                         axes=("dp", "tp"))
        x = rand((2, 2, 4, 5), F16)
        out = np.asarray(f(place(mesh, x, P("dp", "tp"))), np.float64)
        for g in range(2):
            for r in range(2):
                assert_close(out[g, r], f64(x[g]).sum(0), F16)


def test_all_reduce_picks_by_bytes_per_rank(monkeypatch):
    """The tagged push up to PUSH_MAX_BYTES ((world - 1) x bytes per rank), the push
    with flags up to PUSH_FLAGS_MAX_BYTES per rank,
    one-shot up to ONE_SHOT_MAX_BYTES per rank, two-shot above; the result typed
    the same over the group (a replicated out_specs passes shard_map's checks)."""
    mesh = setup(2)
    seen = _launched(monkeypatch)
    x = rand((2, 64), F32)
    big = dict(PUSH_MAX_BYTES=255, PUSH_FLAGS_MAX_BYTES=1)
    for config, kernel in ((None, "all_reduce_push_kernel"),
                           (dict(PUSH_MAX_BYTES=256), "all_reduce_push_kernel"),
                           (dict(PUSH_MAX_BYTES=255), "all_reduce_push_flags_kernel"),
                           (big, "all_reduce_one_shot_kernel"),
                           (dict(big, PUSH_FLAGS_MAX_BYTES=256), "all_reduce_push_flags_kernel"),
                           (dict(big, ONE_SHOT_MAX_BYTES=255), "all_reduce_two_shot_kernel"),
                           (dict(big, ONE_SHOT_MAX_BYTES=256), "all_reduce_one_shot_kernel")):
        f = jax.jit(jax.shard_map(lambda v: all_reduce(v, "tp", config=config), mesh=mesh,
                                  in_specs=P("tp"), out_specs=P()))
        out = f(place(mesh, x.reshape(-1), P("tp")))  # 64 float32 = 256 bytes per rank
        assert seen[-1] == kernel, (config, seen)
        assert_close(out, f64(x).sum(0), F32)


def test_chained_calls_on_changing_data():
    """Reuse races: 50 calls (all_reduce one-shot, two-shot, both one-shot pushes and
    reduce_scatter, in turn), 5 chained in one jit, each on the previous result plus fresh per-rank
    data so that a buffer read a call late shows; the jitted chain runs 10 times
    back to back on new data, without waiting in between (epochs go on)."""
    world, n, inner, outer = 4, 24, 5, 10
    mesh = setup(world)

    def chain(x, y):
        for i in range(inner):
            z = x / world + jnp.roll(y, i)
            if i % 3 == 2:
                x = jnp.tile(reduce_scatter(z, "tp"), world)
            else:
                x = all_reduce(z, "tp", config=dict(
                    ALGORITHM=("one_shot", "one_shot_push")[i // 3] if i % 3 == 0
                    else ("two_shot", "one_shot_push_flags")[i // 3]))
        return x

    f = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=(P("tp"), P("tp")),
                              out_specs=P("tp")))
    x = rand((world, n))
    ys = [rand((world, n)) for _ in range(outer)]
    out = place(mesh, x.reshape(-1), P("tp"))
    for y in ys:
        out = f(out, place(mesh, y.reshape(-1), P("tp")))
    xs = f64(x)
    for y in ys:
        for i in range(inner):
            total = (xs / world + np.roll(f64(y), i, axis=1)).sum(0)
            if i % 3 == 2:
                xs = np.stack([np.tile(block, world) for block in np.split(total, world)])
            else:
                xs = np.tile(total, (world, 1))
    assert_close(np.asarray(out).reshape(world, n), xs, F32, factor=10)


# -- autodiff ---------------------------------------------------------------------

@pytest.mark.parametrize("check_vma", [True, False])
def test_gradients_match_xla(check_vma):
    """jax.grad through both ops equals jax.grad of psum / psum_scatter, with typed
    varying axes (the cotangent arrives summed) and without (psum's transpose is a psum)."""
    world = 4
    mesh = setup(world)
    x = rand((world * 8, 8))
    c = rand((world * 8, 8))

    def grads(ar, rs):
        def body(v, w):
            g1 = jax.grad(lambda v: jnp.sum(jnp.sin(ar(v))))(v)                   # same c
            g2 = jax.grad(lambda v: jnp.sum(ar(v) * w))(v)                        # per-rank c
            g3 = jax.grad(lambda v: jnp.sum(jnp.sin(rs(v)) * w[:, :2]))(v)
            return g1, g2, g3
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P("tp")),
                                     out_specs=(P("tp"),) * 3, check_vma=check_vma))

    ours = grads(lambda v: all_reduce(v, "tp"),
                 lambda v: reduce_scatter(v, "tp", scatter_dimension=1))
    ref = grads(lambda v: jax.lax.psum(v, "tp"),
                lambda v: jax.lax.psum_scatter(v, "tp", scatter_dimension=1, tiled=True))
    args = (place(mesh, x, P("tp")), place(mesh, c, P("tp")))
    for a, b in zip(ours(*args), ref(*args)):
        assert_close(a, f64(b), F32)


# -- world 1, errors, tuning ---------------------------------------------------------

def test_world_1_is_the_local_computation():
    mesh = setup((1, 2), ("tp", "dp"))
    rt = td.runtime.runtime()
    used = rt.bytes_in_use
    x = rand((2 * 4, 6), BF16)
    f = jax.jit(jax.shard_map(
        lambda v: (all_reduce(v, "tp"), reduce_scatter(v, "tp", scatter_dimension=1)),
        mesh=mesh, in_specs=P("dp"), out_specs=(P("dp"), P("dp"))))
    xs = place(mesh, x, P("dp"))
    assert "custom_call" not in f.lower(xs).as_text()
    for out in f(xs):
        np.testing.assert_array_equal(np.asarray(out), x)
    assert rt.bytes_in_use == used


def test_bad_inputs_raise():
    mesh = setup(4)

    def call(fn, x):
        return _per_rank_fn(mesh, fn)(place(mesh, x, P("tp")))

    x = rand((4, 6, 8))
    with pytest.raises(ValueError, match=r"scatter_dimension 0 of x \(shape \(6, 8\)\) has "
                                         r"size 6, which the group's 4 ranks do not divide"):
        call(lambda v: reduce_scatter(v, "tp"), x)
    with pytest.raises(ValueError, match="at least one dimension"):
        call(lambda v: reduce_scatter(v, "tp"), rand((4,)))
    with pytest.raises(ValueError, match="scatter_dimension=2 is out of range"):
        call(lambda v: reduce_scatter(v, "tp", scatter_dimension=2), x)
    with pytest.raises(ValueError, match="dtype int32; supported dtypes"):
        call(lambda v: all_reduce(v, "tp"), np.ones((4, 3), np.int32))
    with pytest.raises(ValueError, match="ALGORITHM='three_shot'; allowed"):
        call(lambda v: all_reduce(v, "tp", config=dict(ALGORITHM="three_shot")), x)
    with pytest.raises(ValueError, match="BLOCK=96 must be a power of 2"):
        call(lambda v: reduce_scatter(v, "tp", scatter_dimension=1, config=dict(BLOCK=96)), x)
    with pytest.raises(ValueError, match=r"unknown config keys \['BLOCKS'\]"):
        call(lambda v: all_reduce(v, "tp", config=dict(BLOCKS=4)), x)
    with pytest.raises(ValueError, match="ONE_SHOT_MAX_BYTES=-1 must be an int >= 0"):
        call(lambda v: all_reduce(v, "tp", config=dict(ONE_SHOT_MAX_BYTES=-1)), x)
    with pytest.raises(ValueError, match="PUSH_MAX_BYTES=True must be an int"):
        call(lambda v: all_reduce(v, "tp", config=dict(PUSH_MAX_BYTES=True)), x)
    with pytest.raises(ValueError, match="PUSH_FLAGS_MAX_BYTES=1.5 must be an int"):
        call(lambda v: all_reduce(v, "tp", config=dict(PUSH_FLAGS_MAX_BYTES=1.5)), x)


def test_configs_on_gpu_problems():
    """GPU defaults: one block per program up to the SMs; all programs resident."""
    from jaxtdist.ops._config import Problem
    from jaxtdist.ops.all_reduce import AllReduceConfig
    from jaxtdist.ops.reduce_scatter import ReduceScatterConfig

    small = Problem("gpu", 4, (8192,), "bfloat16")          # 16 KiB per rank
    large = Problem("gpu", 4, (32 << 20,), "bfloat16")      # 64 MiB per rank
    mid = Problem("gpu", 4, (1 << 20,), "bfloat16")         # 2 MiB per rank
    cfg = AllReduceConfig.default(small)
    assert cfg.settled(small).ALGORITHM == "one_shot_push" and cfg.NUM_PROGRAMS == 4
    assert AllReduceConfig.default(mid).settled(mid).ALGORITHM == "one_shot"
    # Above the tagged push, values and flags up to 1 MiB per rank at 2 ranks, 512 KiB above.
    for world, n, algorithm in ((4, 65536, "one_shot_push"), (4, 65537, "one_shot_push_flags"),
                                (4, 262144, "one_shot_push_flags"), (4, 262145, "one_shot"),
                                (8, 32768, "one_shot_push_flags"), (8, 262145, "one_shot"),
                                (2, 196608, "one_shot_push"), (2, 196609, "one_shot_push_flags"),
                                (2, 524288, "one_shot_push_flags"), (2, 524289, "one_shot")):
        problem = Problem("gpu", world, (n,), "bfloat16")
        assert AllReduceConfig.default(problem).settled(problem).ALGORITHM == algorithm, (
            world, n)
    cfg = AllReduceConfig.default(large)
    assert cfg.settled(large).variant == "two_shot" and cfg.NUM_PROGRAMS == large.sms
    assert ReduceScatterConfig.default(large).NUM_PROGRAMS == large.sms
    with pytest.raises(ValueError, match="NUM_PROGRAMS=200 exceeds the 132 SMs"):
        ReduceScatterConfig().replace(NUM_PROGRAMS=200).validate(large)
    for config_type in (AllReduceConfig, ReduceScatterConfig):
        assert len(config_type.search_space(large)) > 4
    # The pushes (W copies of the array in every heap) are candidates for small arrays only.
    searched = {c.get("ALGORITHM") for c in AllReduceConfig.search_space(small)}
    assert {"one_shot_push", "one_shot_push_flags", "one_shot", "two_shot"} <= searched
    searched = {c.get("ALGORITHM") for c in AllReduceConfig.search_space(large)}
    assert not searched & {"one_shot_push", "one_shot_push_flags"}, searched


@pytest.mark.parametrize("op,variant", [("all_reduce", "two_shot"),
                                        ("reduce_scatter", "pull")])
def test_tuning_with_an_explicit_measure(op, variant):
    """Both ops are tunable through the one engine; every candidate's output is
    checked against the float32 sum before it is timed."""
    setup(2)

    def wall_us(fn, args, world, iterations):
        fn(*args).block_until_ready()
        t = time.perf_counter()
        fn(*args).block_until_ready()
        return (time.perf_counter() - t) * 1e6

    candidates = [dict(ALGORITHM="two_shot")] if op == "all_reduce" else [{}]
    result = td.tune.tune(op, (96,), jnp.float32, axis_name="tp", candidates=candidates,
                          iterations=1, measure=wall_us, save=False)
    assert all("us" in r for r in result["tried"]), result["tried"]
    assert result["variant"] == variant
