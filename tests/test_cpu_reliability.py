"""Transformations, bounded waits, dead workers, bf16 rounding and a soak, on CPU
(the real kernels under the interpreter)."""

from __future__ import annotations

import os
import signal
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxtdist as td
import tests.kernels_for_tests as K
from tests.conftest import (assert_close, cpu_only, f64, place, rand, rel_err, setup, timeout,
                            users_gather)

pytestmark = cpu_only()

F32, BF16 = jnp.float32, jnp.bfloat16
ROWS, COLS = P("tp", None), P(None, "tp")


def _ag(mesh, body, out_specs=P(None, None, "tp")):
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tp", None),
                                                            P(None, None, "tp")),
                                 out_specs=out_specs))


# -- vmap -------------------------------------------------------------------------

@pytest.mark.parametrize("world,batch", [(2, 3), (4, 2)])
def test_vmap_ag_matmul_is_one_call_per_element(world, batch):
    """vmap runs one whole op call (own epoch) per batch element: exact on every
    element, over repeated calls (the failure was whole elements off)."""
    mesh = setup(world)
    f = _ag(mesh, jax.vmap(lambda a, b: td.ag_matmul(a, b, "tp")))
    for _ in range(3):
        x = rand((batch, world * 3, 16), F32)
        w = rand((batch, 16, world * 4), F32)
        out = f(place(mesh, x, P(None, "tp", None)), place(mesh, w, P(None, None, "tp")))
        for b in range(batch):
            assert_close(out[b], f64(x[b]) @ f64(w[b]), F32)


def test_vmap_all_gather_and_user_kernel():
    mesh = setup(4)
    x = rand((2, 4 * 3, 5), F32)
    f = jax.jit(jax.shard_map(jax.vmap(lambda v: td.all_gather(v, "tp")), mesh=mesh,
                              in_specs=P(None, "tp"), out_specs=P(), check_vma=False))
    np.testing.assert_array_equal(np.asarray(f(place(mesh, x, P(None, "tp")))), x)

    n = 8

    def ring(v):  # rank r gets rank r-1's vector
        return td.triton_call(v, kernel=K.ring_kernel, grid=(1,), axis_name="tp",
                              out_shape=jax.ShapeDtypeStruct((n,), F32),
                              workspace_bytes=256 + 8 * n, N=n, BLOCK=8)

    g = jax.jit(jax.shard_map(jax.vmap(ring, in_axes=1, out_axes=1), mesh=mesh,
                              in_specs=P("tp"), out_specs=P("tp")))
    v = rand((4 * n, 3), F32)
    out = np.asarray(g(place(mesh, v, P("tp"))))
    expect = np.roll(v.reshape(4, n, 3), 1, axis=0).reshape(4 * n, 3)
    np.testing.assert_array_equal(out, expect)


def test_vmap_of_grad():
    mesh = setup(2)
    loss = lambda a, b: jnp.sum(jnp.sin(td.ag_matmul(a, b, "tp")))  # noqa: E731
    f = _ag(mesh, jax.vmap(jax.grad(loss, argnums=(0, 1))),
            out_specs=(P(None, "tp", None), P(None, None, "tp")))
    x, w = rand((2, 8, 6), F32), rand((6, 8), F32)
    w = np.stack([w, 2 * w])
    gx, gw = f(place(mesh, x, P(None, "tp", None)), place(mesh, w, P(None, None, "tp")))
    rx, rw = jax.vmap(jax.grad(lambda a, b: jnp.sum(jnp.sin(a @ b)), argnums=(0, 1)))(
        jnp.asarray(x), jnp.asarray(w))
    assert_close(gx, f64(rx), F32)
    assert_close(gw, f64(rw), F32)


# -- remat ------------------------------------------------------------------------

