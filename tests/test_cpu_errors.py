"""Errors: bad arguments, no runtime, a full heap, a wait that times out.

Every test brings the runtime it needs (tests.conftest.setup replaces one with
other settings), so the order of these tests does not matter.
"""

from __future__ import annotations

import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import triton
import triton.language as tl
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxtdist as td
import jaxtdist.language as dl
from jaxtdist.runtime._runtime import _RESERVED_BYTES
from tests import kernels_for_tests as K
from tests.conftest import (check_config_errors, cpu_only, f64, mesh_of, place, rand,
                            rel_err, setup)

pytestmark = cpu_only()

WORLD = 4


def _run(mesh, fn, *arrays, in_specs, out_specs):
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs))
    return f(*arrays)


def _ag_matmul(mesh, x, w, axis_name="tp", x_spec=P("tp", None), w_spec=P(None, "tp")):
    return _run(mesh, lambda a, b: td.ag_matmul(a, b, axis_name), place(mesh, x, x_spec),
                place(mesh, w, w_spec), in_specs=(x_spec, w_spec), out_specs=P(None, "tp"))


def _ag_matmul_ok(mesh, m=5, k=24, n=12):
    x = rand((WORLD * m, k))
    w = rand((k, WORLD * n))
    assert rel_err(_ag_matmul(mesh, x, w), f64(x) @ f64(w)) < 1e-5


# -- bad arguments ------------------------------------------------------------------


def test_ag_matmul_mismatched_k():
    mesh = setup(WORLD)
    with pytest.raises(ValueError, match=r"contraction.*k=24.*k=16"):
        _ag_matmul(mesh, rand((WORLD * 2, 24)), rand((16, WORLD * 8)))


def test_ag_matmul_1d_x():
    mesh = setup(WORLD)
    with pytest.raises(ValueError, match=r"2-D"):
        _ag_matmul(mesh, rand((WORLD * 8,)), rand((8, WORLD * 8)), x_spec=P("tp"))


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.float64 if jax.config.x64_enabled
                                   else jnp.int8])
def test_ag_matmul_bad_dtype(dtype):
    mesh = setup(WORLD)
    x = np.ones((WORLD * 2, 16), dtype)
    w = np.ones((16, WORLD * 8), dtype)
    with pytest.raises(ValueError, match=rf"dtype {jnp.dtype(dtype).name}.*supported.*bfloat16"):
        _ag_matmul(mesh, x, w)


def test_ag_matmul_mixed_dtypes():
    mesh = setup(WORLD)
    with pytest.raises(ValueError, match=r"share a dtype.*float32.*bfloat16"):
        _ag_matmul(mesh, rand((WORLD * 2, 16)), rand((16, WORLD * 8), jnp.bfloat16))


def test_ag_matmul_unknown_axis():
    mesh = setup(WORLD)
    with pytest.raises(ValueError, match=r"'nope' is not an axis.*\('tp',\)"):
        _ag_matmul(mesh, rand((WORLD * 2, 16)), rand((16, WORLD * 8)), axis_name="nope")


def test_ag_matmul_axis_name_none():
    mesh = setup(WORLD)
    with pytest.raises(ValueError, match=r"axis_name is required"):
        _ag_matmul(mesh, rand((WORLD * 2, 16)), rand((16, WORLD * 8)), axis_name=None)


@pytest.mark.parametrize("kwargs,x_shape,dtype,match", [
    (dict(axis=2), (3, 4), jnp.float32, r"axis=2 is out of range.*\(3, 4\)"),
    (dict(axis=-3), (3, 4), jnp.float32, r"axis=-3 is out of range"),
    (dict(), (3, 4), jnp.int32, r"dtype int32"),
    (dict(), (), jnp.float32, r"at least one dimension.*scalar"),
])
def test_all_gather_bad_args(kwargs, x_shape, dtype, match):
    mesh = setup(WORLD)
    x = np.ones((WORLD,) + x_shape, dtype)
    with pytest.raises(ValueError, match=match):
        _run(mesh, lambda a: td.all_gather(a[0], "tp", **kwargs)[None], place(mesh, x, P("tp")),
             in_specs=P("tp"), out_specs=P("tp"))


