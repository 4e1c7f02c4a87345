"""FP8 GEMMs at world 1: ``python -m jaxtdist.bench gemm --dtype fp8``.

Per (op, m, n, k) of the GEMM shapes, one device, default configs (a fresh
empty tuning cache), float8_e4m3fn operands with the weight stored K-major
([N, K], ``jaxtdist.quantize_weight``), every contender a user has in the
same run:

- ``bf16_dot``: ``jnp.dot`` of the bf16 operands ([K, N] weight), the
  speed FP8 must beat;
- ``xla_fp8``: XLA's FP8 dot, ``dot_general`` of the FP8 operands contracting
  dim 1 of both with ``preferred_element_type=float32`` (cuBLASLt, no
  transpose), then the per-tensor scales: the contender of per-tensor FP8;
- ``dequant_bf16``: the blockwise operands dequantized to bf16, then a bf16
  dot (how JAX users run blockwise FP8 today);
- ``tensor``: the op's FP8 kernels forced at world 1 (``fp8_matmul_kernels``),
  per-tensor scales;
- ``block``: the same with blockwise scales (1 x 128 for x, 128 x 128 for w;
  shapes whose K is no multiple of 128 record an error).

Relative errors against the float32 product of each contender's dequantized
operands (per tensor or blockwise), bf16 against its own float32 product.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtdist.bench import harness as h

__all__ = ["COLUMNS", "bench_gemm_fp8", "table"]

_FP8 = jnp.float8_e4m3fn
# x's, w [N, K]'s and the scales' specs per op at world 1 (what its shard_map takes).
_SPECS = {"ag_matmul": (P("tp", None), P("tp", None)),
          "matmul_rs": (P(None, "tp"), P(None, "tp")),
          "matmul_ar": (P(None, "tp"), P(None, "tp"))}
_CONTRACT_K = (((1,), (1,)), ((), ()))


def _kernels(op: str, mesh, block: bool):
    from jaxtdist.ops.matmul_rs import fp8_matmul_kernels

    x_spec, w_spec = _SPECS[op]
    scale_specs = (x_spec, w_spec) if block else (P(), P())
    fn = jax.shard_map(lambda x, w, xs, ws: fp8_matmul_kernels(op, x, w, "tp", x_scale=xs,
                                                               w_scale=ws),
                       mesh=mesh, in_specs=(x_spec, w_spec) + scale_specs, out_specs=P(),
                       check_vma=False)
    return jax.jit(fn)


@jax.jit
def _xla_fp8(x, w_t, xs, ws):
    acc = jax.lax.dot_general(x, w_t, _CONTRACT_K, preferred_element_type=jnp.float32)
    return (acc * (xs * ws)).astype(jnp.bfloat16)


@jax.jit
def _dequant_bf16(x, w_t, xs, ws):
    from jaxtdist.ops.quant import dequantize

    return jax.lax.dot_general(dequantize(x, xs, jnp.bfloat16), dequantize(w_t, ws, jnp.bfloat16),
                               _CONTRACT_K)


def _operands(i: int, m: int, n: int, k: int):
    """bf16 x [m, k] and w [k, n], and their FP8 forms per tensor and blockwise (None
    where k is no multiple of 128)."""
    from jaxtdist.ops.quant import quantize, quantize_weight

    x = h.normal(900 + 2 * i, (m, k), jnp.bfloat16, scale=1 / np.sqrt(k))
    w = h.normal(901 + 2 * i, (k, n), jnp.bfloat16)
    tensor = (*quantize(x, _FP8), *quantize_weight(w, _FP8, block=None))
    block = None
    if k % 128 == 0:
        block = (*quantize(x, _FP8, (1, 128)), *quantize_weight(w, _FP8))
    # Order: x, w_t, x_scale, w_scale.
    return x, w, (tensor[0], tensor[2], tensor[1], tensor[3]), (
        None if block is None else (block[0], block[2], block[1], block[3]))


def _reference(ops, device) -> np.ndarray:
    from jaxtdist.ops.quant import dequantize

    x, w_t, xs, ws = ops
    return h.float32_matmul(dequantize(x, xs), dequantize(w_t, ws).T, device)


def bench_gemm_fp8(shapes, iterations: int, rounds: int = 4) -> list[dict]:
    """The rows of the FP8 table for ``shapes`` ((op, m, n, k) tuples)."""
    import jaxtdist as td

    mesh = jax.make_mesh((1,), ("tp",), devices=jax.devices()[:1],
                         axis_types=(jax.sharding.AxisType.Auto,))
    td.initialize(mesh)
    device = jax.devices()[0]
    bf16_dot = jax.jit(jnp.dot)
    rows = []
    for i, (op, m, n, k) in enumerate(shapes):
        x, w, tensor, block = _operands(i, m, n, k)
        x_spec, w_spec = _SPECS[op]

        def put(ops, scale_specs):
            specs = (x_spec, w_spec) + scale_specs
            return tuple(jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(ops, specs))

        tensor_args = put(tensor, (P(), P()))
        ref_tensor = _reference(tensor, device)
        contenders = dict(
            bf16_dot=h.Contender(bf16_dot, (x, w), 1, h.float32_matmul(x, w, device)),
            xla_fp8=h.Contender(_xla_fp8, tensor, 1, ref_tensor),
            tensor=h.Contender(_kernels(op, mesh, False), tensor_args, 1, ref_tensor))
        if block is not None:
            ref_block = _reference(block, device)
            contenders.update(
                dequant_bf16=h.Contender(_dequant_bf16, block, 1, ref_block),
                block=h.Contender(_kernels(op, mesh, True), put(block, (x_spec, w_spec)), 1,
                                  ref_block))
        row = dict(op=op, m=m, n=n, k=k, dtype="float8_e4m3fn", world=1, rounds=rounds,
                   size=2.0 * m * n * k, label=f"{op} {m}x{n}x{k} fp8")
        row.update(h.interleaved(contenders, iterations, rounds))
        if block is None:
            row["block"] = row["dequant_bf16"] = dict(
                error=[f"blockwise scales need K a multiple of 128, got K={k}"])
        rows.append(row)
        print(f"{op} {m} {n} {k} fp8: bf16 {h.us(row['bf16_dot'])} | xla fp8 "
              f"{h.us(row['xla_fp8'])} | tensor {h.us(row['tensor'])} "
              f"({h.ratio(row['tensor'], row['xla_fp8'])}) | block {h.us(row['block'])} "
              f"(/dequant {h.ratio(row['block'], row['dequant_bf16'])})", flush=True)
    return rows


COLUMNS = [
    h.Column("op", lambda r: r["op"]),
    h.Column("m x n x k", lambda r: f"{r['m']} x {r['n']} x {r['k']}"),
    h.Column("bf16 jnp.dot", lambda r: h.us(r.get("bf16_dot"))),
    h.Column("XLA FP8 (K-major)", lambda r: h.us(r.get("xla_fp8"))),
    h.Column("per-tensor kernels", lambda r: h.us(r.get("tensor"))),
    h.Column("per-tensor / XLA FP8", lambda r: h.ratio(r.get("tensor"), r.get("xla_fp8"))),
    h.Column("per-tensor / bf16", lambda r: h.ratio(r.get("tensor"), r.get("bf16_dot"))),
    h.Column("dequant + bf16 dot", lambda r: h.us(r.get("dequant_bf16"))),
    h.Column("blockwise kernels", lambda r: h.us(r.get("block"))),
    h.Column("blockwise / dequant", lambda r: h.ratio(r.get("block"), r.get("dequant_bf16"))),
    h.Column("blockwise / XLA FP8", lambda r: h.ratio(r.get("block"), r.get("xla_fp8"))),
    h.Column("rel err (per-tensor, XLA FP8, blockwise)", lambda r: " / ".join(
        h.err(r.get(name)) for name in ("tensor", "xla_fp8", "block"))),
]


def table(res: dict) -> str:
    text = h.markdown_table(
        f"FP8 GEMMs at world 1 (float8_e4m3fn, weights K-major [N, K]): each matmul op's "
        f"kernels forced at world 1 with per-tensor and blockwise scales against XLA's "
        f"FP8 dot, dequantize + bf16 dot and bf16 jnp.dot, default configs (no tuning "
        f"cache), 1 x {res['device']}; {h.timing_note(res)}", COLUMNS, res["rows"])
    text += h.ratio_summary(res["rows"], "tensor", "xla_fp8", 1.15)
    text += h.ratio_summary(res["rows"], "block", "dequant_bf16", 1 / 1.5)
    return text
