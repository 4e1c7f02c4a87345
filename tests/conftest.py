"""Shared setup of the CPU suite: 8 host devices, meshes, random inputs, checks.

The environment must be set before JAX is imported anywhere, hence at the top
of this file. GPU runs (``JAXTDIST_TEST_GPU=1``, tests/gpu/) keep their
platform: only the host device count is added there.
"""

from __future__ import annotations

import os

_FLAG = "--xla_force_host_platform_device_count=8"
_xla_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _xla_flags:
    os.environ["XLA_FLAGS"] = (_xla_flags + " " + _FLAG).strip()
if os.environ.get("JAXTDIST_TEST_GPU") != "1":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests never read or write the user's tuning cache.
os.environ["JAXTDIST_TUNING_CACHE"] = os.path.join(
    __import__("tempfile").mkdtemp(prefix="jaxtdist-tests-"), "tuning.json")

import functools  # noqa: E402
import inspect  # noqa: E402
import itertools  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxtdist as td  # noqa: E402
from jaxtdist.runtime import DEFAULT_HEAP_BYTES, DEFAULT_WAIT_TIMEOUT_S  # noqa: E402

# Relative-error tolerances against a float64 reference. The interpreter's
# dot is numpy's, so float32 is exact to rounding.
TOL = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.float16): 5e-3,
       jnp.dtype(jnp.bfloat16): 2e-2}

_seeds = itertools.count(1000)


def cpu_only():
    return pytest.mark.skipif(jax.devices()[0].platform != "cpu",
                              reason="CPU suite (set JAXTDIST_TEST_GPU!=1)")


def slow():
    """Skips unless ``JAXTDIST_TEST_SLOW=1``: a test that would push CI (which runs
    the whole CPU suite within its time limit) over it; run by hand, or where
    time allows."""
    return pytest.mark.skipif(os.environ.get("JAXTDIST_TEST_SLOW") != "1",
                              reason="slow (over a minute): set JAXTDIST_TEST_SLOW=1")


def has_timeout_plugin() -> bool:
    try:
        import pytest_timeout  # noqa: F401
    except ImportError:
        return False
    return True


def timeout(seconds: int):
    """``pytest.mark.timeout`` when pytest-timeout is installed, else a no-op mark."""
    if has_timeout_plugin():
        return pytest.mark.timeout(seconds)
    return lambda f: f


def dp_tp_mesh(shape: tuple[int, int], explicit: bool = True) -> Mesh:
    """A ("dp", "tp") mesh over the first devices, Explicit axes (``jax.make_mesh``'s
    default) or Auto, with jaxtdist initialized on it (the layers' tests)."""
    types = (jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto,) * 2
    mesh = jax.make_mesh(shape, ("dp", "tp"), axis_types=types,
                         devices=jax.devices()[:int(np.prod(shape))])
    td.initialize(mesh, heap_bytes=DEFAULT_HEAP_BYTES["cpu"],
                  wait_timeout_s=DEFAULT_WAIT_TIMEOUT_S)
    return mesh


@functools.lru_cache(maxsize=None)
def mesh_of(shape: tuple[int, ...], names: tuple[str, ...]) -> Mesh:
    """A mesh over the first prod(shape) devices (cached: one object per shape)."""
    n = int(np.prod(shape))
    if len(jax.devices()) < n:
        pytest.skip(f"needs {n} devices, have {len(jax.devices())}")
    return Mesh(np.array(jax.devices()[:n]).reshape(shape), names)


def setup(shape, names=("tp",), **kwargs) -> Mesh:
    """Returns the mesh and makes sure the runtime runs on it with default settings.

    Explicit defaults make a runtime left with other settings (a tiny heap, a
    short wait limit) be replaced; a same-settings call is free.
    """
    if isinstance(shape, int):
        shape = (shape,)
    mesh = mesh_of(tuple(shape), tuple(names))
    kwargs.setdefault("heap_bytes", DEFAULT_HEAP_BYTES["cpu"])
    kwargs.setdefault("wait_timeout_s", DEFAULT_WAIT_TIMEOUT_S)
    td.initialize(mesh, **kwargs)
    return mesh


def gpu_mesh(world: int, axis: str) -> Mesh:
    """A 1-D mesh (Auto axis ``axis``) over the first ``world`` GPUs, with jaxtdist
    initialized on it at its default settings; skips when fewer are visible."""
    if len(jax.devices()) < world:
        pytest.skip(f"needs {world} GPUs, {len(jax.devices())} visible")
    mesh = jax.make_mesh((world,), (axis,), devices=jax.devices()[:world],
                         axis_types=(jax.sharding.AxisType.Auto,))
    td.initialize(mesh)
    return mesh


def rand(shape, dtype=jnp.float32, scale=1.0) -> np.ndarray:
    """Fresh standard-normal data (new seed on every call), rounded to ``dtype``,
    returned as a float32/64-exact numpy array in ``dtype``."""
    rng = np.random.default_rng(next(_seeds))
    x = rng.standard_normal(shape).astype(np.float32) * scale
    return np.asarray(jnp.asarray(x).astype(dtype))


def place(mesh, x, spec):
    return jax.device_put(jnp.asarray(x), NamedSharding(mesh, spec))


def rel_err(out, ref) -> float:
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert np.all(np.isfinite(out)), (
        f"{np.sum(~np.isfinite(out))} non-finite output elements (unwritten or corrupted)")
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def assert_close(out, ref, dtype, factor=1.0):
    err = rel_err(out, ref)
    tol = TOL[jnp.dtype(dtype)] * factor
    assert err < tol, f"relative error {err:.3g} >= {tol:.3g} ({jnp.dtype(dtype).name})"


