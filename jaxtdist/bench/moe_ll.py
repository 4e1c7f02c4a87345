"""moe_ll's benchmark: the low-latency MoE layout (``jaxtdist.moe_dispatch_ll`` /
``moe_combine_ll``, ``grouped_matmul_masked``) against the packed one.

``python -m jaxtdist.bench moe_ll [--world W]``, two tables (see docs/moe.md,
"the low-latency layout"):

1. Dispatch and combine, per (tokens per rank T, H, top-K, E) of
   ``shapes.MOE_LL_SHAPES`` (decode: DeepSeek-V3 and Qwen3-30B-A3B), bf16, a
   random top-K routing (distinct experts), identity experts, expert parallel
   over the first W devices (W = 1: the kernels, as the LL ops have no local
   computation; the packed pair forced onto its kernels with
   ``moe_dispatch_kernels`` / ``moe_combine_kernels``), in one interleaved run:

   - ``ll_dispatch``, ``ll_layer`` (dispatch + combine), ``ll_fp8_dispatch``
     (``fp8=True``: e4m3 with a scale per 1 x 128 block, quantized in the send);
   - ``packed_dispatch``, ``packed_layer``: ``moe_dispatch`` / ``moe_combine``;
   - at W > 1, XLA's ``all_to_all`` and ``ragged_all_to_all`` contenders of
     ``bench moe`` (``moe.all_to_all_moe``, ``moe.ragged_moe``).

   Checks: the LL recv_x's valid rows (each expert's prefix) and recv_counts bit
   for bit against the routing; the FP8 dispatch's dequantized valid rows by
   relative error against x; the packed recv_x bit for bit
   (``moe.expected_recv``, where it fits ``moe.EXACT_RECV_LIMIT``); every combine
   against x times its token's weight sum (float32).
2. The masked grouped GEMM (``moe_ll_gemm``): one rank's E / W experts at decode
   token counts, against the packed grouped GEMMs, bf16 and FP8, with the weight-read
   bandwidth against the HBM peak.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxtdist.bench import harness as h
from jaxtdist.bench import moe, moe_ll_gemm
from jaxtdist.bench.moe_ll_gemm import bench_masked_gemm
from jaxtdist.bench.shapes import MOE_LL_GEMM_MODELS, MOE_LL_GEMM_TOKENS, MOE_LL_SHAPES

__all__ = ["BENCHMARK", "LAYOUT_SERIES", "SERIES", "bench_masked_gemm", "bench_moe_ll_layout",
           "layout_heap_bytes", "table"]

EP = P("ep")
LAYOUT_SERIES = ("ll_layer", "packed_layer", "all_to_all_layer", "ragged_layer", "ll_dispatch",
                 "ll_fp8_dispatch", "packed_dispatch", "all_to_all_dispatch", "ragged_dispatch")
# The GEMM rows' contenders have names of their own: one plot series each.
SERIES = LAYOUT_SERIES + moe_ll_gemm.SERIES


def layout_heap_bytes(shapes, world: int) -> int:
    """A heap holding every shape's workspaces at once: the LL dispatch (bf16 and
    FP8) and combine, and the packed pair's (``moe.ep_heap_bytes``)."""
    from jaxtdist.ops.moe import ll_heap_bytes
    from jaxtdist.ops.moe._ll_launch import LLCombineWorkspace

    need = 0
    for t, hidden, k, e in shapes:
        need += ll_heap_bytes(world, e, t, hidden, 2) + ll_heap_bytes(world, e, t, hidden, 2,
                                                                      fp8=True)
        need += LLCombineWorkspace(world, t, k, hidden, 2, 256).nbytes
    return moe.ep_heap_bytes(shapes, world) + int(need * 1.25) + (64 << 20)


