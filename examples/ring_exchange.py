"""The ring exchange of docs/language.md: every rank sends its vector to the next.

A user kernel (examples/ring_kernels.py) written with jaxtdist.language and
run through jaxtdist.triton_call. On a machine without GPUs it runs on 8 host
devices under Triton's interpreter. Prints one line.

    python examples/ring_exchange.py
"""

import os

# Harmless with GPUs (it only shapes the host platform); gives CPU-only
# machines 8 devices.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxtdist as td  # noqa: E402

# Kernels live in their own module without JAX: the CPU backend's worker
# processes import it by name (they inherit this process's sys.path, whose
# first entry is this script's directory).
from ring_kernels import ring_exchange_kernel, ring_workspace_bytes  # noqa: E402


def main() -> None:
    devices = jax.devices()
    world = len(devices)
    on_gpu = devices[0].platform == "gpu"
    n, block = (1 << 16, 1024) if on_gpu else (1000, 256)  # n need not divide by block
    mesh = jax.make_mesh((world,), ("x",))
    td.initialize(mesh)

    def ring(x):  # x: this rank's (n,) shard
        return td.triton_call(x, kernel=ring_exchange_kernel,
                              out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(1,),
                              axis_name="x", workspace_bytes=ring_workspace_bytes(n),
                              N=n, BLOCK=block)

    f = jax.jit(jax.shard_map(ring, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    calls, ok = 5, True
    for i in range(calls):  # epochs 1..5: both buffer parities, reused twice
        x = np.random.default_rng(i).standard_normal(world * n).astype(np.float32)
        out = np.asarray(f(jax.device_put(jnp.asarray(x), NamedSharding(mesh, P("x")))))
        expect = np.roll(x.reshape(world, n), 1, axis=0).reshape(-1)
        ok = ok and bool(np.array_equal(out, expect))
    print(f"jaxtdist ring exchange on {world} x {devices[0].device_kind} "
          f"({'Triton' if on_gpu else 'Triton interpreter'}): {calls} calls of {n} float32 "
          f"per rank, rank r received rank r-1's vector: {'OK' if ok else 'MISMATCH'}")
    td.shutdown()
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