POLICIES = {
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "everything_saveable": jax.checkpoint_policies.everything_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable":
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "default": None,
}


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_remat_grad_matches_xla(policy):
    """jax.checkpoint around a layer with ag_matmul and all_gather, under grad: the
    recomputed calls run on every device in the same order, so epochs stay in step."""
    mesh = setup(2)

    def layer(a, b):
        h = jnp.tanh(td.ag_matmul(a, b, "tp"))
        return h * jnp.sum(td.all_gather(a, "tp"))

    kw = {} if POLICIES[policy] is None else dict(policy=POLICIES[policy])
    loss = lambda a, b: jnp.sum(jax.checkpoint(layer, **kw)(a, b) ** 2)  # noqa: E731
    f = jax.jit(jax.shard_map(jax.grad(loss, argnums=(0, 1)), mesh=mesh,
                              in_specs=(ROWS, COLS), out_specs=(ROWS, COLS)))
    x, w = rand((2 * 4, 8), F32, 0.3), rand((8, 2 * 4), F32, 0.3)

    def ref(a, b):
        return jnp.sum((jnp.tanh(a @ b) * jnp.sum(a)) ** 2)

    rx, rw = jax.grad(ref, argnums=(0, 1))(jnp.asarray(x), jnp.asarray(w))
    for _ in range(2):
        gx, gw = f(place(mesh, x, ROWS), place(mesh, w, COLS))
        assert_close(gx, f64(rx), F32, factor=10)
        assert_close(gw, f64(rw), F32, factor=10)


# -- second order -----------------------------------------------------------------

@pytest.mark.parametrize("op", ["ag_matmul", "all_gather"])
def test_second_order_says_it_is_not_supported(op):
    mesh = setup(2)
    fn = {"ag_matmul": lambda a, b: td.ag_matmul(a, b, "tp"),
          "all_gather": lambda a, b: td.all_gather(a, "tp") @ b[:, :1]}[op]
    inner = jax.grad(lambda a, b: jnp.sum(jnp.sin(fn(a, b))))
    f = jax.jit(jax.shard_map(jax.grad(lambda a, b: jnp.sum(inner(a, b))), mesh=mesh,
                              in_specs=(ROWS, COLS), out_specs=ROWS))
    with pytest.raises(TypeError, match=rf"jaxtdist.{op}: .*no derivative.*grad of grad"):
        f(place(mesh, rand((8, 4), F32), ROWS), place(mesh, rand((4, 8), F32), COLS))


def test_run_once_is_an_identity_to_second_order_autodiff():
    """A user's custom VJP that marks its forward rule's outputs with run_once (its
    docstring's example) differentiates twice where its pieces do (all_gather and
    reduce_scatter are custom VJPs themselves): grad of grad equals XLA's twin's."""
    mesh = setup(2)
    gather = users_gather()

    def second(g):
        f = jax.shard_map(lambda a: jnp.sin(g(a)), mesh=mesh, in_specs=ROWS, out_specs=ROWS)
        inner = jax.grad(lambda a: jnp.sum(f(a)))
        return jax.jit(jax.grad(lambda a: jnp.sum(inner(a))))

    x = rand((4, 8), F32)
    got = second(gather)(place(mesh, x, ROWS))
    want = second(lambda a: jax.lax.all_gather(a, "tp", tiled=True))(place(mesh, x, ROWS))
    assert_close(got, np.asarray(want, np.float64), F32)


# -- every built-in op: vmap, remat + grad, second order ---------------------------

W = 2  # ranks
# op -> (body(*per-rank args), [(global shape, in_spec)], out_spec, jnp reference of
# the global result). Out specs follow each result's typing: sums are replicated
# over "tp" (as jax.lax.psum's), gathers are per rank (as jax.lax.all_gather's).
EVERY_OP = {
    "ag_matmul": (lambda a, b: td.ag_matmul(a, b, "tp"),
                  [((W * 4, 8), ROWS), ((8, W * 4), COLS)], COLS, lambda a, b: a @ b),
    "all_gather": (lambda a: td.all_gather(a, "tp")[None], [((W * 4, 8), ROWS)],
                   P("tp", None, None), lambda a: jnp.tile(a[None], (W, 1, 1))),
    "all_reduce": (lambda a: td.all_reduce(a, "tp"), [((W * 3, 5), ROWS)], P(None, None),
                   lambda a: a.reshape(W, 3, 5).sum(0)),
    "reduce_scatter": (lambda a: td.reduce_scatter(a, "tp"), [((W * W * 2, 5), ROWS)], ROWS,
                       lambda a: a.reshape(W, W * 2, 5).sum(0)),
    "matmul_rs": (lambda a, b: td.matmul_rs(a, b, "tp"),
                  [((W * 4, W * 8), COLS), ((W * 8, 6), ROWS)], ROWS, lambda a, b: a @ b),
    "matmul_ar": (lambda a, b: td.matmul_ar(a, b, "tp"),
                  [((4, W * 8), COLS), ((W * 8, 6), ROWS)], P(None, None), lambda a, b: a @ b),
}


