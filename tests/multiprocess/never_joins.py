"""One process (``--victim``) never joins; the others must fail within the bound.

  --stage jaxtdist      the victim runs jax.distributed but never calls
                        jaxtdist.initialize: the others' initialize raises
                        BootstrapTimeoutError naming it after --bound-s seconds.
  --stage distributed   the victim never calls jax.distributed.initialize: the
                        others' jax.distributed.initialize fails after its
                        initialization_timeout (--bound-s), JAX's own bound.

Prints ``FAILED_AFTER seconds: message`` on the others and exits 3.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jaxtdist.launch

ap = argparse.ArgumentParser()
ap.add_argument("--stage", choices=("jaxtdist", "distributed"), required=True)
ap.add_argument("--victim", type=int, default=1)
ap.add_argument("--bound-s", type=float, default=3.0)
args = ap.parse_args()
me = int(os.environ[jaxtdist.launch.ENV_PROCESS_ID])


def fail(start: float, e: BaseException) -> None:
    print(f"FAILED_AFTER {time.monotonic() - start:.2f}: {type(e).__name__}: {e}", flush=True)
    os._exit(3)  # jax.distributed's shutdown barrier would wait for the absent process


if me == args.victim and args.stage == "distributed":
    time.sleep(600)  # never joins; the launcher ends it
start = time.monotonic()
try:
    jaxtdist.launch.initialize_from_env(initialization_timeout=int(args.bound_s))
except Exception as e:  # noqa: BLE001 - whatever JAX raises is the report
    fail(start, e)

import jax  # noqa: E402

import jaxtdist as td  # noqa: E402

# Every process must create JAX's CPU backend (it exchanges device topologies).
mesh = jax.make_mesh((jax.device_count(),), ("tp",))
if me == args.victim:
    time.sleep(600)
start = time.monotonic()
try:
    td.initialize(mesh, bootstrap_timeout_s=args.bound_s)
except Exception as e:  # noqa: BLE001
    fail(start, e)
print("UNEXPECTED: initialize succeeded", flush=True)
sys.exit(1)
