"""Every jaxtdist call of a compiled program in one chain of data dependencies.

A call's pieces (prologue, kernels, the copy-out of an inbox) must not
interleave with another call's on the same workspace, and devices must meet
the calls in one order: XLA may schedule anything that data does not order
(several processes sharing one GPU run far apart, so no timing hides it).
These tests read the compiled program (CPU) and check the order data imposes,
whatever schedule XLA picked: under jax.checkpoint, where JAX traces the
backward pass apart and would recompute the forward call there (once a
second, unordered call on the same workspace: wrong gradients and a timed-out
wait with 2 processes on one H100), and with the SM-push producers whose
gathered x is copied out of the inboxes: that copy-out comes after the GEMM
whose output goes on, and calls of one shape (a model's layers) share the
inbox, which the call after next writes again, so the next call must run after
the copy-out (the order token), in the forward and in the backward pass.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxtdist as td
from tests.conftest import cpu_only, rand, rel_err, setup, users_gather

pytestmark = cpu_only()

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?(%[\w.\-]+)\s*=\s*.*?\b[\w\-]+\((.*?)\)(?:,|$)")


def ancestry(operands: dict[str, set[str]]):
    """``up(name)``: the instruction's ancestors (transitive operands)."""
    ancestors: dict[str, set[str]] = {}

    def up(name):
        if name not in ancestors:
            ancestors[name] = set()
            for o in operands.get(name, ()):
                ancestors[name] |= {o} | up(o)
        return ancestors[name]
    return up


def jaxtdist_calls(hlo: str) -> tuple[list[str], dict[str, set[str]]]:
    """The jaxtdist custom calls of the entry computation in program text order,
    and every instruction's ancestors (transitive operands)."""
    entry = hlo[hlo.index("\nENTRY"):]
    entry = entry[:entry.index("\n}")]
    operands, calls = {}, []
    for line in entry.splitlines()[1:]:
        m = _INSTR.match(line)
        if not m:
            continue
        name = m.group(1)
        operands[name] = set(re.findall(r"%[\w.\-]+", m.group(2)))
        if 'custom_call_target="jaxtdist_' in line:
            calls.append(name)
    up = ancestry(operands)
    return calls, {name: up(name) for name in operands}


def assert_one_chain(hlo: str, calls_expected: int | None) -> None:
    calls, ancestors = jaxtdist_calls(hlo)
    assert calls_expected is None or len(calls) == calls_expected, (calls, hlo)
    for i, a in enumerate(calls):
        for b in calls[i + 1:]:
            assert a in ancestors[b] or b in ancestors[a], (
                f"{a} and {b} are not ordered by data: XLA may interleave them")


def remat_grads(mesh, op, x, w, g, specs):
    """jit(forward and backward) of ``op`` under jax.checkpoint, as
    tests/multiprocess/ops_check.py checks it."""
    f = jax.jit(jax.shard_map(jax.checkpoint(lambda u, v: op(u, v, "tp")), mesh=mesh,
                              in_specs=specs[:2], out_specs=specs[2]))

    def forward_and_backward(u, v, dy):
        y, vjp = jax.vjp(f, u, v)
        return (y, *vjp(dy))

    args = tuple(jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, w, g), specs))
    compiled = jax.jit(forward_and_backward).lower(*args).compile()
    return compiled, args


@pytest.fixture(params=["sm", "push"])
def producer(request, monkeypatch):
    """ag_matmul's producers: the CPU default (pulls into the gathered output) or SM
    pushes into heap inboxes, whose gathered x is copied out (the GPU's choice at
    these sizes)."""
    if request.param == "push":
        from jaxtdist.ops._ag_matmul_config import AgMatmulConfig
        default = AgMatmulConfig.default.__func__
        monkeypatch.setattr(AgMatmulConfig, "default", classmethod(
            lambda cls, problem, allow_tma=True: default(cls, problem, allow_tma).replace(
                PRODUCER="push")))
    return request.param


