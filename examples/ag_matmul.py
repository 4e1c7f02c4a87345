"""jaxtdist's main example: an overlapped all-gather matmul on every device there is.

On a machine without GPUs it runs on 8 host devices, the same Triton kernels
under Triton's interpreter. Prints one line: the check against XLA.

    python examples/ag_matmul.py
"""

import os

# Harmless with GPUs (it only shapes the host platform); gives CPU-only
# machines 8 devices.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import functools  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxtdist as td  # noqa: E402


def main() -> None:
    devices = jax.devices()
    world = len(devices)
    on_gpu = devices[0].platform == "gpu"
    m_shard, k, n_shard = (1024, 4096, 1024) if on_gpu else (24, 64, 16)
    mesh = jax.make_mesh((world,), ("tp",))
    td.initialize(mesh)

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("tp", None), P(None, "tp")),
                       out_specs=P(None, "tp"))
    def f(x, w):
        return td.ag_matmul(x, w, axis_name="tp")  # == all_gather(x, "tp", tiled=True) @ w

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("tp", None), P(None, "tp")),
                       out_specs=P(None, "tp"))
    def reference(x, w):
        return jax.lax.all_gather(x, "tp", tiled=True) @ w

    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (world * m_shard, k), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (k, world * n_shard), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    x = jax.device_put(x, NamedSharding(mesh, P("tp", None)))
    w = jax.device_put(w, NamedSharding(mesh, P(None, "tp")))
    out = np.asarray(f(x, w), np.float32)
    ref = np.asarray(reference(x, w), np.float32)
    exact = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
    err = np.linalg.norm(out - exact) / np.linalg.norm(exact)
    err_xla = np.linalg.norm(ref - exact) / np.linalg.norm(exact)
    ok = bool(np.all(np.isfinite(out)) and err < 2e-2)
    print(f"jaxtdist.ag_matmul on {world} x {devices[0].device_kind} "
          f"({'Triton' if on_gpu else 'Triton interpreter'}): out {out.shape}, "
          f"rel err vs float32 {err:.1e} (XLA's {err_xla:.1e}): {'OK' if ok else 'MISMATCH'}")
    td.shutdown()
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
