"""The backend seam of the language: target-specific lowerings of the primitives.

Everything else in ``jaxtdist.language`` is portable Triton (loads, stores and
scoped atomics through translated peer pointers). The primitives below need
code of their own per target; each backend module defines all of them with
the same signatures:

- ``fence_async_proxy()``: orders generic-proxy accesses before TMA loads.
- ``consume_token(value, token)``: ``value`` made data-dependent on ``token``.
- ``spin_acquire_ge(signal, value, limit, SCOPE)``: acquire re-reads of
  ``*signal`` until ``>= value`` or ``limit`` ns have passed (then an
  async-proxy fence); returns (last value seen, a zero int32 token).
- ``fence_system(scratch)``: a system-scope acquire-release fence by the
  calling thread (``scratch``: an int32 word of this rank, for targets that
  fence through a read-modify-write).
- ``now_ns()``: a clock in nanoseconds (int64), the bound of every wait.
- ``poll_pause()``: called between a wait's polls. Nothing on GPUs; under the
  interpreter it gives the host's core away for a moment, since its ranks are
  processes sharing few cores, and a rank polling at full speed takes the core
  from the rank it waits for.
- ``wait_tma_stores()``: waits until this thread's TMA stores are written and
  orders them before its later generic accesses (a release then publishes
  them).

Backends: ``_nvidia`` (inline PTX, sm_90), ``_amd`` (AMDGCN, gfx942),
``_interpret`` (Triton's interpreter, where programs run one at a time in
order). NVSHMEM device calls slot in here.

The backend is chosen once, when the language is imported, for the GPUs of
this process: ``TRITON_INTERPRET=1`` -> interpreter; else
``JAXTDIST_TARGET`` ("cuda" or "hip") if set; else AMD where ROCm's device
file (/dev/kfd) exists and NVIDIA's does not; else NVIDIA. Kernels compiled for
another target than the one chosen (cross-compiling gfx942 code on an
NVIDIA or CPU machine) need ``JAXTDIST_TARGET`` set before the import.
"""

import os


def _target() -> str:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return "interpret"
    asked = os.environ.get("JAXTDIST_TARGET", "")
    if asked:
        if asked not in ("cuda", "hip"):
            raise ValueError(f"jaxtdist.language: JAXTDIST_TARGET={asked!r}; allowed: 'cuda' "
                             "(NVIDIA), 'hip' (AMD)")
        return asked
    # The kernel drivers' device files, not a GPU driver call: importing the
    # language must not initialize a GPU runtime before JAX does.
    if os.path.exists("/dev/kfd") and not os.path.exists("/dev/nvidiactl"):
        return "hip"
    return "cuda"


TARGET = _target()

if TARGET == "interpret":
    from jaxtdist.language._interpret import (consume_token, fence_async_proxy, fence_system,
                                              now_ns, poll_pause, round_tf32,
                                              spin_acquire_ge, wait_tma_stores)
elif TARGET == "hip":
    from jaxtdist.language._amd import (consume_token, fence_async_proxy, fence_system, now_ns,
                                         poll_pause, round_tf32, spin_acquire_ge,
                                         wait_tma_stores)
else:
    from jaxtdist.language._nvidia import (consume_token, fence_async_proxy, fence_system,
                                           now_ns, poll_pause, round_tf32, spin_acquire_ge,
                                           wait_tma_stores)

__all__ = ["TARGET", "consume_token", "fence_async_proxy", "fence_system", "now_ns", "poll_pause",
           "round_tf32", "spin_acquire_ge", "wait_tma_stores"]