@pytest.mark.parametrize("world", [2, 4])
def test_remat_gradients_run_each_call_once_in_one_chain(world, producer):
    mesh = setup(world)
    jax.clear_caches()
    x, w, g = rand((world * 8, 32)), rand((32, 16 * world)), rand((world * 8, 16 * world))
    compiled, args = remat_grads(mesh, td.ag_matmul, x, w, g,
                                 (P("tp", None), P(None, "tp"), P(None, "tp")))
    # The forward call (prologue, kernel, and the copy-out with pushes), then the
    # backward's matmul_rs (prologue, kernel): no recomputed call.
    assert_one_chain(compiled.as_text(), 5 if producer == "push" else 4)
    y, dx, dw = compiled(*args)
    for got, want in ((y, x @ w), (dx, g @ w.T), (dw, x.T @ g)):
        assert rel_err(got, want) < 1e-5
    x, w, g = (rand((world * 8, world * 16)), rand((world * 16, 24)),
               rand((world * 8, 24)))
    compiled, args = remat_grads(mesh, td.matmul_rs, x, w, g,
                                 (P(None, "tp"), P("tp", None), P("tp", None)))
    assert_one_chain(compiled.as_text(), 5 if producer == "push" else 4)
    y, dx, dw = compiled(*args)
    for got, want in ((y, x @ w), (dx, g @ w.T), (dw, x.T @ g)):
        assert rel_err(got, want) < 1e-5



def _mlp(layers: int):
    """``layers`` tensor-parallel MLP blocks of one shape (ag_matmul, then matmul_rs):
    every block's calls share the workspaces, as a model's layers do."""
    def body(x, w1, w2):
        for i in range(layers):
            x = td.matmul_rs(td.ag_matmul(x, w1[i], "tp"), w2[i], "tp")
        return x
    return body, (P("tp", None), P(None, None, "tp"), P(None, "tp", None), P("tp", None))


def _ag_chain(layers: int):
    """``layers`` ag_matmul calls of one shape, each on the previous one's rows."""
    def body(x, w1, w2):
        del w2
        for i in range(layers):
            y = td.ag_matmul(x, w1[i], "tp")
            rank = jax.lax.axis_index("tp")
            x = jax.lax.dynamic_slice_in_dim(y, rank * x.shape[0], x.shape[0], 0)
        return x
    return body, (P("tp", None), P(), P(), P("tp", None))


def chained_grads(mesh, model, layers: int, remat: bool, world: int):
    body, specs = model(layers)
    if remat:
        body = jax.checkpoint(body)
    f = jax.shard_map(body, mesh=mesh, in_specs=specs[:3], out_specs=specs[3])
    d = 32
    x, w1, w2 = rand((world * 8, d)), rand((layers, d, d)), rand((layers, d, d))
    g = rand((world * 8, d))

    def forward_and_backward(u, v1, v2, dy):
        y, vjp = jax.vjp(f, u, v1, v2)
        return (y, *vjp(dy))

    args = tuple(jax.device_put(a, NamedSharding(mesh, s)) for a, s in
                 zip((x, w1, w2, g), specs[:3] + specs[3:]))
    compiled = jax.jit(forward_and_backward).lower(*args).compile()
    want = jax.jit(jax.vjp(lambda u, v1, v2: model_reference(model, layers, u, v1, v2),
                           x, w1, w2)[1])(g)
    return compiled, args, want


def model_reference(model, layers, x, w1, w2):
    for i in range(layers):
        x = x @ w1[i] @ w2[i] if model is _mlp else x @ w1[i]
    return x


