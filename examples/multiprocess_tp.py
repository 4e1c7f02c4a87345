"""A tensor-parallel MLP step in the one-process-per-device layout.

Each process drives its own device(s); jax.distributed joins them and
jaxtdist's heap spans them. The step is the Megatron pair: ``ag_matmul``
gathers the sequence-sharded activations while it multiplies them by the
column-sharded first weight, ``matmul_rs`` multiplies by the row-sharded
second weight while it reduce-scatters the result back to sequence shards.
Every process checks its shard against a float32 reference computed on the
host from the same seeds (no XLA collectives: they are not needed, and fail
with several processes on one GPU).

    python -m jaxtdist.launch --nproc-per-node 2 examples/multiprocess_tp.py

On CPU each process gets one host device (``--cpu-devices-per-process`` for
more) and kernels run under Triton's interpreter. A GPU mesh spanning
processes needs the NVSHMEM heap backend (docs/multiprocess.md).
"""

import time

import jaxtdist.launch

# Before anything touches JAX's devices: join the other processes.
jaxtdist.launch.initialize_from_env()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxtdist as td  # noqa: E402


def place(mesh, x: np.ndarray, spec) -> jax.Array:
    """The global array ``x`` laid out by ``spec``; each process supplies its shards."""
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: x[i])


def main() -> None:
    world = jax.device_count()
    on_gpu = jax.devices()[0].platform == "gpu"
    seq, d_model, d_ff = (4096, 4096, 16384) if on_gpu else (32 * world, 64, 64 * world)
    mesh = jax.make_mesh((world,), ("tp",))
    start = time.perf_counter()
    td.initialize(mesh)
    ready_s = time.perf_counter() - start

    @jax.jit
    def step(x, w1, w2):
        def body(x, w1, w2):          # x [seq/tp, d]; w1 [d, ff/tp]; w2 [ff/tp, d]
            h = td.ag_matmul(x, w1, "tp")           # [seq, ff/tp]
            h = jax.nn.gelu(h)
            return td.matmul_rs(h, w2, "tp")        # [seq/tp, d], summed over tp
        return jax.shard_map(body, mesh=mesh,
                             in_specs=(P("tp", None), P(None, "tp"), P("tp", None)),
                             out_specs=P("tp", None))(x, w1, w2)

    rng = np.random.default_rng(0)
    x = rng.standard_normal((seq, d_model), np.float32)
    w1 = rng.standard_normal((d_model, d_ff), np.float32) / np.sqrt(d_model)
    w2 = rng.standard_normal((d_ff, d_model), np.float32) / np.sqrt(d_ff)
    y = step(place(mesh, x, P("tp", None)), place(mesh, w1, P(None, "tp")),
             place(mesh, w2, P("tp", None)))
    h = x @ w1
    ref = np.asarray(jax.nn.gelu(jnp.asarray(h)), np.float64) @ w2
    err = max(float(np.linalg.norm(np.asarray(s.data) - ref[s.index]) / np.linalg.norm(ref[s.index]))
              for s in y.addressable_shards)
    ok = err < 1e-4
    print(f"process {jax.process_index()} of {jax.process_count()}: tensor-parallel step "
          f"(ag_matmul -> gelu -> matmul_rs) over {world} devices, seq {seq}, d_model "
          f"{d_model}, d_ff {d_ff}; heap ready in {ready_s:.2f} s; relative error of my "
          f"shard {err:.1e}: {'OK' if ok else 'MISMATCH'}")
    td.shutdown()
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
