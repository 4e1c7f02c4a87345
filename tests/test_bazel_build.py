"""The Bazel build (WORKSPACE, bazel/, csrc/BUILD) yields a working native library.

The library comes from $JAXTDIST_BAZEL_LIB (e.g. ``JAXTDIST_BAZEL_LIB=$(bash
.ci/bazel.sh | tail -1)``) or from running ``bazel build`` here. It is loaded
through $JAXTDIST_FFI_LIBRARY in a fresh process that runs one all_gather on
two CPU devices. Skipped without ``bazel`` unless JAXTDIST_REQUIRE_BAZEL=1.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TARGET = "//csrc:_jaxtdist_ffi.so"
BAZEL_OUT = ROOT / "bazel-bin" / "csrc" / "_jaxtdist_ffi.so"

PROGRAM = textwrap.dedent("""
    import functools
    import importlib
    import os

    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jaxtdist

    # `jaxtdist.runtime` the attribute may be the runtime() accessor; the module is:
    rt_mod = importlib.import_module("jaxtdist.runtime")
    lib = os.environ["JAXTDIST_FFI_LIBRARY"]
    used = rt_mod.native_library_path()
    assert os.path.realpath(used) == os.path.realpath(lib), (used, lib)

    mesh = jax.make_mesh((2,), ("x",))
    jaxtdist.initialize(mesh)

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    def ours(x):
        return jaxtdist.all_gather(x, axis_name="x")

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    def ref(x):
        return jax.lax.all_gather(x, "x", tiled=True)

    x = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
    x = jax.device_put(x, NamedSharding(mesh, P("x")))
    # out_specs=P("x") stacks each rank's gathered copy: shape (2 * 8, 16).
    got, want = np.asarray(ours(x)), np.asarray(ref(x))
    assert got.shape == want.shape == (16, 16), (got.shape, want.shape)
    np.testing.assert_array_equal(got, want)
    print("BAZEL_LIB_OK", used)
""")


def _bazel_library() -> pathlib.Path:
    env_lib = os.environ.get("JAXTDIST_BAZEL_LIB")
    if env_lib:
        path = pathlib.Path(env_lib)
        assert path.is_file(), f"JAXTDIST_BAZEL_LIB={env_lib!r} is not a file"
        return path
    bazel = shutil.which("bazel")
    if bazel is None:
        if os.environ.get("JAXTDIST_REQUIRE_BAZEL") == "1":
            pytest.fail("JAXTDIST_REQUIRE_BAZEL=1 but `bazel` is not on PATH "
                        "(apt-get install bazel-bootstrap bazel-rules-cc bazel-rules-java)")
        pytest.skip("`bazel` is not on PATH (apt-get install bazel-bootstrap bazel-rules-cc "
                    "bazel-rules-java, or set JAXTDIST_BAZEL_LIB)")
    proc = subprocess.run([bazel, "build", TARGET], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, f"bazel build {TARGET} failed:\n{proc.stdout}\n{proc.stderr[-8000:]}"
    assert BAZEL_OUT.is_file(), f"bazel build succeeded but {BAZEL_OUT} is missing"
    return BAZEL_OUT.resolve()


def test_bazel_built_library_runs_all_gather():
    lib = _bazel_library()
    env = dict(os.environ)
    env["JAXTDIST_FFI_LIBRARY"] = str(lib)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", PROGRAM], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (
        f"jaxtdist with the Bazel-built {lib} failed (rc={proc.returncode}):\n"
        f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    assert "BAZEL_LIB_OK" in proc.stdout
