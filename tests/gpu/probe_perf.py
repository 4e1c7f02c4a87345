"""Where does jaxtdist's GPU time go? Times variants of all_gather and ag_matmul.

Run on the GPU node: python3 tests/gpu/probe_perf.py (prints one line per variant).
"""

import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxtdist as td
from jaxtdist.bench.harness import profile, rel_err
from jaxtdist.ops.ag_matmul import ag_matmul_with_gathered

AUTO = jax.sharding.AxisType.Auto


# The bench's large (m_shard, n_shard, k) shapes (issue 3).
LARGE_SHAPES = ((1024, 4096, 4096), (2048, 3072, 4096), (2048, 2752, 4096), (2048, 3584, 4096),
                (2048, 7168, 8192))


def _ag_specs(mesh):
    """shard_map arguments of an ag_matmul over "tp": x rows and w columns sharded."""
    return dict(mesh=mesh, in_specs=(P("tp", None), P(None, "tp")), out_specs=P(None, "tp"),
                check_vma=False)


def _ag_fn(mesh, config: dict):
    """jit(shard_map) of an ag_matmul over "tp" with ``config`` (``_ag_specs``)."""
    return jax.jit(jax.shard_map(
        lambda x, w: ag_matmul_with_gathered(x, w, "tp", config=config,
                gathered=False)[0], **_ag_specs(mesh)))


def _shipped_config(rt, m, n, k, world=4) -> dict:
    """The config jaxtdist ships (or the tuning cache holds) for a bf16 shape."""
    return rt.tuning.lookup("ag_matmul", world, (m, n, k), jnp.bfloat16) or {}


def mesh_of(n):
    return jax.make_mesh((n,), ("tp",), devices=jax.devices()[:n], axis_types=(AUTO,))


def probe_all_gather(world, cfg, rows=4096, cols=1024):
    mesh = mesh_of(world)
    td.initialize(mesh)
    f = jax.jit(jax.shard_map(lambda x: td.all_gather(x, "tp", config=cfg), mesh=mesh,
                              in_specs=P("tp", None), out_specs=P(None, None), check_vma=False))
    x = jax.random.normal(jax.random.key(0), (world * rows, cols), jnp.bfloat16)
    xs = jax.device_put(x, NamedSharding(mesh, P("tp", None)))
    out, t = profile(f, (xs,), 10, world)
    ok = np.array_equal(np.asarray(out), np.asarray(x))
    print(f"all_gather w={world} {cfg}: mean {t['mean_us']:.1f} min {t['min_us']:.1f} ok={ok} "
          f"kernels={t['kernels']}", flush=True)


def probe_ag_matmul(world, cfg, m=1024, n=4096, k=4096):
    mesh = mesh_of(world)
    td.initialize(mesh)
    f = _ag_fn(mesh, cfg)
    x = (jax.random.normal(jax.random.key(1), (world * m, k), jnp.float32)
         / np.sqrt(k)).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.key(2), (k, world * n), jnp.bfloat16)
    xs = jax.device_put(x, NamedSharding(mesh, P("tp", None)))
    ws = jax.device_put(w, NamedSharding(mesh, P(None, "tp")))
    from jax.experimental.mosaic.gpu import profiler
    out, raw = profiler.measure(f, aggregate=False, iterations=5)(xs, ws)
    last = raw[-1]
    ours = [t * 1e3 for name, t in last if "ag_matmul" in name]
    ref = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
    err = rel_err(out, ref)
    print(f"ag_matmul w={world} m={m} {cfg}: per-device kernel us "
          f"{[round(v, 1) for v in ours]} err={err:.1e}", flush=True)


def probe_gemm_configs():
    big = [dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3),
           dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=4),
           dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4),
           dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3, NUM_COMM=16),
           dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3, GROUP_M=16)]
    for cfg in big:
        probe_ag_matmul(4, cfg)
    probe_ag_matmul(1, big[0])
    for m in (1, 16, 128):
        for cfg in ({}, dict(BLOCK_N=64, BLOCK_K=128), dict(BLOCK_N=16, BLOCK_K=256),
                    dict(BLOCK_N=32, BLOCK_K=128, num_stages=6)):
            if m == 128 and cfg:
                cfg = dict(cfg, BLOCK_M=512, ALL_ROWS=True)
            try:
                probe_ag_matmul(4, cfg, m=m, n=4096, k=8192)
            except Exception as e:  # noqa: BLE001
                print(f"ag_matmul m={m} {cfg}: {type(e).__name__} {str(e)[:120]}", flush=True)


def _kernel_us(f, args, name_part, iterations=20):
    """Median over iterations of the summed time of kernels whose name holds name_part."""
    from jax.experimental.mosaic.gpu import profiler
    out, raw = profiler.measure(f, aggregate=False, iterations=iterations)(*args)
    per_iter = [sum(t for name, t in it if name_part in name) * 1e3 for it in raw]
    return out, float(np.median(per_iter))