def _ll_valid_rows(recv, counts, scale=None) -> tuple[list, np.ndarray]:
    """The LL recv_x's valid rows per global expert (its prefix of sum(counts) rows),
    dequantized with ``scale`` (1 x 128 blocks) where given. Each prefix is cut
    before any conversion: the whole FP8 recv_x in float32 at 8 ranks of DeepSeek-V3
    would be 7.5 GB of host memory."""
    recv, counts = np.asarray(recv), np.asarray(counts)
    scale = None if scale is None else np.asarray(scale)
    rows = []
    for e in range(recv.shape[0]):
        n = int(counts[e].sum())
        r = recv[e, :n]
        if scale is not None:
            r = r.astype(np.float32) * np.repeat(scale[e, :n], 128, axis=1)[:, :r.shape[1]]
        rows.append(r)
    return rows, counts


def _expected_ll(x: np.ndarray, ids: np.ndarray, world: int, experts: int):
    """Per global expert: its rows in (source rank, token) order, which is global token
    order; and the counts [E, W] (tokens of each source routed to it)."""
    rows = [x[(ids == e).any(axis=1)] for e in range(experts)]
    src = np.arange(x.shape[0]) // (x.shape[0] // world)
    counts = np.stack([np.bincount(src[(ids == e).any(axis=1)], minlength=world)
                       for e in range(experts)]).astype(np.int32)
    return rows, counts


def _bodies(world: int, e: int) -> dict:
    """Contender name -> shard_map body of (x, ids, w) over "ep"."""
    import jaxtdist as td
    from jaxtdist.ops.moe import moe_combine_kernels, moe_dispatch_kernels

    # At world 1 the packed ops run their local computation: force the kernels.
    dispatch = moe_dispatch_kernels if world == 1 else td.moe_dispatch
    combine = moe_combine_kernels if world == 1 else td.moe_combine

    def ll_dispatch(x, ids, w):
        return td.moe_dispatch_ll(x, ids, "ep", num_experts=e)[:2]

    def ll_fp8_dispatch(x, ids, w):
        return td.moe_dispatch_ll(x, ids, "ep", num_experts=e, fp8=True)[:2]

    def ll_layer(x, ids, w):
        recv, _, handle = td.moe_dispatch_ll(x, ids, "ep", num_experts=e)
        return td.moe_combine_ll(recv, handle, w, "ep")                  # identity experts

    def packed_layer(x, ids, w):
        recv, _, handle = dispatch(x, ids, "ep", num_experts=e)
        return combine(recv, handle, w, "ep")

    bodies = dict(ll_dispatch=(ll_dispatch, (EP, EP)),
                  ll_fp8_dispatch=(ll_fp8_dispatch, ((EP, EP), EP)),
                  ll_layer=(ll_layer, EP),
                  packed_dispatch=(lambda x, ids, w: dispatch(x, ids, "ep", num_experts=e)[0],
                                   EP),
                  packed_layer=(packed_layer, EP))
    if world > 1:  # bench moe's XLA contenders
        for name, fn in (("all_to_all", moe.all_to_all_moe), ("ragged", moe.ragged_moe)):
            for what, combine_too in (("dispatch", False), ("layer", True)):
                bodies[f"{name}_{what}"] = (
                    lambda x, ids, w, fn=fn, c=combine_too: fn(
                        x, ids, w, "ep", world=world, num_experts=e, combine=c), EP)
    return bodies


