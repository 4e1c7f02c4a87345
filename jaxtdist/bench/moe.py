"""moe's benchmark: ``jaxtdist.moe_dispatch`` + ``moe_combine``, at world 1 and world W.

``python -m jaxtdist.bench moe`` (``--world 1``, the default), per (tokens, hidden, top_k, experts) of
``shapes.MOE_SHAPES`` (bf16, one device): the op at world 1 is its local
computation, pure JAX (a scatter into the expert-major layout, then a
weighted gather), which is the reference the kernels are held to; the
kernels forced at world 1 (``moe_dispatch_kernels`` / ``moe_combine_kernels``:
what a group of several ranks runs, communication aside) are timed for
dispatch alone and for dispatch + combine. The experts are the identity
(y = recv_x), so combine's output is x times the sum of its token's weights,
checked against float32. Also ``jax.lax.ragged_dot`` on the received groups
(the experts' GEMM with w [E, H, H/4]), for scale.

``python -m jaxtdist.bench moe --world W`` (W > 1), expert parallelism over the
first W devices (mesh axis "ep", E / W experts per rank), per (tokens per
rank T, H, K, E) of ``MOE_SHAPES``, bf16, random top-K routing (distinct
experts per token), identity experts; in one interleaved run, dispatch alone
and dispatch + combine of:

- ``jaxtdist``: ``moe_dispatch`` (+ ``moe_combine``) in ``jax.jit(shard_map)``;
- ``all_to_all``: pure JAX, each rank scatters its (token, k) pairs into a
  dense [W, C, H] send buffer (C = T * min(K, E / W): nothing dropped),
  ``jax.lax.all_to_all``, identity experts, ``all_to_all`` back, gather and
  weighted sum in float32;
- ``ragged``: the same with ``jax.lax.ragged_all_to_all`` on the pairs sorted
  by destination rank (exact sizes; the size matrix by ``all_gather``). Where
  the platform lacks it (XLA:CPU) the contender records the error;
- ``jaxtdist, unused rows not zeroed``: ``moe_dispatch(...,
  zero_unused_rows=False)`` (+ ``moe_combine``): recv_x's rows past the received
  ones left unwritten;
- ``jaxtdist fp8`` (dispatch only): the same tokens as float8_e4m3fn with a
  float32 scale per 128 columns (``x_scale``), its dequantized rows checked
  bit for bit against the dispatch of the dequantized tokens.

Both XLA dispatches deliver the rows grouped by source rank (not expert-major
like jaxtdist's ``recv_x``) and send one row per (token, k) pair, where
jaxtdist's dispatch sends one per (token, destination rank). Every
contender's combine output is checked against float32 (x times its token's
weight sum); jaxtdist's ``recv_x`` is checked bit for bit against its
documented layout where it fits on the host (``EXACT_RECV_LIMIT``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxtdist.bench import harness as h
from jaxtdist.bench.shapes import MOE_SHAPES

# The combine inbox holds T * K rows per call parity (940 MB at 4096 x 8 x 7168
# bf16): more than the default 1 GiB heap with the dispatch's inbox beside it.
HEAP_BYTES = 4 << 30
# jaxtdist's recv_x (all ranks) up to this size is fetched and compared bit for bit.
EXACT_RECV_LIMIT = 1 << 30


def _routing(seed: int, t: int, k: int, e: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.argsort(rng.random((t, e)), axis=1)[:, :k].astype(np.int32)


def bench_moe(shapes, iterations: int, rounds: int = 4, dtype=jnp.bfloat16,
              heap_bytes: int = HEAP_BYTES) -> list[dict]:
    import jaxtdist as td
    from jaxtdist.ops.moe import moe_combine_kernels, moe_dispatch_kernels

    device = jax.devices()[0]
    mesh = jax.make_mesh((1,), ("ep",), devices=[device],
                         axis_types=(jax.sharding.AxisType.Auto,))
    td.initialize(mesh, heap_bytes=heap_bytes)
    rows = []
    for i, (t, hidden, k, e) in enumerate(shapes):
        specs = dict(mesh=mesh, in_specs=(P(), P(), P()), out_specs=P(), check_vma=False)

        def op_dispatch(x, ids, w):
            return td.moe_dispatch(x, ids, "ep", num_experts=e)[0]

        def op_layer(x, ids, w):
            recv, _, handle = td.moe_dispatch(x, ids, "ep", num_experts=e)
            return td.moe_combine(recv, handle, w, "ep")

        def kernel_dispatch(x, ids, w):
            return moe_dispatch_kernels(x, ids, "ep", num_experts=e)[0]

        def kernel_layer(x, ids, w):
            recv, _, handle = moe_dispatch_kernels(x, ids, "ep", num_experts=e)
            return moe_combine_kernels(recv, handle, w, "ep")

        fns = {name: jax.jit(jax.shard_map(body, **specs)) for name, body in (
            ("reference_dispatch", op_dispatch), ("reference_layer", op_layer),
            ("kernels_dispatch", kernel_dispatch), ("kernels_layer", kernel_layer))}
        x = h.normal(1100 + i, (t, hidden), dtype)
        ids = jnp.asarray(_routing(1200 + i, t, k, e))
        w = jnp.asarray(np.random.default_rng(1300 + i).random((t, k), np.float32))
        args = tuple(jax.device_put(a, device) for a in (x, ids, w))
        ref = np.asarray(x, np.float32) * np.asarray(w).sum(1, keepdims=True)
        recv_ref = np.asarray(fns["reference_dispatch"](*args))
        # The experts' GEMM on the received groups, for scale (H -> H / 4).
        local_sizes = jax.jit(jax.shard_map(
            lambda x, ids, w: td.moe_dispatch(x, ids, "ep", num_experts=e)[1], **specs))(*args)
        wexp = h.normal(1400 + i, (e, hidden, hidden // 4), dtype, scale=hidden ** -0.5)
        ragged = jax.jit(jax.lax.ragged_dot)
        recv_dev = jax.device_put(jnp.asarray(recv_ref), device)
        row = dict(tokens=t, hidden=hidden, top_k=k, experts=e, world=1,
                   dtype=jnp.dtype(dtype).name, rounds=rounds, size=float(t),
                   label=f"T={t}")
        row.update(h.interleaved(dict(
            reference_dispatch=h.Contender(fns["reference_dispatch"], args, 1),
            kernels_dispatch=h.Contender(fns["kernels_dispatch"], args, 1, recv_ref,
                                         exact=True),
            reference_layer=h.Contender(fns["reference_layer"], args, 1, ref),
            kernels_layer=h.Contender(fns["kernels_layer"], args, 1, ref),
            ragged_dot=h.Contender(ragged, (recv_dev, wexp, local_sizes), 1)),
            iterations, rounds))
        rows.append(row)
        print(f"moe T={t} H={hidden} K={k} E={e}: " + " | ".join(
            f"{name} {h.us(row.get(name))}" for name in
            ("reference_dispatch", "kernels_dispatch", "reference_layer", "kernels_layer",
             "ragged_dot")), flush=True)
    return rows


COLUMNS = [
    h.Column("T x H, top-K, E", lambda r: f"{r['tokens']} x {r['hidden']}, top-{r['top_k']}, "
                                          f"{r['experts']}"),
    h.Column("dispatch: pure JAX", lambda r: h.us(r.get("reference_dispatch"))),
    h.Column("dispatch: kernels", lambda r: h.us(r.get("kernels_dispatch"))),
    h.Column("ratio", lambda r: h.ratio(r.get("kernels_dispatch"), r.get("reference_dispatch"))),
    h.Column("dispatch + combine: pure JAX", lambda r: h.us(r.get("reference_layer"))),
    h.Column("dispatch + combine: kernels", lambda r: h.us(r.get("kernels_layer"))),
    h.Column("ratio ", lambda r: h.ratio(r.get("kernels_layer"), r.get("reference_layer"))),
    h.Column("ragged_dot (H -> H/4)", lambda r: h.us(r.get("ragged_dot"))),
    h.Column("exact dispatch", lambda r: h.err(r.get("kernels_dispatch"))),
    h.Column("rel err layer", lambda r: h.err(r.get("kernels_layer"))),
]


def world1_table(res: dict) -> str:
    return h.markdown_table(
        f"moe dispatch + combine at world 1, bfloat16, 1 x {res['device']}; "
        f"{h.timing_note(res)}. Pure JAX = the op's local computation", COLUMNS, res["rows"])


# ---------------------------------------------------------------- world W > 1

EP_SPEC = P("ep")
# The plot's series at world W (the Benchmark's own are world 1's).
EP_SERIES = ("jaxtdist_layer", "all_to_all_layer", "ragged_layer", "jaxtdist_dispatch",
             "all_to_all_dispatch", "ragged_dispatch", "jaxtdist_fp8_dispatch",
             "jaxtdist_dispatch_routing_xla",
             "jaxtdist_dispatch_unzeroed", "jaxtdist_layer_unzeroed")
# The dispatch's routing words computed otherwise than by the GPU default at decode
# sizes (MoeConfig.ROUTING, "fused"), each timed beside it.
ROUTINGS = ("xla",)


def fp8_tokens(x: np.ndarray, blocks: int | None = None,
               dtype=jnp.float8_e4m3fn) -> tuple[np.ndarray, np.ndarray]:
    """x [T, H] -> (fp8 [T, H], float32 scales [T, S]): each token's H / S columns
    scaled into the fp8 range. ``blocks`` S (default: one scale per 128 columns
    where 128 divides H, DeepSeek-V3's blocks, else one per token)."""
    t, hidden = x.shape
    if blocks is None:
        blocks = hidden // 128 if hidden % 128 == 0 else 1
    xb = np.asarray(x, np.float32).reshape(t, blocks, hidden // blocks)
    scale = np.maximum(np.abs(xb).max(-1), 1e-12) / float(jnp.finfo(dtype).max)
    q = np.asarray(jnp.asarray((xb / scale[..., None]).reshape(t, hidden), dtype))
    return q, scale.astype(np.float32)


def fp8_dequantize(q, scale):
    """fp8 [T, H] and scales [T, S] -> float32 [T, H] (NumPy or JAX arrays)."""
    t, hidden = q.shape
    blocks = scale.shape[1]
    return (q.astype(np.float32).reshape(t, blocks, hidden // blocks)
            * scale[..., None]).reshape(t, hidden)


def _pair_slots(expert_ids, world: int, num_experts: int):
    """Per (token, k) pair of this rank: its destination rank and its position among
    the pairs this rank sends there (token-major order), both [T * K] int32; and the
    pairs sent to each rank, [W] int32."""
    dest = (expert_ids // (num_experts // world)).reshape(-1).astype(jnp.int32)
    onehot = (dest[:, None] == jnp.arange(world, dtype=jnp.int32)[None]).astype(jnp.int32)
    before = jnp.cumsum(onehot, axis=0) - onehot
    pos = jnp.take_along_axis(before, dest[:, None], axis=1)[:, 0]
    return dest, pos, jnp.sum(onehot, axis=0)


def _weighted_sum(rows, weights, t: int, k: int, dtype):
    """rows [T * K, H] (pair t * K + k's expert row) -> sum_k weights[t, k] * row, in
    float32, as ``dtype``."""
    rows = rows.reshape(t, k, -1).astype(jnp.float32)
    # Elementwise, not a dot: no TF32 rounding of the weights on GPUs.
    return jnp.sum(rows * weights.astype(jnp.float32)[:, :, None], axis=1).astype(dtype)


def all_to_all_moe(x, expert_ids, weights, axis_name: str, *, world: int, num_experts: int,
                   combine: bool = True):
    """Dispatch (+ identity experts + combine) with ``jax.lax.all_to_all`` on a dense
    [W, C, H] buffer per rank, C = T * min(K, E / W) (nothing dropped). Inside
    shard_map; returns the received [W * C, H] rows, or the combined [T, H]."""
    t, k = expert_ids.shape
    cap = t * min(k, num_experts // world)
    dest, pos, _ = _pair_slots(expert_ids, world, num_experts)
    # The buffer by a gather of rows (slot -> its pair's token), not a scatter of
    # rows into it: XLA's GPU scatter of [T * K, H] rows took 487 of this
    # contender's 696 us on 4 x H200 (128 tokens, top-8, H 7168).
    pair = jnp.full((world * cap,), -1, jnp.int32).at[dest * cap + pos].set(
        jnp.arange(t * k, dtype=jnp.int32))
    send = jnp.where((pair >= 0)[:, None], x[jnp.maximum(pair, 0) // k], 0).reshape(
        world, cap, x.shape[1])
    recv = jax.lax.all_to_all(send, axis_name, 0, 0)                       # [W (source), C, H]
    if not combine:
        return recv.reshape(world * cap, -1)
    y = recv                                                                # identity experts
    back = jax.lax.all_to_all(y, axis_name, 0, 0)                          # [W (expert rank), C, H]
    return _weighted_sum(back[dest, pos], weights, t, k, x.dtype)


def ragged_moe(x, expert_ids, weights, axis_name: str, *, world: int, num_experts: int,
               combine: bool = True, ragged_all_to_all=None):
    """Dispatch (+ identity experts + combine) with ``jax.lax.ragged_all_to_all``: the
    (token, k) pairs sorted by destination rank, exact sizes (the [W, W] size matrix
    by all_gather); each rank receives into [W * T * min(K, E / W), H] rows, grouped
    by source rank. Inside shard_map; returns the received rows, or the combined [T, H].
    ``ragged_all_to_all``: the collective (default ``jax.lax.ragged_all_to_all``)."""
    a2a = ragged_all_to_all or jax.lax.ragged_all_to_all
    t, k = expert_ids.shape
    rows_out = world * t * min(k, num_experts // world)
    dest, _, send_sizes = _pair_slots(expert_ids, world, num_experts)
    order = jnp.argsort(dest, stable=True)                                  # pairs by destination
    sent = x[order // k]                                                    # [T * K, H]
    sizes = jax.lax.all_gather(send_sizes, axis_name)                      # [W (src), W (dst)]
    me = jax.lax.axis_index(axis_name)
    input_offsets = (jnp.cumsum(send_sizes) - send_sizes).astype(jnp.int32)
    output_offsets = (jnp.cumsum(sizes, axis=0) - sizes)[me].astype(jnp.int32)
    recv_sizes = sizes[:, me].astype(jnp.int32)
    recv = a2a(sent, jnp.zeros((rows_out, x.shape[1]), x.dtype), input_offsets,
               send_sizes.astype(jnp.int32), output_offsets, recv_sizes, axis_name=axis_name)
    if not combine:
        return recv
    y = recv                                                                # identity experts
    recv_offsets = (jnp.cumsum(recv_sizes) - recv_sizes).astype(jnp.int32)
    back_offsets = (jnp.cumsum(sizes, axis=1) - sizes)[:, me].astype(jnp.int32)
    back = a2a(y, jnp.zeros((t * k, x.shape[1]), x.dtype), recv_offsets, recv_sizes,
               back_offsets, send_sizes.astype(jnp.int32), axis_name=axis_name)
    inverse = jnp.zeros((t * k,), jnp.int32).at[order].set(jnp.arange(t * k, dtype=jnp.int32))
    return _weighted_sum(back[inverse], weights, t, k, x.dtype)


def expected_recv(x: np.ndarray, ids: np.ndarray, world: int, num_experts: int) -> np.ndarray:
    """jaxtdist's recv_x of every rank, [W * R, H] (R = W * T * min(K, E / W)), from
    the global x [W * T, H] and ids [W * T, K]: per rank its local experts in order,
    each expert's rows in (source rank, token) order, which is global token order."""
    e_loc = num_experts // world
    rows = world * (x.shape[0] // world) * min(ids.shape[1], e_loc)
    out = np.zeros((world, rows, x.shape[1]), x.dtype)
    for d in range(world):
        got = np.concatenate([x[(ids == d * e_loc + j).any(axis=1)] for j in range(e_loc)])
        out[d, :len(got)] = got
    return out.reshape(world * rows, -1)


def ep_heap_bytes(shapes, world: int, itemsize: int = 2) -> int:
    """A heap that holds every shape's dispatch and combine workspaces at once
    (``HEAP_BYTES`` at least)."""
    from jaxtdist.ops.moe import CombineWorkspace, DispatchWorkspace

    need = 0
    for t, hidden, k, e in shapes:
        programs = min(t, 256)  # at most one per SM; a bound, the flags are small
        chunks = t  # a bound too (chunks of one token)
        need += DispatchWorkspace(world, t, hidden, itemsize, e // world,
                                  min(k, e // world), programs, chunks).nbytes
        need += CombineWorkspace(world, t, k, hidden, itemsize, programs, chunks).nbytes
    return max(HEAP_BYTES, int(need * 1.25) + (64 << 20))


def bench_moe_ep(shapes, iterations: int, world: int, rounds: int = 4, dtype=jnp.bfloat16,
                 heap_bytes: int | None = None) -> list[dict]:
    """The expert-parallel table at world W > 1 (see the module docstring)."""
    import jaxtdist as td
    from jax.sharding import NamedSharding

    devices = jax.devices()[:world]
    if len(devices) < world:
        raise ValueError(f"bench moe --world {world}: only {len(devices)} devices")
    mesh = jax.make_mesh((world,), ("ep",), devices=devices,
                         axis_types=(jax.sharding.AxisType.Auto,))
    itemsize = jnp.dtype(dtype).itemsize
    td.initialize(mesh, heap_bytes=heap_bytes or ep_heap_bytes(shapes, world, itemsize))
    specs = dict(mesh=mesh, in_specs=(EP_SPEC,) * 3, out_specs=EP_SPEC, check_vma=False)
    rows = []
    for i, (t, hidden, k, e) in enumerate(shapes):
        if e % world:
            raise ValueError(f"bench moe: E={e} experts is not a multiple of world {world}")

        def ours_dispatch(x, ids, w, e=e, zero=True):
            return td.moe_dispatch(x, ids, "ep", num_experts=e, zero_unused_rows=zero)[0]

        def ours_layer(x, ids, w, e=e, zero=True):
            recv, _, handle = td.moe_dispatch(x, ids, "ep", num_experts=e,
                                              zero_unused_rows=zero)
            return td.moe_combine(recv, handle, w, "ep")                # identity experts

        bodies = dict(
            jaxtdist_dispatch=ours_dispatch, jaxtdist_layer=ours_layer,
            jaxtdist_dispatch_unzeroed=lambda x, ids, w, e=e: ours_dispatch(x, ids, w, e, False),
            jaxtdist_layer_unzeroed=lambda x, ids, w, e=e: ours_layer(x, ids, w, e, False),
            all_to_all_dispatch=lambda x, ids, w, e=e: all_to_all_moe(
                x, ids, w, "ep", world=world, num_experts=e, combine=False),
            all_to_all_layer=lambda x, ids, w, e=e: all_to_all_moe(
                x, ids, w, "ep", world=world, num_experts=e),
            ragged_dispatch=lambda x, ids, w, e=e: ragged_moe(
                x, ids, w, "ep", world=world, num_experts=e, combine=False),
            ragged_layer=lambda x, ids, w, e=e: ragged_moe(
                x, ids, w, "ep", world=world, num_experts=e))
        # The routing metadata computed the other ways (config ROUTING).
        for routing in ROUTINGS:
            bodies[f"jaxtdist_dispatch_routing_{routing}"] = (
                lambda x, ids, w, e=e, routing=routing: td.moe_dispatch(
                    x, ids, "ep", num_experts=e, config=dict(ROUTING=routing))[0])
        fns = {name: jax.jit(jax.shard_map(body, **specs)) for name, body in bodies.items()}
        # fp8 dispatch: the same routing, fp8 tokens with float32 scales per 128 columns.
        fns["jaxtdist_fp8_dispatch"] = jax.jit(jax.shard_map(
            lambda q, s, ids, e=e: td.moe_dispatch(q, ids, "ep", num_experts=e, x_scale=s)[0],
            mesh=mesh, in_specs=(EP_SPEC,) * 3, out_specs=(EP_SPEC, EP_SPEC),
            check_vma=False))
        x = h.normal(1600 + i, (world * t, hidden), dtype)
        ids_np = _routing(1700 + i, world * t, k, e)
        w_np = np.random.default_rng(1800 + i).random((world * t, k), np.float32)
        sharding = NamedSharding(mesh, EP_SPEC)
        args = tuple(jax.device_put(a, sharding) for a in (x, jnp.asarray(ids_np),
                                                           jnp.asarray(w_np)))
        x_np = np.asarray(x)
        ref = x_np.astype(np.float32) * w_np.sum(1, keepdims=True)
        e_loc, kl = e // world, min(k, e // world)
        recv_rows = world * t * kl
        recv_ref = None
        if world * recv_rows * hidden * itemsize <= EXACT_RECV_LIMIT:
            recv_ref = expected_recv(x_np, ids_np, world, e)
        # Bytes per rank (mean over ranks): jaxtdist's dispatch sends one row per
        # (token, destination rank), its own rank included; the XLA contenders and
        # jaxtdist's combine one per (token, k) pair; all_to_all its dense buffer.
        ranks = (ids_np // e_loc).reshape(world, t, k)
        token_ranks = sum(int((ranks == d).any(axis=2).sum()) for d in range(world)) / world
        remote = sum(int((ranks[s] == d).any(axis=1).sum()) for s in range(world)
                     for d in range(world) if d != s) / world
        row = dict(tokens=t, hidden=hidden, top_k=k, experts=e, world=world,
                   dtype=jnp.dtype(dtype).name, rounds=rounds, size=float(t), label=f"T={t}",
                   dispatch_bytes_per_rank=token_ranks * hidden * itemsize,
                   dispatch_remote_bytes_per_rank=remote * hidden * itemsize,
                   pair_bytes_per_rank=float(t * k * hidden * itemsize),
                   all_to_all_bytes_per_rank=float(world * t * kl * hidden * itemsize))
        q_np, s_np = fp8_tokens(x_np)
        fp8_args = (jax.device_put(jnp.asarray(q_np), sharding),
                    jax.device_put(jnp.asarray(s_np), sharding), args[1])
        row["fp8_dispatch_bytes_per_rank"] = token_ranks * (
            hidden + 4 * s_np.shape[1] + (-(hidden + 4 * s_np.shape[1]) % 16))
        row.update(h.interleaved(dict(
            jaxtdist_dispatch=h.Contender(fns["jaxtdist_dispatch"], args, world, recv_ref,
                                          exact=True),
            jaxtdist_fp8_dispatch=h.Contender(fns["jaxtdist_fp8_dispatch"], fp8_args, world),
            # Its unused rows are unspecified: timed, its combine checked.
            jaxtdist_dispatch_unzeroed=h.Contender(fns["jaxtdist_dispatch_unzeroed"], args,
                                                   world),
            jaxtdist_layer_unzeroed=h.Contender(fns["jaxtdist_layer_unzeroed"], args, world,
                                                ref),
            **{f"jaxtdist_dispatch_routing_{r}": h.Contender(
                fns[f"jaxtdist_dispatch_routing_{r}"], args, world, recv_ref, exact=True)
               for r in ROUTINGS},
            all_to_all_dispatch=h.Contender(fns["all_to_all_dispatch"], args, world),
            ragged_dispatch=h.Contender(fns["ragged_dispatch"], args, world),
            jaxtdist_layer=h.Contender(fns["jaxtdist_layer"], args, world, ref),
            all_to_all_layer=h.Contender(fns["all_to_all_layer"], args, world, ref),
            ragged_layer=h.Contender(fns["ragged_layer"], args, world, ref)),
            iterations, rounds))
        disp = row.get("jaxtdist_dispatch") or {}
        if "mean_us" in disp:
            disp["gb_per_s"] = row["dispatch_bytes_per_rank"] / disp["mean_us"] / 1e3
        fp8 = row.get("jaxtdist_fp8_dispatch") or {}
        if "error" not in fp8 and recv_ref is not None:
            # The dequantized rows where the dequantized tokens' dispatch puts them.
            rq, rs = fns["jaxtdist_fp8_dispatch"](*fp8_args)
            fp8["exact"] = bool(np.array_equal(
                fp8_dequantize(np.asarray(rq), np.asarray(rs)),
                expected_recv(fp8_dequantize(q_np, s_np), ids_np, world, e)))
        rows.append(row)
        print(f"moe world={world} T={t} H={hidden} K={k} E={e}: " + " | ".join(
            f"{name} {h.us(row.get(name))}" for name in bodies), flush=True)
    return rows


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f}"


def _gbps(r: dict) -> str:
    entry = r.get("jaxtdist_dispatch") or {}
    return f"{entry['gb_per_s']:.0f}" if "gb_per_s" in entry else "n/a"


def _versus_xla(label: str, what: str, extra: list | None = None) -> list:
    """Columns of one measurement (``what``: "dispatch" or "layer"): jaxtdist's time,
    ``extra``, XLA's all_to_all and ragged_all_to_all times, jaxtdist's ratios to them."""
    ours, a2a, ragged = f"jaxtdist_{what}", f"all_to_all_{what}", f"ragged_{what}"
    return [h.Column(f"{label}: jaxtdist", lambda r: h.us(r.get(ours))), *(extra or []),
            h.Column(f"{label}: all_to_all", lambda r: h.us(r.get(a2a))),
            h.Column(f"{label}: ragged_all_to_all", lambda r: h.us(r.get(ragged))),
            h.Column(f"{label}: jaxtdist / a2a", lambda r: h.ratio(r.get(ours), r.get(a2a))),
            h.Column(f"{label}: jaxtdist / ragged",
                     lambda r: h.ratio(r.get(ours), r.get(ragged)))]


EP_COLUMNS = [
    h.Column("T x H, top-K, E", lambda r: f"{r['tokens']} x {r['hidden']}, top-{r['top_k']}, "
                                          f"{r['experts']}"),
    h.Column("MB/rank: jaxtdist dispatch (off-rank)",
             lambda r: f"{_mb(r['dispatch_bytes_per_rank'])} "
                       f"({_mb(r['dispatch_remote_bytes_per_rank'])})"),
    h.Column("MB/rank: (t, k) pairs, a2a dense", lambda r: f"{_mb(r['pair_bytes_per_rank'])}, "
                                                           f"{_mb(r['all_to_all_bytes_per_rank'])}"),
    *_versus_xla("dispatch", "dispatch", extra=[
        h.Column("dispatch: jaxtdist, routing by XLA",
                 lambda r: h.us(r.get("jaxtdist_dispatch_routing_xla"))),
        h.Column("dispatch: jaxtdist, unused rows not zeroed",
                 lambda r: h.us(r.get("jaxtdist_dispatch_unzeroed")))]),
    h.Column("jaxtdist dispatch GB/s", _gbps),
    h.Column("dispatch: jaxtdist fp8 (MB/rank)",
             lambda r: f"{h.us(r.get('jaxtdist_fp8_dispatch'))} "
                       f"({_mb(r.get('fp8_dispatch_bytes_per_rank', 0))})"),
    h.Column("fp8 / bf16", lambda r: h.ratio(r.get("jaxtdist_fp8_dispatch"),
                                             r.get("jaxtdist_dispatch"))),
    *_versus_xla("d + c", "layer", extra=[
        h.Column("d + c: jaxtdist, unused rows not zeroed",
                 lambda r: h.us(r.get("jaxtdist_layer_unzeroed")))]),
    h.Column("exact recv_x", lambda r: h.err(r.get("jaxtdist_dispatch"))),
    h.Column("exact fp8 recv", lambda r: h.err(r.get("jaxtdist_fp8_dispatch"))),
    h.Column("rel err: jaxtdist", lambda r: h.err(r.get("jaxtdist_layer"))),
    h.Column("rel err: jaxtdist, not zeroed",
             lambda r: h.err(r.get("jaxtdist_layer_unzeroed"))),
    h.Column("rel err: a2a", lambda r: h.err(r.get("all_to_all_layer"))),
    h.Column("rel err: ragged", lambda r: h.err(r.get("ragged_layer"))),
]


def _errors(rows) -> str:
    seen = {}
    for r in rows:
        for name in EP_SERIES:
            for e in (r.get(name) or {}).get("error", []):
                seen.setdefault(f"{name}: {e}", None)
    return "".join(f"\n\n- {e}" for e in seen)


def ep_table(res: dict) -> str:
    return h.markdown_table(
        f"moe dispatch + combine, expert parallel over {res['world']} x {res['device']}, "
        f"bfloat16, identity experts; {h.timing_note(res)}. d + c: dispatch + combine. "
        "MB/rank: jaxtdist's dispatch sends one row per (token, rank), own rank included "
        "(GB/s: these bytes over its time); the XLA contenders one per (token, k) pair, "
        "all_to_all its whole dense buffer", EP_COLUMNS, res["rows"]) + _errors(res["rows"])


def table(res: dict) -> str:
    return ep_table(res) if res.get("world", 1) > 1 else world1_table(res)


def run(args) -> tuple[list[dict], dict]:
    shapes = MOE_SHAPES[:1] if args.quick else MOE_SHAPES
    if args.world > 1:
        rows = bench_moe_ep(shapes, args.iterations, args.world, rounds=args.rounds)
        return rows, dict(world=args.world,
                          plot=dict(series=list(EP_SERIES), size_label="tokens per rank"))
    return bench_moe(shapes, args.iterations, rounds=args.rounds), dict(world=1)


def _arguments(parser) -> None:
    parser.add_argument("--quick", action="store_true", help="the first size only")
    parser.add_argument("--world", type=int, default=1,
                        help="1 (default): the kernels at world 1 against the local "
                             "computation; W > 1: expert parallel over the first W devices "
                             "against all_to_all and ragged_all_to_all")


BENCHMARK = h.Benchmark(
    name="moe", op="moe", run=run, table=table,
    series=("kernels_layer", "reference_layer", "kernels_dispatch", "reference_dispatch"),
    size_label="tokens per rank", arguments=_arguments)