@pytest.mark.parametrize("axis_name,match", [("nope", r"'nope' is not an axis"),
                                             (None, r"axis_name is required"),
                                             (("tp", "tp"), r"repeats an axis")])
def test_all_gather_bad_axis_name(axis_name, match):
    mesh = setup(WORLD)
    x = rand((WORLD * 2, 3))
    with pytest.raises(ValueError, match=match):
        _run(mesh, lambda a: td.all_gather(a, axis_name), place(mesh, x, P("tp")),
             in_specs=P("tp"), out_specs=P("tp"))


def test_outside_shard_map():
    setup(WORLD)
    x = jnp.ones((8, 16), jnp.float32)
    w = jnp.ones((16, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"inside jax.shard_map"):
        jax.jit(lambda a, b: td.ag_matmul(a, b, "tp"))(x, w)


def test_shard_map_over_another_mesh():
    setup(WORLD)
    other = mesh_of((2,), ("tp",))
    with pytest.raises(ValueError, match=r"differs from the mesh given to jaxtdist.initialize"):
        _ag_matmul(other, rand((4, 16)), rand((16, 16)))


@pytest.mark.parametrize("devices", ["others", "reordered"])
def test_shard_map_over_other_devices_with_the_same_axes(devices):
    """Axes and sizes match (all tracing sees); the devices do not: other devices
    have no heap of the runtime's, and reordered ones would take other ranks than
    their shard_map positions. Refused when the program is lowered."""
    mesh = setup(WORLD)
    ids = np.array(jax.devices()[:2 * WORLD] if devices == "others" else jax.devices()[:WORLD])
    other = Mesh(ids[WORLD:] if devices == "others" else ids[::-1], ("tp",))
    with pytest.raises(ValueError, match=r"jaxtdist.ag_matmul: the shard_map's mesh has devices "
                       r"\[.*\], the mesh given to jaxtdist.initialize has \[0, 1, 2, 3\]"):
        _ag_matmul(other, rand((4 * WORLD, 16)), rand((16, 16)))
    _ag_matmul_ok(mesh)  # the runtime is still usable


def test_a_heap_size_off_the_page_is_rounded_up():
    """heap_bytes = 1 MiB + 8: the heaps of a CPU mesh lie one after another, so every
    peer's heap started 8 bytes off alignment and every collective deadlocked."""
    mesh = mesh_of((2,), ("tp",))
    rt = td.initialize(mesh, heap_bytes=(1 << 20) + 8, wait_timeout_s=30)
    assert rt.heap_bytes == (1 << 20) + 4096
    assert td.initialize(mesh, heap_bytes=(1 << 20) + 8, wait_timeout_s=30) is rt
    x = rand((4, 16))
    out = _run(mesh, lambda a: td.all_gather(a, "tp"), place(mesh, x, P("tp")),
               in_specs=P("tp"), out_specs=P("tp"))
    np.testing.assert_array_equal(np.asarray(out), np.concatenate([x, x]))


@pytest.mark.parametrize("config,match", [
    ({"BLOCK_C": 1 << 21}, r"all_gather: config BLOCK_C=2097152 is past Triton's largest block"),
    ({"num_warps": 48}, r"all_gather: config num_warps=48; allowed: 1, 2, 4, 8, 16, 32"),
    ({"NUM_WORKERS": 1 << 33}, r"all_gather: config NUM_WORKERS=8589934592 does not fit in int32"),
    ({"SCOPE": 3}, r"all_gather: config SCOPE=3 must be a string \(the default here: 'sys'\)"),
])
def test_config_values_past_what_compiles_are_refused_when_traced(config, match):
    """Accepted before, then failed inside the kernel (a worker's traceback on CPU;
    Triton's assertion on GPUs)."""
    mesh = setup(2)
    x = place(mesh, rand((8, 16)), P("tp"))
    with pytest.raises(ValueError, match=match):
        _run(mesh, lambda a: td.all_gather(a, "tp", config=config), x, in_specs=P("tp"),
             out_specs=P("tp"))


def test_config_values_of_the_wrong_type_are_named():
    """A string or None for an int field reached arithmetic in settle (a bare
    TypeError); a non-bool for a bool field ran as its truth value."""
    check_config_errors([
        ({"BLOCK_N": "64"}, r"ag_matmul: config BLOCK_N='64' must be an int"),
        ({"BLOCK_N": None}, r"ag_matmul: config BLOCK_N=None must be an int"),
        ({"ALL_ROWS": "yes"}, r"ag_matmul: config ALL_ROWS='yes' must be True or False"),
        ({"TMA": None}, r"ag_matmul: config TMA=None must be True or False"),
    ])


def test_triton_call_missing_workspace_param():
    mesh = setup(WORLD)
    with pytest.raises(ValueError, match=r"ids_kernel needs a constexpr parameter WORKSPACE"):
        _run(mesh, lambda: td.triton_call(kernel=K.ids_kernel, grid=(1,), axis_name="tp",
                                          out_shape=jax.ShapeDtypeStruct((3,), jnp.int32),
                                          workspace_bytes=64)[None],
             in_specs=(), out_specs=P("tp"))


def test_triton_call_local_kernel():
    mesh = setup(WORLD)

    @triton.jit
    def local_kernel(ctx, out_ptr):
        tl.store(out_ptr, dl.rank(ctx))

    with pytest.raises(ValueError, match=r"defined inside a function.*top level"):
        _run(mesh, lambda: td.triton_call(kernel=local_kernel, grid=(1,), axis_name="tp",
                                          out_shape=jax.ShapeDtypeStruct((1,), jnp.int32))[None],
             in_specs=(), out_specs=P("tp"))


# -- runtime state --------------------------------------------------------------------


def _world_1_calls(config):
    """Every op with a config at world 1 (where the local computation runs, not the
    kernels) as {name: () -> output}."""
    rng = np.random.default_rng(0)

    def x(*shape):  # fresh operands, constants of the traced function
        return rng.standard_normal(shape, np.float32)

    ids = jnp.asarray([[0, 1], [2, 3], [1, 2], [3, 0]], jnp.int32)
    weights = x(4, 2)

    def combine():
        recv, _, handle = td.moe_dispatch(x(4, 16), ids, "tp", num_experts=4)
        return td.moe_combine(recv, handle, weights, "tp", config=config)

    return {
        "ag_matmul": lambda: td.ag_matmul(x(8, 16), x(16, 8), "tp", config=config),
        "matmul_rs": lambda: td.matmul_rs(x(8, 16), x(16, 8), "tp", config=config),
        "matmul_ar": lambda: td.matmul_ar(x(2, 16), x(16, 8), "tp", config=config),
        "all_gather": lambda: td.all_gather(x(8, 4), "tp", config=config),
        "all_reduce": lambda: td.all_reduce(x(8, 4), "tp", config=config),
        "reduce_scatter": lambda: td.reduce_scatter(x(8, 4), "tp", config=config),
        "ag_attention": lambda: td.ag_attention(*(x(1, 16, 2, 16) for _ in range(3)), "tp",
                                                config=config),
        "moe_dispatch": lambda: td.moe_dispatch(x(4, 16), ids, "tp", num_experts=4,
                                                config=config)[0],
        "moe_combine": combine,
    }


@pytest.mark.parametrize("op", list(_world_1_calls(None)))
def test_a_bad_config_is_refused_at_world_1(op):
    """At world 1 the ops run their local computation, which takes no config; a bad
    one (here a misspelt key) is still refused, as the kernels at world > 1 refuse
    it, and a good one (the defaults) changes nothing."""
    mesh = setup(1)

    def run(config):
        return jax.jit(jax.shard_map(_world_1_calls(config)[op], mesh=mesh, in_specs=(),
                                     out_specs=P(), check_vma=False))()

    with pytest.raises(ValueError, match=r"jaxtdist.\w+: unknown config keys \['BLOCK_MM'\]"):
        run({"BLOCK_MM": 64})
    np.testing.assert_array_equal(np.asarray(run({})), np.asarray(run(None)))
    # Neither a dict nor a typed config: a TypeError naming the op (was an AttributeError).
    with pytest.raises(TypeError, match=rf"jaxtdist.{op}: config must be a dict of config "
                                        r"keys .*got list"):
        run([("BLOCK_M", 16)])


def test_a_typed_config_is_taken_as_all_its_keys():
    """config=AgPointerConfig(...) (the typed configs behind the dicts) asks for every
    key it holds and its variant's selectors (TMA, PRODUCER): the same result as the
    dict of them, at world 1 and 2."""
    import dataclasses

    from jaxtdist.ops._ag_matmul_config import AgPointerConfig
    typed = AgPointerConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16)
    keys = {f.name: getattr(typed, f.name) for f in dataclasses.fields(typed)}
    keys["TMA"] = False
    for world in (1, 2):
        mesh = setup(world)
        x, w = rand((world * 8, 16)), rand((16, world * 32))
        outs = [np.asarray(_run(mesh, lambda a, b, c=c: td.ag_matmul(a, b, "tp", config=c),
                                place(mesh, x, P("tp", None)), place(mesh, w, P(None, "tp")),
                                in_specs=(P("tp", None), P(None, "tp")),
                                out_specs=P(None, "tp")))
                for c in (typed, keys)]
        np.testing.assert_array_equal(outs[0], outs[1])
        assert rel_err(outs[0], f64(x) @ f64(w)) < 1e-5


