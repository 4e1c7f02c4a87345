"""The op platform: import structure, the heap-backend seam, the op mechanism
(world 1, autodiff, program order) and typed configs."""

from __future__ import annotations

import ast
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxtdist as td
from tests.conftest import assert_close, cpu_only, f64, place, rand, setup

pytestmark = cpu_only()

PACKAGE = pathlib.Path(td.__file__).parent


# The layer order (language -> kernels -> runtime -> ops -> tune, nn -> bench) and
# the no-circle check, lazy and by-name imports included, are
# tests/test_import_graph.py.


def test_kernels_import_no_jax():
    for path in (PACKAGE / "kernels").glob("*.py"):
        tree = ast.parse(path.read_text())
        names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                 for a in n.names}
        names |= {n.module.split(".")[0] for n in ast.walk(tree)
                  if isinstance(n, ast.ImportFrom) and n.module}
        assert "jax" not in names, f"{path.name} imports jax"


# -- the heap-backend seam -------------------------------------------------------

def test_backends_implement_the_seam():
    from jaxtdist.runtime import _backend

    setup(2)
    rt = td.runtime.runtime()
    assert isinstance(rt.backend, _backend.HeapBackend)
    assert rt.backend_name == "cpu-shared-memory"
    assert list(rt.backend.positions) == [0, 1]
    from jaxtdist.runtime._cuda import CudaHeap
    for name in ("positions", "base_of", "ordinal_of", "error_record", "scratch", "write",
                 "read", "aligns_at_launch", "launch", "close", "has_copy_engines"):
        assert hasattr(CudaHeap, name), name


def test_unserved_mesh_names_the_missing_backend(monkeypatch):
    """A GPU mesh spanning processes with no NVSHMEM backend available (a build
    without it) is refused naming the backend and why it is missing."""
    import types

    from jaxtdist.runtime import _backend

    monkeypatch.setattr(_backend, "_REGISTRY",
                        [e for e in _backend._REGISTRY if e.name != "nvshmem"])
    monkeypatch.setattr(_backend, "_import_lazy", lambda name: "its module is absent")
    devices = tuple(types.SimpleNamespace(process_index=i, platform="gpu") for i in range(2))
    spec = _backend.BackendSpec("gpu", devices, 1 << 20, None)
    assert spec.multi_process
    with pytest.raises(NotImplementedError, match="NVSHMEM backend.*its module is absent"):
        _backend.create_backend(spec)


def test_a_registered_backend_serves_its_meshes():
    """A backend registered for a kind of mesh is the one the runtime creates (the
    seam an NVSHMEM or ROCm backend slots into); the newest registration wins."""
    from jaxtdist.runtime import _backend
    from jaxtdist.runtime._cpu import CpuHeap

    made = []

    def factory(spec):
        made.append(spec)
        return CpuHeap(len(spec.devices), spec.heap_bytes)

    _backend.register_backend("test-cpu", factory, applies=lambda s: s.platform == "cpu")
    try:
        td.shutdown()
        mesh = setup(2)
        rt = td.runtime.runtime()
        assert rt.backend_name == "test-cpu" and len(made) == 1
        x = rand((8, 3), jnp.float32)
        f = jax.jit(jax.shard_map(lambda v: td.all_gather(v, "tp"), mesh=mesh,
                                  in_specs=P("tp"), out_specs=P(), check_vma=False))
        np.testing.assert_array_equal(np.asarray(f(place(mesh, x, P("tp")))), x)
    finally:
        _backend._REGISTRY[:] = [e for e in _backend._REGISTRY if e.name != "test-cpu"]
        td.shutdown()


# -- world 1: the local computation ---------------------------------------------

def test_world_one_is_the_local_computation():
    """On an axis of size 1, ag_matmul is x @ w and all_gather is x: no prologue, no
    kernel, no workspace (the HLO has no custom call), and the same numbers as XLA."""
    mesh = setup((4, 1), ("dp", "tp"))
    rt = td.runtime.runtime()
    used = rt.bytes_in_use
    x = rand((4 * 6, 16), jnp.bfloat16)
    w = rand((16, 8), jnp.bfloat16)

    def body(a, b):
        return td.ag_matmul(a, b, "tp"), td.all_gather(a, "tp"), td.all_gather(a, "tp",
                                                                             tiled=False)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(("dp", "tp"), None), P(None, "tp")),
                              out_specs=(P("dp", "tp"), P("dp"), P("dp")), check_vma=False))
    args = (place(mesh, x, P(("dp", "tp"), None)), place(mesh, w, P(None, "tp")))
    assert "custom_call" not in f.lower(*args).as_text()
    out, gathered, stacked = f(*args)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(jnp.asarray(x) @ jnp.asarray(w)))
    np.testing.assert_array_equal(np.asarray(gathered), x)
    assert stacked.shape == (4, 6, 16)
    assert rt.bytes_in_use == used


