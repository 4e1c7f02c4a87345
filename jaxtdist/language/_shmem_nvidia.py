"""NVIDIA lowering of ``jaxtdist.language.shmem``: calls into NVSHMEM's device
library through jaxtdist's wrappers (``runtime/_nvshmem_device.cu``), linked
into the kernel's cubin when jaxtdist compiles it (``runtime/_shmem_link.py``).

Every call is an extern op that every thread of the program executes; the
wrappers make per-thread NVSHMEM functions issue once per program.
"""

import triton
import triton.language as tl
from triton.language import core

_SIG_OPS = {"set": 9, "add": 10}  # NVSHMEM_SIGNAL_SET, NVSHMEM_SIGNAL_ADD


def _call(name, args, types, _semantic):
    # Returns int32 (0): Triton's extern calls need a value; the wrappers give one.
    return core.extern_elementwise("jaxtdist_shmem", "", args,
                                   {types: ("jaxtdist_shmem_" + name, core.int32)},
                                   is_pure=False, _semantic=_semantic)


_I64 = core.int64
_I32 = core.int32


@core.extern
def _putmem_nbi_block(dest, source, nbytes, pe, _semantic=None):
    return _call("putmem_nbi_block", [dest, source, nbytes, pe], (_I64, _I64, _I64, _I32),
                 _semantic)


@core.extern
def _putmem_signal_nbi_block(dest, source, nbytes, sig, signal, sig_op, pe, _semantic=None):
    return _call("putmem_signal_nbi_block", [dest, source, nbytes, sig, signal, sig_op, pe],
                 (_I64, _I64, _I64, _I64, _I64, _I32, _I32), _semantic)


@core.extern
def _signal_op(sig, signal, sig_op, pe, _semantic=None):
    return _call("signal_op", [sig, signal, sig_op, pe], (_I64, _I64, _I32, _I32), _semantic)


@core.extern
def _no_arg(name: core.constexpr, _semantic=None):
    return _call(name.value if hasattr(name, "value") else name,
                 [_semantic.to_tensor(0)], (_I32,), _semantic)


@triton.jit
def _addr(ptr):
    return ptr.to(tl.int64, bitcast=True)


@triton.jit
def _sig_op_code(OP: tl.constexpr):
    if OP == "add":
        code: tl.constexpr = 10
    else:
        code: tl.constexpr = 9
    return code


@triton.jit
def putmem_nbi_block(ctx, dest, source, nbytes, pe):
    _putmem_nbi_block(_addr(dest), _addr(source), tl.cast(nbytes, tl.int64), tl.cast(pe, tl.int32))


@triton.jit
def putmem_signal_nbi_block(ctx, dest, source, nbytes, sig_addr, signal, pe,
                            SIG_OP: tl.constexpr = tl.constexpr("set")):
    _putmem_signal_nbi_block(_addr(dest), _addr(source), tl.cast(nbytes, tl.int64), _addr(sig_addr),
                             tl.cast(signal, tl.int64), _sig_op_code(SIG_OP), tl.cast(pe, tl.int32))


@triton.jit
def signal_op(ctx, sig_addr, signal, pe, SIG_OP: tl.constexpr = tl.constexpr("set")):
    _signal_op(_addr(sig_addr), tl.cast(signal, tl.int64), _sig_op_code(SIG_OP), tl.cast(pe, tl.int32))


@triton.jit
def fence(ctx):
    _no_arg("fence")


@triton.jit
def quiet(ctx):
    _no_arg("quiet")


@triton.jit
def barrier_all(ctx, signals):
    _no_arg("barrier_all_block")


@triton.jit
def my_pe(ctx):
    return _no_arg("my_pe")


@triton.jit
def n_pes(ctx):
    return _no_arg("n_pes")
