"""ag_attention's benchmark: jaxtdist's sequence-parallel attention against XLA's.

B=1, H=32, D=128, causal, bf16 (``shapes.AG_ATTENTION_*``; ``--head-dim`` and
``--dtype`` change D and the inputs' type):

- world 1 (default): jaxtdist's forward kernel forced at world 1
  (``ag_attention_kernels``) against ``jax.nn.dot_product_attention`` (JAX's
  default pick) and, on GPUs, the same with ``implementation="cudnn"`` and JAX's
  Pallas Mosaic-GPU flash attention (``attention_mgpu``, Hopper, the fastest of
  its block sizes, on float16 copies of the inputs, q scaled by 1 / sqrt(D):
  it takes no bfloat16 and does not scale the scores;
  forward only: it has no causal backward) at S of
  ``AG_ATTENTION_SEQS``;
- world W > 1 (``--world W``): ``jaxtdist.ag_attention`` (and its Triton kernel,
  forced) against XLA's ``all_gather`` of k and v + ``jax.nn.dot_product_attention``
  with the causal mask by global position, at S total of ``AG_ATTENTION_SEQS_MULTI``.
- ``--backward``: forward + backward (the gradients of q, k and v) of the op
  ``jaxtdist.ag_attention`` (at world 1 on GPUs: cuDNN where it takes the case,
  else the kernels; and the kernels forced, ``config={"PATH": "fused"}``)
  against the same contenders' (JAX's VJPs).

Outputs are checked on 256 query rows per rank (first and last 128) against a
float32 attention on the device: the full reference would not fit in memory.
Gradients are checked against float32 gradients (``ops.ag_attention.attention``)
where S is at most ``_GRAD_CHECK_SEQ``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtdist.bench import harness as h
from jaxtdist.bench.random_shapes import AttentionProblem, attention_problems
from jaxtdist.bench.shapes import AG_ATTENTION_HEADS, AG_ATTENTION_SEQS, AG_ATTENTION_SEQS_MULTI

SP = P(None, "sp")


def _mesh(world: int):
    return jax.make_mesh((world,), ("sp",), devices=jax.devices()[:world],
                         axis_types=(jax.sharding.AxisType.Auto,))


def _ops():
    import importlib

    return importlib.import_module("jaxtdist.ops.ag_attention")


def _checked_rows(s_total: int, world: int) -> np.ndarray:
    """The query rows whose output is checked: the first and last 128 of each rank."""
    shard = s_total // world
    rows = []
    for r in range(world):
        lo, hi = r * shard, (r + 1) * shard
        rows += list(range(lo, min(lo + 128, hi))) + list(range(max(lo, hi - 128), hi))
    return np.unique(np.asarray(rows))


def _reference_rows(q, k, v, rows: np.ndarray, causal: bool = True) -> np.ndarray:
    """float32 attention of query rows ``rows`` over every key (on the device, 128
    rows at a time: the scores of all of them would not fit); GQA by repeating k
    and v's heads."""
    group = q.shape[2] // k.shape[2]
    kf, vf = (jnp.repeat(jnp.asarray(a).astype(jnp.float32), group, axis=2) for a in (k, v))

    # k and v as arguments: captured, they became lowering constants (2 GB at 64K).
    @jax.jit
    def block(qs, pos, kf, vf):
        scores = jnp.einsum("bqhd,bkhd->bhqk", qs.astype(jnp.float32), kf,
                            precision=jax.lax.Precision.HIGHEST) / np.float32(np.sqrt(q.shape[-1]))
        if causal:
            seen = pos[:, None] >= jnp.arange(kf.shape[1])[None, :]
            scores = jnp.where(seen, scores, -jnp.inf)
        p = jax.nn.softmax(scores, axis=-1)
        return jnp.einsum("bhqk,bkhd->bqhd", p, vf, precision=jax.lax.Precision.HIGHEST)

    qa = jnp.asarray(q)
    return np.concatenate([np.asarray(block(qa[:, rows[i:i + 128]], jnp.asarray(rows[i:i + 128]),
                                            kf, vf))
                           for i in range(0, len(rows), 128)], axis=1)