# -- autodiff through the mechanism ----------------------------------------------

@pytest.mark.parametrize("axis,tiled", [(0, True), (1, True), (0, False), (-1, False)])
def test_all_gather_grad_is_a_reduce_scatter(axis, tiled):
    mesh = setup(4)
    x = rand((4 * 3, 5), jnp.float32)
    t = rand((4 * 3, 5), jnp.float32)  # weights of the loss, replicated per rank below

    def loss(fn, xb):
        g = fn(xb)
        return jnp.sum(jnp.sin(g) * jnp.cos(g))

    def per_rank(fn):
        return jax.jit(jax.shard_map(jax.grad(lambda xb: loss(fn, xb)), mesh=mesh,
                                     in_specs=P("tp"), out_specs=P("tp")))

    ours = per_rank(lambda v: td.all_gather(v, "tp", axis=axis, tiled=tiled))
    ref = per_rank(lambda v: jax.lax.all_gather(v, "tp", axis=axis, tiled=tiled))
    xs = place(mesh, x, P("tp"))
    del t
    assert_close(ours(xs), f64(ref(xs)), jnp.float32)


def test_triton_call_names_its_missing_backward():
    from tests.kernels_for_tests import ring_kernel

    mesh = setup(2)

    def loss(v):
        out = td.triton_call(v, kernel=ring_kernel, grid=(1,), axis_name="tp", N=v.size, BLOCK=16,
                             out_shape=jax.ShapeDtypeStruct(v.shape, v.dtype),
                             workspace_bytes=256 + 8 * v.size)
        return jnp.sum(out)

    f = jax.jit(jax.shard_map(jax.grad(loss), mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))
    with pytest.raises(TypeError, match="triton_call is not differentiable"):
        f(place(mesh, rand((2 * 64,), jnp.float32), P("tp")))


# -- typed configs ---------------------------------------------------------------

def test_configs_are_typed_and_name_their_keys():
    from jaxtdist.ops._ag_matmul_config import AgMatmulConfig
    from jaxtdist.ops._config import Problem
    from jaxtdist.ops.all_gather import AllGatherConfig

    problem = Problem("gpu", 4, (1024, 4096, 4096), "bfloat16")
    cfg = AgMatmulConfig.default(problem)
    assert cfg.variant == "ce" and cfg.PUSH_ORDER == "serial"
    cfg.validate(problem)
    with pytest.raises(ValueError, match=r"unknown config keys \['BLOK_M'\]"):
        cfg.replace(BLOK_M=64)
    with pytest.raises(ValueError, match="BLOCK_N=96 must be a power of 2"):
        cfg.replace(BLOCK_N=96).validate(problem)
    with pytest.raises(ValueError, match="BLOCK_C=3 must be a power of 2"):
        AllGatherConfig().replace(BLOCK_C=3).validate(Problem("gpu", 2, (8, 8), "float32"))
    assert len(AgMatmulConfig.search_space(problem)) > 5
    # float32: the TMA GEMM (K-major w) where rows allow it, 128-wide tiles at most;
    # the pointer GEMM where they do not.
    for world, rows in ((1, 4096), (4, 512)):
        f32 = Problem("gpu", world, (rows, 4096, 4096), "float32")
        cfg = AgMatmulConfig.default(f32)
        assert cfg.variant == "ce" and cfg.BLOCK_N <= 128 and cfg.BLOCK_K == 32, cfg
        cfg.validate(f32)
    ragged = Problem("gpu", 2, (1000, 4096, 4096), "float32")
    assert not AgMatmulConfig.default(ragged).TMA


