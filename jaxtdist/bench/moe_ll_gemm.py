"""moe_ll's masked grouped GEMM: ``jaxtdist.grouped_matmul_masked`` on the
low-latency layout against the packed grouped GEMMs on the same valid rows.

Per expert shape (model, H, F, E, K) of ``shapes.MOE_LL_GEMM_MODELS`` and per
number of tokens N routed in all (``MOE_LL_GEMM_TOKENS``), one rank of W: its
G = E / W experts, their valid rows counted from a random top-K routing of the N
tokens over the E experts, x [G, M = N, H] (the rows past each group's count
random too: the op must not read them), bf16 weights [G, H, F]:

- ``masked``: ``grouped_matmul_masked(x, w, valid)``;
- ``grouped_matmul`` / ``ragged_dot``: the valid rows packed, [sum(valid), H],
  with the counts as group sizes (the packed layout's GEMM);
- ``masked_fp8_tensor`` / ``masked_fp8_block``: ``grouped_matmul_masked`` of
  float8_e4m3fn x and K-major weights [G, F, H] (``jaxtdist.quantize_weight``),
  per-tensor and blockwise scales.

At decode the GEMM is a weight read: the table gives each contender's
weight-read bandwidth, the bytes of the experts that have a valid row over its
time, and its fraction of the device's HBM peak (``harness.hbm_peak``). Relative
errors of the valid rows against the float32 product of each contender's own
operands. The ops run replicated on the W devices of the mesh (every device
computes one rank's GEMM; the time is the mean per device).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxtdist.bench import _grouped_ops as g
from jaxtdist.bench import harness as h

__all__ = ["COLUMNS", "SERIES", "bench_masked_gemm", "table", "valid_rows"]

SERIES = ("masked", "masked_fp8_tensor", "masked_fp8_block", "grouped_matmul", "ragged_dot")


def valid_rows(seed: int, tokens: int, experts: int, top_k: int, groups: int) -> np.ndarray:
    """int32 [groups]: tokens routed to each of the first ``groups`` experts by a
    random top-K (distinct experts per token) of ``tokens`` tokens over ``experts``."""
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k]
    return np.bincount(ids.reshape(-1), minlength=experts)[:groups].astype(np.int32)


def _packed(x3, valid: np.ndarray):
    """x [G, M, H]'s valid rows packed, [max(1, sum), H] (one zero row if none)."""
    parts = [x3[i, :n] for i, n in enumerate(valid) if n]
    if not parts:
        return jnp.zeros((1, x3.shape[2]), x3.dtype)
    return jnp.concatenate(parts)


def _check_masked(stats: dict, out3, valid: np.ndarray, ref: np.ndarray) -> None:
    """rel_err of the masked op's valid rows (packed) against ``ref`` [R, F]."""
    if "error" in stats or not valid.sum():
        return  # no valid row: nothing to check
    h.check_output(stats, np.asarray(_packed(jnp.asarray(out3), valid), np.float32), ref,
                   exact=False)