def _xla_gather_attention(q, k, v, causal: bool = True):
    """XLA's sequence parallelism: all_gather k and v, attention with the causal mask
    of this rank's global positions."""
    s = q.shape[1]
    k_all = jax.lax.all_gather(k, "sp", axis=1, tiled=True)
    v_all = jax.lax.all_gather(v, "sp", axis=1, tiled=True)
    if not causal:
        try:
            return jax.nn.dot_product_attention(q, k_all, v_all, implementation="cudnn")
        except Exception:  # noqa: BLE001 - cuDNN absent or refusing the shapes
            return jax.nn.dot_product_attention(q, k_all, v_all)
    start = jax.lax.axis_index("sp") * s
    # From iotas, not jnp.arange: a concrete mask became a lowering constant of
    # S_shard x S bytes (4.3 GB at 128K over 4 ranks), which took minutes to compile.
    shape = (s, k_all.shape[1])
    mask = start + jax.lax.broadcasted_iota(jnp.int32, shape, 0) >= jax.lax.broadcasted_iota(
        jnp.int32, shape, 1)
    try:  # cuDNN's fused attention where it takes the mask: XLA's would not fit at 32K
        return jax.nn.dot_product_attention(q, k_all, v_all, mask=mask[None, None],
                                            implementation="cudnn")
    except Exception:  # noqa: BLE001 - cuDNN absent or refusing the shapes
        return jax.nn.dot_product_attention(q, k_all, v_all, mask=mask[None, None])


def _pallas_mgpu_attention() -> dict:
    """JAX's Pallas Mosaic-GPU causal flash attention at the block sizes JAX's own
    benchmark tries, as {config label: (q, k, v) -> out} (empty where it cannot be
    imported); ``harness.fastest`` picks among them (a config past the shared
    memory fails there)."""
    try:
        from jax.experimental.pallas.ops.gpu import attention_mgpu
    except Exception:  # noqa: BLE001 - an older or trimmed JAX: no such contender
        return {}
    return {f"block_q=64, block_kv={kv}, max_concurrent_steps=2": jax.jit(functools.partial(
                attention_mgpu.attention, config=attention_mgpu.TuningConfig(
                    block_q=64, block_kv=kv, max_concurrent_steps=2, causal=True)))
            for kv in (256, 128, 64)}


# The longest S whose gradients are checked against float32 ones: the reference's
# [H, S, S] float32 scores, probabilities and their cotangents must fit.
_GRAD_CHECK_SEQ = 4096


def _with_grads(fn):
    """(q, k, v, c) -> the gradients of sum(fn(q, k, v) * c) over q, k and v."""
    def grads(q, k, v, c):
        return jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * c),
                        argnums=(0, 1, 2))(q, k, v)
    return grads


def _reference_grads(q, k, v, c, causal: bool = True) -> tuple:
    from jaxtdist.ops.ag_attention import attention

    f32 = [jnp.asarray(a).astype(jnp.float32) for a in (q, k, v, c)]
    with jax.default_matmul_precision("highest"):
        return jax.jit(_with_grads(lambda *a: attention(*a, causal=causal)))(*f32)


def _fixed_problems(seqs, head_dim: int | None) -> list[AttentionProblem]:
    """The fixed list: ``AG_ATTENTION_HEADS`` (head dim ``head_dim`` if given), causal,
    at each total length of ``seqs``."""
    b, hh, d = AG_ATTENTION_HEADS
    return [AttentionProblem(b, s, hh, hh, head_dim or d, True) for s in seqs]