def test_not_initialized():
    mesh = mesh_of((WORLD,), ("tp",))
    td.shutdown()
    td.shutdown()  # safe twice
    assert not td.is_initialized()
    with pytest.raises(td.NotInitializedError, match=r"jaxtdist.initialize\(mesh\)"):
        td.runtime.runtime()
    with pytest.raises(td.NotInitializedError, match=r"not initialized"):
        _ag_matmul(mesh, rand((WORLD * 2, 16)), rand((16, WORLD * 8)))
    with pytest.raises(td.NotInitializedError):
        _run(mesh, lambda a: td.all_gather(a, "tp"), place(mesh, rand((WORLD, 3)), P("tp")),
             in_specs=P("tp"), out_specs=P("tp"))
    # And back.
    _ag_matmul_ok(setup(WORLD))


def test_heap_too_small_for_reserved_part():
    mesh = mesh_of((2,), ("tp",))
    with pytest.raises(ValueError, match=rf"heap_bytes=1024 is below the minimum "
                                         rf"{2 * _RESERVED_BYTES}"):
        td.initialize(mesh, heap_bytes=1024)


def test_rejected_initialize_keeps_the_runtime():
    """Every argument of initialize is checked before the running runtime is torn
    down: a rejected call leaves it, and programs compiled for it, working."""
    mesh = setup(WORLD)
    rt = td.runtime.runtime()
    f = jax.jit(jax.shard_map(lambda a: td.all_gather(a, "tp"), mesh=mesh, in_specs=P("tp"),
                              out_specs=P("tp")))
    x = place(mesh, rand((WORLD, 3)), P("tp"))
    want = np.asarray(f(x))
    bad = [(dict(wait_timeout_s=-1), ValueError, r"wait_timeout_s=-1; allowed"),
           (dict(wait_timeout_s="5"), TypeError, r"wait_timeout_s='5' must be a number"),
           (dict(heap_bytes=0), ValueError, r"heap_bytes=0 is below the minimum"),
           (dict(heap_bytes=100), ValueError, r"heap_bytes=100 is below the minimum"),
           (dict(heap_bytes="1G"), TypeError, r"heap_bytes='1G' must be an int"),
           (dict(heap_bytes=2.5e9), TypeError, r"heap_bytes=2500000000.0 must be an int"),
           (dict(align_launches="no"), TypeError, r"align_launches='no' must be True or False"),
           (dict(launcher="triton"), ValueError, r"launcher='triton'; allowed"),
           (dict(bootstrap_timeout_s=0), ValueError, r"bootstrap_timeout_s=0; allowed")]
    for kwargs, error, message in bad:
        with pytest.raises(error, match=message):
            td.initialize(mesh, **kwargs)
        assert td.runtime.runtime() is rt, kwargs
    with pytest.raises(TypeError, match=r"mesh must be a jax.sharding.Mesh .*got NoneType"):
        td.initialize(None)
    assert td.runtime.runtime() is rt
    np.testing.assert_array_equal(np.asarray(f(x)), want)