def bench_moe_ll_layout(shapes, iterations: int, world: int, rounds: int = 4,
                        heap_bytes: int | None = None) -> list[dict]:
    """The dispatch / combine rows (see the module docstring)."""
    from jax.sharding import NamedSharding

    import jaxtdist as td

    devices = jax.devices()[:world]
    if len(devices) < world:
        raise ValueError(f"bench moe_ll --world {world}: only {len(devices)} devices")
    mesh = jax.make_mesh((world,), ("ep",), devices=devices,
                         axis_types=(jax.sharding.AxisType.Auto,))
    td.initialize(mesh, heap_bytes=heap_bytes or layout_heap_bytes(shapes, world))
    sharding = NamedSharding(mesh, EP)
    rows = []
    for i, (t, hidden, k, e) in enumerate(shapes):
        if e % world:
            raise ValueError(f"bench moe_ll: E={e} experts is not a multiple of world {world}")
        fns = {name: jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(EP,) * 3, out_specs=out,
                                           check_vma=False))
               for name, (body, out) in _bodies(world, e).items()}
        x = h.normal(2600 + i, (world * t, hidden), jnp.bfloat16)
        ids_np = moe._routing(2700 + i, world * t, k, e)
        w_np = np.random.default_rng(2800 + i).random((world * t, k), np.float32)
        args = tuple(jax.device_put(a, sharding) for a in (x, jnp.asarray(ids_np),
                                                           jnp.asarray(w_np)))
        x_np = np.asarray(x)
        ref = x_np.astype(np.float32) * w_np.sum(1, keepdims=True)
        e_loc = e // world
        packed_ref = None
        if world * world * t * min(k, e_loc) * hidden * 2 <= moe.EXACT_RECV_LIMIT:
            packed_ref = moe.expected_recv(x_np, ids_np, world, e)
        contenders = {name: h.Contender(fn, args, world) for name, fn in fns.items()}
        for name in ("ll_layer", "packed_layer", "all_to_all_layer", "ragged_layer"):
            if name in contenders:
                contenders[name].ref = ref
        if packed_ref is not None:
            contenders["packed_dispatch"].ref, contenders["packed_dispatch"].exact = (
                packed_ref, True)
        row = dict(kind="layout", tokens=t, hidden=hidden, top_k=k, experts=e, world=world,
                   dtype="bfloat16", rounds=rounds, size=float(t), label=f"T={t} H={hidden}",
                   pair_bytes_per_rank=float(t * k * hidden * 2))
        row.update(h.interleaved(contenders, iterations, rounds))
        _check_ll(row, fns, args, x_np, ids_np, world, e)
        rows.append(row)
        print(f"moe_ll world={world} T={t} H={hidden} K={k} E={e}: " + " | ".join(
            f"{name} {h.us(row.get(name))}" for name in fns), flush=True)
    return rows


def _check_ll(row: dict, fns: dict, args, x_np, ids_np, world: int, e: int) -> None:
    """The LL dispatches' valid rows and counts against the routing (their rows past
    the counts are unspecified, so the harness cannot compare whole outputs)."""
    want_rows, want_counts = _expected_ll(x_np, ids_np, world, e)
    if "error" not in row["ll_dispatch"]:
        got_rows, counts = _ll_valid_rows(*fns["ll_dispatch"](*args))
        row["ll_dispatch"]["exact"] = bool(np.array_equal(counts, want_counts) and all(
            np.array_equal(a, b) for a, b in zip(got_rows, want_rows)))
    if "error" not in row["ll_fp8_dispatch"]:
        (q, s), counts = fns["ll_fp8_dispatch"](*args)
        got_rows, counts = _ll_valid_rows(q, counts, s)
        if np.array_equal(counts, want_counts):
            row["ll_fp8_dispatch"]["rel_err"] = h.rel_err(np.concatenate(got_rows),
                                                          np.concatenate(want_rows))
        else:
            row["ll_fp8_dispatch"]["rel_err"] = float("inf")


LAYOUT_COLUMNS = [
    h.Column("T x H, top-K, E", lambda r: f"{r['tokens']} x {r['hidden']}, top-{r['top_k']}, "
                                          f"{r['experts']}"),
    h.Column("dispatch: LL", lambda r: h.us(r.get("ll_dispatch"))),
    h.Column("dispatch: LL fp8", lambda r: h.us(r.get("ll_fp8_dispatch"))),
    h.Column("dispatch: packed", lambda r: h.us(r.get("packed_dispatch"))),
    h.Column("dispatch: all_to_all", lambda r: h.us(r.get("all_to_all_dispatch"))),
    h.Column("dispatch: ragged_all_to_all", lambda r: h.us(r.get("ragged_dispatch"))),
    h.Column("LL / packed", lambda r: h.ratio(r.get("ll_dispatch"), r.get("packed_dispatch"))),
    h.Column("LL fp8 / LL", lambda r: h.ratio(r.get("ll_fp8_dispatch"), r.get("ll_dispatch"))),
    h.Column("d + c: LL", lambda r: h.us(r.get("ll_layer"))),
    h.Column("d + c: packed", lambda r: h.us(r.get("packed_layer"))),
    h.Column("d + c: all_to_all", lambda r: h.us(r.get("all_to_all_layer"))),
    h.Column("d + c: ragged_all_to_all", lambda r: h.us(r.get("ragged_layer"))),
    h.Column("LL / packed ", lambda r: h.ratio(r.get("ll_layer"), r.get("packed_layer"))),
    h.Column("LL / a2a", lambda r: h.ratio(r.get("ll_layer"), r.get("all_to_all_layer"))),
    h.Column("combine alone: LL (d + c - d)", lambda r: _difference(r, "ll")),
    h.Column("combine alone: packed", lambda r: _difference(r, "packed")),
    h.Column("exact recv (LL, packed)", lambda r: f"{h.err(r.get('ll_dispatch'))}, "
                                                  f"{h.err(r.get('packed_dispatch'))}"),
    h.Column("rel err fp8 recv", lambda r: h.err(r.get("ll_fp8_dispatch"))),
    h.Column("rel err d + c (LL, packed, a2a, ragged)", lambda r: " / ".join(
        h.err(r.get(f"{n}_layer")) for n in ("ll", "packed", "all_to_all", "ragged"))),
]