def probe_gemm_variants(shapes=((4096, 4096, 4096), (8192, 3072, 4096), (8192, 3584, 4096),
                                (8192, 7168, 8192))):
    """One GPU: cuBLAS against plain persistent TMA GEMMs with the ag_matmul kernel's
    features added one at a time (tests/gpu/gemm_probe_kernels.py)."""
    from tests.gpu.gemm_probe_kernels import gemm_dynamic_kernel, gemm_static_kernel
    mesh = mesh_of(1)
    td.initialize(mesh)
    sms = jax.devices()[0].core_count
    variants = [("static", gemm_static_kernel, dict(FLATTEN=False, WAIT=False)),
                ("static+flatten", gemm_static_kernel, dict(FLATTEN=True, WAIT=False)),
                ("static+flatten+asmwait", gemm_static_kernel, dict(FLATTEN=True, WAIT=True)),
                ("static+asmwait", gemm_static_kernel, dict(FLATTEN=False, WAIT=True)),
                ("dynamic", gemm_dynamic_kernel, dict(WAIT=False)),
                ("dynamic+dlwait", gemm_dynamic_kernel, dict(WAIT=True))]
    for m, n, k in shapes:
        a = (jax.random.normal(jax.random.key(1), (m, k), jnp.float32) / np.sqrt(k)).astype(
            jnp.bfloat16)
        b = jax.random.normal(jax.random.key(2), (k, n), jnp.bfloat16)
        ref = np.asarray(jnp.dot(a, b, preferred_element_type=jnp.float32))
        err = functools.partial(rel_err, ref=ref)
        _, cublas = _kernel_us(jax.jit(jnp.dot), (a, b), "")
        print(f"gemm {m}x{n}x{k}: cublas {cublas:.1f} us", flush=True)
        for label, kernel, extra in variants:
            for bn, stages in ((256, 3), (128, 4)):
                def body(a, b, kernel=kernel, extra=extra, bn=bn, stages=stages):
                    return td.triton_call(
                        a, b, kernel=kernel, grid=(sms,), axis_name="tp", tma=True,
                        out_shape=jax.ShapeDtypeStruct((m, n), jnp.bfloat16),
                        workspace_bytes=4096, num_warps=8 if bn == 256 else 4,
                        num_stages=stages, M=m, N=n, K=k, BLOCK_M=128, BLOCK_N=bn, BLOCK_K=64,
                        GROUP_M=8, NUM_PROGRAMS=sms, **extra)
                f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P()), out_specs=P(),
                                          check_vma=False))
                try:
                    out, us = _kernel_us(f, (a, b), kernel.__name__)
                    print(f"  {label:24s} BN={bn} stages={stages}: {us:8.1f} us "
                          f"({us / cublas:.2f}x cublas) err={err(out):.1e}", flush=True)
                except Exception as e:  # noqa: BLE001
                    print(f"  {label} BN={bn}: {type(e).__name__} {str(e)[:200]}", flush=True)
        for cfg in ({}, dict(NUM_COMM=8), dict(NUM_COMM=32, CHUNK_ROWS=32)):
            try:
                probe_ag_matmul(1, cfg, m=m, n=n, k=k)
            except Exception as e:  # noqa: BLE001
                print(f"  ag_matmul w=1 {cfg}: {type(e).__name__} {str(e)[:200]}", flush=True)


def probe_decode():
    """Decode shapes: the gather alone, the GEMM alone (world 1, all rows local), both."""
    for m in (1, 16, 128):
        probe_all_gather(4, {}, rows=m, cols=8192)
        probe_ag_matmul(1, {}, m=4 * m, n=4096, k=8192)
        probe_ag_matmul(4, {}, m=m, n=4096, k=8192)