def test_cpu_heap_larger_than_the_host():
    """A heap no host memory can back: HeapExhaustedError with what was asked and what
    the host has (was a bare OSError, an OverflowError, or accepted silently)."""
    mesh = mesh_of((2,), ("tp",))
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for heap in (ram, 1 << 62):
        with pytest.raises(td.HeapExhaustedError,
                           match=rf"needs {2 * heap} bytes of shared memory \(heap_bytes="
                                 rf"{heap} per device\) but this host has {ram} bytes"):
            td.initialize(mesh, heap_bytes=heap)
    assert not td.is_initialized()
    _ag_matmul_ok(setup(WORLD))


def test_bad_launcher():
    mesh = setup(WORLD)
    rt = td.runtime.runtime()
    assert rt.launcher == "native"
    with pytest.raises(ValueError, match=r"launcher='triton'; allowed: 'native' .* or "
                                         r"'jax-triton'"):
        td.initialize(mesh, launcher="triton")
    with pytest.raises(ValueError, match=r"launcher='cuda'; allowed"):
        rt.launcher = "cuda"
    assert td.initialize(mesh, launcher="jax-triton") is rt and rt.launcher == "jax-triton"
    # CPU runs the interpreter whoever would launch on GPUs.
    _ag_matmul_ok(mesh)
    rt.launcher = "native"