def bench_masked_gemm(models, token_counts, iterations: int, world: int, rounds: int = 4,
                      mesh=None) -> list[dict]:
    """The masked-GEMM rows (see the module docstring); ``mesh``: the one
    ``jaxtdist.initialize`` was given (default: device 0 alone, initialized here)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxtdist as td
    from jaxtdist.ops.quant import quantize

    if mesh is None:
        mesh = jax.make_mesh((1,), ("ep",), devices=jax.devices()[:1],
                             axis_types=(jax.sharding.AxisType.Auto,))
        td.initialize(mesh)
    devices = mesh.devices.size
    replicated = NamedSharding(mesh, P())

    def put(*arrays):
        return tuple(jax.device_put(a, replicated) for a in arrays)
    peak = h.hbm_peak(jax.devices()[0].device_kind)
    masked = g.local_fn(td.grouped_matmul_masked, mesh, 3)
    masked_fp8 = g.local_fn(lambda x, w, v, xs, ws: td.grouped_matmul_masked(
        x, w, v, x_scale=xs, w_scale=ws), mesh, 5)
    packed = g.local_fn(td.grouped_matmul, mesh, 3)
    ragged = g.local_fn(jax.lax.ragged_dot, mesh, 3)
    rows = []
    for i, (model, hidden, f, experts, top_k) in enumerate(models):
        if experts % world:
            raise ValueError(f"bench moe_ll: E={experts} is not a multiple of world {world}")
        groups = experts // world
        # One weight stack per model, every token count on it (DeepSeek-V3's 256
        # experts at world 1: 7.5 GB in bf16).
        w, = put(h.normal(2300 + i, (groups, hidden, f), jnp.bfloat16))
        fp8_w = {block: put(*g.fp8_weights(w, block)) for block in (False, True)}
        for j, n in enumerate(token_counts):
            valid_np = valid_rows(2400 + 10 * i + j, n, experts, top_k, groups)
            x3 = h.normal(2500 + 10 * i + j, (groups, n, hidden), jnp.bfloat16,
                          scale=hidden ** -0.5)
            valid, x3, xp = put(jnp.asarray(valid_np), x3, _packed(x3, valid_np))
            sizes = valid
            # No valid row (a rank of many, few tokens): timed, not checked.
            ref = g.packed_reference(xp, w, sizes) if valid_np.sum() else None
            used = int((valid_np > 0).sum())
            contenders = dict(
                masked=h.Contender(masked, (x3, w, valid), devices),
                grouped_matmul=h.Contender(packed, (xp, w, sizes), devices, ref),
                ragged_dot=h.Contender(ragged, (xp, w, sizes), devices, ref))
            fp8_refs = {}
            for name, block in (("masked_fp8_tensor", False), ("masked_fp8_block", True)):
                wq, ws = fp8_w[block]
                xq, xs = put(*quantize(x3, g.FP8, (1, 128) if block else None))
                contenders[name] = h.Contender(masked_fp8, (xq, wq, valid, xs, ws), devices)
                xpq, xps = _packed(xq, valid_np), (_packed(xs, valid_np) if block else xs)
                fp8_refs[name] = g.fp8_reference(xpq, wq, xps, ws, sizes)
            row = dict(kind="masked_gemm", model=model, tokens=n, hidden=hidden, ffn=f,
                       groups=groups, top_k=top_k, world=world, rows_valid=int(valid_np.sum()),
                       groups_used=used, weight_bytes=float(used * hidden * f * 2),
                       rounds=rounds, size=float(n), label=f"{model} N={n}")
            row.update(h.interleaved(contenders, iterations, rounds))
            outs = {name: contenders[name].fn(*contenders[name].args) for name in
                    ("masked", "masked_fp8_tensor", "masked_fp8_block")
                    if "error" not in row[name]}
            _check_masked(row["masked"], outs.get("masked"), valid_np, ref)
            for name, want in fp8_refs.items():
                _check_masked(row[name], outs.get(name), valid_np, want)
            for name in SERIES:
                # FP8 weights: one byte per element (the scales are a few KB).
                g.weight_gbps(row[name], row["weight_bytes"] / (2 if "fp8" in name else 1),
                              peak)
            rows.append(row)
            print(f"moe_ll gemm {model} N={n} G={groups}: " + " | ".join(
                f"{name} {h.us(row.get(name))}" for name in SERIES), flush=True)
    return rows


COLUMNS = [
    h.Column("model", lambda r: r["model"]),
    h.Column("tokens", lambda r: str(r["tokens"])),
    h.Column("G x H x F (experts with rows, rows)",
             lambda r: f"{r['groups']} x {r['hidden']} x {r['ffn']} ({r['groups_used']}, "
                       f"{r['rows_valid']})"),
    h.Column("masked bf16", lambda r: h.us(r.get("masked"))),
    h.Column("GB/s (HBM)", lambda r: g.gbps_cell(r.get("masked"))),
    h.Column("grouped_matmul packed", lambda r: h.us(r.get("grouped_matmul"))),
    h.Column("ragged_dot packed", lambda r: h.us(r.get("ragged_dot"))),
    h.Column("masked / grouped_matmul",
             lambda r: h.ratio(r.get("masked"), r.get("grouped_matmul"))),
    h.Column("masked / ragged_dot", lambda r: h.ratio(r.get("masked"), r.get("ragged_dot"))),
    h.Column("masked fp8 per-tensor", lambda r: h.us(r.get("masked_fp8_tensor"))),
    h.Column("GB/s (HBM) ", lambda r: g.gbps_cell(r.get("masked_fp8_tensor"))),
    h.Column("masked fp8 blockwise", lambda r: h.us(r.get("masked_fp8_block"))),
    h.Column("GB/s (HBM)  ", lambda r: g.gbps_cell(r.get("masked_fp8_block"))),
    h.Column("fp8 blockwise / bf16", lambda r: h.ratio(r.get("masked_fp8_block"),
                                                       r.get("masked"))),
    h.Column("rel err (masked, fp8 tensor, fp8 block, grouped_matmul, ragged_dot)",
             lambda r: " / ".join(h.err(r.get(name)) for name in SERIES)),
]


def table(res: dict, rows: list[dict]) -> str:
    return h.markdown_table(
        f"grouped_matmul_masked (the low-latency layout's experts, one rank of "
        f"{res.get('world', 1)}: E / W experts, valid rows of a random top-K routing of N "
        f"tokens) against grouped_matmul and ragged_dot on the same rows packed, bf16 and "
        f"FP8 (float8_e4m3fn, weights K-major), {res['device']}; {h.timing_note(res)}. "
        f"GB/s: the weights of the experts with rows over the time (HBM: of the device's "
        f"peak)", COLUMNS, rows)