def probe_copy_engine():
    """SM producer programs against the copy engines, world 4 and 1, large shapes."""
    from jax.experimental.mosaic.gpu import profiler
    shapes = ((1024, 4096, 4096), (2048, 3072, 4096), (2048, 3584, 4096), (2048, 7168, 8192))
    for m, n, k in shapes:
        for world in (4, 1):
            for cfg in (dict(TMA=True), dict(TMA=True, CHUNK_ROWS=32, NUM_COMM=24),
                        dict(TMA=True, PRODUCER="ce", CHUNK_ROWS=128),
                        dict(TMA=True, PRODUCER="ce", CHUNK_ROWS=256),
                        dict(TMA=True, PRODUCER="ce", CHUNK_ROWS=512)):
                if world == 1 and cfg.get("PRODUCER") != "ce" and "NUM_COMM" in cfg:
                    continue
                try:
                    probe_ag_matmul(world, cfg, m=m if world == 4 else 4 * m, n=n, k=k)
                except Exception as e:  # noqa: BLE001
                    print(f"ag_matmul w={world} m={m} {cfg}: {type(e).__name__} {str(e)[:300]}",
                          flush=True)
    mesh = mesh_of(4)
    td.initialize(mesh)
    f = _ag_fn(mesh, dict(TMA=True, PRODUCER="ce"))
    x = jnp.ones((4 * 1024, 4096), jnp.bfloat16)
    w = jnp.ones((4096, 4 * 4096), jnp.bfloat16)
    _, raw = profiler.measure(f, aggregate=False, iterations=2)(
        jax.device_put(x, NamedSharding(mesh, P("tp", None))),
        jax.device_put(w, NamedSharding(mesh, P(None, "tp"))))
    print("activities seen by the profiler (CE run):", sorted({n for n, _ in raw[-1]}))


def probe_variance(rounds=4):
    """Run-to-run spread of ag_matmul (the shipped configs) within one process:
    several CUPTI rounds of 20 iterations, launch alignment on and off."""
    mesh = mesh_of(4)
    rt = td.initialize(mesh)
    f = jax.jit(jax.shard_map(lambda x, w: td.ag_matmul(x, w, "tp"), mesh=mesh,
                              in_specs=(P("tp", None), P(None, "tp")), out_specs=P(None, "tp"),
                              check_vma=False))
    for m, n, k in ((1024, 4096, 4096), (2048, 3072, 4096), (2048, 2752, 4096)):
        x = (jax.random.normal(jax.random.key(1), (4 * m, k), jnp.float32)
             / np.sqrt(k)).astype(jnp.bfloat16)
        w = jax.random.normal(jax.random.key(2), (k, 4 * n), jnp.bfloat16)
        args = (jax.device_put(x, NamedSharding(mesh, P("tp", None))),
                jax.device_put(w, NamedSharding(mesh, P(None, "tp"))))
        for aligned in (True, False, True):
            rt.align_launches = aligned
            line = []
            for _ in range(rounds):
                _, t = profile(f, args, 20, 4)
                line.append(f"{t['mean_us']:.0f}/{t['min_us']:.0f}")
            print(f"variance {m}x{n}x{k} aligned={aligned}: mean/fastest per round {line}",
                  flush=True)
        rt.align_launches = True


def probe_stream_k(rounds=3, iterations=20):
    """The shipped config of each large shape with its last wave cut along K
    (STREAM_K=True) and not (False), alternating in one process; the GEMM alone
    (cuBLAS, one device) beside them."""
    mesh = mesh_of(4)
    rt = td.initialize(mesh)
    shapes = ((1024, 4096, 4096), (2048, 3072, 4096), (2048, 7168, 8192), (2048, 2752, 4096),
              (2048, 3584, 4096))
    for m, n, k in shapes:
        x = (jax.random.normal(jax.random.key(1), (4 * m, k), jnp.float32)
             / np.sqrt(k)).astype(jnp.bfloat16)
        w = jax.random.normal(jax.random.key(2), (k, 4 * n), jnp.bfloat16)
        args = (jax.device_put(x, NamedSharding(mesh, P("tp", None))),
                jax.device_put(w, NamedSharding(mesh, P(None, "tp"))))
        ref = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
        _, gemm = profile(jax.jit(jnp.dot), (jax.device_put(x, jax.devices()[0]),
                                              jax.device_put(w[:, :n], jax.devices()[0])),
                           iterations, 1)
        tuned = _shipped_config(rt, m, n, k)
        times = {True: [], False: []}
        errs = {}
        fns = {mode: _ag_fn(mesh, dict(tuned, STREAM_K=mode)) for mode in (True, False)}
        for _ in range(rounds):
            for mode, f in fns.items():
                out, t = profile(f, args, iterations, 4)
                times[mode].append(t["mean_us"])
                errs[mode] = rel_err(out, ref)
        print(f"stream-k {m}x{n}x{k}: gemm {gemm['mean_us']:.1f} us; cut "
              f"{[round(v, 1) for v in times[True]]} (err {errs[True]:.1e}); whole "
              f"{[round(v, 1) for v in times[False]]} (err {errs[False]:.1e}); median "
              f"{np.median(times[True]):.1f} vs {np.median(times[False]):.1f}", flush=True)


