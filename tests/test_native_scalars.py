"""Scalar arguments of jaxtdist's native Triton launcher (runtime/_cuda_launch.py,
csrc/triton_launch.cc): typed as Triton's JIT types them, compiled once for
every value (no value in the signature or the cache key), passed to the handler
as attributes. The compile tests build for sm_90 on any machine; the launch test
needs a CUDA GPU and skips without one."""

from __future__ import annotations

import re
import types

import numpy as np
import pytest

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from jaxtdist.runtime import _cuda_launch, _native  # noqa: E402


@triton.jit
def axpb_kernel(x_ptr, n, alpha, shift, out_ptr, BLOCK: tl.constexpr):
    """out[i] = alpha * x[i] + shift for i < n (n: i32, alpha: fp32, shift: i64)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, alpha * x + shift.to(tl.float32), mask=mask)


@pytest.fixture(autouse=True)
def _fresh_launcher_cache():
    """A test that fakes the native registration must not leave its fake kernel ids
    in the launcher's cache, where a later real launch of the same kernel finds them."""
    _cuda_launch._registered.cache_clear()
    yield
    _cuda_launch._registered.cache_clear()


def _skip_without_ptxas(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except RuntimeError as e:  # no ptxas usable here
        if "ptxas" in str(e).lower():
            pytest.skip(f"cannot assemble for sm_90 here: {e}")
        raise


def test_scalar_types_follow_tritons_jit():
    st = _cuda_launch.scalar_type
    assert [st(v) for v in (0, 1, 16, -2**31, 2**31 - 1)] == ["i32"] * 5
    assert [st(v) for v in (2**31, -2**31 - 1, 2**62, np.int64(2**40))] == ["i64"] * 4
    assert st(np.int64(3)) == st(np.int8(3)) == "i32"  # numpy ints: by value
    assert st(1.0) == st(np.float64(0.5)) == st(np.float32(2)) == "fp32"
    assert st(True) == st(np.bool_(False)) == "i1"
    with pytest.raises(ValueError, match="int64"):
        st(2**63)


def test_launch_operands_keep_argument_order():
    x = np.zeros(8, np.float32)
    out = np.zeros(8, np.float32)
    args = (x, 5, 1.5, 2**40, True, x)
    types_ = _cuda_launch.argument_types(args, [out])
    assert types_ == ("*fp32", "i32", "fp32", "i64", "i1", "*fp32", "*fp32")
    arrays, kinds, scalars = _cuda_launch.launch_operands(args, types_)
    assert len(arrays) == 2 and all(a is x for a in arrays)
    # csrc/triton_launch.h ParamKind: 0 buffer, 1 i32, 2 i64, 3 fp32, 4 i1.
    assert kinds.tolist() == [0, 1, 3, 2, 4, 0, 0] and kinds.dtype == np.int64
    assert scalars.dtype == np.int64
    assert scalars.tolist() == [5, int(np.float32(1.5).view(np.uint32)), 2**40, 1]


def test_one_signature_for_every_value():
    x = np.zeros(8, np.float32)
    sig = _cuda_launch.argument_types
    assert sig((x, 1, 1.0, 16), [x]) == sig((x, 4096, -3.5, 7), [x])


def test_scalar_kernel_compiles_once_for_two_values(monkeypatch):
    """Two launches that differ only in their scalars' values share one
    compiled, registered kernel; its parameters are the pointers and the
    scalars in argument order (no value specialized away), then the scratch."""
    registered = []

    def register(cubin, name, warps, shared, scratch, uses_shmem=False):
        registered.append(name)
        return len(registered) - 1

    monkeypatch.setattr(_native, "native",
                        lambda: types.SimpleNamespace(register_triton_kernel=register))
    compiles = []
    real_compile = _cuda_launch.compile_kernel

    def compile_kernel(*a, **kw):
        compiled = real_compile(*a, **kw)
        compiles.append(compiled)
        return compiled

    monkeypatch.setattr(_cuda_launch, "compile_kernel", compile_kernel)
    x = np.zeros(1024, np.float32)
    first = second = None
    # Values Triton's JIT would specialize on (1, multiples of 16) and others.
    for values in [(1, 1.0, 2**40), (1000, -2.5, -(2**33) + 16)]:
        key = _cuda_launch.argument_types((x,) + values, [x])
        got = _skip_without_ptxas(_cuda_launch._registered, axpb_kernel, key,
                                  (("BLOCK", 256),), 4, 1, 90)
        first, second = (got, None) if first is None else (first, got)
    assert second == first
    assert len(compiles) == 1 and len(registered) == 1
    compiled = compiles[0]
    # Triton's ABI: x, n, alpha, shift, out, then the global and profile scratch.
    ptx = compiled.asm["ptx"]
    params = re.findall(r"\.param \.(\w+)( \.ptr)?[^,)]* axpb_kernel_param_\d+",
                        ptx.split(")")[0])
    assert params == [("u64", " .ptr"), ("u32", ""), ("f32", ""), ("u64", "")] + [
        ("u64", " .ptr")] * 3, params
    # The value-taking arguments carry no specialization attributes (1, % 16).
    ttir = compiled.asm["ttir"]
    head = ttir[ttir.index("tt.func"):].split("{\n")[0]
    for arg, ty in [("%n", "i32"), ("%alpha", "f32"), ("%shift", "i64")]:
        assert re.search(rf"{arg}: {ty} loc", head), head
    assert head.count("tt.divisibility") == 2  # the two pointers only


@triton.jit
def flag_kernel(x_ptr, flag, out_ptr):
    v = tl.load(x_ptr)
    if flag:
        v = v + 1
    tl.store(out_ptr, v)


def test_bool_is_a_byte_parameter():
    """A bool is i1, which the kernel takes as one byte (the handler's kParamI1)."""
    x = np.zeros(4, np.float32)
    key = _cuda_launch.argument_types((x, True), [x])
    assert key == ("*fp32", "i1", "*fp32")
    compiled = _skip_without_ptxas(_cuda_launch.compile_kernel, flag_kernel, key, {}, 4, 1, 90)
    assert ".param .u8 flag_kernel_param_1," in compiled.asm["ptx"]


def _gpu_or_skip():
    import jax
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus:
        pytest.skip("needs a CUDA GPU (the native launcher's handler is CUDA-only)")
    if not _native.native().with_cuda:
        pytest.skip("the native library was built without CUDA headers")
    return gpus


@pytest.mark.gpu
def test_launch_with_runtime_scalars():
    """The handler packs the scalars between the pointers: two values of each,
    one compiled kernel."""
    gpus = _gpu_or_skip()
    import functools

    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import jaxtdist as td
    from jaxtdist.runtime import runtime

    mesh = Mesh(np.array(gpus[:1]), ("tp",))
    td.initialize(mesh)
    rt = runtime()
    size = 1000
    x = jax.device_put(jnp.arange(size, dtype=jnp.float32), NamedSharding(mesh, P("tp")))
    before = _cuda_launch._registered.cache_info().misses

    def run(n, alpha, shift):
        @jax.jit
        @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"),
                           check_vma=False)
        def f(v):
            out = jax.ShapeDtypeStruct(v.shape, v.dtype)
            return _cuda_launch.launch(rt, axpb_kernel, (v, n, alpha, shift), [out],
                                       (-(-size // 256),), 4, 1, dict(BLOCK=256))[0]
        return np.asarray(f(x))

    ref = np.arange(size, dtype=np.float32)
    # shift: i64 both times (a lost high word would show).
    for n, alpha, shift in [(size, 2.0, 2**33), (size // 2, -0.5, -(2**34))]:
        got = run(n, alpha, shift)
        want = np.float32(alpha) * ref[:n] + np.float32(shift)
        np.testing.assert_allclose(got[:n], want, rtol=1e-6)
    assert _cuda_launch._registered.cache_info().misses - before == 1