def _op_case(op: str, batch: int | None = None, remat: bool = False):
    """The op's shard_map'd function (vmapped over a leading ``batch`` axis, once per
    axis of a tuple, or checkpointed), its placed random arguments (host copies too)
    and reference."""
    body, args, out_spec, ref = EVERY_OP[op]
    mesh = setup(W)
    lead = () if batch is None else batch if isinstance(batch, tuple) else (batch,)
    specs = tuple(P(*((None,) * len(lead)), *spec) for _, spec in args)
    for _ in lead:  # one jax.vmap per leading batch axis
        body, ref = jax.vmap(body), jax.vmap(ref)
        out_spec = P(None, *out_spec)
    if remat:
        body = jax.checkpoint(body)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out_spec))
    host = [rand(lead + shape, F32) for shape, _ in args]
    return f, [place(mesh, h, spec) for h, spec in zip(host, specs)], host, ref


@pytest.mark.parametrize("op", sorted(EVERY_OP))
def test_every_op_under_vmap(op):
    """jax.vmap of each built-in op: one whole call per batch element, each right."""
    f, placed, host, ref = _op_case(op, batch=3)
    for _ in range(2):  # both parities of the workspaces
        assert_close(f(*placed), f64(ref(*map(jnp.asarray, host))), F32)


@pytest.mark.parametrize("op", sorted(EVERY_OP))
def test_every_op_under_nested_vmap(op):
    """vmap of vmap of each built-in op: the outer vmap batches the inner one's
    lax.map, whose body must again run one whole call per element (it was a
    NotImplementedError: no batching rule for the native call)."""
    f, placed, host, ref = _op_case(op, batch=(2, 2))
    assert_close(f(*placed), f64(ref(*map(jnp.asarray, host))), F32)


@pytest.mark.parametrize("op", sorted(EVERY_OP))
def test_every_op_under_remat_and_grad(op):
    """jax.grad through jax.checkpoint of each built-in op against jax.grad of the
    float32 reference (the backward passes run jaxtdist's ops too)."""
    f, placed, host, ref = _op_case(op, remat=True)
    argnums = tuple(range(len(placed)))
    loss = lambda fn: lambda *a: jnp.sum(jnp.sin(fn(*a)))  # noqa: E731
    got = jax.jit(jax.grad(loss(f), argnums=argnums))(*placed)
    want = jax.grad(loss(ref), argnums=argnums)(*map(jnp.asarray, host))
    for g, r in zip(got, want):
        assert_close(g, f64(r), F32, factor=10)


@pytest.mark.parametrize("op", sorted(EVERY_OP))
def test_every_op_second_order_says_it_is_not_supported(op):
    f, placed, _, _ = _op_case(op)
    inner = jax.grad(lambda a, *rest: jnp.sum(jnp.sin(f(a, *rest))))
    with pytest.raises(TypeError, match=r"jaxtdist\.\w+: .*no derivative.*grad of grad"):
        jax.grad(lambda a, *rest: jnp.sum(inner(a, *rest)))(*placed)


# -- bounded waits ----------------------------------------------------------------

@timeout(60)
def test_divergent_cond_times_out_within_twice_the_bound():
    """ag_matmul inside a lax.cond taken on rank 0 only: rank 0 waits for a peer that
    never comes; the error arrives within twice the bound, naming the wait."""
    bound = 1.5
    mesh = setup(2, wait_timeout_s=bound)

    def body(a, b):
        return jax.lax.cond(jax.lax.axis_index("tp") == 0,
                            lambda: td.ag_matmul(a, b, "tp"),
                            lambda: jnp.zeros((2 * a.shape[0], b.shape[1]), a.dtype))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(ROWS, COLS), out_specs=COLS,
                              check_vma=False))
    args = (place(mesh, rand((8, 8), F32), ROWS), place(mesh, rand((8, 8), F32), COLS))
    compiled = f.lower(*args).compile()
    try:
        start = time.monotonic()
        # The status, then jaxtdist's error: no host-callback traceback in front.
        with pytest.raises(jax.errors.JaxRuntimeError,
                           match=r"^DEADLINE_EXCEEDED: jaxtdist\.WaitTimeoutError: a wait "
                                 r"timed out after 1\.5 s on rank 0"):
            np.asarray(compiled(*args))
        assert time.monotonic() - start < 2 * bound
    finally:
        td.shutdown()


# -- dead workers and shutdown ------------------------------------------------------