@pytest.mark.parametrize("remat", [False, True])
@pytest.mark.parametrize("model", [_ag_chain, _mlp])
def test_chained_calls_and_their_copy_outs_in_one_chain(model, remat, producer):
    """Calls of one shape share an inbox workspace (parity = epoch % 2): the copy-out
    of call e must come before the prologue of call e+1 (whose peers may then write
    that parity again at e+2), in the forward and in the backward pass."""
    world = 2
    mesh = setup(world)
    jax.clear_caches()
    compiled, args, want = chained_grads(mesh, model, 3, remat, world)
    assert_one_chain(compiled.as_text(), None)
    got = compiled(*args)[1:]
    for a, b in zip(got, want):
        assert rel_err(a, b) < 1e-4 if b.any() else not a.any()


def test_chained_pjit_wrappers_and_their_copy_outs_in_one_chain(producer):
    """The same across pjit-style wrappers (one shard_map each): the order token
    leaves every shard_map with its result."""
    world, d = 2, 32
    mesh = setup(world)
    jax.clear_caches()
    x, w, g = rand((world * 8, d)), rand((3, d, d)), rand((world * 8, d))

    def f(u, v):
        for i in range(3):
            u = td.ag_matmul_sharded(u, v[i], axis_name="tp")[:u.shape[0]]
        return u

    def forward_and_backward(u, v, dy):
        y, vjp = jax.vjp(f, u, v)
        return (y, *vjp(dy))

    args = tuple(jax.device_put(a, NamedSharding(mesh, s)) for a, s in
                 zip((x, w, g), (P("tp", None), P(), P("tp", None))))
    compiled = jax.jit(forward_and_backward).lower(*args).compile()
    assert_one_chain(compiled.as_text(), None)
    want = jax.vjp(lambda u, v: u @ v[0] @ v[1] @ v[2], x, w)
    got = compiled(*args)
    for a, b in zip(got, (want[0], *want[1](g))):
        assert rel_err(a, b) < 1e-4


@pytest.mark.parametrize("remat", [False, True])
def test_moe_tp_mlp_gradients_in_one_chain(remat):
    """moe_tp_mlp's own custom VJP around its packed gather: under jax.checkpoint the
    gather is not recomputed in the backward pass (a second, unordered call timed out
    a wait on 4 CPU ranks under load); forward and backward calls in one chain."""

    from tests.test_cpu_moe_tp import EXPERTS_W1, EXPERTS_W2, TOKENS, _routing

    world, t, k, e, h, f = 4, 2, 3, 5, 8, 8
    mesh = setup(world)
    jax.clear_caches()
    specs = (TOKENS, TOKENS, TOKENS, EXPERTS_W1, EXPERTS_W2)
    fn = jax.shard_map(lambda *a: td.moe_tp_mlp(*a, "tp"), mesh=mesh, in_specs=specs,
                       out_specs=TOKENS)
    fn = jax.checkpoint(fn) if remat else fn
    arrays = (rand((world * t, h)), _routing(np.random.default_rng(1), world * t, k, e),
              rand((world * t, k)), rand((e, h, f)), rand((e, f, h)))
    args = tuple(jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(arrays, specs))
    grad = jax.jit(jax.grad(lambda *a: (fn(*a) ** 2).sum(), argnums=(0, 2, 3)))
    # The gather and the reduce-scatter; backward: the reduce-scatter's gather and
    # the gather's two reduce-scatters (x, weights): a prologue and a kernel each.
    assert_one_chain(grad.lower(*args).compile().as_text(), 10)


def test_run_once_keeps_a_users_custom_vjp_in_one_chain():
    """jaxtdist.run_once on the forward rule of a user's custom VJP that calls an op:
    under jax.checkpoint every call runs once, in one chain, and the gradients are
    those without remat."""
    mesh = setup(2)
    gather = users_gather()

    def loss(remat):
        f = jax.shard_map(lambda x: jax.numpy.sin(gather(2 * x)), mesh=mesh,
                          in_specs=P("tp"), out_specs=P("tp"))
        f = jax.checkpoint(f) if remat else f
        return jax.jit(jax.grad(lambda a: f(a).sum()))

    x = jax.device_put(rand((8, 4)), NamedSharding(mesh, P("tp")))
    assert_one_chain(loss(True).lower(x).compile().as_text(), 4)
    assert rel_err(loss(True)(x), loss(False)(x)) < 1e-6