def _probe_modes(label, modes: dict, shapes, rounds: int, iterations: int):
    """Each shape's shipped config under each of ``modes`` (config overrides),
    alternating in one process, with XLA's dot of the gathered x on one device
    (the issue's (a)) timed before them."""
    mesh = mesh_of(4)
    rt = td.initialize(mesh)
    for m, n, k in shapes:
        args, ref = _sharded_args(mesh, m, n, k)
        x = jax.device_put(jax.random.normal(jax.random.key(3), (4 * m, k), jnp.bfloat16),
                           jax.devices()[0])
        _, gemm = profile(jax.jit(jnp.dot), (x, jax.device_put(
            jax.random.normal(jax.random.key(4), (k, n), jnp.bfloat16), jax.devices()[0])),
            iterations, 1)
        print(f"{label} {m}x{n}x{k}: (a) {gemm['mean_us']:.1f} us", flush=True)
        tuned = _shipped_config(rt, m, n, k)
        fns = {name: _ag_fn(mesh, dict(tuned, **mode)) for name, mode in modes.items()}
        _alternate(f"{label} {m}x{n}x{k}", fns, args, ref, 4, rounds, iterations)


def probe_tail(rounds=5, iterations=20, shapes=((2048, 2752, 4096),)):
    """The last partial wave left whole, cut along K (stream-K) and cut along N
    (halves)."""
    _probe_modes("tail", dict(whole=dict(STREAM_K=False, TAIL_SPLIT_N=1),
                              stream_k=dict(STREAM_K=True),
                              halves=dict(STREAM_K=False, TAIL_SPLIT_N=2)),
                 shapes, rounds, iterations)


def probe_flatten(rounds=4, iterations=20, shapes=LARGE_SHAPES + ((128, 4096, 8192),)):
    """The copy-engine kernel's tile loops flattened with their K loops, or not."""
    _probe_modes("flatten", dict(nested=dict(FLATTEN=False), flat=dict(FLATTEN=True)),
                 shapes, rounds, iterations)


def _flag_values(flag: str) -> list:
    """Every value given after ``flag`` on the command line."""
    return [sys.argv[i + 1] for i, arg in enumerate(sys.argv[:-1]) if arg == flag]


def probe_configs(modes: dict, shapes, rounds=4, iterations=20):
    """Named config overrides (``--configs '{"name": {...}}'``) of each shape's shipped
    config, alternating in one process; shapes from ``--shape M_SHARD,N_SHARD,K``."""
    _probe_modes("configs", modes, shapes, rounds, iterations)


