"""FP8 grouped GEMM at world 1: ``python -m jaxtdist.bench grouped_matmul --dtype fp8``.

Per (R, H, F, G, used) of ``shapes.GROUPED_FP8_SHAPES`` (expert shapes at
prefill and decode; one device, default configs), on the same group sizes
(``grouped_matmul.group_sizes``):

- ``ragged_dot``: ``jax.lax.ragged_dot`` of the bf16 operands;
- ``bf16``: ``jaxtdist.grouped_matmul`` of the bf16 operands;
- ``tensor``: ``grouped_matmul`` of float8_e4m3fn operands, per-tensor scales
  (x's one, w's one per expert, [G]: ``jaxtdist.quantize_weight(w_g, block=None)``
  stacked), weights K-major [G, F, H];
- ``block``: the same with blockwise scales (1 x 128 for x, 128 x 128 per group
  for w: ``quantize(x, block=(1, 128))``, ``quantize_weight(w)``).

Relative errors against the float32 grouped product of each contender's own
operands (the dequantized ones for FP8), computed a few groups at a time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxtdist.bench import _grouped_ops as g
from jaxtdist.bench import harness as h

__all__ = ["COLUMNS", "SERIES", "bench_grouped_fp8", "table"]

SERIES = ("tensor", "block", "bf16", "ragged_dot")


def bench_grouped_fp8(shapes, iterations: int, rounds: int = 4) -> list[dict]:
    """The rows of the FP8 grouped table for ``shapes`` ((R, H, F, G, used) tuples)."""
    import jaxtdist as td
    device = jax.devices()[0]
    mesh = jax.make_mesh((1,), ("ep",), devices=[device],
                         axis_types=(jax.sharding.AxisType.Auto,))
    td.initialize(mesh)
    bf16 = g.local_fn(td.grouped_matmul, mesh, 3)
    fp8 = g.local_fn(lambda x, w, s, xs, ws: td.grouped_matmul(x, w, s, x_scale=xs, w_scale=ws),
                     mesh, 5)
    ragged = jax.jit(jax.lax.ragged_dot)
    rows = []
    for i, (r, hidden, f, groups, used) in enumerate(shapes):
        x = jax.device_put(h.normal(2100 + 2 * i, (r, hidden), jnp.bfloat16,
                                    scale=hidden ** -0.5), device)
        w = jax.device_put(h.normal(2101 + 2 * i, (groups, hidden, f), jnp.bfloat16), device)
        sizes = jax.device_put(jnp.asarray(g.group_sizes(2150 + i, r, groups, used)), device)
        ref = g.packed_reference(x, w, sizes)
        contenders = dict(ragged_dot=h.Contender(ragged, (x, w, sizes), 1, ref),
                          bf16=h.Contender(bf16, (x, w, sizes), 1, ref))
        for name, block in (("tensor", False), ("block", True)):
            if block and hidden % 128:
                continue  # recorded as an error below
            xq, wq, xs, ws = g.fp8_operands(x, w, block)
            contenders[name] = h.Contender(fp8, (xq, wq, sizes, xs, ws), 1,
                                           g.fp8_reference(xq, wq, xs, ws, sizes))
            del wq  # the next one's weights only: DeepSeek-V3's 256 experts are 3.8 GB
        row = dict(R=r, hidden=hidden, ffn=f, groups=groups, used=used,
                   dtype="float8_e4m3fn", world=1, rounds=rounds,
                   size=2.0 * float(np.asarray(sizes).sum()) * hidden * f,
                   label=f"{r}x{hidden}x{f} G={groups} fp8")
        row.update(h.interleaved(contenders, iterations, rounds))
        if "block" not in row:
            row["block"] = dict(error=[f"blockwise scales need H a multiple of 128, got {hidden}"])
        rows.append(row)
        print(f"grouped fp8 R={r} H={hidden} F={f} G={groups}: " + " | ".join(
            f"{name} {h.us(row.get(name))}" for name in SERIES), flush=True)
    return rows


COLUMNS = [
    h.Column("R x H x F", lambda r: f"{r['R']} x {r['hidden']} x {r['ffn']}"),
    h.Column("groups", lambda r: str(r["groups"])),
    h.Column("rows used", lambda r: f"{r['used']:.0%}"),
    h.Column("ragged_dot bf16", lambda r: h.us(r.get("ragged_dot"))),
    h.Column("grouped_matmul bf16", lambda r: h.us(r.get("bf16"))),
    h.Column("fp8 per-tensor", lambda r: h.us(r.get("tensor"))),
    h.Column("fp8 blockwise", lambda r: h.us(r.get("block"))),
    h.Column("per-tensor / bf16", lambda r: h.ratio(r.get("tensor"), r.get("bf16"))),
    h.Column("blockwise / bf16", lambda r: h.ratio(r.get("block"), r.get("bf16"))),
    h.Column("per-tensor / ragged_dot", lambda r: h.ratio(r.get("tensor"), r.get("ragged_dot"))),
    h.Column("blockwise / ragged_dot", lambda r: h.ratio(r.get("block"), r.get("ragged_dot"))),
    h.Column("rel err (per-tensor, blockwise, bf16, ragged_dot)", lambda r: " / ".join(
        h.err(r.get(name)) for name in SERIES)),
]


def table(res: dict) -> str:
    text = h.markdown_table(
        f"FP8 grouped_matmul (float8_e4m3fn, weights K-major [G, F, H]; per-tensor and "
        f"blockwise scales) against bf16 grouped_matmul and jax.lax.ragged_dot on the same "
        f"groups, default configs, 1 x {res['device']}; {h.timing_note(res)}", COLUMNS,
        res["rows"])
    text += h.ratio_summary(res["rows"], "tensor", "bf16", 1.0)
    text += h.ratio_summary(res["rows"], "block", "bf16", 1.0)
    return text