_CALLEES = re.compile(r"(?:calls|body|condition|to_apply|branch_computations|"
                      r"true_computation|false_computation)=\{?(%[\w.\-]+(?:,\s*%[\w.\-]+)*)")


def unordered_call_sites(hlo: str) -> list[tuple[str, str]]:
    """Pairs of the entry computation's jaxtdist call sites that data does not order;
    a site is a jaxtdist custom call, or an instruction (loop, branch, call) whose
    computations hold one."""
    comps, current, entry = {}, None, None
    for line in hlo.splitlines():
        if m := re.match(r"^(ENTRY\s+)?(%[\w.\-]+)\s.*\{\s*$", line):
            current = comps[m.group(2)] = []
            entry = m.group(2) if m.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif current is not None and (m := re.match(r"^\s*(?:ROOT\s+)?(%[\w.\-]+)\s*=\s*(.*)$",
                                                     line)):
            current.append((m.group(1), re.sub(r"metadata=\{.*?\}|backend_config=.*$", "",
                                                m.group(2))))
    holds: dict[str, bool] = {}

    def holds_call(rest: str) -> bool:
        return 'custom_call_target="jaxtdist_' in rest or any(
            comp_holds(c) for group in _CALLEES.findall(rest)
            for c in re.findall(r"%[\w.\-]+", group))

    def comp_holds(comp: str) -> bool:
        if comp not in holds:
            holds[comp] = False
            holds[comp] = any(holds_call(rest) for _, rest in comps.get(comp, ()))
        return holds[comp]

    operands, sites = {}, []
    for name, rest in comps[entry]:
        m = re.search(r"\b[\w\-]+\((.*?)\)(?:,|$)", rest)
        operands[name] = set(re.findall(r"%[\w.\-]+", m.group(1))) if m else set()
        if holds_call(rest):
            sites.append(name)
    up = ancestry(operands)
    return [(a, b) for i, a in enumerate(sites) for b in sites[i + 1:]
            if a not in up(b) and b not in up(a)]


_NESTINGS = {
    "checkpoint": jax.checkpoint,
    "jit": jax.jit,
    "cond": lambda fn: lambda a: jax.lax.cond(a.sum() > -1e30, fn, fn, a),
    "map": lambda fn: lambda a: jax.lax.map(fn, a[None])[0],
}


@pytest.mark.parametrize("before", [False, True])
@pytest.mark.parametrize("nesting", list(_NESTINGS))
def test_calls_in_and_around_an_unrelated_nested_computation_in_one_order(nesting, before):
    """Calls in a nested computation (a checkpointed piece, a nested jit, a branch, a
    loop body) and a call before or after it (checkpointed: no record of it in the
    enclosing trace) with no data between them are still ordered: on CPU devices
    otherwise ran them in different orders (wrong values, timed-out waits)."""
    world = 4
    mesh = setup(world, wait_timeout_s=60.0)
    jax.clear_caches()
    nested = _NESTINGS[nesting](lambda a: td.all_reduce(td.all_gather(a, "tp"), "tp"))
    other = jax.checkpoint(lambda b: td.all_gather(b, "tp"))

    def body(a, b):
        if before:
            gathered = other(b)
            return nested(a), gathered
        return nested(a), other(b)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P("tp")),
                              out_specs=(P("tp"), P("tp"))))  # every rank's copy
    x, y = (jax.device_put(rand((world * 4, 8)), NamedSharding(mesh, P("tp")))
            for _ in range(2))
    hlo = f.lower(x, y).compile().as_text()
    assert not unordered_call_sites(hlo), (unordered_call_sites(hlo), hlo)
    for _ in range(3):  # a race moves the error from run to run
        got_a, got_b = f(x, y)
        assert rel_err(got_a, np.tile(world * np.asarray(x), (world, 1))) < 1e-6
        assert rel_err(got_b, np.tile(np.asarray(y), (world, 1))) < 1e-6