def probe_host_rate(calls=200, repeats=3, iterations=20,
                    shapes=((1024, 512, 512), (1024, 4096, 4096), (2048, 2752, 4096),
                            (2048, 3584, 4096))):
    """Is a call host-bound? Wall time per call of ``calls`` back-to-back calls
    (host enqueue included, one block at the end; the contenders alternate)
    next to the kernel time (CUPTI): jaxtdist's shipped config, the same with
    launch alignment off ("unaligned") and with 4 chunks a shard; XLA's
    all_gather + dot (the bench's contender (b)). The first shape's GPU work
    is small: its wall per call is the host's cost. Host time per call and
    device in the copy-engine handler (``handler``, of which ``enqueue``;
    ``waits``: every launch rendezvous of the call)."""
    import time
    mesh = mesh_of(4)
    rt = td.initialize(mesh)
    native = rt.native
    for m, n, k in shapes:
        args, _ = _sharded_args(mesh, m, n, k)
        tuned = _shipped_config(rt, m, n, k)
        rows = tuned.get("CHUNK_ROWS") or m
        fns = {f"shipped ({-(-m // rows)} chunks)": _ag_fn(mesh, tuned)}
        fns["unaligned"] = fns[next(iter(fns))]
        if m // 4 != rows:
            fns["4 chunks"] = _ag_fn(mesh, dict(tuned, CHUNK_ROWS=m // 4))
        fns["xla"] = jax.jit(jax.shard_map(
            lambda x, w: jnp.dot(jax.lax.all_gather(x, "tp", tiled=True), w), **_ag_specs(mesh)))
        # jit's C++ dispatch path needs a program without JAX effects.
        print(f"host-rate {m}x{n}x{k}: JAX effects of the jaxtdist program: "
              f"{jax.make_jaxpr(fns['unaligned'])(*args).effects or 'none'}", flush=True)
        walls = {name: [] for name in fns}
        spent = {name: dict(handler=0.0, enqueue=0.0, waits=0.0) for name in fns}
        for f in fns.values():
            f(*args).block_until_ready()
        for _ in range(repeats):
            for name, f in fns.items():
                rt.align_launches = name != "unaligned"
                ce, align = native.ce_push_stats(), native.launch_alignment_stats()
                start = time.perf_counter()
                for _ in range(calls):
                    out = f(*args)
                out.block_until_ready()
                walls[name].append((time.perf_counter() - start) / calls * 1e6)
                ce_after, align_after = native.ce_push_stats(), native.launch_alignment_stats()
                per = calls * 4 * repeats
                for key, stat in (("handler", "handler_us"), ("enqueue", "enqueue_us")):
                    spent[name][key] += (ce_after[stat] - ce[stat]) / per
                spent[name]["waits"] += (align_after["wait_us"] - align["wait_us"]) / per
        rt.align_launches = True
        for name, f in fns.items():
            _, t = profile(f, args, iterations, 4)
            host = ", ".join(f"{key} {us:.1f}" for key, us in spent[name].items())
            print(f"host-rate {m}x{n}x{k} {name}: wall per call "
                  f"{[round(w, 1) for w in walls[name]]} us (host clock), kernel "
                  f"{t['mean_us']:.1f} fastest {t['min_us']:.1f} us (CUPTI); host us per call "
                  f"and device: {host}", flush=True)


def _is_all_gather(kernel_name: str) -> bool:
    """NCCL's (ncclDevKernel_AllGather_*) or XLA's all-gather kernels."""
    return "allgather" in kernel_name.lower().replace("_", "").replace("-", "")


def gap_functions(mesh, cfg: dict):
    """The contenders of ``probe_gap`` on a ("tp", "one") = (world, 1) mesh, all
    taking (x, w) = ([world * m, k] rows over "tp", [k, world * n] columns over
    "tp") and returning x @ w: cuBLAS and jaxtdist's kernel on every device at
    once without communication (each device the whole product of its block
    column, x replicated: "one" is a world-1 axis), and ag_matmul over "tp"."""
    specs = dict(mesh=mesh, in_specs=(P("tp", None), P(None, "tp")), out_specs=P(None, "tp"),
                 check_vma=False)

    def gathered(body):
        # The all_gather stays outside the timed kernels' comparison: its own kernel
        # appears under its own name and is left out of the sums (see probe_gap).
        return jax.jit(jax.shard_map(
            lambda x, w: body(jax.lax.all_gather(x, "tp", tiled=True), w), **specs))

    return {
        "cublas_all": gathered(lambda x, w: x @ w),
        "triton_all": gathered(
            lambda x, w: ag_matmul_with_gathered(x, w, "one", config=cfg, gathered=False)[0]),
        "fused": jax.jit(jax.shard_map(
            lambda x, w: ag_matmul_with_gathered(x, w, "tp", config=cfg,
                    gathered=False)[0], **specs)),
    }


def probe_gap(rounds=3, iterations=20, shapes=LARGE_SHAPES):
    """Where (d) loses to (a), under the same power draw: every device at once runs
    cuBLAS on the gathered rows, jaxtdist's kernel on them with no communication
    (world 1), and the fused ag_matmul (world 4); (a) on one device beside them.
    Times exclude the all_gather that feeds the first two (kernel names filtered)."""
    world = 4
    mesh = jax.make_mesh((world, 1), ("tp", "one"), devices=jax.devices()[:world],
                         axis_types=(AUTO, AUTO))
    rt = td.initialize(mesh)
    for m, n, k in shapes:
        args, ref = _sharded_args(mesh, m, n, k, world)
        tuned = _shipped_config(rt, m, n, k, world)
        x0 = jax.device_put(args[0], jax.devices()[0])
        w0 = jax.device_put(np.asarray(args[1])[:, :n], jax.devices()[0])
        _, one = profile(jax.jit(jnp.dot), (x0, w0), iterations, 1)
        times = {name: [] for name in ("cublas_all", "triton_all", "fused")}
        outs = {}
        fns = gap_functions(mesh, tuned)
        from jax.experimental.mosaic.gpu import profiler
        for _ in range(rounds):
            for name, f in fns.items():
                out, per_iter = profiler.measure(f, aggregate=False, iterations=iterations)(*args)
                sums = [sum(t for kname, t in kernels if not _is_all_gather(kname)) * 1e3 / world
                        for kernels in per_iter]
                times[name].append(float(np.median(sums)))
                outs[name] = out
        errs = {name: rel_err(out, ref) for name, out in outs.items()}  # once, off the clock
        med = {name: float(np.median(v)) for name, v in times.items()}
        print(f"gap {m}x{n}x{k}: (a) one device {one['mean_us']:.1f}; all devices: cuBLAS "
              f"{med['cublas_all']:.1f}, jaxtdist kernel alone {med['triton_all']:.1f}, fused "
              f"{med['fused']:.1f} | rounds {times} | err {errs}", flush=True)


def _sharded_args(mesh, m, n, k, world=4):
    x = (jax.random.normal(jax.random.key(1), (world * m, k), jnp.float32)
         / np.sqrt(k)).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.key(2), (k, world * n), jnp.bfloat16)
    args = (jax.device_put(x, NamedSharding(mesh, P("tp", None))),
            jax.device_put(w, NamedSharding(mesh, P(None, "tp"))))
    return args, np.asarray(x, np.float32) @ np.asarray(w, np.float32)


def _alternate(label, fns, args, ref, world, rounds, iterations):
    """Rounds of every variant in turn; prints the medians over rounds of each
    variant's mean and fastest-device times (us)."""
    times = {name: [] for name in fns}
    outs = {}
    for _ in range(rounds):
        for name, f in fns.items():
            out, t = profile(f, args, iterations, world)
            times[name].append((t["mean_us"], t["min_us"]))
            outs[name] = out
    errs = {name: rel_err(out, ref) for name, out in outs.items()}  # once, off the clock
    for name, ts in times.items():
        print(f"{label} {name}: mean {np.median([t[0] for t in ts]):.1f} fastest "
              f"{np.median([t[1] for t in ts]):.1f} rounds {[round(t[0], 1) for t in ts]} "
              f"err {errs[name]:.1e}", flush=True)


def probe_launcher(rounds=3, iterations=50, world=4):
    """Decode ag_matmul and small all_gathers launched by jax-triton or by jaxtdist's
    own FFI launcher (``rt.launcher``, read at trace time), XLA beside them,
    alternating in one process."""
    mesh = mesh_of(world)
    rt = td.initialize(mesh)
    specs = _ag_specs(mesh)

    def traced(make, args):
        fns = {}
        for launcher in ("jax-triton", "native"):
            rt.launcher = launcher
            fns[launcher] = make()
            jax.block_until_ready(fns[launcher](*args))  # traced with this launcher
        rt.launcher = "native"
        return fns

    for m in (1, 16):
        args, ref = _sharded_args(mesh, m, 4096, 8192, world)
        fns = {"xla": jax.jit(jax.shard_map(
            lambda x, w: jnp.dot(jax.lax.all_gather(x, "tp", tiled=True), w), **specs))}
        fns.update(traced(lambda: jax.jit(jax.shard_map(
            lambda x, w: td.ag_matmul(x, w, "tp"), **specs)), args))
        _alternate(f"launcher ag_matmul w={world} m={m}", fns, args, ref, world, rounds,
                   iterations)
    for rows in (8, 128, 512):
        x = jax.random.normal(jax.random.key(0), (world * rows, 1024), jnp.bfloat16)
        args = (jax.device_put(x, NamedSharding(mesh, P("tp", None))),)
        gather_specs = dict(mesh=mesh, in_specs=P("tp", None), out_specs=P(None, None),
                            check_vma=False)
        fns = {"xla": jax.jit(jax.shard_map(lambda v: jax.lax.all_gather(v, "tp", tiled=True),
                                            **gather_specs))}
        fns.update(traced(lambda: jax.jit(jax.shard_map(
            lambda v: td.all_gather(v, "tp"), **gather_specs)), args))
        _alternate(f"launcher all_gather w={world} {rows * 2048} B/rank", fns, args,
                   np.asarray(x, np.float32), world, rounds, iterations)


def probe_rendezvous(rounds=3, iterations=50, calls=40, world=4):
    """Launch rendezvous that only spins (as before) against spin-then-sleep.

    Per setting (microseconds an early arrival spins before it sleeps): the
    timeouts and the largest arrival spread over ``calls`` host-paced calls
    (inputs made and outputs read on the host between calls, as in
    test_launchers); then the kernel times of decode ag_matmul and a small
    all_gather called back to back, rounds alternating between settings."""
    from jaxtdist.runtime._runtime import LAUNCH_ALIGN_TIMEOUT_US
    mesh = mesh_of(world)
    rt = td.initialize(mesh)
    settings = {"spin only": LAUNCH_ALIGN_TIMEOUT_US, "spin 200 us": 200, "sleep at once": 0}
    specs = _ag_specs(mesh)
    ag = jax.jit(jax.shard_map(lambda x, w: td.ag_matmul(x, w, "tp"), **specs))
    gather = jax.jit(jax.shard_map(lambda v: td.all_gather(v, "tp"), mesh=mesh,
                                   in_specs=P("tp", None), out_specs=P(None, None),
                                   check_vma=False))
    cases = []
    for m in (1, 16):
        args, ref = _sharded_args(mesh, m, 4096, 8192, world)
        cases.append((f"ag_matmul m={m}", ag, args, ref))
    v = jax.random.normal(jax.random.key(0), (world * 64, 1024), jnp.bfloat16)
    cases.append(("all_gather 128 kB/rank", gather,
                  (jax.device_put(v, NamedSharding(mesh, P("tp", None))),),
                  np.asarray(v, np.float32)))
    for _, f, args, _ in cases:
        jax.block_until_ready(f(*args))
    rng = np.random.default_rng(0)
    try:
        for name, spin in settings.items():
            rt.native.configure_launch_alignment(True, LAUNCH_ALIGN_TIMEOUT_US, spin)
            for _ in range(calls):
                x = rng.standard_normal((world * 64, 1024)).astype(np.float32)
                xs = jax.block_until_ready(
                    jax.device_put(jnp.asarray(x, jnp.bfloat16), NamedSharding(mesh, P("tp", None))))
                assert np.array_equal(np.asarray(gather(xs), np.float32),
                                      np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32))
                np.asarray(ag(*cases[0][2]))
            st = rt.launch_alignment_stats()
            late = [" ".join(f"{m['position']}@{m['entered_us'] / 1e3:.1f}/"
                             f"{m['arrived_us'] / 1e3:.1f}ms" for m in r["members"])
                    for r in st["late"][:4]]
            print(f"rendezvous {name}: {calls} host-paced call pairs: met {st['met']} timed out "
                  f"{st['timed_out']} largest spread {st['max_spread_us'] / 1e3:.2f} ms "
                  f"late (position@entered/arrived) {late}", flush=True)
        times = {(label, name): [] for label, *_ in cases for name in settings}
        for _ in range(rounds):
            for name, spin in settings.items():
                rt.native.configure_launch_alignment(True, LAUNCH_ALIGN_TIMEOUT_US, spin)
                for label, f, args, ref in cases:
                    out, t = profile(f, args, iterations, world)
                    err = rel_err(out, ref)
                    times[(label, name)].append((t["mean_us"], t["min_us"], err))
        for (label, name), ts in times.items():
            print(f"rendezvous {label} {name}: mean {np.median([t[0] for t in ts]):.1f} "
                  f"fastest {np.median([t[1] for t in ts]):.1f} rounds "
                  f"{[round(t[0], 1) for t in ts]} err {max(t[2] for t in ts):.1e}", flush=True)
    finally:
        rt.align_launches = True  # the shipped settings


