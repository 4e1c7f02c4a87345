"""jaxtdist's FFI calls: XLA side effects without a JAX effect (runtime/_ffi.py).

Lowered for CUDA on the CPU machine: no GPU is needed to check the HLO.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxtdist import _errors as td_errors
from jaxtdist.interpret import KernelFailed
from jaxtdist.runtime import _ffi

from tests.conftest import setup

TARGET = "jaxtdist_test_target"


def _custom_calls(fn, *args) -> list[str]:
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return [line.strip() for line in text.splitlines() if "stablehlo.custom_call" in line]


@pytest.mark.parametrize("aliases", [None, {0: 0}])
@pytest.mark.parametrize("several", [False, True])
def test_same_hlo_as_jax_ffi_call_without_an_effect(aliases, several):
    """The HLO is jax.ffi.ffi_call's with has_side_effect=True; the jaxpr has no
    effect, so jit keeps its C++ dispatch path."""
    spec = jax.ShapeDtypeStruct((4,), jnp.int32)
    specs = ([spec, jax.ShapeDtypeStruct((2, 3), jnp.bfloat16), jax.ShapeDtypeStruct((1,), jnp.float16)]
             if several else spec)
    attrs = dict(step=np.int64(3), groups=np.arange(6, dtype=np.int64).reshape(2, 3).reshape(-1))
    ours = _ffi.ffi_call(TARGET, specs, platform="gpu", input_output_aliases=aliases)
    theirs = jax.ffi.ffi_call(TARGET, specs, has_side_effect=True, input_output_aliases=aliases)
    x = jnp.arange(4, dtype=jnp.int32)
    assert jax.make_jaxpr(lambda v: ours(v, **attrs))(x).effects == set()
    assert jax.make_jaxpr(lambda v: theirs(v, **attrs))(x).effects != set()
    out = jax.eval_shape(lambda v: ours(v, **attrs), x)
    if several:
        assert [(o.shape, o.dtype) for o in out] == [((4,), jnp.int32), ((2, 3), jnp.bfloat16),
                                                     ((1,), jnp.float16)]
    else:
        assert (out.shape, out.dtype) == ((4,), jnp.int32)
    hlo = _custom_calls(lambda v: ours(v, **attrs), x)
    assert hlo == _custom_calls(lambda v: theirs(v, **attrs), x)
    assert len(hlo) == 1 and "has_side_effect = true" in hlo[0]


@pytest.mark.parametrize("check_vma", [False, True])
def test_inside_shard_map(check_vma):
    mesh = setup(4)
    call = _ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((4,), jnp.int32), platform="gpu")
    f = jax.shard_map(lambda v: call(v, step=np.int64(1)), mesh=mesh, in_specs=P("tp"),
                      out_specs=P("tp"), check_vma=check_vma)
    hlo = _custom_calls(f, jnp.zeros((16,), jnp.int32))
    assert len(hlo) == 1 and f"@{TARGET}" in hlo[0] and "has_side_effect = true" in hlo[0]


def test_cpu_lowers_like_jax_ffi_call_without_an_effect():
    """On CPU too: the HLO is jax.ffi.ffi_call's side-effecting custom call, the jaxpr
    has no effect (so remat and scan bodies can hold it)."""
    call = _ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((4,), jnp.int32), platform="cpu")
    theirs = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((4,), jnp.int32),
                              has_side_effect=True)
    x = jnp.zeros((4,), jnp.int32)
    assert jax.make_jaxpr(lambda v: call(v, step=np.int64(1)))(x).effects == set()

    def cpu_calls(fn):
        text = jax.jit(fn).trace(x).lower(lowering_platforms=("cpu",)).as_text()
        return [line.strip() for line in text.splitlines() if "stablehlo.custom_call" in line]

    ours = cpu_calls(lambda v: call(v, step=np.int64(1)))
    assert ours == cpu_calls(lambda v: theirs(v, step=np.int64(1)))
    assert len(ours) == 1 and "has_side_effect = true" in ours[0]


def test_kernels_have_no_derivative_of_their_own():
    call = _ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((4,), jnp.float32), op="my_op")
    with pytest.raises(TypeError, match=r"jaxtdist.my_op: the native call jaxtdist_test_target "
                                        "has no derivative"):
        jax.jvp(lambda v: call(v, step=np.int64(1)), (jnp.zeros(4),), (jnp.ones(4),))


def test_unused_outputs_are_not_dropped():
    """With no JAX effect, only the DCE rule keeps a call whose outputs nothing
    reads (in jit, in a nested jit, in a shard_map body)."""
    mesh = setup(4)
    call = _ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((4,), jnp.int32), platform="gpu")

    def body(v):
        call(v, step=np.int64(1))  # result dropped
        return v + 1

    nested = jax.jit(body)
    sharded = jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"))
    for fn, x in ((body, jnp.zeros((4,), jnp.int32)),
                  (lambda v: nested(v) * 2, jnp.zeros((4,), jnp.int32)),
                  (sharded, jnp.zeros((16,), jnp.int32))):
        assert len([c for c in _custom_calls(fn, x) if f"@{TARGET}" in c]) == 1


# -- host kernels (the CPU backend's kernel launches) ------------------------------

def test_host_kernel_runs_python_on_xla_buffers():
    """The callable gets read-only numpy arrays of the operands and fills every
    result (several dtypes, bfloat16 and an empty one), one call per device inside
    shard_map; the jaxpr has no effect."""
    mesh = setup(4)
    seen = []

    def host(a, b):
        seen.append((a.flags.writeable, a.dtype, b.dtype))
        return a * 2, (b.astype(np.float32) + 1).astype(b.dtype), np.zeros((0, 3), np.int32)

    specs = (jax.ShapeDtypeStruct((2, 3), jnp.float32), jax.ShapeDtypeStruct((5,), jnp.bfloat16),
             jax.ShapeDtypeStruct((0, 3), jnp.int32))

    def body(a, b):
        return tuple(_ffi.host_kernel(host, specs, a, b, op="test"))

    a = jnp.arange(4 * 2 * 3, dtype=jnp.float32).reshape(8, 3)
    b = jnp.arange(4 * 5).astype(jnp.bfloat16)
    assert jax.make_jaxpr(body)(a[:2], b[:5]).effects == set()
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P("tp")),
                              out_specs=(P("tp"), P("tp"), P("tp"))))
    x, y, z = f(a, b)
    np.testing.assert_array_equal(np.asarray(x), np.asarray(a) * 2)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(b, np.float32) + 1)
    assert z.shape == (0, 3)
    assert seen == [(False, np.dtype(np.float32), np.dtype(jnp.bfloat16))] * 4


def _raise(error):
    def host(v):
        raise error
    return host


@pytest.mark.parametrize("error,expected", [
    (td_errors.WaitTimeoutError("jaxtdist.WaitTimeoutError: a wait timed out after 1.0 s"),
     "DEADLINE_EXCEEDED: jaxtdist.WaitTimeoutError: a wait timed out after 1.0 s"),
    (td_errors.WorkerDiedError("jaxtdist: the interpreter worker of mesh position 1 died"),
     "UNAVAILABLE: jaxtdist.WorkerDiedError: the interpreter worker of mesh position 1 died"),
    (td_errors.JaxtdistError("jaxtdist: the runtime is gone"),
     "FAILED_PRECONDITION: jaxtdist.JaxtdistError: the runtime is gone"),
    (KernelFailed("jaxtdist: kernel k failed on mesh position 0 under the interpreter:\nboom"),
     "INTERNAL: jaxtdist.interpret.KernelFailed: kernel k failed on mesh position 0 under "
     "the interpreter:\nboom"),
    (ValueError("not jaxtdist's"), "INTERNAL: ValueError: not jaxtdist's"),
])
def test_host_kernel_error_is_the_status_and_jaxtdist_error(error, expected):
    """An exception becomes the call's XLA status, the message GPUs give: the status,
    the error's name and message, and no Python traceback."""
    spec = jax.ShapeDtypeStruct((4,), jnp.float32)
    f = jax.jit(lambda v: _ffi.host_kernel(_raise(error), [spec], v)[0])
    with pytest.raises(jax.errors.JaxRuntimeError) as info:
        np.asarray(f(jnp.zeros(4)))
    assert str(info.value) == expected