def test_heap_exhausted():
    heap = 2 * _RESERVED_BYTES + 4096
    mesh = setup(WORLD, heap_bytes=heap)
    available = heap - _RESERVED_BYTES
    m, k = 48, 256  # two staging slots of 48 * 256 * 4 bytes > available (fails at trace)
    try:
        with pytest.raises(td.HeapExhaustedError) as info:
            _ag_matmul(mesh, rand((WORLD * m, k)), rand((k, WORLD * 8)))
        msg = str(info.value)
        assert "exhausted" in msg
        assert f"but {available} of {heap} bytes are free" in msg, msg
        assert "heap_bytes=" in msg, msg
        needed = int(msg.split("workspace of ")[1].split(" bytes")[0])
        assert needed > available
        assert f"at least {_RESERVED_BYTES + needed} bytes" in msg, msg
        assert "buckets" in msg, msg  # what to do about many shapes
        # A small op still fits in the same runtime.
        _ag_matmul_ok(mesh, m=2, k=16, n=8)
        # Now the error lists what holds the heap: the small op's workspaces.
        with pytest.raises(td.HeapExhaustedError) as info:
            _ag_matmul(mesh, rand((WORLD * m, k)), rand((k, WORLD * 8)))
        assert re.search(r"workspaces allocated: ag_matmul/\S+ 1 x \d+\.\d [KM]iB", str(info.value)), \
            str(info.value)
    finally:
        td.shutdown()


@pytest.mark.parametrize("kernel,cmp", [("withheld_kernel", ">="), ("withheld_tma_kernel", ">="),
                                        ("withheld_tagged_kernel", "==")])
