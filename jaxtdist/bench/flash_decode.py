"""flash_decode's benchmark: jaxtdist's decode attention against XLA's.

Per total sequence length S of ``shapes.FLASH_DECODE_SEQS`` (B=1, Hq=32, Hkv=8,
D=128, bf16, every position valid but the last 3):

- world 1 (the default on one GPU): jaxtdist's kernel forced at world 1
  (``flash_decode_kernels``) and the op itself (at world 1 its local
  computation) against XLA's decode attention of the same cache
  (``decode_attention`` in bf16 with float32 softmax, and
  ``jax.nn.dot_product_attention`` with ``key_value_seq_lengths``), with the KV
  read bandwidth each reaches (bytes of K and V / kernel time), and the kernel
  on the same cache paged (16-position pages in shuffled order, ``block_table``),
  and the read floor: an XLA reduction that reads the same K and V once and
  does nothing else (``_read_floor``), the rate a kernel of this size reaches
  with launch and ramp included, against which the kernel's read rate is
  judged besides the HBM peak, and on GPUs JAX's Pallas (Triton) decode
  attention ``decode_attention.gqa`` at its defaults;
- world W > 1 (``--world W``): ``jaxtdist.flash_decode`` over S / W positions per
  rank against XLA's way (each rank's partial and log-sum-exp, ``all_gather``
  of them, merge) and against one GPU holding the whole cache (the kernel at
  world 1 on device 0).

With ``--layers L`` every contender runs L calls back to back in one program,
each taking the previous call's output as its query (a decode step through L
layers that share one cache), and its times are per call (the step's kernel
time over L). One call per program leaves the GPUs idle between calls, so a
world > 1 call also waits out how far apart the host started it on each
device; back to back, each device starts a call as its previous one ends, as
in a model's decode step.

Every output checked against a float32 reference on the host (of the chain of
L calls, the query rounded to the cache's dtype between calls as the kernels
do).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtdist.bench import harness as h
from jaxtdist.bench.shapes import FLASH_DECODE_HEADS, FLASH_DECODE_SEQS

SPECS = (P(), P(None, "sp"), P(None, "sp"), P())


def _mesh(world: int):
    return jax.make_mesh((world,), ("sp",), devices=jax.devices()[:world],
                         axis_types=(jax.sharding.AxisType.Auto,))


def _ops():
    import importlib

    return importlib.import_module("jaxtdist.ops.flash_decode")


def _reference(q, k, v, kv_len) -> np.ndarray:
    """float32 decode attention on the host, chunked over the sequence (large S)."""
    q, kv_len = np.asarray(q, np.float32), np.asarray(kv_len)
    b, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, hkv, hq // hkv, d)
    m = np.full((b, hkv, hq // hkv, 1), -np.inf, np.float32)
    l = np.zeros_like(m)
    acc = np.zeros((b, hkv, hq // hkv, d), np.float32)
    step = 16384
    for lo in range(0, k.shape[1], step):
        kc = np.asarray(k[:, lo:lo + step], np.float32)
        vc = np.asarray(v[:, lo:lo + step], np.float32)
        s = np.einsum("bhgd,bshd->bhgs", qg, kc) / np.float32(math.sqrt(d))
        valid = (lo + np.arange(kc.shape[1]))[None, :] < kv_len[:, None]
        s = np.where(valid[:, None, None, :], s, -np.inf)
        m_new = np.maximum(m, s.max(-1, keepdims=True))
        alpha = np.exp(m - m_new)
        p = np.exp(s - m_new)
        l = l * alpha + p.sum(-1, keepdims=True)
        acc = acc * alpha + np.einsum("bhgs,bshd->bhgd", p, vc)
        m = m_new
    return (acc / l).reshape(b, hq, d)


def _xla_partial_merge(q, k, v, n):
    """XLA's distributed decode: this rank's partial (o, lse), all_gather, merge."""
    b, hq, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    start = jax.lax.axis_index("sp") * s
    qg = q.reshape(b, hkv, hq // hkv, d)
    scores = jnp.einsum("bhgd,bshd->bhgs", qg, k, preferred_element_type=jnp.float32)
    scores = scores / np.float32(math.sqrt(d))
    valid = (start + jnp.arange(s))[None, :] < n[:, None]
    scores = jnp.where(valid[:, None, None, :], scores, -jnp.inf)
    m = jnp.max(scores, -1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(scores - m)
    l = jnp.sum(p, -1, keepdims=True)
    o = jnp.einsum("bhgs,bshd->bhgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
    o_all = jax.lax.all_gather(o / jnp.where(l > 0, l, 1.0), "sp")  # [W, b, hkv, g, d]
    lse_all = jax.lax.all_gather(lse, "sp")
    top = jnp.max(lse_all, 0)
    w = jnp.exp(lse_all - top)
    out = jnp.sum(o_all * w, 0) / jnp.sum(w, 0)
    return out.reshape(b, hq, d).astype(q.dtype)


def _operands(seed: int, b: int, hq: int, hkv: int, d: int, s: int, dtype):
    q = h.normal(seed, (b, hq, d), dtype)
    k = h.normal(seed + 1, (b, s, hkv, d), dtype)
    v = h.normal(seed + 2, (b, s, hkv, d), dtype)
    n = jnp.full((b,), s - 3, jnp.int32)
    return q, k, v, n


def placed(mesh, q, k, v, kv_len) -> tuple:
    """flash_decode's operands on ``mesh`` as the op takes them (``SPECS``: the
    query and lengths on every rank, the cache split by position)."""
    return tuple(jax.device_put(a, NamedSharding(mesh, sp))
                 for a, sp in zip((q, k, v, kv_len), SPECS))


def _chained(fn, layers: int):
    """``fn(q, *rest) -> out`` called ``layers`` times back to back in one program,
    each call's output the next one's query."""
    if layers == 1:
        return fn

    def step(q, *rest):
        for _ in range(layers):
            q = fn(q, *rest)
        return q
    return jax.jit(step)


def _chain_reference(q, k, v, kv_len, layers: int) -> np.ndarray:
    """``_reference`` of ``_chained``'s last output (queries rounded to q's dtype)."""
    out = _reference(q, k, v, kv_len)
    for _ in range(layers - 1):
        out = _reference(jnp.asarray(out, q.dtype), k, v, kv_len)
    return out


def _per_call(stats: dict, layers: int) -> dict:
    """A chained contender's stats per call (its step's times over ``layers``)."""
    if layers == 1 or "mean_us" not in stats:
        return stats
    out = dict(stats, layers=layers)
    for key in ("mean_us", "min_us"):
        out[key] = stats[key] / layers
    for key in ("samples_us", "min_samples_us", "round_medians_us"):
        if key in stats:
            out[key] = [t / layers for t in stats[key]]
    if "kernel_us" in stats:
        out["kernel_us"] = {name: t / layers for name, t in stats["kernel_us"].items()}
    return out


PAGE = 16  # positions per page of the paged contender (vLLM's default block size)


def paged_cache(k, v, page: int, spare: int, seed: int):
    """k, v [B, S, Hkv, D] as page pools [B * S / page + spare, page, Hkv, D] in a
    shuffled order (``spare`` extra pages, copies of page 0, that no sequence
    uses) and the block table [B, S / page] int32 that maps them back."""
    b, s = k.shape[:2]
    pages = s // page
    order = np.random.default_rng(seed).permutation(b * pages + spare)
    inverse = np.argsort(order)  # pool slot j holds logical page inverse[j] (or a spare)
    pools = []
    for cache in (k, v):
        flat = jnp.asarray(cache).reshape((b * pages, page) + tuple(cache.shape[2:]))
        flat = jnp.concatenate([flat] + [flat[:1]] * spare)
        pools.append(flat[jnp.asarray(inverse)])
    return (*pools, jnp.asarray(order[:b * pages].reshape(b, pages), jnp.int32))


def _one_gpu_times(seqs, iterations: int, dtype, rounds: int,
                   layers: int = 1) -> dict[int, dict]:
    """The kernel at world 1 holding the whole cache on device 0, per length (run
    before the W-device mesh is set up: jaxtdist holds one mesh at a time)."""
    import jaxtdist as td

    ops = _ops()
    b, hq, hkv, d = FLASH_DECODE_HEADS
    one = _mesh(1)
    td.initialize(one)
    fn = _chained(jax.jit(jax.shard_map(lambda *a: ops.flash_decode_kernels(*a, "sp"), mesh=one,
                                        in_specs=SPECS, out_specs=P(), check_vma=False)),
                  layers)
    times = {}
    for i, s in enumerate(seqs):
        q, k, v, n = _operands(700 + 3 * i, b, hq, hkv, d, s, dtype)
        args = placed(one, q, k, v, n)
        ref = _chain_reference(q, k, v, n, layers)
        times[s] = _per_call(h.interleaved(dict(one_gpu=h.Contender(fn, args, 1, ref)),
                                           iterations, rounds)["one_gpu"], layers)
        del args
    return times


def bench_flash_decode(seqs, iterations: int, world: int, dtype=jnp.bfloat16,
                       rounds: int = 4, layers: int = 1) -> list[dict]:
    import jaxtdist as td

    ops = _ops()
    b, hq, hkv, d = FLASH_DECODE_HEADS
    itemsize = jnp.dtype(dtype).itemsize
    seqs = [-(-s // world) * world for s in seqs]
    if layers < 1:
        raise ValueError(f"bench flash_decode: layers={layers} must be >= 1")
    one_gpu = _one_gpu_times(seqs, iterations, dtype, rounds, layers) if world > 1 else {}
    mesh = _mesh(world)
    td.initialize(mesh)
    specs = dict(mesh=mesh, in_specs=SPECS, out_specs=P(), check_vma=False)
    if world == 1:
        fns = dict(
            jaxtdist=jax.jit(jax.shard_map(lambda *a: ops.flash_decode_kernels(*a, "sp"),
                                           **specs)),
            # What a user's call costs at world 1: the op's local computation.
            op=jax.jit(jax.shard_map(lambda *a: td.flash_decode(*a, "sp"), **specs)),
            xla_decode=jax.jit(_xla_decode_local),
            jax_nn_dpa=jax.jit(lambda q, k, v, n: jax.nn.dot_product_attention(
                q[:, None], k, v, key_value_seq_lengths=n)[:, 0]))
        if layers == 1:  # chained, XLA would hoist the reads out of the chain
            fns["read_floor"] = jax.jit(_read_floor)
        pallas = _pallas_decode()
        if pallas is not None and jax.devices()[0].platform == "gpu":
            fns["pallas_decode"] = jax.jit(pallas)
    else:
        fns = dict(jaxtdist=jax.jit(jax.shard_map(lambda *a: td.flash_decode(*a, "sp"), **specs)),
                   xla_all_gather_merge=jax.jit(jax.shard_map(_xla_partial_merge, **specs)))
    fns = {name: _chained(fn, layers) for name, fn in fns.items()}
    rows = []
    for i, s in enumerate(seqs):
        q, k, v, n = _operands(700 + 3 * i, b, hq, hkv, d, s, dtype)
        ref = _chain_reference(q, k, v, n, layers)
        args = placed(mesh, q, k, v, n)
        kv_bytes = 2 * b * s * hkv * d * itemsize  # K and V, all ranks together
        row = dict(b=b, hq=hq, hkv=hkv, d=d, seq=s, world=world, dtype=jnp.dtype(dtype).name,
                   kv_bytes_per_device=kv_bytes // world, size=float(s), label=f"S={s}",
                   layers=layers)
        contenders = {name: h.Contender(fn, args, world, None if name == "read_floor" else ref)
                      for name, fn in fns.items()}
        if world == 1 and s % PAGE == 0:  # the same cache paged: the block table's cost
            k_pool, v_pool, table = paged_cache(k, v, PAGE, 1, 800 + i)
            paged = _chained(jax.jit(jax.shard_map(
                lambda q, kp, vp, n, t: ops.flash_decode_kernels(q, kp, vp, n, "sp",
                                                                 block_table=t),
                mesh=mesh, in_specs=(P(),) * 5, out_specs=P(), check_vma=False)), layers)
            contenders["jaxtdist_paged"] = h.Contender(paged, (q, k_pool, v_pool, n, table), 1,
                                                       ref)
        row.update({name: _per_call(stats, layers)
                    for name, stats in h.interleaved(contenders, iterations, rounds).items()})
        if s in one_gpu:
            row["one_gpu"] = one_gpu[s]
        for name in ("jaxtdist", "jaxtdist_paged", "op", "xla_decode", "jax_nn_dpa", "one_gpu",
                     "read_floor", "pallas_decode"):
            stats = row.get(name)
            if stats and stats.get("mean_us"):
                per_device = kv_bytes if name == "one_gpu" else kv_bytes // world
                stats["kv_tb_s"] = per_device / (stats["mean_us"] * 1e-6) / 1e12
        rows.append(row)
        print(f"S={s} world={world}: " + " | ".join(
            f"{name} {h.us(row.get(name))}" for name in (*fns, "one_gpu") if name in row),
            flush=True)
        del args
    return rows


def _pallas_decode():
    """JAX's Pallas (Triton) split-KV decode attention (``decode_attention.gqa`` at
    its defaults) as (q, k, v, kv_len) -> out, or None where it cannot be imported."""
    try:
        from jax.experimental.pallas.ops.gpu import decode_attention
    except Exception:  # noqa: BLE001 - an older or trimmed JAX: no such contender
        return None
    return lambda q, k, v, n: decode_attention.gqa(q, k, v, kv_seq_len=n)


def _xla_decode_local(q, k, v, n):
    """XLA's decode attention of the whole cache on one device (bf16 dots, float32
    softmax): ``_xla_partial_merge`` without the exchange."""
    b, hq, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    qg = q.reshape(b, hkv, hq // hkv, d)
    scores = jnp.einsum("bhgd,bshd->bhgs", qg, k, preferred_element_type=jnp.float32)
    scores = scores / np.float32(math.sqrt(d))
    scores = jnp.where((jnp.arange(s)[None, :] < n[:, None])[:, None, None, :], scores,
                       -jnp.inf)
    p = jax.nn.softmax(scores, axis=-1)
    o = jnp.einsum("bhgs,bshd->bhgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(b, hq, d).astype(q.dtype)


def _read_floor(q, k, v, n):
    """Reads K and V once and nothing more (their maxima over the positions,
    added to the query): the time XLA's reduction takes to read the cache."""
    del n
    b, hq, d = q.shape
    peak = (jnp.max(k, axis=1).astype(jnp.float32) + jnp.max(v, axis=1).astype(jnp.float32))
    return (q.astype(jnp.float32) + jnp.repeat(peak, hq // k.shape[2], axis=1)).astype(q.dtype)


def _tb_s(entry: dict | None) -> str:
    return f"{entry['kv_tb_s']:.2f}" if entry and "kv_tb_s" in entry else "n/a"


WORLD1_COLUMNS = [
    h.Column("S", lambda r: str(r["seq"])),
    h.Column("KV MiB", lambda r: f"{r['kv_bytes_per_device'] / 2**20:.0f}"),
    h.Column("XLA decode", lambda r: h.us(r.get("xla_decode"))),
    h.Column("jax.nn.dot_product_attention", lambda r: h.us(r.get("jax_nn_dpa"))),
    h.Column("jaxtdist.flash_decode (the op at world 1)", lambda r: h.us(r.get("op"))),
    h.Column("jaxtdist kernel", lambda r: h.us(r.get("jaxtdist"))),
    h.Column("jaxtdist / XLA decode", lambda r: h.ratio(r.get("jaxtdist"), r.get("xla_decode"))),
    h.Column("KV read TB/s (jaxtdist)", lambda r: _tb_s(r.get("jaxtdist"))),
    h.Column("KV read TB/s (XLA decode)", lambda r: _tb_s(r.get("xla_decode"))),
    h.Column("Pallas decode_attention.gqa", lambda r: h.us(r.get("pallas_decode"))),
    h.Column("jaxtdist / Pallas", lambda r: h.ratio(r.get("jaxtdist"), r.get("pallas_decode"))),
    h.Column("read floor: XLA reduction over K, V", lambda r: h.us(r.get("read_floor"))),
    h.Column("KV read TB/s (read floor)", lambda r: _tb_s(r.get("read_floor"))),
    h.Column("jaxtdist / read floor", lambda r: h.ratio(r.get("jaxtdist"),
                                                        r.get("read_floor"))),
    h.Column(f"jaxtdist paged ({PAGE}-position pages)", lambda r: h.us(r.get("jaxtdist_paged"))),
    h.Column("paged / contiguous", lambda r: h.ratio(r.get("jaxtdist_paged"),
                                                     r.get("jaxtdist"))),
    h.Column("rel err", lambda r: h.err(r.get("jaxtdist"))),
    h.Column("rel err (paged)", lambda r: h.err(r.get("jaxtdist_paged"))),
    h.Column("rel err (Pallas)", lambda r: h.err(r.get("pallas_decode"))),
]

WORLD_COLUMNS = [
    h.Column("S total", lambda r: str(r["seq"])),
    h.Column("one GPU, whole cache", lambda r: h.us(r.get("one_gpu"))),
    h.Column("XLA partials + all_gather + merge", lambda r: h.us(r.get("xla_all_gather_merge"))),
    h.Column("jaxtdist.flash_decode", lambda r: h.us(r.get("jaxtdist"))),
    h.Column("speedup vs one GPU", lambda r: h.ratio(r.get("one_gpu"), r.get("jaxtdist"))),
    h.Column("jaxtdist / XLA", lambda r: h.ratio(r.get("jaxtdist"),
                                                 r.get("xla_all_gather_merge"))),
    h.Column("KV read TB/s per GPU", lambda r: _tb_s(r.get("jaxtdist"))),
    h.Column("rel err", lambda r: h.err(r.get("jaxtdist"))),
]


def table(res: dict) -> str:
    b, hq, hkv, d = FLASH_DECODE_HEADS
    shape = f"B={b}, Hq={hq}, Hkv={hkv}, D={d}, bfloat16"
    layers = res.get("layers", 1)
    if layers > 1:
        shape += (f"; {layers} calls back to back per program (each call's output the next "
                  "one's query), times per call")
    if res["world"] == 1:
        return h.markdown_table(
            f"flash_decode at world 1 (kernel forced), {shape}, 1 x {res['device']}; "
            f"{h.timing_note(res)}", WORLD1_COLUMNS, res["rows"])
    return h.markdown_table(
        f"flash_decode, {shape}, S total over {res['world']} x {res['device']}; "
        f"{h.timing_note(res)}", WORLD_COLUMNS, res["rows"])


def run(args) -> tuple[list[dict], dict]:
    world = args.world or 1
    seqs = args.seqs or (FLASH_DECODE_SEQS[:1] if args.quick else FLASH_DECODE_SEQS)
    layers = getattr(args, "layers", 1)
    return (bench_flash_decode(seqs, args.iterations, world, rounds=args.rounds, layers=layers),
            dict(world=world, layers=layers))


def _arguments(parser) -> None:
    parser.add_argument("--world", type=int, default=1,
                        help="devices the cache is sharded over (default 1: the kernel forced "
                             "at world 1 against XLA)")
    parser.add_argument("--quick", action="store_true", help="the first length only")
    parser.add_argument("--seqs", type=int, nargs="+", default=None,
                        help="total sequence lengths to time (default: the standard lengths)")
    parser.add_argument("--layers", type=int, default=1,
                        help="calls back to back per program, each call's output the next "
                             "one's query (a decode step through that many layers); times "
                             "are per call (default 1)")


BENCHMARK = h.Benchmark(
    name="flash_decode", op="flash_decode", run=run, table=table,
    series=("jaxtdist", "jaxtdist_paged", "op", "xla_decode", "jax_nn_dpa", "xla_all_gather_merge",
            "one_gpu"),
    size_label="sequence length", arguments=_arguments)