_REUSED = {
    "jit": jax.jit(lambda c: td.all_reduce(c, "tp")),
    "scan": lambda c: jax.lax.scan(_reused_step, c, None, length=2)[0],
    "cond": lambda c: jax.lax.cond(c.sum() > -1e30, _reused_branch, _reused_branch, c),
    "checkpoint": jax.checkpoint(lambda c: td.all_reduce(c, "tp")),
}


def _reused_step(c, _):
    return td.all_reduce(c, "tp"), None


def _reused_branch(c):
    return td.all_reduce(c, "tp")


@pytest.mark.parametrize("nesting", list(_REUSED))
def test_a_nested_body_reused_by_another_program_or_shape(nesting):
    """A body JAX caches by function and shapes (nested jit, scan body, cond branch,
    checkpoint) holding an op, traced first after another op, then reused by a
    program without that op and by the first at other shapes: it had closed over
    the first program's previous output (UnexpectedTracerError)."""
    world = 2
    mesh = setup(world, wait_timeout_s=60.0)
    piece = _REUSED[nesting]
    sp = P("tp", None)
    # check_vma=False: a scan carries all_reduce's result (typed invariant) as its input.
    after = jax.jit(jax.shard_map(lambda a, c: (td.all_gather(a, "tp"), piece(c)), mesh=mesh,
                                  in_specs=(sp, sp), out_specs=(P("tp"), sp), check_vma=False))
    alone = jax.jit(jax.shard_map(piece, mesh=mesh, in_specs=sp, out_specs=sp, check_vma=False))
    c = rand((world * 4, 8))
    shards = c.reshape(world, 4, 8).astype(np.float64)
    sums = {"scan": world * shards.sum(0)}.get(nesting, shards.sum(0))  # scan: two all_reduces
    want = np.tile(sums, (world, 1))
    placed = jax.device_put(c, NamedSharding(mesh, sp))
    for rows in (4, 8):
        a = jax.device_put(rand((world * rows, 8)), NamedSharding(mesh, sp))
        assert rel_err(after(a, placed)[1], want) < 1e-6
    assert rel_err(alone(placed), want) < 1e-6