def _ag_call(mesh):
    f = jax.jit(jax.shard_map(lambda a, b: td.ag_matmul(a, b, "tp"), mesh=mesh,
                              in_specs=(ROWS, COLS), out_specs=COLS))
    x, w = rand((2 * 4, 8), F32), rand((8, 2 * 4), F32)
    return f, (place(mesh, x, ROWS), place(mesh, w, COLS)), f64(x) @ f64(w)


@timeout(120)
def test_dead_worker_fails_every_later_call_at_once_and_recovers():
    mesh = setup(2, wait_timeout_s=60)
    f, args, ref = _ag_call(mesh)
    assert_close(f(*args), ref, F32)
    victim = td.runtime.runtime().backend.workers._procs[1]
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(timeout=10)
    for _ in range(3):  # this call and every later one: at once, naming the worker
        start = time.monotonic()
        with pytest.raises(jax.errors.JaxRuntimeError,
                           match=r"^UNAVAILABLE: jaxtdist\.WorkerDiedError: the interpreter "
                                 r"worker of mesh position 1 \(pid \d+\) died"):
            np.asarray(f(*args))
        assert time.monotonic() - start < 10
    td.shutdown()
    mesh = setup(2)
    f, args, ref = _ag_call(mesh)
    assert_close(f(*args), ref, F32)


@timeout(120)
def test_shutdown_waits_for_calls_in_flight():
    """shutdown() while a call runs: the call finishes (or fails saying why), and
    shutdown returns; nothing blocks."""
    mesh = setup(2)
    f = jax.jit(jax.shard_map(lambda a, b: td.ag_matmul(a, b, "tp"), mesh=mesh,
                              in_specs=(ROWS, COLS), out_specs=COLS))
    x, w = rand((2 * 64, 64), F32), rand((64, 2 * 64), F32)
    args = (place(mesh, x, ROWS), place(mesh, w, COLS))
    f(*args).block_until_ready()
    results = {}

    def run():
        try:
            results["out"] = np.asarray(f(*args))
        except Exception as e:  # noqa: BLE001
            results["error"] = str(e)

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(0.3)
    start = time.monotonic()
    td.shutdown()
    thread.join(60)
    assert not thread.is_alive()
    assert time.monotonic() - start < 40
    if "out" in results:
        assert_close(results["out"], f64(x) @ f64(w), F32)
    else:
        assert "initialize" in results["error"], results["error"]


# -- bf16 rounding -------------------------------------------------------------------

def test_interpreter_rounds_bfloat16_to_nearest_even():
    """The interpreter's float32 -> bfloat16 cast equals numpy/XLA's astype bitwise
    (Triton 3.6 alone truncates)."""
    mesh = setup(2)
    n = 4096
    x = np.random.default_rng(7).standard_normal(2 * n).astype(np.float32) * 3
    x[:6] = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1.00390625]  # 1 + 2^-8: a tie, to even

    def body(v):
        return td.triton_call(v, kernel=K.to_bfloat16_kernel, grid=(1,), axis_name="tp",
                              out_shape=jax.ShapeDtypeStruct((n,), BF16), N=n, BLOCK=1024)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))
    got = np.asarray(f(place(mesh, x, P("tp")))).view(np.uint16)
    want = np.asarray(jnp.asarray(x).astype(BF16)).view(np.uint16)
    np.testing.assert_array_equal(got, want)


def test_bf16_ag_matmul_error_matches_xla():
    mesh = setup(2)
    x, w = rand((2 * 16, 64), BF16), rand((64, 2 * 16), BF16)
    f = jax.jit(jax.shard_map(lambda a, b: td.ag_matmul(a, b, "tp"), mesh=mesh,
                              in_specs=(ROWS, COLS), out_specs=COLS))
    ref = f64(x) @ f64(w)
    ours = np.linalg.norm(f64(f(place(mesh, x, ROWS), place(mesh, w, COLS))) - ref)
    xla = np.linalg.norm(f64(jnp.dot(jnp.asarray(x), jnp.asarray(w))) - ref)
    assert ours <= 1.2 * xla, (ours, xla)


# -- soak -----------------------------------------------------------------------------