def _forward_contenders(mesh, world: int, causal: bool) -> dict:
    """The forward of the op and of its contenders, (q, k, v) -> out."""
    import jaxtdist as td

    ops = _ops()
    specs = dict(mesh=mesh, in_specs=(SP,) * 3, out_specs=SP, check_vma=False)
    if world > 1:
        return dict(jaxtdist=jax.jit(jax.shard_map(
                        lambda *a: td.ag_attention(*a, "sp", causal=causal), **specs)),
                    # The Triton kernel beside the default (warp-specialized where it fits).
                    jaxtdist_triton=jax.jit(jax.shard_map(
                        lambda *a: td.ag_attention(*a, "sp", causal=causal,
                                                   config=dict(KERNEL="triton")), **specs)),
                    xla_all_gather_dpa=jax.jit(jax.shard_map(
                        functools.partial(_xla_gather_attention, causal=causal), **specs)))
    fns = dict(jaxtdist=jax.jit(jax.shard_map(
                   lambda *a: ops.ag_attention_kernels(*a, "sp", causal=causal), **specs)),
               # The Triton kernel (what a group of several ranks runs) beside the
               # default (the warp-specialized kernel where it fits).
               jaxtdist_triton=jax.jit(jax.shard_map(
                   lambda *a: ops.ag_attention_kernels(*a, "sp", causal=causal,
                                                       config=dict(KERNEL="triton")),
                   **specs)),
               # The op as a user calls it, with its world-1 path choice.
               jaxtdist_op=jax.jit(jax.shard_map(
                   lambda *a: td.ag_attention(*a, "sp", causal=causal), **specs)),
               jax_nn_dpa=jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
                   q, k, v, is_causal=causal)))
    if jax.devices()[0].platform == "gpu":  # cuDNN's fused attention, asked for by name
        fns["cudnn_dpa"] = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="cudnn"))
    return fns


