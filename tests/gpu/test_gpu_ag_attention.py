"""jaxtdist.ag_attention on GPUs, against a float32 reference (attention over the
whole sequence on the host); skipped without GPUs (run with JAXTDIST_TEST_GPU=1,
as tests/gpu/run.sh does).

World 1 runs cuDNN where it takes the case, else the kernels (the op; and
``ag_attention_kernels`` everywhere); 2 and 4 GPUs run
them too, causal and not, GQA, odd lengths, chained calls on changing data, and
gradients (the fused backward)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxtdist as td
from jaxtdist.ops.ag_attention import ag_attention_kernels, attention
from tests.conftest import gpu_mesh

pytestmark = pytest.mark.skipif(
    jax.devices()[0].platform != "gpu", reason="needs CUDA GPUs (none visible)")

TOL = {jnp.bfloat16: 2e-2, jnp.float16: 5e-3, jnp.float32: 5e-3}
SP = P(None, "sp")
_seed = [0]


def _rand(shape, dtype):
    _seed[0] += 1
    x = np.random.default_rng(_seed[0]).standard_normal(shape, np.float32)
    return np.asarray(jnp.asarray(x).astype(dtype).astype(jnp.float32))


def _mesh(world):
    return gpu_mesh(world, "sp")


def _reference(q, k, v, causal):
    """float32 attention on the host's CPU device (HIGHEST precision)."""
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        return np.asarray(attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                    causal=causal))


def _rel(out, ref):
    out = np.asarray(out, np.float32)
    assert np.all(np.isfinite(out)), "non-finite output (unwritten or corrupted)"
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


def _put(mesh, dtype, *arrays):
    return tuple(jax.device_put(jnp.asarray(a, dtype), NamedSharding(mesh, SP)) for a in arrays)