def test_host_kernel_wrong_result_is_an_internal_error():
    spec = jax.ShapeDtypeStruct((4,), jnp.float32)
    f = jax.jit(lambda v: _ffi.host_kernel(lambda a: (a[:2],), [spec], v)[0])
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=r"^INTERNAL: TypeError: the host kernel's result 0 is "
                             r"float32\[2\], expected float32\[4\]"):
        np.asarray(f(jnp.zeros(4)))


def test_host_kernel_is_released_with_its_owner():
    """The callable stays registered until its owner releases it (async dispatch may
    run an executable after JAX freed the Python object that lowered it); a program
    that calls it after that fails with a status saying why."""
    import gc

    owner = object()
    spec = jax.ShapeDtypeStruct((3,), jnp.float32)
    before = set(_ffi._host_callbacks)
    f = jax.jit(lambda v: _ffi.host_kernel(lambda a: (a + 1,), [spec], v, owner=owner)[0])
    compiled = f.lower(jnp.zeros(3)).compile()
    added = set(_ffi._host_callbacks) - before
    assert len(added) == 1
    out = compiled(jnp.ones(3))
    del f
    gc.collect()
    np.testing.assert_array_equal(np.asarray(out), [2, 2, 2])
    _ffi.release_host_kernels(owner)
    assert not added & set(_ffi._host_callbacks)
    # ValueError: jit's C++ path ran this small one-device program inline (JAX raises a
    # synchronous failure there as ValueError, with the same message).
    with pytest.raises((jax.errors.JaxRuntimeError, ValueError),
                       match=r"^FAILED_PRECONDITION: jaxtdist\.JaxtdistError: this program was "
                             r"traced for a jaxtdist runtime that is gone"):
        np.asarray(compiled(jnp.ones(3)))