def _difference(r: dict, prefix: str) -> str:
    """The combine's time: the layer's less the dispatch's (combine needs a dispatch's
    handle, so it is not timed alone)."""
    layer, disp = r.get(f"{prefix}_layer") or {}, r.get(f"{prefix}_dispatch") or {}
    if "mean_us" not in layer or "mean_us" not in disp:
        return "n/a"
    return f"{layer['mean_us'] - disp['mean_us']:.1f}"


def _errors(rows) -> str:
    seen = {}
    for r in rows:
        for name in SERIES:
            for e in (r.get(name) or {}).get("error", []):
                seen.setdefault(f"{name}: {e}", None)
    return "".join(f"\n\n- {e}" for e in seen)


def table(res: dict) -> str:
    layout = [r for r in res["rows"] if r.get("kind") == "layout"]
    gemm = [r for r in res["rows"] if r.get("kind") == "masked_gemm"]
    parts = []
    if layout:
        parts.append(h.markdown_table(
            f"moe low-latency layout (moe_dispatch_ll / moe_combine_ll) against the packed "
            f"layout (moe_dispatch / moe_combine){' and XLA' if res['world'] > 1 else ''}, "
            f"{res['world']} x {res['device']}, bfloat16, identity experts; "
            f"{h.timing_note(res)}. d + c: dispatch + combine", LAYOUT_COLUMNS, layout))
    if gemm:
        parts.append(moe_ll_gemm.table(res, gemm))
    return "\n\n".join(parts) + _errors(res["rows"])


def run(args) -> tuple[list[dict], dict]:
    world = args.world
    shapes = MOE_LL_SHAPES[:2] if args.quick else MOE_LL_SHAPES
    models = MOE_LL_GEMM_MODELS[:1] if args.quick else MOE_LL_GEMM_MODELS
    tokens = MOE_LL_GEMM_TOKENS[::2] if args.quick else MOE_LL_GEMM_TOKENS
    rows = bench_moe_ll_layout(shapes, args.iterations, world, rounds=args.rounds)
    mesh = jax.make_mesh((world,), ("ep",), devices=jax.devices()[:world],
                         axis_types=(jax.sharding.AxisType.Auto,))
    # The GEMM on the mesh initialize was given (replicated: one rank's experts).
    gemm = bench_masked_gemm(models, tokens, args.iterations, world, rounds=args.rounds,
                             mesh=mesh)
    return rows + gemm, dict(world=world, plot=dict(series=list(SERIES),
                                                    size_label="tokens per rank / routed"))


def _arguments(parser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="two layout shapes; Qwen3's experts at 1, 32 and 256 tokens")
    parser.add_argument("--world", type=int, default=1,
                        help="1 (default): the kernels on one device; W > 1: expert parallel "
                             "over the first W devices (also XLA's all_to_all and "
                             "ragged_all_to_all), the GEMM on one rank's E / W experts")


BENCHMARK = h.Benchmark(name="moe_ll", op="moe_ll", run=run, table=table, series=SERIES,
                        size_label="tokens per rank / routed", arguments=_arguments)