@pytest.mark.parametrize("wrapper", ["checkpoint", "jit"])
@pytest.mark.parametrize("world", [2, 4])
def test_separately_wrapped_moe_layers_in_one_chain(world, wrapper):
    """Two MoE layers (dispatch, expert GEMM, combine) on independent batches, each
    under its own jax.checkpoint or nested jax.jit, summed, differentiated: their
    calls are ordered (they were not: wrong losses and gradients from run to run,
    or a timed-out wait), and the loss and gradients match a float32 reference."""
    batches, t, h, f, k, e = 2, 3, 16, 8, 2, 4
    mesh = setup(world, wait_timeout_s=60.0)
    jax.clear_caches()
    rng = np.random.default_rng(1)
    x = rand((batches, world * t, h))
    ids = np.stack([np.stack([rng.permutation(e)[:k] for _ in range(world * t)])
                    for _ in range(batches)]).astype(np.int32)
    w, gate, c = rand((e, h, f), scale=0.3), rand((batches, world * t, k)), rand(
        (batches, world * t, f))

    def layer(x, ids, w, gate):
        recv, sizes, handle = td.moe_dispatch(x, ids, "tp", num_experts=e)
        return td.moe_combine(jax.lax.ragged_dot(recv, w, sizes), handle, gate, "tp")

    def body(x, ids, w, gate, c):
        def loss(x, w, gate):
            wrapped = _NESTINGS[wrapper](layer)
            return sum(jnp.sum(wrapped(x[b], ids[b], w, gate[b]) * c[b])
                       for b in range(batches))
        value, grads = jax.value_and_grad(loss, argnums=(0, 1, 2))(x, w, gate)
        return jax.lax.psum(value, "tp"), grads

    rows, local = P(None, "tp"), P("tp")
    w_local = w.reshape(world, e // world, h, f)
    args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in
            zip((x, ids, w_local, gate, c), (rows, rows, local, rows, rows))]
    fn = jax.jit(jax.shard_map(
        lambda x, ids, w, gate, c: body(x, ids, w[0], gate, c), mesh=mesh,
        in_specs=(rows, rows, local, rows, rows), out_specs=(P(), (rows, local, rows))))
    compiled = fn.lower(*args).compile()
    assert not unordered_call_sites(compiled.as_text())

    def dense(x, w, gate):
        y = jnp.einsum("bth,btkhf->btkf", x, w[ids])
        return jnp.sum(jnp.einsum("btkf,btk->btf", y, gate) * c)

    with jax.default_matmul_precision("highest"):
        want_value, want = jax.value_and_grad(dense, argnums=(0, 1, 2))(x, w, gate)
    for _ in range(3):  # a race moves the error from run to run
        value, (dx, dw, dgate) = compiled(*args)
        assert abs(float(value) - float(want_value)) < 1e-4 * abs(float(want_value))
        dw = np.asarray(dw).reshape(w.shape)
        for got, ref in ((dx, want[0]), (dw, want[1]), (dgate, want[2])):
            assert rel_err(got, ref) < 1e-5


def _two_inbox_calls(op: str):
    """Two independent calls of an inbox op (an SM push kernel, then its consumer,
    under the interpreter) and what each gives alone: (body, in_specs, out_specs,
    operand shapes)."""
    if op == "ag_attention":
        def one(q):
            return td.ag_attention(q, q, q, "tp", causal=True, config=dict(GATHER="inbox"))
        return one, P(None, "tp"), P(None, "tp"), (1, 4 * 8, 2, 16)

    def one(x):
        w = jnp.ones((x.shape[1], 32), x.dtype) / x.shape[1]
        return td.ag_matmul(x, w, "tp", config=dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16,
                                                     TMA=True, PRODUCER="ce"))
    return one, P("tp", None), P(None, "tp"), (4 * 16, 32)


@pytest.mark.parametrize("op", ["ag_attention", "ag_matmul"])
def test_inbox_consumers_run_after_their_pushes(op):
    """Under the interpreter the inbox ops push with an SM kernel, then run their
    consumer, which waits for the peers' pushes. The consumer takes a value of the
    push kernel (an optimization barrier tying them did not survive XLA:CPU's
    compilation: a device whose worker ran the consumer first waited for peers
    that could do the same), and the next call comes after both: no two call
    sites of two independent calls unordered in the compiled HLO, 4 ranks; each
    call's values as alone."""
    world = 4
    mesh = setup(world, wait_timeout_s=60.0)
    one, in_spec, out_spec, shape = _two_inbox_calls(op)
    f = jax.jit(jax.shard_map(lambda a, b: (one(a), one(b)), mesh=mesh,
                              in_specs=(in_spec, in_spec), out_specs=(out_spec, out_spec),
                              check_vma=False))
    alone = jax.jit(jax.shard_map(one, mesh=mesh, in_specs=in_spec, out_specs=out_spec,
                                  check_vma=False))
    a, b = (jax.device_put(rand(shape), NamedSharding(mesh, in_spec)) for _ in range(2))
    hlo = f.lower(a, b).compile().as_text()
    assert not unordered_call_sites(hlo), unordered_call_sites(hlo)
    want_a, want_b = np.asarray(alone(a)), np.asarray(alone(b))
    for _ in range(3):
        got_a, got_b = f(a, b)
        assert rel_err(got_a, want_a) < 1e-6 and rel_err(got_b, want_b) < 1e-6
