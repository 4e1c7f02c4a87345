"""jaxtdist.language.shmem (NVSHMEM-style device calls): the interpreter's lowering
on CPU with several ranks, and, for the NVIDIA lowering, compiling without a GPU
(a kernel calling NVSHMEM is refused outside the NVSHMEM heap; linked when
NVSHMEM's package and the CUDA toolkit are present)."""

from __future__ import annotations

import itertools
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxtdist as td
from tests import kernels_for_tests as K
from tests.conftest import cpu_only, place, rand, setup

_names = itertools.count()


def _gather_fn(mesh, world: int, n: int, name: str):
    def body(x):
        out = td.triton_call(x[0], kernel=K.shmem_all_gather_kernel,
                             out_shape=jax.ShapeDtypeStruct((world * n,), jnp.float32),
                             grid=(1,), axis_name="tp", name=name,
                             workspace_bytes=1024 + 2 * 4 * world * n, N=n, BLOCK=16)
        return out[None]

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp", None),
                                 out_specs=P("tp", None)))


@cpu_only()
@pytest.mark.parametrize("world", [2, 4, 8])
def test_put_based_all_gather(world):
    """Every rank gets every rank's x, over 4 calls (both buffer parities, reused)."""
    mesh = setup(world)
    n = 21  # not a multiple of BLOCK
    f = _gather_fn(mesh, world, n, f"shmem_gather_{next(_names)}")
    for _ in range(4):
        x = rand((world, n))
        out = np.asarray(f(place(mesh, x, P("tp", None))))
        np.testing.assert_array_equal(out, np.tile(x.reshape(1, -1), (world, 1)))


def _compile(shmem: bool):
    from jaxtdist.runtime import _cuda_launch

    return _cuda_launch.compile_kernel(K.shmem_all_gather_kernel, ("*i32", "*fp32", "*fp32"),
                                       {"N": 32, "BLOCK": 32, "WORKSPACE": 8192}, 4, 1, 90,
                                       shmem=shmem)


def _nvidia_lowering_available() -> str:
    from jaxtdist.language import _lowering

    if _lowering.TARGET != "cuda":
        return f"the language was imported for target {_lowering.TARGET!r}"
    return ""


def test_a_kernel_calling_nvshmem_is_refused_off_the_nvshmem_heap(monkeypatch):
    """Compiled for sm_90 (no GPU needed) for a runtime without NVSHMEM: a clear error."""
    if why := _nvidia_lowering_available():
        pytest.skip(why)
    with pytest.raises(td.JaxtdistError, match="NVSHMEM heap"):
        _compile(shmem=False)


def test_a_kernel_calling_nvshmem_links_into_a_cubin():
    """With NVSHMEM's package and the CUDA toolkit: ptxas -c, nvlink with the
    wrappers and libnvshmem_device.a, one cubin with NVSHMEM's device state."""
    if why := _nvidia_lowering_available():
        pytest.skip(why)
    from jaxtdist.runtime import _nvshmem

    try:
        _nvshmem.host_library_path()
    except td.JaxtdistError as e:
        pytest.skip(str(e).split(":")[1][:120])
    if not (shutil.which("nvcc") or os.environ.get("CUDA_HOME")):
        pytest.skip("no CUDA toolkit (nvcc)")
    compiled = _compile(shmem=True)
    assert b"nvshmemi_device_state_d" in compiled.asm["cubin"]
