"""The model benchmark: a training step and decode steps of ``jaxtdist.nn.Llama``
(RMSNorm, RoPE, GQA, SwiGLU; MoE presets with ``ParallelMoE`` MLPs) against the same
model as a JAX GPU user runs it, every contender in one run:

- ``xla``: the ``impl="xla"`` twin (XLA's collectives), its attention
  ``jax.nn.dot_product_attention`` with a mask: XLA's unfused attention;
- ``xla+cudnn``: the same twin on cuDNN's flash attention wherever cuDNN takes
  the case (``xla_attention="cudnn"``; the note says which cases fell back);
- ``xla+cudnn+flags``: the same with the XLA flags a MaxText GPU user sets
  (``jaxtdist.bench.xla_flags``), world > 1 only, in a process of its own;
- ``jaxtdist``: the model on jaxtdist's overlapped ops and kernels.

MoE presets run each XLA contender's experts both ways a JAX user would
(``jax.lax.ragged_dot``; MaxText's dense [E, C, d] slots with batched GEMMs) and
keep the faster. The ratio column is jaxtdist over the fastest contender.

All models share one set of parameters (and, for decode, one KV cache filled with
random keys and values at the preset's length): the training step is
value_and_grad plus an Adam update on float32 parameters, donated and carried from
call to call; the decode step is one token per sequence on bf16 parameters (its
cache write not carried). Kernel time per step from CUPTI; beside it tokens/s,
the compiled step's memory (arguments + outputs + temporaries - aliases, from
``memory_analysis``: every contender's own, where the device's
``peak_bytes_in_use`` is one number for the whole process) and the breakdown of
the kernel time (``jaxtdist.bench.breakdown``).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtdist.bench import breakdown as bd
from jaxtdist.bench import harness as h
from jaxtdist.bench import xla_flags

__all__ = ["BENCHMARK", "CONTENDERS", "SIZES", "bench_model", "fastest_contender", "table"]

OURS = "jaxtdist"
CONTENDERS = ("xla", "xla+cudnn", xla_flags.FLAGS_CONTENDER, OURS)
LABELS = {"xla": "XLA unfused attention", "xla+cudnn": "XLA + cuDNN attention",
          xla_flags.FLAGS_CONTENDER: "XLA + cuDNN + flags", OURS: "jaxtdist"}

# name -> model and steps: train (batch, seq), decode ((batch, KV length), ...). The
# real presets have their models' layer dimensions and few layers; their vocabulary
# is 32000 (Llama 3's 128256 would add 2 x 128256 x d embedding parameters, which
# are not a layer's work).
SIZES = {
    "tiny": dict(vocab=256, d=64, heads=4, kv_heads=2, hidden=128, layers=1,
                 train=(4, 64), decode=((4, 72),)),
    "tiny-moe": dict(vocab=256, d=64, heads=4, kv_heads=2, hidden=128, layers=1,
                     experts=4, top_k=2, train=(4, 64), decode=((4, 72),)),
    "small": dict(vocab=32000, d=2048, heads=16, kv_heads=4, hidden=5632, layers=4,
                  train=(8, 1024), decode=((8, 1032),)),
    # Mixtral's layer shape scaled down: 8 experts, top-2, every layer's MLP a ParallelMoE.
    "moe": dict(vocab=32000, d=2048, heads=16, kv_heads=4, hidden=5632, layers=4,
                experts=8, top_k=2, train=(8, 1024), decode=((8, 1032),)),
    "llama3-8b": dict(vocab=32000, d=4096, heads=32, kv_heads=8, head_dim=128, hidden=14336,
                      layers=2, train=(1, 8192), decode=((1, 32768), (32, 32768), (128, 8192))),
    "llama3-70b": dict(vocab=32000, d=8192, heads=64, kv_heads=8, head_dim=128, hidden=28672,
                       layers=2, train=(1, 4096), decode=((1, 32768), (32, 16384), (128, 8192))),
    # Qwen3-30B-A3B: 128 experts of hidden 768, top-8, q/k norms, every layer sparse.
    "qwen3-30b-a3b": dict(vocab=32000, d=2048, heads=32, kv_heads=4, head_dim=128, hidden=768,
                          layers=2, experts=128, top_k=8, qk_norm=True, train=(1, 8192),
                          decode=((1, 32768), (32, 32768), (128, 8192))),
}


def _config(a: dict):
    from jaxtdist.nn import LlamaConfig

    return LlamaConfig(vocab=a["vocab"], d_model=a["d"], num_layers=a["layers"],
                       num_heads=a["heads"], num_kv_heads=a["kv_heads"], hidden=a["hidden"],
                       head_dim=a.get("head_dim"), qk_norm=a.get("qk_norm", False),
                       num_experts=a.get("experts", 0), experts_per_token=a.get("top_k", 2))


def _describe(a: dict) -> str:
    moe = f", MoE {a['experts']} experts top-{a['top_k']}" if a.get("experts") else ""
    dim = a.get("head_dim") or a["d"] // a["heads"]
    return (f"{a['layers']} x d{a['d']} GQA {a['heads']}/{a['kv_heads']} hd{dim} "
            f"ffn{a['hidden']}{moe}")


def _head_dim(a: dict) -> int:
    return a.get("head_dim") or a["d"] // a["heads"]


# ---------------------------------------------------------------- contenders


def _variants(a: dict, names: tuple[str, ...]) -> dict[str, tuple[str, str, str]]:
    """Timed name -> (contender, xla_attention, xla_experts): the MoE presets' XLA
    contenders twice, once per expert form."""
    forms = ("ragged_dot", "dense") if a.get("experts") else ("ragged_dot",)
    out = {}
    for name in names:
        if name == OURS:
            out[name] = (name, "unfused", "ragged_dot")
            continue
        attention = "unfused" if name == "xla" else "cudnn"
        for form in forms:
            out[name if len(forms) == 1 else f"{name}/{form}"] = (name, attention, form)
    return out


# MaxText's dense MoE path drops the picks past each expert's capacity: with the
# capacity of its configs' capacity_factor, not every token's slot for every expert
# (E / top_k times the work). The ragged_dot form and jaxtdist drop none (the
# output diff shows what the drops change).
DENSE_CAPACITY_FACTOR = 1.25


def _set_forms(model, attention: str, experts: str) -> None:
    """The twin's attention and expert forms (static attributes: a new graphdef); the
    dense form with the model's capacity factor, else ``DENSE_CAPACITY_FACTOR``."""
    own = model.config.moe_capacity_factor
    for layer in model.layers:
        layer.self_attn.xla_attention = attention
        if hasattr(layer.mlp, "xla_experts"):
            layer.mlp.xla_experts = experts
            layer.mlp.capacity_factor = (own or DENSE_CAPACITY_FACTOR) if experts == "dense" \
                else own


