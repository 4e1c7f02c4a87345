"""all_reduce over "tp" of a dp x tp mesh spanning 2 processes x 2 devices, with
tp across the processes and then within each (a second jaxtdist.initialize:
the bootstrap's keys of the new generation). Prints ``SUBMESH layout err``."""

import jaxtdist.launch

jaxtdist.launch.initialize_from_env()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxtdist as td  # noqa: E402

devices = np.array(jax.devices()).reshape(2, 2)     # rows: processes
for layout, grid in (("tp-across", devices.T), ("tp-within", devices)):
    mesh = Mesh(grid, ("dp", "tp"))
    td.initialize(mesh)
    spec = P(("dp", "tp"))
    x = np.random.default_rng(0).standard_normal((4, 8, 5)).astype(np.float32)
    f = jax.jit(jax.shard_map(lambda a: td.all_reduce(a, "tp"), mesh=mesh, in_specs=spec,
                              out_specs=spec))
    out = f(jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: x[i]))
    ref = np.repeat(x.reshape(2, 2, 8, 5).sum(1, keepdims=True), 2, axis=1).reshape(4, 8, 5)
    err = max(float(np.linalg.norm(np.asarray(s.data) - ref[s.index]) /
                    np.linalg.norm(ref[s.index])) for s in out.addressable_shards)
    print(f"SUBMESH {layout} {err:.3e}", flush=True)
td.shutdown()