def _check_calls(f, mesh, dtype, b, s, hq, hkv, d, causal, calls):
    """``calls`` calls of ``f`` on fresh q, k, v ([b, s, hq or hkv, d] global), each
    checked against the float32 reference."""
    for _ in range(calls):
        q = _rand((b, s, hq, d), dtype)
        k, v = (_rand((b, s, hkv, d), dtype) for _ in range(2))
        out = f(*_put(mesh, dtype, q, k, v))
        assert out.dtype == jnp.dtype(dtype)
        assert _rel(out, _reference(q, k, v, causal)) < TOL[dtype]


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("b,s,hq,hkv,d", [(1, 1000, 8, 2, 128), (2, 257, 4, 4, 64),
                                          (1, 512, 16, 2, 128)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kernels", [False, True])
def test_ag_attention(world, dtype, b, s, hq, hkv, d, causal, kernels):
    if kernels and world > 1:
        pytest.skip("ag_attention runs the kernel at world > 1 anyway")
    mesh = _mesh(world)
    op = ag_attention_kernels if kernels else td.ag_attention
    f = jax.jit(jax.shard_map(lambda q, k, v: op(q, k, v, "sp", causal=causal), mesh=mesh,
                              in_specs=(SP,) * 3, out_specs=SP))
    # Three calls: both staging parities, and one reused.
    _check_calls(f, mesh, dtype, b, world * s, hq, hkv, d, causal, 3)


@pytest.mark.parametrize("b,s,hq,hkv,d,grads", [(1, 1000, 8, 2, 128, True),
                                                (2, 4224, 32, 8, 128, False),
                                                (1, 300, 4, 2, 256, True)])
def test_ag_attention_float32_highest_fits_shared_memory(b, s, hq, hkv, d, grads):
    """float32 under "highest" precision (three TF32 products per dot: more shared
    memory per tile) with the default tiles: the forward kernel, and the op's
    gradients (the forward's defaults for few and for many programs, head dims
    128 and 256)."""
    mesh = _mesh(1)
    with jax.default_matmul_precision("highest"):
        f = jax.jit(jax.shard_map(lambda q, k, v: ag_attention_kernels(q, k, v, "sp"),
                                  mesh=mesh, in_specs=(SP,) * 3, out_specs=SP))
        _check_calls(f, mesh, jnp.float32, b, s, hq, hkv, d, True, 1)
        if not grads:
            return
        q = _rand((b, s, hq, d), jnp.float32)
        k, v = (_rand((b, s, hkv, d), jnp.float32) for _ in range(2))
        grad = jax.jit(jax.shard_map(
            lambda q, k, v: jax.grad(lambda q, k, v: jnp.sum(
                td.ag_attention(q, k, v, "sp") ** 2), argnums=(0, 1, 2))(q, k, v),
            mesh=mesh, in_specs=(SP,) * 3, out_specs=(SP,) * 3))
        got = grad(*_put(mesh, jnp.float32, q, k, v))
    with jax.default_device(jax.devices("cpu")[0]):
        want = jax.grad(lambda q, k, v: jnp.sum(attention(q, k, v, causal=True) ** 2),
                        argnums=(0, 1, 2))(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    for name, g, w in zip("qkv", got, want):
        assert _rel(g, np.asarray(w)) < 1e-4, f"d{name}"


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("gather", ["inbox", "peer"])
@pytest.mark.parametrize("causal", [True, False])
def test_ag_attention_gather_paths(world, gather, causal):
    """Both ways to reach peers' k and v: the copy engines' push into local inboxes
    (the default) and reads of peers' staged copies (the fallback), 3 calls each."""
    mesh = _mesh(world)
    b, s, hq, hkv, d = 2, 300, 8, 2, 128
    f = jax.jit(jax.shard_map(
        lambda q, k, v: td.ag_attention(q, k, v, "sp", causal=causal,
                                        config=dict(GATHER=gather)),
        mesh=mesh, in_specs=(SP,) * 3, out_specs=SP))
    _check_calls(f, mesh, jnp.bfloat16, b, world * s, hq, hkv, d, causal, 3)


@pytest.mark.parametrize("world", [2, 4])
def test_ag_attention_pushed_kv_outlives_the_copies(world):
    """The copy engines push each rank's [k | v] rows while the kernel runs; those
    rows must stay alive until the pushes end. With Hq = 2 Hkv the output is as
    large as them, so XLA would hand their buffer to the output if only the push
    kept them (seen on 4 x H200: rel err 0.11 on the first call). Ten calls, each
    checked, short sequences (the kernel ends while pushes are still on the link)."""
    mesh = _mesh(world)
    b, s, hq, hkv, d = 1, 1000, 8, 4, 128
    f = jax.jit(jax.shard_map(lambda q, k, v: td.ag_attention(q, k, v, "sp", causal=False),
                              mesh=mesh, in_specs=(SP,) * 3, out_specs=SP))
    _check_calls(f, mesh, jnp.bfloat16, b, world * s, hq, hkv, d, False, 10)


@pytest.mark.parametrize("world", [2, 4])
def test_ag_attention_chained_calls(world):
    """8 calls in one jit, each on the previous output plus fresh data (causal and
    not alternating), 4 jit calls: staging parities rewritten while peers may lag."""
    mesh = _mesh(world)
    b, s, h, d, calls = 1, 384, 8, 128, 8

    def chain(q, k, v, xs):
        for i in range(calls):
            q = td.ag_attention(q + xs[i], k, v, "sp", causal=i % 2 == 0)
        return q

    f = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=(SP, SP, SP, P(None, None, "sp")),
                              out_specs=SP))
    for _ in range(4):
        q, k, v = (_rand((b, world * s, h, d), jnp.float16) for _ in range(3))
        xs = _rand((calls, b, world * s, h, d), jnp.float16)
        out = f(*_put(mesh, jnp.float16, q, k, v),
                jax.device_put(jnp.asarray(xs, jnp.float16),
                               NamedSharding(mesh, P(None, None, "sp"))))
        expect = q
        for i in range(calls):
            q_in = np.asarray(jnp.asarray(expect + xs[i], jnp.float16), np.float32)
            expect = _reference(q_in, k, v, i % 2 == 0)
        assert _rel(out, expect) < 2e-2


@pytest.mark.parametrize("world", [2, 4])
def test_ag_attention_grad(world):
    mesh = _mesh(world)
    b, s, hq, hkv, d = 1, 128, 4, 2, 64
    q = _rand((b, world * s, hq, d), jnp.float32)
    k, v = _rand((b, world * s, hkv, d), jnp.float32), _rand((b, world * s, hkv, d), jnp.float32)
    c = _rand(q.shape, jnp.float32)
    grads = jax.jit(jax.shard_map(
        lambda q, k, v, c: jax.grad(lambda q, k, v: jnp.sum(
            td.ag_attention(q, k, v, "sp") * c), argnums=(0, 1, 2))(q, k, v),
        mesh=mesh, in_specs=(SP,) * 4, out_specs=(SP,) * 3))(*_put(mesh, jnp.float32, q, k, v, c))
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        expect = jax.grad(lambda q, k, v: jnp.sum(attention(q, k, v) * c), argnums=(0, 1, 2))(
            jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    for got, want in zip(grads, expect):
        assert _rel(got, np.asarray(want)) < 5e-3


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("b,s,hq,hkv,d", [(1, 1000, 8, 2, 128), (2, 257, 4, 4, 64),
                                          (1, 512, 16, 2, 128), (1, 384, 8, 1, 96)])
@pytest.mark.parametrize("causal", [True, False])
def test_ag_attention_fused_backward(world, dtype, b, s, hq, hkv, d, causal):
    """The fused backward (every world: at world 1 the kernels forced with config
    PATH='fused', where cuDNN would otherwise run) against float32 gradients of
    plain attention on the host, twice on fresh inputs; the forward of the op at
    world 1 is the kernel's, bit for bit."""
    if len(jax.devices()) < world:
        pytest.skip(f"needs {world} GPUs")
    mesh = _mesh(world)
    s = -(-s // world) * world
    fused = dict(PATH="fused")
    grad = jax.jit(jax.shard_map(
        lambda q, k, v, c: jax.grad(lambda q, k, v: jnp.sum(
            td.ag_attention(q, k, v, "sp", causal=causal, config=fused).astype(jnp.float32)
            * c),
            argnums=(0, 1, 2))(q, k, v),
        mesh=mesh, in_specs=(SP,) * 4, out_specs=(SP,) * 3))
    for _ in range(2):
        q = _rand((b, s, hq, d), dtype)
        k, v = (_rand((b, s, hkv, d), dtype) for _ in range(2))
        c = _rand(q.shape, jnp.float32)
        args = _put(mesh, dtype, q, k, v) + _put(mesh, jnp.float32, c)
        got = grad(*args)
        cpu = jax.devices("cpu")[0]
        with jax.default_device(cpu):
            expect = jax.grad(lambda q, k, v: jnp.sum(attention(q, k, v, causal=causal) * c),
                              argnums=(0, 1, 2))(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
        for name, g, want in zip("qkv", got, expect):
            assert g.dtype == jnp.dtype(dtype)
            assert _rel(g, np.asarray(want)) < TOL[dtype], f"d{name}"
    if world == 1:
        outs = [np.asarray(jax.jit(jax.shard_map(
            lambda q, k, v, fn=fn: fn(q, k, v, "sp", causal=causal, config=fused), mesh=mesh,
            in_specs=(SP,) * 3, out_specs=SP))(*args[:3]).astype(jnp.float32))
            for fn in (td.ag_attention, ag_attention_kernels)]
        np.testing.assert_array_equal(*outs)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("b,s,hq,hkv,d", [(2, 1000, 8, 2, 128), (1, 257, 4, 4, 64),
                                          (1, 300, 4, 1, 256), (1, 256, 4, 2, 96)])
@pytest.mark.parametrize("causal", [True, False])
def test_world_1_path(dtype, b, s, hq, hkv, d, causal):
    """At world 1 the op is cuDNN's flash attention where cuDNN takes the case (its
    output bit for bit, its gradients), else the kernels (bit for bit): the path
    ``jaxtdist.explain`` names."""
    from jaxtdist.ops.ag_attention import cudnn_refuses

    mesh = _mesh(1)
    q = _rand((b, s, hq, d), dtype)
    k, v = (_rand((b, s, hkv, d), dtype) for _ in range(2))
    c = _rand(q.shape, jnp.float32)
    args = _put(mesh, dtype, q, k, v)
    capability = str(getattr(jax.devices()[0], "compute_capability", ""))
    cudnn = not cudnn_refuses("gpu", capability, dtype, d)
    choice = td.explain(td.ag_attention, *args, axis_size=1, causal=causal)
    assert choice.path == ("decomposed" if cudnn else "fused"), str(choice)

    def run(fn):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(SP,) * 3, out_specs=SP))(*args)

    out = run(lambda q, k, v: td.ag_attention(q, k, v, "sp", causal=causal))
    if cudnn:
        want = run(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="cudnn"))
    else:
        want = run(lambda q, k, v: ag_attention_kernels(q, k, v, "sp", causal=causal))
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)),
                                  np.asarray(want.astype(jnp.float32)))
    grads = jax.jit(jax.shard_map(
        lambda q, k, v, c: jax.grad(lambda q, k, v: jnp.sum(
            td.ag_attention(q, k, v, "sp", causal=causal).astype(jnp.float32) * c),
            argnums=(0, 1, 2))(q, k, v),
        mesh=mesh, in_specs=(SP,) * 4, out_specs=(SP,) * 3))(*args, *_put(mesh, jnp.float32, c))
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        expect = jax.grad(lambda q, k, v: jnp.sum(attention(q, k, v, causal=causal) * c),
                          argnums=(0, 1, 2))(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    for name, g, e in zip("qkv", grads, expect):
        assert _rel(g, np.asarray(e)) < TOL[dtype], f"d{name}"


def _hopper():
    return str(getattr(jax.devices()[0], "compute_capability", "")) == "9.0"


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("b,s,hq,hkv", [(2, 2048, 4, 2), (1, 128, 2, 1), (3, 640, 8, 8)])
def test_warp_specialized_kernel_at_world_1(dtype, causal, b, s, hq, hkv):
    """The warp-specialized Gluon kernel (world 1's default on Hopper where it fits:
    head dim 128, S a multiple of 128) against the float32 reference on fresh
    inputs, call after call: one key block, and more blocks than its three K/V
    stages (the stage ring and the warpgroups' turns wrap); "auto" runs it, bit
    for bit; the Triton kernel within the same tolerance."""
    if not _hopper():
        pytest.skip("the warp-specialized kernel runs on Hopper (sm_90)")
    _check_kernel_choices(ag_attention_kernels, _mesh(1), dtype, b, s, hq, hkv, causal, 3)


def _check_kernel_choices(op, mesh, dtype, b, s, hq, hkv, causal, calls):
    """``op`` with KERNEL "ws", "auto" and "triton", ``calls`` calls on fresh q, k, v
    ([b, s, hq or hkv, 128] global): each within tolerance of the float32
    reference, "auto" bit for bit "ws"."""
    fns = {name: jax.jit(jax.shard_map(
        lambda q, k, v, name=name: op(q, k, v, "sp", causal=causal, config=dict(KERNEL=name)),
        mesh=mesh, in_specs=(SP,) * 3, out_specs=SP)) for name in ("ws", "auto", "triton")}
    for _ in range(calls):
        q = _rand((b, s, hq, 128), dtype)
        k, v = (_rand((b, s, hkv, 128), dtype) for _ in range(2))
        args = _put(mesh, dtype, q, k, v)
        ref = _reference(q, k, v, causal)
        outs = {name: np.asarray(f(*args).astype(jnp.float32)) for name, f in fns.items()}
        for name, out in outs.items():
            assert _rel(out, ref) < TOL[dtype], name
        np.testing.assert_array_equal(outs["auto"], outs["ws"])


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("b,s,hq,hkv,calls", [(2, 256, 4, 2, 3), (1, 128, 8, 4, 10),
                                              (1, 640, 8, 8, 3)])
def test_warp_specialized_kernel_over_ranks(world, dtype, causal, b, s, hq, hkv, calls):
    """The warp-specialized kernel in a group of ranks (the default there on Hopper
    where it fits): peers' chunks from the heap inbox, their flags awaited by the
    producer warp. One block per chunk (where Hq = 2 Hkv the output could take the
    pushed rows' buffer: ten short calls) and more blocks than its three stages;
    fresh inputs each call (both inbox parities, reused); "auto" runs it, bit for
    bit; the Triton kernel within the same tolerance."""
    if not _hopper():
        pytest.skip("the warp-specialized kernel runs on Hopper (sm_90)")
    if len(jax.devices()) < world:
        pytest.skip(f"needs {world} GPUs")
    _check_kernel_choices(td.ag_attention, _mesh(world), dtype, b, world * s, hq, hkv, causal,
                          calls)


def test_warp_specialized_kernel_over_ranks_needs_the_inbox():
    """KERNEL='ws' with GATHER='peer' names why it cannot run; 'auto' runs the
    Triton kernel there."""
    if not _hopper():
        pytest.skip("the warp-specialized kernel runs on Hopper (sm_90)")
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 GPUs")
    mesh = _mesh(2)

    def f(kernel):
        return jax.jit(jax.shard_map(
            lambda q, k, v: td.ag_attention(q, k, v, "sp",
                                            config=dict(KERNEL=kernel, GATHER="peer")),
            mesh=mesh, in_specs=(SP,) * 3, out_specs=SP))

    q, k, v = (_rand((1, 512, 4, 128), jnp.bfloat16) for _ in range(3))
    args = _put(mesh, jnp.bfloat16, q, k, v)
    with pytest.raises(ValueError, match=r"KERNEL='ws' .* cannot run this call: in a group of "
                                         r"several ranks it reads peers' keys from the heap "
                                         r"inbox, and config GATHER='peer'"):
        f("ws")(*args)
    assert _rel(f("auto")(*args), _reference(q, k, v, True)) < TOL[jnp.bfloat16]


def test_warp_specialized_kernel_asked_where_it_does_not_fit():
    if not _hopper():
        pytest.skip("the warp-specialized kernel runs on Hopper (sm_90)")
    mesh = _mesh(1)
    for shape, why in (((1, 256, 2, 64), "head dim 128, not 64"),
                       ((1, 200, 2, 128), "S a multiple of 128, not 200")):
        q = jnp.zeros(shape, jnp.bfloat16)
        f = jax.jit(jax.shard_map(
            lambda a: ag_attention_kernels(a, a, a, "sp", config=dict(KERNEL="ws")), mesh=mesh,
            in_specs=SP, out_specs=SP))
        with pytest.raises(ValueError, match=rf"KERNEL='ws' .* cannot run this call: it takes "
                                             rf"{why}"):
            f(q)