def test_wait_timeout(kernel, cmp):
    """A wait nobody notifies times out within twice its bound in seconds, with a
    precise error naming the wait; the runtime stays poisoned until shutdown +
    initialize. Every wait: ``wait``, ``wait_for_tma`` and ``wait_tagged``."""
    bound = 1.0
    mesh = setup(WORLD, wait_timeout_s=bound)

    def body():
        out = td.triton_call(kernel=getattr(K, kernel), grid=(1,), axis_name="tp",
                             out_shape=jax.ShapeDtypeStruct((1,), jnp.int32),
                             workspace_bytes=256, name="withheld")
        return out[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(), out_specs=P("tp", None)))
    compiled = f.lower().compile()
    try:
        start = time.monotonic()
        with pytest.raises(jax.errors.JaxRuntimeError) as info:
            np.asarray(compiled())
        elapsed = time.monotonic() - start
        assert elapsed < 2 * bound, f"a {bound} s bound took {elapsed:.2f} s"
        msg = str(info.value)
        # The form GPUs report: the status, then jaxtdist's error (no host-callback
        # traceback in front of it).
        assert msg.startswith(f"DEADLINE_EXCEEDED: jaxtdist.WaitTimeoutError: a wait timed "
                              f"out after {bound:.1f} s on rank"), msg
        assert "Traceback" not in msg, msg
        assert f"to become {cmp} 1001" in msg, msg  # epoch 1 + 1000
        assert "last saw 0" in msg, msg
        assert "jaxtdist.shutdown()" in msg, msg
        assert "jax.block_until_ready every 20 calls" in msg, msg  # the CPU cause too
        # The error stays recorded: check_errors raises it directly...
        with pytest.raises(td.WaitTimeoutError, match=r"timed out.*rank"):
            td.check_errors()
        # ...as does a later call inside jaxtdist.errors(), typed (the XLA error
        # as its cause).
        with pytest.raises(td.WaitTimeoutError, match=r"^a wait timed out") as typed:
            with td.errors():
                np.asarray(compiled())
        assert isinstance(typed.value.__cause__, (jax.errors.JaxRuntimeError, ValueError))
        # ...and a later op fails fast instead of hanging.
        start = time.monotonic()
        with pytest.raises(jax.errors.JaxRuntimeError,
                           match=r"^DEADLINE_EXCEEDED: jaxtdist\.WaitTimeoutError: .*timed "
                                 r"out.* in an earlier call"):
            np.asarray(_ag_matmul(mesh, rand((WORLD * 2, 16)), rand((16, WORLD * 8))))
        assert time.monotonic() - start < 30
    finally:
        td.shutdown()
    # A fresh runtime works again.
    _ag_matmul_ok(setup(WORLD))
    td.check_errors()


def test_jitted_function_after_reinitialize():
    """A function jitted before shutdown + initialize either works or says why not."""
    mesh = setup(WORLD)
    f = jax.jit(jax.shard_map(lambda a, b: td.ag_matmul(a, b, "tp"), mesh=mesh,
                              in_specs=(P("tp", None), P(None, "tp")), out_specs=P(None, "tp")))
    x, w = rand((WORLD * 2, 16)), rand((16, WORLD * 8))
    f(place(mesh, x, P("tp", None)), place(mesh, w, P(None, "tp"))).block_until_ready()
    td.shutdown()
    setup(WORLD)
    x, w = rand((WORLD * 2, 16)), rand((16, WORLD * 8))
    try:
        out = f(place(mesh, x, P("tp", None)), place(mesh, w, P(None, "tp")))
    except Exception as e:  # noqa: BLE001
        assert "initialize" in str(e), f"unhelpful error after re-initialize: {e!r}"
    else:
        assert rel_err(out, f64(x) @ f64(w)) < 1e-5


def test_errors_context_maps_only_jaxtdist_messages():
    with pytest.raises(td.WorkerDiedError, match="^process 1 died") as info:
        with td.errors():
            raise ValueError("UNAVAILABLE: jaxtdist.WorkerDiedError: process 1 died")
    assert isinstance(info.value.__cause__, ValueError)
    with pytest.raises(td.HeapExhaustedError):
        with td.errors():
            raise td.HeapExhaustedError("full")  # already typed: unchanged
    with pytest.raises(KeyError):
        with td.errors():
            raise KeyError("jaxtdist.NoSuchError: not one of ours")
    with pytest.raises(ValueError, match="plain"):
        with td.errors():
            raise ValueError("plain")