def _cudnn_skip(a: dict, mesh) -> str | None:
    """Why the cuDNN contenders do not run here (cuDNN takes neither step's attention:
    they would repeat the unfused twin), or None."""
    from jaxtdist.nn._cudnn import cudnn_refusal, mesh_platform

    return cudnn_refusal(jnp.bfloat16, _head_dim(a), *mesh_platform(mesh))


def skipped_contenders(a: dict, mesh, world: int, names: tuple[str, ...]) -> dict[str, str]:
    """Contender -> why it is not timed in this process (the note says so)."""
    skip = {}
    platform = mesh.devices.flat[0].platform
    reason = _cudnn_skip(a, mesh)
    for name in names:
        if name in ("xla+cudnn", xla_flags.FLAGS_CONTENDER) and reason:
            skip[name] = f"cuDNN does not take the case: {reason}"
        elif name == xla_flags.FLAGS_CONTENDER and world == 1:
            skip[name] = "world 1: no collectives to overlap"
        elif name == xla_flags.FLAGS_CONTENDER and platform != "gpu":
            skip[name] = f"XLA's GPU flags: not on {platform}"
    return skip


class _Carried:
    """A training state donated to each step and replaced by its result, shared by
    the contenders (their programs take and give the same shardings)."""

    def __init__(self, state):
        self.state = state

    def step(self, compiled):
        def run(tokens, targets):
            loss, self.state = compiled(self.state, tokens, targets)
            return loss
        return run


def _copy(tree):
    return jax.tree.map(lambda x: jax.device_put(x, x.sharding, may_alias=False), tree)