def probe_tiles(rounds=3, iterations=20):
    """2048/2752/4096: the copy-engine kernel with 128x256 tiles (shipped) against
    tiles whose last wave is fuller, at world 4 and alone on one GPU (cuBLAS beside)."""
    m, n, k = 2048, 2752, 4096
    variants = (dict(), dict(BLOCK_N=128, num_stages=4), dict(BLOCK_N=128, num_stages=5),
                dict(BLOCK_M=64, BLOCK_N=256, num_warps=4, num_stages=4, CHUNK_ROWS=64))
    for world in (4, 1):
        mesh = mesh_of(world)
        rt = td.initialize(mesh)
        tuned = _shipped_config(rt, m, n, k)
        args, ref = _sharded_args(mesh, m * 4 // world, n, k, world)
        fns = {}
        if world == 1:
            fns["cublas"] = jax.jit(jnp.dot)
        for v in variants:
            cfg = dict(tuned, **v)
            fns[str(v) or "tuned"] = _ag_fn(mesh, cfg)
        try:
            _alternate(f"tiles 2752 world={world}", fns, args, ref, world, rounds, iterations)
        except Exception as e:  # noqa: BLE001
            print(f"tiles 2752 world={world}: {type(e).__name__} {str(e)[:300]}", flush=True)


def probe_balance(shapes=((8192, 2752, 4096), (4096, 4096, 4096), (8192, 3072, 4096)),
                  rounds=3, iterations=20, programs=None, edge=False):
    """One GPU: cuBLAS against the static persistent TMA GEMM, with Triton's warp
    specialization, and with narrow edge tiles leveling the last wave
    (tests/gpu/gemm_probe_kernels.py), alternating in one process."""
    from tests.gpu.gemm_probe_kernels import gemm_edge_kernel
    from tests.kernels_for_tests import warp_specialized_matmul_kernel as gemm_ws_kernel
    mesh = mesh_of(1)
    td.initialize(mesh)
    sms = programs or getattr(jax.devices()[0], "core_count", None) or 132
    gpu = jax.devices()[0].platform == "gpu"
    for m, n, k in shapes:
        a = (jax.random.normal(jax.random.key(1), (m, k), jnp.float32) / np.sqrt(k)).astype(
            jnp.bfloat16)
        b = jax.random.normal(jax.random.key(2), (k, n), jnp.bfloat16)
        ref = np.asarray(a, np.float32) @ np.asarray(b, np.float32)
        variants = {"ws=False w8 s3": (gemm_ws_kernel, dict(WS=False), 8, 3)}
        if gpu:
            for warps, stages in ((4, 3), (4, 2)):
                variants[f"ws=True w{warps} s{stages}"] = (gemm_ws_kernel, dict(WS=True),
                                                           warps, stages)
        width = 64 if gpu else 8
        if edge and n % (256 if gpu else 32):
            for level in (2, 3, 4):
                variants[f"edge{width} level{level} w8 s3"] = (
                    gemm_edge_kernel, dict(EDGE_N=width, LEVEL=level), 8, 3)
        fns = {}
        if gpu:
            from jax.experimental.mosaic.gpu import profiler
            fns["cublas"] = jax.jit(jnp.dot)
            _, raw = profiler.measure(fns["cublas"], aggregate=False, iterations=2)(a, b)
            print(f"balance {m}x{n}x{k}: cublas kernels {sorted({nm for nm, _ in raw[-1]})}",
                  flush=True)
        for label, (kernel, extra, warps, stages) in variants.items():
            def body(a, b, kernel=kernel, extra=extra, warps=warps, stages=stages):
                return td.triton_call(
                    a, b, kernel=kernel, grid=(sms,), axis_name="tp", tma=True,
                    out_shape=jax.ShapeDtypeStruct((m, n), jnp.bfloat16),
                    num_warps=warps, num_stages=stages, M=m, N=n, K=k, BLOCK_M=128,
                    BLOCK_N=256 if gpu else 32, BLOCK_K=64 if gpu else 32, GROUP_M=8,
                    NUM_PROGRAMS=sms, **extra)
            fns[label] = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P()),
                                               out_specs=P(), check_vma=False))
        if not gpu:  # interpreter: correctness only
            for label, f in fns.items():
                out = f(a, b)
                err = rel_err(out, ref)
                print(f"balance {m}x{n}x{k} {label}: err {err:.1e}", flush=True)
            continue
        times = {label: [] for label in fns}
        errs = {}
        for _ in range(rounds):
            for label, f in fns.items():
                try:
                    out, us = _kernel_us(f, (a, b), "" if label == "cublas" else "gemm_",
                                         iterations)
                except Exception as e:  # noqa: BLE001
                    errs[label] = f"{type(e).__name__} {str(e)[:200]}"
                    continue
                times[label].append(us)
                errs[label] = rel_err(out, ref)
        base = np.median(times["cublas"])
        for label, ts in times.items():
            if not ts:
                print(f"balance {m}x{n}x{k} {label}: failed {errs.get(label)}", flush=True)
                continue
            print(f"balance {m}x{n}x{k} {label:22s}: {np.median(ts):7.1f} us "
                  f"({np.median(ts) / base:.3f}x cublas) rounds {[round(t, 1) for t in ts]} "
                  f"err {errs[label]:.1e}", flush=True)