def test_a_kernel_failing_on_one_rank_releases_its_peers():
    """A kernel that raises on rank 0 (before its notify) fails the call at once on
    every rank, not at the peers' wait bound, and every later call fails at once
    naming it, until shutdown and initialize (signals are out of step)."""
    mesh = setup((2,), ("tp",), wait_timeout_s=60.0)
    x = place(mesh, np.ones((2, 1), np.float32), P("tp", None))

    def call(kernel):
        return jax.jit(jax.shard_map(
            lambda v: td.triton_call(v[0], kernel=kernel, grid=(1,), axis_name="tp",
                                     out_shape=jax.ShapeDtypeStruct((1,), jnp.float32),
                                     workspace_bytes=64)[None],
            mesh=mesh, in_specs=P("tp", None), out_specs=P("tp", None)))(x)

    start = time.monotonic()
    with pytest.raises(jax.errors.JaxRuntimeError, match="fails_on_rank0_kernel failed on mesh "
                                                         "position 0"):
        np.asarray(call(K.fails_on_rank0_kernel))
    with pytest.raises(jax.errors.JaxRuntimeError, match="(?s)KernelFailed.*fails_on_rank0_"
                                                         "kernel.*jaxtdist.shutdown"):
        np.asarray(call(K.rank_as_float_kernel))
    assert time.monotonic() - start < 30, "a rank waited out its bound"
    td.shutdown()
    setup((2,), ("tp",), wait_timeout_s=60.0)
    x = place(mesh, np.ones((2, 1), np.float32), P("tp", None))
    np.testing.assert_array_equal(np.asarray(call(K.rank_as_float_kernel)), [[0.0], [1.0]])


@pytest.mark.parametrize("grid", [(0,), (-1,), 1.5, (1, 1, 1, 1), (), True])
def test_triton_call_refuses_a_grid_that_launches_nothing_or_cannot_launch(grid):
    mesh = setup((2,), ("tp",))
    with pytest.raises(ValueError, match=r"grid=.* must be a positive int or a tuple of 1 to 3"):
        jax.jit(jax.shard_map(
            lambda: td.triton_call(kernel=K.ids_kernel, grid=grid, axis_name="tp",
                                   out_shape=jax.ShapeDtypeStruct((3,), jnp.int32))[None],
            mesh=mesh, in_specs=(), out_specs=P("tp")))()


def test_triton_call_takes_numpy_scalars_and_refuses_other_arguments():
    """NumPy scalars and bools are run-time scalars (the interpreter refused them);
    None or a string, and an out_shape that is no ShapeDtypeStruct, are refused at
    trace time naming the argument."""
    mesh = setup((2,), ("tp",))
    x = place(mesh, np.arange(2 * 8, dtype=np.float32).reshape(2, 8), P("tp", None))

    def run(scale, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32)):
        return jax.jit(jax.shard_map(
            lambda v: td.triton_call(v[0], scale, kernel=K.scale_kernel, grid=(1,),
                                     axis_name="tp", out_shape=out_shape, N=8)[None],
            mesh=mesh, in_specs=P("tp", None), out_specs=P("tp", None)))(x)

    for scale in (np.float32(1.5), np.int64(3), True):
        np.testing.assert_allclose(np.asarray(run(scale)), np.asarray(x) * float(scale))
    for bad in (None, "2"):
        with pytest.raises(ValueError, match=r"argument 1 of kernel scale_kernel is"):
            run(bad)
    with pytest.raises(ValueError, match=r"out_shape=\(8,\) .* must be a jax.ShapeDtypeStruct"):
        run(2.0, out_shape=(8,))


def test_an_ahead_of_time_program_after_shutdown_says_what_to_do():
    """A compiled program run after shutdown (no runtime at all): the message said
    runtime #0 was active and omitted both initialize and compiling again."""
    mesh = setup(2)
    x = place(mesh, rand((4, 16)), P("tp"))
    compiled = jax.jit(jax.shard_map(lambda a: td.all_gather(a, "tp"), mesh=mesh,
                                     in_specs=P("tp"), out_specs=P("tp"))).lower(x).compile()
    td.shutdown()
    with pytest.raises(Exception, match=r"no runtime is active \(jaxtdist.shutdown ran\).*"
                                        r"Call jaxtdist.initialize\(mesh\), then trace it again"
                                        r".*must be lowered and compiled again"):
        jax.block_until_ready(compiled(x))
