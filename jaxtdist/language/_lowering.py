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
- ``now_ns()``: a clock in nanoseconds (int64), the bound of every wait.

Backends: ``_nvidia`` (inline PTX, sm_90), ``_interpret`` (Triton's
interpreter, where programs run one at a time in order). An AMD lowering
(AMDGCN, issue 25) and NVSHMEM device calls slot in here.
"""

import os

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    from jaxtdist.language._interpret import (consume_token, fence_async_proxy, now_ns,
                                              spin_acquire_ge)
else:
    from jaxtdist.language._nvidia import (consume_token, fence_async_proxy, now_ns,
                                           spin_acquire_ge)

__all__ = ["consume_token", "fence_async_proxy", "now_ns", "spin_acquire_ge"]