def f64(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def _first_argument(text: str) -> str:
    """The text of a call's first argument: ``text`` up to its first top-level comma."""
    depth = 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                return text[:i].strip()
            depth -= 1
        elif ch == "," and depth == 0:
            return text[:i].strip()
    return text.strip()


def _mesh_key(item):
    """The mesh a test sets up, as far as its ``world`` parameter or its first
    ``setup(...)`` call tell (None when neither does): tests of one key share a
    runtime."""
    params = item.callspec.params if hasattr(item, "callspec") else {}
    if "world" in params:
        return repr(params["world"])
    try:
        source = inspect.getsource(item.function)
    except (AttributeError, OSError, TypeError):
        return None
    match = re.search(r"\bsetup\(", source)
    if match is None:
        return None
    arg = _first_argument(source[match.end():])
    return repr(params[arg]) if arg in params else arg


def pytest_collection_modifyitems(session, config, items):
    """Runs each file's tests grouped by the mesh they set up (groups in the order
    of their first test, tests in file order within a group). A test on another
    mesh than the last one's replaces the runtime: new interpreter workers (which
    interpret each kernel afresh) and cleared JAX caches, about a second or more
    each time; parametrized tests alternating worlds 2, 4, 8 paid that on nearly
    every test. Only the order changes: every test still sets up its own mesh."""
    ordered = []
    for _, group in itertools.groupby(items, key=lambda item: item.path):
        keyed = [(_mesh_key(item), item) for item in group]
        rank = {}
        for key, _ in keyed:
            rank.setdefault(key, len(rank))
        ordered += [item for _, item in sorted(keyed, key=lambda pair: rank[pair[0]])]
    items[:] = ordered


@pytest.fixture(autouse=True)
def _fresh_runtime_after_errors():
    """A test that left a timed-out (poisoned) runtime behind must not fail later ones."""
    yield
    if td.is_initialized():
        try:
            td.check_errors()
        except td.WaitTimeoutError:
            td.shutdown()


@pytest.fixture(scope="session", autouse=True)
def _shutdown_at_end():
    yield
    if td.is_initialized():
        td.shutdown()


@pytest.fixture
def ce_launches(monkeypatch):
    """The keyword arguments (constexprs) of every copy-engine ag_matmul kernel
    launched while the test runs, in order (recorded when jit traces)."""
    from jaxtdist.kernels.ag_matmul import ag_matmul_ce_kernel
    from jaxtdist.ops._protocol import Call
    seen = []
    launch = Call.launch

    def record(self, kernel, *args, **kwargs):
        if kernel is ag_matmul_ce_kernel:
            seen.append(kwargs)
        return launch(self, kernel, *args, **kwargs)

    monkeypatch.setattr(Call, "launch", record)
    return seen


def ag_matmul_fn(mesh, config=None, axis="tp", batch=None):
    """jit(shard_map) of ``ag_matmul_with_gathered`` over ``axis`` with ``config``:
    x rows and w columns sharded (x rows also over ``batch``, if given)."""
    from jaxtdist.ops.ag_matmul import ag_matmul_with_gathered
    return jax.jit(jax.shard_map(
        lambda x, w: ag_matmul_with_gathered(x, w, axis, config=config,
                gathered=False)[0], mesh=mesh,
        in_specs=(P((batch, axis) if batch else axis, None), P(None, axis)),
        out_specs=P(batch, axis)))


def users_gather(axis: str = "tp"):
    """``jaxtdist.run_once``'s docstring example: a user's custom VJP around
    ``all_gather`` (backward: ``reduce_scatter``) marking its forward rule's outputs."""

    @jax.custom_vjp
    def gather(x):
        return td.all_gather(x, axis)

    gather.defvjp(lambda x: (td.run_once(gather(x)), None),
                  lambda _, ct: (td.reduce_scatter(ct, axis),))
    return gather


def check_config_errors(cases, x_shape=(64, 64), w_shape=(64, 64)):
    """Each (config, message) of ``cases`` raises ValueError with that message on a
    2-rank ag_matmul call of float32 x and w (global shapes)."""
    mesh = setup(2)
    x = place(mesh, rand(x_shape, jnp.float32), P("tp", None))
    w = place(mesh, rand(w_shape, jnp.float32), P(None, "tp"))
    for config, match in cases:
        with pytest.raises(ValueError, match=match):
            ag_matmul_fn(mesh, config)(x, w)


def check_ag_matmul_call(mesh, f, world, m, k, n, dtype):
    """One call of an ag_matmul ``f`` over "tp" (x rows, w columns sharded) on fresh
    random x [world * m, k] and w [k, world * n], against the float64 product."""
    x = rand((world * m, k), dtype)
    w = rand((k, world * n), dtype)
    assert_close(f(place(mesh, x, P("tp", None)), place(mesh, w, P(None, "tp"))),
                 f64(x) @ f64(w), dtype)


@pytest.fixture
def faked_timing(monkeypatch):
    """The benchmark harness on CPU with faked timing: every contender runs (once per
    iteration, its outputs still checked) and reports 1.0 and 2.0 us samples."""
    if jax.devices()[0].platform != "cpu":
        pytest.skip("CPU: the timing is faked")
    from jaxtdist.bench import harness

    def measure(fn, args, iterations, world):
        out = None
        for _ in range(iterations):
            out = fn(*args)
        return out, dict(mean_us=1.5, min_us=0.5, samples_us=[1.0, 2.0],
                         min_samples_us=[0.0, 1.0], kernels=["k"])

    real = harness.interleaved
    monkeypatch.setattr(harness, "interleaved",
                        lambda c, it, rounds: real(c, it, rounds, measure=measure))
