"""Main loop of an interpreter worker: one process per mesh position."""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import os
import sys
import traceback

import numpy as np

# It imports neither JAX nor ml_dtypes: a worker runs kernels on plain numpy.
from jaxtdist.interpret._wire import BF16, BF16_NAN_BITS, is_bf16, spec_is_bf16


def _resolve(ref):
    module_name, qualname, path = ref
    module = None
    if module_name != "__main__":
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            module = None
    if module is None:
        # A kernel defined in a script (or a test file): load it under another
        # name so that its `if __name__ == "__main__"` block does not run.
        alias = "_jaxtdist_user_" + str(abs(hash(path)))
        module = sys.modules.get(alias)
        if module is None:
            spec = importlib.util.spec_from_file_location(alias, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[alias] = module
            spec.loader.exec_module(module)
    obj = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def main(position: int, shm_name: str, main_segment_base: int, conn) -> None:
    from jaxtdist.interpret._launcher import HostPointer, launch
    from jaxtdist.language import _layout as L

    from jaxtdist.interpret._segment import map_segment

    segment = map_segment(shm_name)
    anchor = ctypes.c_char.from_buffer(segment)
    segment_base = ctypes.addressof(anchor)
    shift = segment_base - main_segment_base
    kernels = {}
    conn.send(("ready", position))
    while True:
        job = conn.recv()
        if job is None:
            break
        try:
            ref, grid, args, out_specs, constexprs = job
            kernel = kernels.get(ref)
            if kernel is None:
                kernel = kernels[ref] = _resolve(ref)
            # A 64-byte aligned copy: kernels rely on the context being aligned
            # like the XLA buffer it is on GPUs.
            raw = np.empty(args[0].nbytes + 64, np.uint8)
            start = -raw.ctypes.data % 64
            ctx = raw[start:start + args[0].nbytes].view(args[0].dtype)
            ctx[:] = args[0]
            words = ctx.view(np.int64)
            # The main process's addresses of the shared heap -> this process's.
            world = int(words[L.CTX_WORLD])
            for w in (L.CTX_ERR_ADDR, L.CTX_HEAP_BASE, L.CTX_SCRATCH_ADDR):
                words[w] += shift
            words[L.CTX_PEER_BASES:L.CTX_PEER_BASES + world] += shift
            record = (ctypes.c_int64 * L.ERR_WORDS).from_address(int(words[L.CTX_ERR_ADDR]))
            outs, call_outs = [], []
            for shape, dtype in out_specs:
                if spec_is_bf16(dtype):  # its bits, poisoned with NaN's
                    out = np.full(shape, BF16_NAN_BITS, np.uint16)
                    call_outs.append(HostPointer(out.ctypes.data, BF16))
                else:
                    out = np.empty(shape, dtype)
                    # Poison outputs so that anything a kernel fails to write shows.
                    if np.issubdtype(out.dtype, np.floating):
                        out.fill(np.nan)
                    else:
                        out.fill(np.iinfo(out.dtype).min if out.dtype.kind in "iu" else 0)
                    call_outs.append(out)
                outs.append(out)
            # bfloat16 arguments come as (BF16, their uint16 bits, contiguous):
            # typed pointers to the bits, which `args` keeps alive.
            call_args = [ctx] + [
                HostPointer(a[1].ctypes.data, BF16) if is_bf16(a)
                else np.ascontiguousarray(a) if isinstance(a, np.ndarray) else a
                for a in args[1:]] + call_outs
            launch(kernel, grid, call_args, constexprs)
            timed_out = record[0] != 0
            conn.send(("ok", outs, timed_out))
        except BaseException:  # report everything to the caller, keep serving
            conn.send(("error", traceback.format_exc(), False))
    del anchor
    segment.close()


def _die_with_parent() -> None:
    """Ends this worker soon after the process that started it dies: a worker
    spinning in a kernel would otherwise outlive a killed rank (its pipe's EOF
    is read only between kernels). Polls rather than PR_SET_PDEATHSIG, which
    fires when the starting *thread* exits, and initialize() may run in any
    thread."""
    import threading
    import time

    parent = int(os.environ.get("_JAXTDIST_PARENT_PID") or os.getppid())

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="jaxtdist-parent-watch", daemon=True).start()


if __name__ == "__main__":
    from multiprocessing.connection import Client

    _die_with_parent()

    _pos, _shm, _base, _address = sys.argv[1:5]
    _conn = Client(_address, family="AF_UNIX",
                   authkey=bytes.fromhex(os.environ["_JAXTDIST_WORKER_AUTHKEY"]))
    try:
        main(int(_pos), _shm, int(_base), _conn)
    except (EOFError, KeyboardInterrupt):
        pass  # the parent went away