@timeout(600)
def test_soak_chained_calls_with_changing_data_and_shapes():
    """200 calls of each op, chained (each output feeds the next call), changing
    data every call and shapes between batches; every result checked: 0 mismatches."""
    mesh = setup(2)
    calls = 0
    mismatches = []
    steps = 25  # calls per dispatch, chained through a scan

    def chained(m):
        def chain(a, b):
            def step(carry, _):
                g = td.all_gather(carry, "tp")                   # [2m, k]
                y = td.ag_matmul(carry, b, "tp")                 # [2m, n]
                nxt = carry + 0.125 * y[: m, :1] + 0.25 * g[m:, :]
                return nxt, (carry, g, y)
            return jax.lax.scan(step, a, None, length=steps)[1]

        return jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=(ROWS, COLS),
                                     out_specs=(P(None, "tp", None), P(None, None, None),
                                                P(None, None, "tp")), check_vma=False))

    # One program per shape, compiled once and dispatched twice: the same calls
    # and shape changes between batches as a program per batch, without 8 compiles.
    programs = {}
    for m, k, n in [(2, 8, 4), (3, 16, 8), (4, 8, 8), (1, 24, 4)] * 2:
        if (m, k, n) not in programs:
            programs[(m, k, n)] = chained(m)
        f = programs[(m, k, n)]
        x, w = rand((2 * m, k), F32, 0.1), rand((k, 2 * n), F32, 0.1)
        carries, gs, ys = (np.asarray(v) for v in f(place(mesh, x, ROWS), place(mesh, w, COLS)))
        # Each call against its own inputs (no compounding of rounding): the gather
        # is exact, the product holds to float32 rounding.
        for t in range(steps):
            if not np.array_equal(gs[t], carries[t]):
                mismatches.append(f"all_gather {(m, k, n)} step {t}: "
                                  f"{np.abs(gs[t] - carries[t]).max():.3g}")
            product = f64(carries[t]) @ f64(w)
            # Relative to the whole product: an element near zero in a sum of
            # terms of size ~10 is off by float32 rounding (~1e-6), while a race
            # gives another call's data (errors of order 1).
            err = rel_err(ys[t], product)
            if err > 1e-5:
                mismatches.append(f"ag_matmul {(m, k, n)} step {t}: relative error "
                                  f"{err:.3g}")
            calls += 1
        assert np.isfinite(carries).all() and np.abs(carries[-1]).max() > 0
    assert calls == 200 and not mismatches, (calls, mismatches)


def test_soak_of_the_reduction_ops():
    """200 chained calls each of all_reduce, reduce_scatter, matmul_rs and
    matmul_ar (each step's input is the last step's output), changing data every
    call and shapes between batches; every result checked against float32
    references of its own inputs: 0 mismatches."""
    mesh = setup(2)
    calls = 0
    mismatches = []
    steps = 25

    def chain(a, b):
        def step(c, _):                                   # c: [2m, k] per rank
            r = td.all_reduce(c, "tp")                    # sum of the ranks' c
            s = td.reduce_scatter(c, "tp")                # rows block of it
            y = td.matmul_rs(c, b, "tp")                  # rows block of sum c_r @ b_r
            z = td.matmul_ar(c, b, "tp")                  # all of it
            nxt = 0.5 * c + 0.125 * r + 0.0625 * z[:, :1]
            return nxt, (c, r, s, y, z)
        return jax.lax.scan(step, a, None, length=steps)[1]

    stacked = P(None, "tp", None)
    # One program, compiled once per shape and dispatched twice: the same calls
    # and shape changes between batches as a program per batch, without 8 compiles.
    f = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=(ROWS, ROWS),
                              out_specs=(stacked, P(None, None, None), stacked, stacked,
                                         P(None, None, None)), check_vma=False))
    for m, k, n in [(2, 8, 4), (3, 16, 8), (4, 8, 8), (1, 24, 4)] * 2:
        x, w = rand((2 * 2 * m, k), F32), rand((2 * k, n), F32)
        cs, rs, ss, ys, zs = (np.asarray(v, np.float64)
                              for v in f(place(mesh, x, ROWS), place(mesh, w, ROWS)))
        for t in range(steps):
            c0, c1 = cs[t][: 2 * m], cs[t][2 * m:]
            total = c0 + c1
            product = c0 @ f64(w[:k]) + c1 @ f64(w[k:])
            # A race gives another call's data (errors of order 1); float32
            # rounding stays near 1e-7.
            for name, got, ref in (("all_reduce", rs[t], total), ("reduce_scatter", ss[t], total),
                                   ("matmul_rs", ys[t], product), ("matmul_ar", zs[t], product)):
                err = rel_err(got, ref)
                if err > 1e-5:
                    mismatches.append(f"{name} {(m, k, n)} step {t}: relative error {err:.3g}")
            calls += 1
        assert np.isfinite(cs).all() and np.abs(cs[-1]).max() > 0
    assert calls == 200 and not mismatches, (calls, mismatches[:10])
