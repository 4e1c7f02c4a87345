"""The handlers' shared prelude (csrc/call_context.cc) and the prologue's
attribute binding, driven through the CPU prologue handler: the CUDA handlers
run the same Resolve, which cannot run on a machine without GPUs.

Runs in a fresh process: it resets the native registry to a generation of its
own and registers a heap in a numpy buffer, which must not leak into the
runtime that other tests share.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]

PROGRAM = textwrap.dedent("""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxtdist.language import _layout as L
    from jaxtdist.runtime import _native

    lib = _native.native()  # registers the FFI targets
    lib.reset(7)
    heap = np.zeros(1 << 16, np.uint8)
    record = np.zeros(L.ERR_WORDS, np.int64)
    lib.register_heap(0, -1, heap.ctypes.data, heap.nbytes, record.ctypes.data)
    heap.view(np.int64)[:L.CTX_WORDS] = np.arange(100, 100 + L.CTX_WORDS)

    def prologue(position=0, *stage, generation=7, groups=None, world=1, stage_bytes=256):
        groups = np.zeros(1, np.int64) if groups is None else groups
        call = jax.ffi.ffi_call(_native.PROLOGUE_TARGET,
                                jax.ShapeDtypeStruct((2 * L.CTX_WORDS,), jnp.int32),
                                has_side_effect=True)
        f = jax.jit(lambda *a: call(
            *a, template_offset=np.int64(0), counter_id=np.int64(3),
            stage_offset=np.int64(4096), parity_bytes=np.int64(stage_bytes),
            generation=np.int64(generation), groups=groups, world=np.int64(world),
            align_launch=np.int64(1), stages=np.int64(len(stage))))
        return np.asarray(f(np.array([position], np.int32), *stage)).view(np.int64)

    def error(*args, **kwargs):
        try:
            prologue(*args, **kwargs)
        except Exception as e:  # XLA's runtime error carries the handler's message
            return str(e)
        raise AssertionError("the prologue did not fail")

    # Success: the template copied, the epoch advanced per call, the stage staged
    # into the slot of the epoch's parity.
    x = np.arange(16, dtype=np.float32)
    for epoch in (1, 2):
        ctx = prologue(0, x + epoch)
        assert ctx[L.CTX_EPOCH] == epoch, ctx[:4]
        assert ctx[L.CTX_RANK] == 100 and ctx[L.CTX_WORDS - 1] == 100 + L.CTX_WORDS - 1
        slot = 4096 + (epoch & 1) * 256
        np.testing.assert_array_equal(heap[slot:slot + 64].view(np.float32), x + epoch)
    assert lib.peek_epoch(3, 0) == 2

    msg = error(generation=6)
    assert "compiled for jaxtdist runtime #6 but runtime #7" in msg, msg
    msg = error(3)
    assert "no symmetric heap is registered for mesh position 3" in msg, msg
    # An empty int64 array attribute decodes (as an empty span).
    msg = error(groups=np.zeros(0, np.int64))
    assert "jaxtdist prologue: group table of 0 entries does not cover mesh position 0" in msg, msg
    msg = error(0, x, x)
    assert "stages at most one buffer" in msg, msg
    msg = error(0, x, stage_bytes=16)
    assert "staging 64 bytes at offset 4096" in msg, msg
    assert lib.peek_epoch(3, 0) == 2  # failed calls advance nothing

    record[[L.ERR_FLAG, L.ERR_RANK, L.ERR_PEER, L.ERR_SIGNAL_OFFSET, L.ERR_EXPECTED,
            L.ERR_SEEN, L.ERR_CMP, L.ERR_TIMEOUT_NS]] = [1, 1, 2, 4000, 4, 5, L.CMP_CODES["ge"],
                                                        2_500_000_000]
    msg = error()
    want = ("jaxtdist.WaitTimeoutError: a wait timed out after 2.5 s in an earlier call on "
            "rank 1 (mesh position 0): it waited for the signal at heap offset 4000 (notified "
            "by rank 2) to become >= 4 but last saw 5")
    assert want in msg, msg
    print("CALL_CONTEXT_OK")
""")


def test_cpu_prologue_resolves_its_call():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", PROGRAM], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    assert "CALL_CONTEXT_OK" in proc.stdout
