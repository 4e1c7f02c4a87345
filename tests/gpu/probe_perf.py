"""Where does jaxtdist's GPU time go? Times variants of all_gather and ag_matmul.

Run on the GPU node: python3 tests/gpu/probe_perf.py (prints one line per variant).
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxtdist as td
from jaxtdist.bench import _profile
from jaxtdist.ops.ag_matmul import ag_matmul_with_gathered

AUTO = jax.sharding.AxisType.Auto


def mesh_of(n):
    return jax.make_mesh((n,), ("tp",), devices=jax.devices()[:n], axis_types=(AUTO,))


def probe_all_gather(world, cfg, rows=4096, cols=1024):
    mesh = mesh_of(world)
    td.initialize(mesh)
    f = jax.jit(jax.shard_map(lambda x: td.all_gather(x, "tp", config=cfg), mesh=mesh,
                              in_specs=P("tp", None), out_specs=P(None, None), check_vma=False))
    x = jax.random.normal(jax.random.key(0), (world * rows, cols), jnp.bfloat16)
    xs = jax.device_put(x, NamedSharding(mesh, P("tp", None)))
    out, t = _profile(f, (xs,), 10, world)
    ok = np.array_equal(np.asarray(out), np.asarray(x))
    print(f"all_gather w={world} {cfg}: mean {t['mean_us']:.1f} min {t['min_us']:.1f} ok={ok} "
          f"kernels={t['kernels']}", flush=True)


def probe_ag_matmul(world, cfg, m=1024, n=4096, k=4096):
    mesh = mesh_of(world)
    td.initialize(mesh)
    f = jax.jit(jax.shard_map(lambda x, w: ag_matmul_with_gathered(x, w, "tp", config=cfg)[0],
                              mesh=mesh, in_specs=(P("tp", None), P(None, "tp")),
                              out_specs=P(None, "tp"), check_vma=False))
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
    err = np.linalg.norm(np.asarray(out, np.float32) - ref) / np.linalg.norm(ref)
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


if __name__ == "__main__":
    probe_gemm_configs()