def _memory(compiled) -> int | None:
    """The compiled step's bytes: arguments + outputs + temporaries - aliases."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - a backend without the analysis: n/a
        return None
    if m is None:
        return None
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
               - m.alias_size_in_bytes)


def _fill_cache(model, batch: int, kv_len: int, seed: int) -> None:
    """A KV cache of ``kv_len`` positions in every layer, all but the last holding
    random keys and values, the next position the last (decode attends to all)."""
    model.init_cache(batch, kv_len)
    first = model.layers[0].self_attn.cached_key[...]
    # One program for every layer's keys and values (same shape, type and sharding).
    fill = jax.jit(lambda key: jax.random.normal(key, first.shape, jnp.float32).astype(
        first.dtype), out_shardings=first.sharding)
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        attn.cached_key[...] = fill(jax.random.key(seed + 2 * i))
        attn.cached_value[...] = fill(jax.random.key(seed + 2 * i + 1))
        attn.cache_index[...] = jnp.full_like(attn.cache_index[...], kv_len - 1)


def _train(a: dict, mesh, variants: dict) -> tuple[dict, dict, int]:
    """Timed name -> (function, args), name -> compiled bytes, tokens per step."""
    import optax
    from flax import nnx

    from jaxtdist.nn import Llama

    cfg = _config(a)
    ours, twin = Llama.twins(cfg, mesh, dtype=jnp.bfloat16)
    batch, seq = a["train"]
    rng = np.random.default_rng(0)
    data = rng.integers(0, a["vocab"], (batch, seq + 1)).astype(np.int32)
    spec = NamedSharding(mesh, P("dp", "tp"))
    tokens, targets = (jax.device_put(x, spec) for x in (data[:, :-1], data[:, 1:]))
    adam = optax.adam(1e-4)
    pairs = {id(ours): (ours, nnx.Optimizer(ours, adam, wrt=nnx.Param))}
    # One state for every contender where the twins' states match (they do: the same
    # parameters by the same paths): the twin's own arrays are replaced, so freed.
    shared = _same_structure(ours, twin)
    if shared:
        nnx.update(twin, nnx.split(ours)[1])
    pairs[id(twin)] = (twin, nnx.Optimizer(twin, adam, wrt=nnx.Param))
    if shared:
        nnx.update(pairs[id(twin)], nnx.split(pairs[id(ours)])[1])
    states = {k: _on_mesh(nnx.split(pair)[1], mesh) for k, pair in pairs.items()}
    carries = {id(ours): _Carried(states[id(ours)])}
    carries[id(twin)] = carries[id(ours)] if shared else _Carried(states[id(twin)])

    fns, memory, first = {}, {}, {}
    for timed, (name, attention, experts) in variants.items():
        model = ours if name == OURS else twin
        if model is twin:
            _set_forms(model, attention, experts)
        graphdef = nnx.split(pairs[id(model)])[0]
        carry = carries[id(model)]
        shardings = jax.tree.map(lambda x: x.sharding, carry.state)

        def step(state, tokens, targets, graphdef=graphdef):
            model, optimizer = nnx.merge(graphdef, state)
            loss, grads = nnx.value_and_grad(Llama.loss)(model, tokens, targets)
            optimizer.update(model, grads)
            return loss, nnx.state((model, optimizer))

        try:
            compiled = jax.jit(step, donate_argnums=0,
                               out_shardings=(NamedSharding(mesh, P()), shardings)).lower(
                carry.state, tokens, targets).compile()
            memory[timed] = _memory(compiled)
            # The first step's loss from the shared initial parameters (on a copy: the
            # step consumes its state), before any contender trains them.
            first[timed] = np.asarray(compiled(_copy(carry.state), tokens, targets)[0],
                                      np.float32)
        except Exception as e:  # noqa: BLE001 - a contender that cannot run is a result
            fns[timed] = _failed(e)
            continue
        fns[timed] = (carry.step(compiled), (tokens, targets))
    return fns, dict(memory=memory, outputs=first), batch * seq


def _on_mesh(state, mesh):
    """``state`` with every array on ``mesh`` (optax's step count is made on one
    device: replicated here, so one program takes the whole state)."""
    devices = set(mesh.devices.flat)
    replicated = NamedSharding(mesh, P())
    return jax.tree.map(lambda x: x if set(x.sharding.device_set) == devices
                        else jax.device_put(x, replicated), state)


def _same_structure(a, b) -> bool:
    from flax import nnx

    return jax.tree.structure(nnx.split(a)[1]) == jax.tree.structure(nnx.split(b)[1])


def _failed(e: BaseException) -> tuple:
    """A contender that failed to compile or run once: its error, for the row."""
    text = str(e).splitlines()[0][:200] if str(e) else ""
    return None, f"{type(e).__name__}: {text}"


def _decode(a: dict, mesh, variants: dict, batch: int, kv_len: int) -> tuple[dict, dict, int]:
    from flax import nnx

    from jaxtdist.nn import Llama

    ours, twin = Llama.twins(_config(a), mesh, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    # The same parameters (twins) and cache (the same seeds); one copy of both where
    # the states match.
    _fill_cache(twin, batch, kv_len, seed=1)
    ours.init_cache(batch, kv_len)
    if _same_structure(ours, twin):
        nnx.update(ours, nnx.split(twin)[1])
    else:
        _fill_cache(ours, batch, kv_len, seed=1)
    states = {id(m): nnx.split(m)[1] for m in (ours, twin)}
    rng = np.random.default_rng(1)
    token = jax.device_put(rng.integers(0, a["vocab"], (batch, 1)).astype(np.int32),
                           NamedSharding(mesh, P("dp", None)))
    fns, memory, outs = {}, {}, {}
    for timed, (name, attention, experts) in variants.items():
        model = ours if name == OURS else twin
        if model is twin:
            _set_forms(model, attention, experts)
        graphdef = nnx.split(model)[0]
        state = states[id(model)]
        try:
            # Not nnx.jit: it would return every Variable, copying all parameters per call.
            compiled = jax.jit(lambda st, tok, g=graphdef: nnx.merge(g, st)(tok, decode=True)
                               ).lower(state, token).compile()
            memory[timed] = _memory(compiled)
            outs[timed] = np.asarray(compiled(state, token), np.float32)
        except Exception as e:  # noqa: BLE001 - a contender that cannot run is a result
            fns[timed] = _failed(e)
            continue
        fns[timed] = (compiled, (state, token))
    return fns, dict(memory=memory, outputs=outs), batch


def fastest_contender(row: dict, names=CONTENDERS) -> tuple[str | None, dict | None]:
    """(name, stats) of the fastest contender other than jaxtdist that has a time.

    Example:
      >>> fastest_contender({"xla": {"mean_us": 9.0}, "xla+cudnn": {"mean_us": 4.0},
      ...                    "jaxtdist": {"mean_us": 5.0}})
      ('xla+cudnn', {'mean_us': 4.0})
    """
    timed = [(row[n]["mean_us"], n) for n in names
             if n != OURS and isinstance(row.get(n), dict) and "mean_us" in row[n]]
    if not timed:
        return None, None
    name = min(timed)[1]
    return name, row[name]


def _collapse(row: dict, variants: dict, stats: dict, extra: dict, tokens: int) -> None:
    """Each contender's entry in ``row``: its faster expert form (MoE) with the form,
    tokens/s, compiled memory and breakdown; the forms kept under "variants"."""
    for timed, (name, _, experts) in variants.items():
        entry = dict(stats[timed], memory_bytes=extra["memory"].get(timed))
        if "mean_us" in entry and tokens:
            entry["tokens_per_s"] = tokens / (entry["mean_us"] * 1e-6)
            if entry.get("kernel_us"):
                entry["breakdown_us"] = bd.breakdown(entry["kernel_us"])
        if timed != name:
            entry["experts"] = experts
            row.setdefault("variants", {})[timed] = entry
        best = row.get(name)
        if best is None or ("mean_us" in entry and entry["mean_us"] < best.get("mean_us", 1e30)):
            row[name] = entry
    outs = extra["outputs"]
    ours = outs.get(OURS)  # jaxtdist's variant is its name
    if ours is not None:
        diffs = row.setdefault("output_rel_diff", {})
        for timed, (name, _, experts) in variants.items():
            chosen = timed == name or row[name].get("experts") == experts
            if name != OURS and chosen and timed in outs:
                diffs[name] = h.rel_err(outs[timed], ours)


def bench_model(size: str, iterations: int, world: int, tp: int, rounds: int = 4,
                contenders: tuple[str, ...] = CONTENDERS) -> list[dict]:
    """The rows of ``bench model --size size`` (one training step, one decode step per
    (batch, KV length) of the preset) on a (world / tp, tp) mesh.

    Raises:
      ValueError: an unknown size or contender, or tp not dividing world.
    """
    import jaxtdist as td

    if size not in SIZES:
        raise ValueError(f"jaxtdist.bench model: --size {size!r}; allowed: {sorted(SIZES)}")
    bad = [c for c in contenders if c not in CONTENDERS]
    if bad:
        raise ValueError(f"jaxtdist.bench model: --contenders {bad}; allowed: {CONTENDERS}")
    tp = tp or world
    if world % tp:
        raise ValueError(f"jaxtdist.bench model: --tp {tp} must divide --world {world}")
    mesh = jax.make_mesh((world // tp, tp), ("dp", "tp"), devices=jax.devices()[:world])
    td.initialize(mesh)
    a = SIZES[size]
    skipped = skipped_contenders(a, mesh, world, contenders)
    flags_here = (xla_flags.FLAGS_CONTENDER in contenders and
                  xla_flags.FLAGS_CONTENDER not in skipped and xla_flags.flags_active(os.environ))
    in_process = tuple(c for c in contenders if c not in skipped and (
        c != xla_flags.FLAGS_CONTENDER or flags_here))
    variants = _variants(a, in_process)
    spawn = [c for c in contenders if c == xla_flags.FLAGS_CONTENDER and c not in skipped
             and not flags_here]
    # The flags process first, while this one holds little GPU memory.
    flag_rows = (xla_flags.run_flags_process(
        xla_flags.command(size, world, tp, iterations, rounds, "-"),
        xla_flags.flags_env(os.environ)) if spawn else None)
    steps = [("train", f"{a['train'][0]} x {a['train'][1]} tokens",
              lambda: _train(a, mesh, variants))]
    steps += [("decode", f"batch {b}, KV {n}",
               lambda b=b, n=n: _decode(a, mesh, variants, b, n)) for b, n in a["decode"]]
    rows = []
    for step, label, build in steps:
        try:
            fns, extra, tokens = build()
        except Exception as e:  # noqa: BLE001 - e.g. a batch the mesh cannot split: a result
            why = _failed(e)[1]
            fns, extra, tokens = {t: (None, why) for t in variants}, dict(memory={}, outputs={}), 0
        stats = h.interleaved({t: h.Contender(fn, args, world) for t, (fn, args) in fns.items()
                               if fn is not None}, iterations, rounds)
        stats.update({t: dict(error=[why]) for t, (fn, why) in fns.items() if fn is None})
        row = dict(step=step, label=label, world=world, tp=tp, size=float(len(rows) + 1),
                   model=_describe(a), tokens=tokens)
        _collapse(row, variants, stats, extra, tokens)
        for name, why in skipped.items():
            row[name] = dict(skipped=why)
        rows.append(row)
        del fns, extra, stats  # this step's models and states, before the next one's
    if spawn:
        xla_flags.merge_rows(rows, flag_rows, spawn)
    for row in rows:
        name, _ = fastest_contender(row)
        row["fastest"] = name
    return rows


def _ratio(row: dict) -> str:
    name, best = fastest_contender(row)
    return h.ratio(row.get(OURS), best) if name else "n/a"


def _time(name: str):
    def cell(r: dict) -> str:
        entry = r.get(name)
        if isinstance(entry, dict) and "skipped" in entry:
            return "skipped"
        text = h.us(entry)
        if entry and entry.get("experts") and text != "n/a":
            text += f" ({entry['experts']})"
        return text
    return cell


def _diff(r: dict) -> str:
    diffs = r.get("output_rel_diff", {})
    if isinstance(diffs, float):  # a result written before the contenders (xla only)
        diffs = {"xla": diffs}
    return ", ".join(f"{n} {v:.1e}" for n, v in diffs.items()) or "n/a"


COLUMNS = [
    h.Column("step", lambda r: r["step"]),
    h.Column("shape", lambda r: r["label"]),
    h.Column("mesh (dp x tp)", lambda r: f"{r['world'] // r['tp']} x {r['tp']}"),
    *(h.Column(LABELS[n], _time(n)) for n in CONTENDERS),
    h.Column("fastest contender", lambda r: LABELS.get(r.get("fastest"), "n/a")),
    h.Column("jaxtdist / fastest", _ratio),
    h.Column("output diff vs jaxtdist", _diff),
]


def _gib(n) -> str:
    return f"{n / 2**30:.2f}" if n else "n/a"


DETAIL_COLUMNS = [
    h.Column("step", lambda r: r["row"]["step"]),
    h.Column("shape", lambda r: r["row"]["label"]),
    h.Column("contender", lambda r: LABELS[r["name"]]),
    h.Column("time (us)", lambda r: _time(r["name"])(r["row"])),
    h.Column("tokens/s", lambda r: (f"{r['entry']['tokens_per_s']:.0f}"
                                    if "tokens_per_s" in r["entry"] else "n/a")),
    h.Column("step memory (GiB)", lambda r: _gib(r["entry"].get("memory_bytes"))),
    h.Column("device time by kind", lambda r: bd.breakdown_cell(r["entry"])),
]


def _note(res: dict) -> str:
    skipped = {}
    for row in res["rows"]:
        for name in CONTENDERS:
            entry = row.get(name)
            if isinstance(entry, dict) and "skipped" in entry:
                skipped[name] = entry["skipped"]
            elif isinstance(entry, dict) and "error" in entry:
                skipped.setdefault(name, "error: " + entry["error"][0])
    lines = [
        "Contenders: XLA unfused attention = the impl=\"xla\" twin, its attention "
        "jax.nn.dot_product_attention with a mask (XLA's default: scores in memory); "
        "XLA + cuDNN attention = the same twin with implementation=\"cudnn\" (causal for the "
        "training step, key lengths for decode) where cuDNN takes the case: float16/bfloat16, "
        "head dim a multiple of 8 up to 256 on Hopper (128 before), no packed-sequence mask; "
        "elsewhere the unfused form; XLA + cuDNN + flags = the same in a process of its own "
        "(world > 1) with XLA_FLAGS " + " ".join(xla_flags.FLAGS) + "; jaxtdist = the model "
        "on jaxtdist's ops and kernels. MoE: each XLA contender's experts as ragged_dot and as "
        f"dense [E, C, d] slots with batched GEMMs (MaxText's dense path, capacity factor "
        f"{DENSE_CAPACITY_FACTOR} unless the model sets one: it drops the picks past C, which "
        "ragged_dot and jaxtdist do not; its output diff shows what that changes), the faster "
        "shown with its form. Ratio: jaxtdist over the fastest contender.",
        "Step memory: the compiled step's arguments + outputs + temporaries - aliases "
        "(memory_analysis), per device program; process peak (memory_stats "
        "peak_bytes_in_use, all contenders of this process): "
        + (_gib(res.get("peak_bytes_in_use")) + " GiB" if res.get("peak_bytes_in_use")
           else "n/a") + ". Device time by kind: CUPTI kernel names sorted by "
        "jaxtdist.bench.breakdown.classify_kernel (XLA's unfused attention shows as GEMM and "
        "other).",
    ]
    if skipped:
        lines.append("Not timed: " + "; ".join(f"{LABELS[n]}: {why}"
                                               for n, why in skipped.items()) + ".")
    return "\n\n".join(lines)


def table(res: dict) -> str:
    rows = res["rows"]
    title = (f"Llama training and decode steps, bf16, {res['world']} x {res['device']}; "
             f"{h.timing_note(res)}; {rows[0]['model'] if rows else ''}")
    detail = [dict(row=r, name=n, entry=r[n]) for r in rows for n in CONTENDERS
              if isinstance(r.get(n), dict) and "skipped" not in r[n]]
    return "\n\n".join([h.markdown_table(title, COLUMNS, rows),
                        h.markdown_table("Per contender", DETAIL_COLUMNS, detail),
                        _note(res)])


def _arguments(parser) -> None:
    parser.add_argument("--world", type=int, default=0, help="devices (default: all)")
    parser.add_argument("--tp", type=int, default=0, help="tensor-parallel size (default: world)")
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--contenders", default=",".join(CONTENDERS),
                        help=f"comma-separated, of {','.join(CONTENDERS)} (default: all)")


def _peak_bytes() -> int | None:
    """The largest ``peak_bytes_in_use`` of the devices (None where not reported)."""
    peaks = []
    for d in jax.devices():
        try:
            stats = d.memory_stats()
        except Exception:  # noqa: BLE001 - a backend without memory stats
            stats = None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None


def run(args) -> tuple[list[dict], dict]:
    world = args.world or len(jax.devices())
    contenders = tuple(c for c in args.contenders.split(",") if c)
    rows = bench_model(args.size, args.iterations, world, args.tp, rounds=args.rounds,
                       contenders=contenders)
    return rows, dict(world=world, peak_bytes_in_use=_peak_bytes())


BENCHMARK = h.Benchmark(name="model", op="model", run=run, table=table, series=CONTENDERS,
                        size_label="step", arguments=_arguments)