def bench_ag_attention(seqs, iterations: int, world: int, dtype=jnp.bfloat16,
                       rounds: int = 4, backward: bool = False,
                       head_dim: int | None = None,
                       problems: list[AttentionProblem] | None = None) -> list[dict]:
    """One row per problem (``problems``, else the fixed list at ``seqs``)."""
    import jaxtdist as td

    drawn = problems is not None
    problems = problems if drawn else _fixed_problems(seqs, head_dim)
    mesh = _mesh(world)
    # Room for the KV inboxes of every problem (2 parities x world ranks' k and v;
    # each shape keeps its own), else ag_attention falls back to reading peers over
    # the link. World 1 needs none.
    inbox = sum(2 * world * 2 * p.batch * (-(-p.seq // world)) * p.kv_heads * p.head_dim
                * jnp.dtype(dtype).itemsize for p in problems) if world > 1 else 0
    td.initialize(mesh, heap_bytes=max(1 << 30, inbox + (256 << 20)))
    contenders = {}  # by causal
    rows = []
    for i, (b, s, hh, hkv, d, causal) in enumerate(problems):
        if causal not in contenders:
            contenders[causal] = (_backward_contenders(mesh, world, causal) if backward
                                  else _forward_contenders(mesh, world, causal))
        fns = contenders[causal]
        s = -(-s // world) * world
        q = h.normal(600 + 3 * i, (b, s, hh, d), dtype)
        k, v = (h.normal(601 + 3 * i + j, (b, s, hkv, d), dtype) for j in range(2))
        args = tuple(jax.device_put(a, NamedSharding(mesh, SP)) for a in (q, k, v))
        flops = 4.0 * b * hh * d * s * s / (2 if causal else 1)  # QK^T and PV (causal: half)
        if backward:  # the backward's five products against the forward's two
            flops *= 3.5
            c = h.normal(700 + i, (b, s, hh, d), jnp.float32)
            args += (jax.device_put(c, NamedSharding(mesh, SP)),)
        label = f"S={s}" if not drawn else f"B={b} S={s} H={hh}/{hkv} D={d}" + (
            "" if causal else " non-causal")
        row = dict(b=b, h=hh, h_kv=hkv, d=d, seq=s, causal=causal, world=world,
                   dtype=jnp.dtype(dtype).name, size=float(s), label=label, flops=flops,
                   backward=backward)
        # XLA's own attention materializes [B, H, S, S] float32 scores: past 8K at
        # B=1, H=32 they do not fit (its backward's past 4K).
        scores = b * hh * s * s * 4
        longest = (32 << 30) // (4 if backward else 1)
        timed = {name: fn for name, fn in fns.items()
                 if name != "jax_nn_dpa" or scores <= longest}
        pallas_stats, own_args, pallas_args = None, {}, None
        if (world == 1 and not backward and causal and hh == hkv
                and jax.devices()[0].platform == "gpu"):
            # attention_mgpu takes float16 only, and does not scale the scores: float16
            # copies of the inputs (exact for bfloat16 values in float16's normal range,
            # as these standard-normal ones), q times 1 / sqrt(D) (rounded to float16).
            pallas_args = tuple(a.astype(jnp.float16) for a in
                                ((args[0].astype(jnp.float32) / np.sqrt(d),) + args[1:]))
            pallas_fn, pallas_stats = h.fastest(_pallas_mgpu_attention(), pallas_args, world,
                                                max(2, iterations // 4))
            if pallas_fn is not None:
                timed["pallas_mgpu"], own_args["pallas_mgpu"] = pallas_fn, pallas_args
        row.update(h.interleaved({name: h.Contender(fn, own_args.get(name, args), world)
                                  for name, fn in timed.items()}, iterations, rounds))
        if pallas_stats is not None:
            if "pallas_mgpu" in row:
                row["pallas_mgpu"]["config"] = pallas_stats["config"]
            else:
                row["pallas_mgpu"] = pallas_stats
        if backward:
            _check_grads(row, timed, args, b * hh * s * s, world, flops, causal)
            rows.append(row)
            print(f"{label} world={world} fwd+bwd: " + " | ".join(
                f"{n} {h.us(row.get(n))}" for n in timed), flush=True)
            del args
            continue
        checked = _checked_rows(s, world)
        ref = _reference_rows(q, k, v, checked, causal)
        for name, fn in timed.items():
            stats = row[name]
            if "error" in stats:
                continue
            out = np.asarray(fn(*own_args.get(name, args))[:, checked], np.float32)
            stats["rel_err"] = h.rel_err(out, ref)
            stats["tflops"] = flops / world / (stats["mean_us"] * 1e-6) / 1e12
        rows.append(row)
        print(f"{label} world={world}: " + " | ".join(f"{n} {h.us(row.get(n))}" for n in timed),
              flush=True)
        del args, own_args, pallas_args
    return rows


def _backward_contenders(mesh, world: int, causal: bool = True) -> dict:
    """Forward + backward of the op and of its contenders, (q, k, v, c) -> grads."""
    import jaxtdist as td

    specs = dict(mesh=mesh, in_specs=(SP,) * 4, out_specs=(SP,) * 3, check_vma=False)
    op = _with_grads(lambda *a: td.ag_attention(*a, "sp", causal=causal))
    fns = dict(jaxtdist=jax.jit(jax.shard_map(op, **specs)))
    if world == 1:  # the op's path at world 1 may be cuDNN: the kernels forced too
        fns["jaxtdist_kernels"] = jax.jit(jax.shard_map(_with_grads(
            lambda *a: td.ag_attention(*a, "sp", causal=causal, config=dict(PATH="fused"))),
            **specs))
        fns["jax_nn_dpa"] = jax.jit(_with_grads(
            lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal)))
        if jax.devices()[0].platform == "gpu":
            fns["cudnn_dpa"] = jax.jit(_with_grads(lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, is_causal=causal, implementation="cudnn")))
    else:
        fns["xla_all_gather_dpa"] = jax.jit(jax.shard_map(
            _with_grads(functools.partial(_xla_gather_attention, causal=causal)), **specs))
    return fns


def _check_grads(row: dict, fns: dict, args: tuple, scores: int, world: int, flops: float,
                 causal: bool = True) -> None:
    """Each contender's TFLOP/s, and its gradients' error against float32 ones (up to
    ``_GRAD_CHECK_SEQ``^2 x 32 scores: the reference's scores must fit)."""
    ref = (_reference_grads(*args, causal=causal) if scores <= 32 * _GRAD_CHECK_SEQ ** 2
           else None)
    for name, fn in fns.items():
        stats = row[name]
        if "error" in stats:
            continue
        stats["tflops"] = flops / world / (stats["mean_us"] * 1e-6) / 1e12
        if ref is not None:
            got = fn(*args)
            stats["rel_err"] = max(h.rel_err(np.asarray(g, np.float32), np.asarray(r))
                                   for g, r in zip(got, ref))


def _tflops(entry: dict | None) -> str:
    return f"{entry['tflops']:.0f}" if entry and "tflops" in entry else "n/a"


WORLD1_COLUMNS = [
    h.Column("S", lambda r: str(r["seq"])),
    h.Column("jax.nn.dot_product_attention", lambda r: h.us(r.get("jax_nn_dpa"))),
    h.Column("jaxtdist kernel", lambda r: h.us(r.get("jaxtdist"))),
    h.Column("jaxtdist / jax.nn", lambda r: h.ratio(r.get("jaxtdist"), r.get("jax_nn_dpa"))),
    h.Column("cuDNN (implementation='cudnn')", lambda r: h.us(r.get("cudnn_dpa"))),
    h.Column("jaxtdist / cuDNN", lambda r: h.ratio(r.get("jaxtdist"), r.get("cudnn_dpa"))),
    h.Column("Pallas Mosaic GPU (float16)", lambda r: h.us(r.get("pallas_mgpu"))),
    h.Column("jaxtdist / Pallas", lambda r: h.ratio(r.get("jaxtdist"), r.get("pallas_mgpu"))),
    h.Column("TFLOP/s (jaxtdist)", lambda r: _tflops(r.get("jaxtdist"))),
    h.Column("Triton kernel (groups > 1)", lambda r: h.us(r.get("jaxtdist_triton"))),
    h.Column("Triton / cuDNN", lambda r: h.ratio(r.get("jaxtdist_triton"), r.get("cudnn_dpa"))),
    h.Column("rel err", lambda r: h.err(r.get("jaxtdist"))),
    h.Column("rel err (Triton)", lambda r: h.err(r.get("jaxtdist_triton"))),
    h.Column("rel err (jax.nn)", lambda r: h.err(r.get("jax_nn_dpa"))),
    h.Column("rel err (Pallas)", lambda r: h.err(r.get("pallas_mgpu"))),
]

BACKWARD_COLUMNS = [
    h.Column("S", lambda r: str(r["seq"])),
    h.Column("jax.nn.dot_product_attention", lambda r: h.us(r.get("jax_nn_dpa"))),
    h.Column("cuDNN (implementation='cudnn')", lambda r: h.us(r.get("cudnn_dpa"))),
    h.Column("all_gather + dot_product_attention", lambda r: h.us(r.get("xla_all_gather_dpa"))),
    h.Column("jaxtdist.ag_attention", lambda r: h.us(r.get("jaxtdist"))),
    h.Column("jaxtdist / cuDNN", lambda r: h.ratio(r.get("jaxtdist"), r.get("cudnn_dpa"))),
    h.Column("jaxtdist / XLA", lambda r: h.ratio(
        r.get("jaxtdist"), r.get("jax_nn_dpa") or r.get("xla_all_gather_dpa"))),
    h.Column("TFLOP/s (jaxtdist)", lambda r: _tflops(r.get("jaxtdist"))),
    h.Column("kernels forced (world 1)", lambda r: h.us(r.get("jaxtdist_kernels"))),
    h.Column("kernels forced / cuDNN", lambda r: h.ratio(r.get("jaxtdist_kernels"),
                                                         r.get("cudnn_dpa"))),
    h.Column("max rel err of dq, dk, dv", lambda r: h.err(r.get("jaxtdist"))),
    h.Column("rel err (cuDNN)", lambda r: h.err(r.get("cudnn_dpa"))),
]

WORLD_COLUMNS = [
    h.Column("S total", lambda r: str(r["seq"])),
    h.Column("all_gather + dot_product_attention", lambda r: h.us(r.get("xla_all_gather_dpa"))),
    h.Column("jaxtdist.ag_attention", lambda r: h.us(r.get("jaxtdist"))),
    h.Column("jaxtdist / XLA", lambda r: h.ratio(r.get("jaxtdist"), r.get("xla_all_gather_dpa"))),
    h.Column("TFLOP/s per GPU", lambda r: _tflops(r.get("jaxtdist"))),
    h.Column("Triton kernel", lambda r: h.us(r.get("jaxtdist_triton"))),
    h.Column("Triton / XLA", lambda r: h.ratio(r.get("jaxtdist_triton"),
                                               r.get("xla_all_gather_dpa"))),
    h.Column("rel err", lambda r: h.err(r.get("jaxtdist"))),
    h.Column("rel err (Triton)", lambda r: h.err(r.get("jaxtdist_triton"))),
]


def _problem(r: dict) -> str:
    return r["label"]


RANDOM_COLUMNS = [
    h.Column("problem (per rank)", _problem),
    h.Column("cuDNN", lambda r: h.us(r.get("cudnn_dpa"))),
    h.Column("jax.nn (XLA)", lambda r: h.us(r.get("jax_nn_dpa"))),
    h.Column("jaxtdist.ag_attention", lambda r: h.us(r.get("jaxtdist_op"))),
    h.Column("op / cuDNN", lambda r: h.ratio(r.get("jaxtdist_op"), r.get("cudnn_dpa"))),
    h.Column("kernels forced", lambda r: h.us(r.get("jaxtdist"))),
    h.Column("kernels / cuDNN", lambda r: h.ratio(r.get("jaxtdist"), r.get("cudnn_dpa"))),
    h.Column("rel err (op)", lambda r: h.err(r.get("jaxtdist_op"))),
    h.Column("rel err (kernels)", lambda r: h.err(r.get("jaxtdist"))),
]

RANDOM_BACKWARD_COLUMNS = [
    h.Column("problem (per rank)", _problem),
    h.Column("cuDNN", lambda r: h.us(r.get("cudnn_dpa"))),
    h.Column("jax.nn (XLA)", lambda r: h.us(r.get("jax_nn_dpa"))),
    h.Column("jaxtdist.ag_attention", lambda r: h.us(r.get("jaxtdist"))),
    h.Column("op / cuDNN", lambda r: h.ratio(r.get("jaxtdist"), r.get("cudnn_dpa"))),
    h.Column("kernels forced", lambda r: h.us(r.get("jaxtdist_kernels"))),
    h.Column("kernels / cuDNN", lambda r: h.ratio(r.get("jaxtdist_kernels"), r.get("cudnn_dpa"))),
    h.Column("max rel err of dq, dk, dv", lambda r: h.err(r.get("jaxtdist"))),
    h.Column("rel err (kernels)", lambda r: h.err(r.get("jaxtdist_kernels"))),
]


def _random_table(res: dict) -> str:
    backward = any(r.get("backward") for r in res["rows"])
    what = "forward + backward (gradients of q, k, v)" if backward else "forward"
    text = h.markdown_table(
        f"ag_attention {what} at world 1 on random model shapes, default configs, "
        f"{res['rows'][0]['dtype'] if res['rows'] else 'bfloat16'}, 1 x {res['device']}; "
        f"{h.drawn_note(res)}{h.timing_note(res)}",
        RANDOM_BACKWARD_COLUMNS if backward else RANDOM_COLUMNS, res["rows"])
    if backward:
        return (text + h.ratio_summary(res["rows"], "jaxtdist", "cudnn_dpa", 1.05)
                + h.ratio_summary(res["rows"], "jaxtdist_kernels", "cudnn_dpa", 1.15))
    return (text + h.ratio_summary(res["rows"], "jaxtdist_op", "cudnn_dpa", 1.00)
            + h.ratio_summary(res["rows"], "jaxtdist", "cudnn_dpa", 1.10))


def table(res: dict) -> str:
    if "random" in res:
        return _random_table(res)
    first = res["rows"][0] if res["rows"] else {}
    b, hh, d = AG_ATTENTION_HEADS
    shape = (f"B={first.get('b', b)}, H={first.get('h', hh)}, D={first.get('d', d)}, causal, "
             f"{first.get('dtype', 'bfloat16')}")
    if any(r.get("backward") for r in res["rows"]):
        return h.markdown_table(
            f"ag_attention forward + backward (gradients of q, k, v), {shape}, S total over "
            f"{res['world']} x {res['device']}; {h.timing_note(res)}", BACKWARD_COLUMNS,
            res["rows"])
    if res["world"] == 1:
        return h.markdown_table(
            f"ag_attention's forward at world 1 (kernel forced), {shape}, 1 x {res['device']}; "
            f"{h.timing_note(res)}", WORLD1_COLUMNS, res["rows"])
    return h.markdown_table(
        f"ag_attention forward, {shape}, S total over {res['world']} x {res['device']}; "
        f"{h.timing_note(res)}", WORLD_COLUMNS, res["rows"])


def run(args) -> tuple[list[dict], dict]:
    world = args.world or 1
    seqs = AG_ATTENTION_SEQS if world == 1 else AG_ATTENTION_SEQS_MULTI
    seqs = args.seqs or (seqs[:1] if args.quick else seqs)
    problems = None if args.random is None else attention_problems(args.random, args.seed)
    drawn = {} if args.random is None else dict(random=args.random, seed=args.seed)
    return (bench_ag_attention(seqs, args.iterations, world, dtype=jnp.dtype(args.dtype),
                               rounds=args.rounds, backward=args.backward,
                               head_dim=args.head_dim, problems=problems),
            dict(world=world, **drawn))


def _arguments(parser) -> None:
    parser.add_argument("--world", type=int, default=1,
                        help="devices the sequence is sharded over (default 1: the kernel "
                             "forced at world 1 against jax.nn.dot_product_attention)")
    parser.add_argument("--quick", action="store_true", help="the first length only")
    parser.add_argument("--backward", action="store_true",
                        help="forward + backward (gradients of q, k, v) instead of the forward")
    parser.add_argument("--seqs", type=int, nargs="*", default=[],
                        help="these total sequence lengths instead of the default ones "
                             "(rounded up to a multiple of the world size)")
    parser.add_argument("--random", type=int, metavar="N",
                        help="N random model attention shapes (bench/random_shapes.py: batch, "
                             "length, GQA heads, head dim, causal or not) instead of the fixed "
                             "list; the table prints the ratios' geomean, p90 and max")
    parser.add_argument("--seed", type=int, default=0,
                        help="the seed of --random's draw (report it with the table)")
    parser.add_argument("--head-dim", type=int, default=None, choices=(64, 128, 256),
                        help=f"head dim (default {AG_ATTENTION_HEADS[2]})")
    parser.add_argument("--dtype", default="bfloat16",
                        choices=("bfloat16", "float16", "float32"),
                        help="q, k and v's dtype (default bfloat16; cuDNN and Pallas take "
                             "no float32)")


BENCHMARK = h.Benchmark(
    name="ag_attention", op="ag_attention", run=run, table=table,
    series=("jaxtdist", "jax_nn_dpa", "xla_all_gather_dpa"), size_label="sequence length",
    arguments=_arguments)