def test_shipped_configs_hold_configs_only():
    import json

    from jaxtdist.ops._ag_matmul_config import AgMatmulConfig
    from jaxtdist.ops._config import Problem
    from jaxtdist.runtime._config_cache import SHIPPED

    data = json.loads(SHIPPED.read_text())
    assert {"jaxtdist", "triton", "format", "entries"} <= set(data)
    for key, entry in data["entries"].items():
        assert set(entry) == {"config", "variant"}, key
        op, _, world, dims, dtype = key.split("|")
        problem = Problem("gpu", int(world.split("=")[1]),
                          tuple(int(d) for d in dims.split("x")), dtype)
        cfg = AgMatmulConfig.settle(AgMatmulConfig.default(problem), entry["config"])
        cfg.validate(problem)
        assert cfg.variant == entry["variant"], key


def test_results_are_typed_like_jax_lax_collectives():
    """all_gather's and ag_matmul's results vary over the axes their inputs vary
    over, as jax.lax.all_gather's (so gradients through either agree), and stay
    replicated over mesh axes no input varies over."""
    from jaxtdist.ops._protocol import varying_axes

    mesh = setup((2, 2), ("dp", "tp"))
    seen = {}

    def body(v, w):
        ours, theirs = td.all_gather(v, "tp"), jax.lax.all_gather(v, "tp", tiled=True)
        seen["all_gather"] = (varying_axes(ours), varying_axes(theirs))
        seen["ag_matmul"] = (varying_axes(td.ag_matmul(v, w, "tp")),
                             varying_axes(theirs @ w))
        return ours

    jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(None, "tp")),
                          out_specs=P("tp"))).trace(
        place(mesh, rand((4, 3), jnp.float32), P("tp")),
        place(mesh, rand((3, 4), jnp.float32), P(None, "tp")))
    for name, (ours, theirs) in seen.items():
        assert ours == theirs == frozenset({"tp"}), (name, ours, theirs)


def test_every_op_is_tunable_through_one_engine():
    from jaxtdist.ops._config import KernelConfig

    assert {"ag_matmul", "all_gather"} <= set(td.tune.tunable_ops())
    with pytest.raises(ValueError, match="no tunable op 'nope'"):
        td.tune.tune("nope", (1,), jnp.float32, measure=lambda *a: 0.0)
    assert KernelConfig.variant.fget(None) == "default"


def test_all_gather_tuning_on_cpu_with_a_given_measure():
    """The one engine tunes all_gather too (timing faked on CPU), checking every
    candidate's output exactly first."""
    setup(2)
    seen = []

    def measure(fn, args, world, iterations):
        seen.append(fn)
        return 10.0 - len(seen)

    result = td.tune.tune("all_gather", (8, 16), jnp.float32, axis_name="tp",
                          candidates=[{}, dict(BLOCK_C=8), dict(BLOCK_C=3)], measure=measure,
                          save=False)
    assert result["config"]["BLOCK_C"] == 8 and result["variant"] == "pull"
    assert "power of 2" in result["tried"][2]["error"]


@pytest.mark.parametrize("w_spec", [P(None, "tp"), P(None, None)])
def test_ag_matmul_grad_with_sharded_or_replicated_weight(w_spec):
    """Gradients with the weight sharded over the group or replicated (then the
    weight's cotangent is summed over the group, as JAX's typing says)."""
    mesh = setup(2)
    x, w = rand((2 * 4, 6), jnp.float32), rand((6, 4), jnp.float32)

    def loss(a, b):
        return jnp.sum(jnp.sin(td.ag_matmul(a, b, "tp")) * jnp.sum(td.all_gather(a, "tp")))

    f = jax.jit(jax.shard_map(jax.grad(loss, argnums=(0, 1)), mesh=mesh,
                              in_specs=(P("tp", None), w_spec), out_specs=(P("tp", None), w_spec)))
    gx, gw = f(place(mesh, x, P("tp", None)), place(mesh, w, w_spec))
    # The rank losses add up (as with jax.lax.all_gather): with w sharded they cover
    # the product's columns once; with w replicated each rank's covers all of it.
    copies = 1 if w_spec == P(None, "tp") else 2
    ref = jax.grad(lambda a, b: copies * jnp.sum(jnp.sin(a @ b) * jnp.sum(a)), argnums=(0, 1))
    rx, rw = ref(jnp.asarray(x), jnp.asarray(w))
    assert_close(gx, f64(rx), jnp.float32, factor=10)
    assert_close(gw, f64(rw), jnp.float32, factor=10)