def probe_push_order(rounds=3, iterations=20):
    """The shipped config of each copy-engine shape with the copy engines pushing
    to every peer at once ("parallel") or to one peer after another ("serial"),
    alternating in one process."""
    mesh = mesh_of(4)
    rt = td.initialize(mesh)
    for m, n, k in LARGE_SHAPES + ((128, 4096, 8192),):
        args, ref = _sharded_args(mesh, m, n, k)
        tuned = _shipped_config(rt, m, n, k)
        if m == 128:
            tuned = dict(tuned, TMA=True, PRODUCER="ce")
        fns = {order: _ag_fn(mesh, dict(tuned, PUSH_ORDER=order))
               for order in ("parallel", "serial")}
        _alternate(f"push-order {m}x{n}x{k}", fns, args, ref, 4, rounds, iterations)


PROBES = {
    "--launcher": lambda: probe_launcher(world=min(4, len(jax.devices()))),
    "--rendezvous": lambda: probe_rendezvous(world=min(4, len(jax.devices()))),
    "--tiles": lambda: probe_tiles(),
    "--stream-k": lambda: probe_stream_k(),
    "--tail": lambda: probe_tail(),
    "--flatten": lambda: probe_flatten(),
    "--gap": lambda: probe_gap(),
    "--variance": lambda: probe_variance(),
    "--ce": lambda: probe_copy_engine(),
    "--gemm": lambda: probe_gemm_variants(),
    "--push-order": lambda: probe_push_order(),
    "--balance": lambda: probe_balance(edge="--edge" in sys.argv),
    "--decode": lambda: probe_decode(),
    "--host-rate": lambda: probe_host_rate(**({"shapes": [
        tuple(int(v) for v in shape.split(",")) for shape in _flag_values("--shape")]}
        if "--shape" in sys.argv else {})),
    "--configs": lambda: probe_configs(
        json.loads(_flag_values("--configs")[0]),
        [tuple(int(v) for v in shape.split(",")) for shape in _flag_values("--shape")]
        or LARGE_SHAPES),
}

if __name__ == "__main__":
    for flag, probe in PROBES.items():
        if flag in sys.argv:
            probe()
    if len(sys.argv) == 1:
        probe_gemm_configs()
