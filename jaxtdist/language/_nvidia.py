"""NVIDIA lowering of the target-specific primitives (see ``_lowering``): inline PTX."""

import triton
import triton.language as tl

# wait_for_tma's spin: $0 = last value seen, $1 = 0 (the token), $2 = signal
# address, $3 = value, $4 = timeout in ns (%globaltimer: nanoseconds). One asm
# op, so no loop in Triton's IR.
_SPIN_ASM = """{{
            .reg .pred %p_done;
            .reg .u64 %t0, %t;
            .reg .s64 %waited;
            mov.u64 %t0, %globaltimer;
            SPIN_${{:uid}}:
            ld.acquire.{scope}.global.b32 $0, [$2];
            setp.ge.s32 %p_done, $0, $3;
            @%p_done bra DONE_${{:uid}};
            mov.u64 %t, %globaltimer;
            sub.s64 %waited, %t, %t0;
            setp.lt.s64 %p_done, %waited, $4;
            @%p_done bra SPIN_${{:uid}};
            DONE_${{:uid}}:
            fence.proxy.async.global;
            mov.b32 $1, 0;
            }}"""
_SPIN_ASM_GPU = tl.constexpr(_SPIN_ASM.format(scope="gpu"))
_SPIN_ASM_SYS = tl.constexpr(_SPIN_ASM.format(scope="sys"))


@triton.jit
def fence_async_proxy():
    """Orders this thread's earlier memory accesses before its later TMA ones.

    Data that a ``wait`` acquired was written through the generic proxy;
    TMA loads (tensor descriptors) read through the async proxy, which the
    acquire alone does not order. Call it after the wait, before the loads.
    """
    tl.inline_asm_elementwise("fence.proxy.async.global;\n mov.u32 $0, $1;", "=r,r",
                              [tl.full([], 0, tl.int32)], dtype=tl.int32, is_pure=False,
                              pack=1)


@triton.jit
def wait_tma_stores():
    """Waits until this thread's TMA stores (tensor-descriptor stores, async
    proxy) have been written, then orders them before its later generic
    accesses: a release after it publishes them. (Triton's own wait after a
    descriptor store is only for the read of its shared-memory source.)"""
    tl.inline_asm_elementwise(
        "cp.async.bulk.wait_group 0;\n fence.proxy.async.global;\n mov.u32 $0, $1;", "=r,r",
        [tl.full([], 0, tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def consume_token(value, token):
    """Returns ``value``, made data-dependent on ``token`` (a wait's result).

    Loads through the returned pointers cannot be scheduled above the wait
    that produced ``token``.
    """
    addr = value.to(tl.int64, bitcast=True)
    tok = (tl.zeros_like(addr) + token).to(tl.int32)
    addr = tl.inline_asm_elementwise(
        "mov.b64 $0, $1;", "=l,l,r", [addr, tok], dtype=tl.int64,
        is_pure=False, pack=1)
    return addr.to(value.dtype, bitcast=True)


@triton.jit
def spin_acquire_ge(signal, value, limit, SCOPE: tl.constexpr):
    """One inline-asm op: acquire re-reads of ``*signal`` until it is >= ``value``
    or ``limit`` ns have passed, then an async-proxy fence. Returns (last value
    seen, 0)."""
    return tl.inline_asm_elementwise(
        _SPIN_ASM_SYS if SCOPE == "sys" else _SPIN_ASM_GPU, "=r,=r,l,r,l",
        [signal.to(tl.int64, bitcast=True), value, limit], dtype=(tl.int32, tl.int32),
        is_pure=False, pack=1)


@triton.jit
def fence_system(scratch):
    """A ``fence.acq_rel.sys`` by this thread: with a strong (relaxed or
    stronger) write after it, a release pattern of PTX's memory model, so later
    relaxed signals publish everything this thread's fence ordered before them.
    ``scratch`` (an int32 word of this rank) is unused here."""
    tl.inline_asm_elementwise("fence.acq_rel.sys;\n mov.u32 $0, $1;", "=r,r",
                              [tl.full([], 0, tl.int32)], dtype=tl.int32, is_pure=False,
                              pack=1)


@triton.jit
def now_ns():
    """The GPU's global timer, in nanoseconds (int64; the same clock on every SM)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r",
                                     [tl.full([], 0, tl.int32)], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def poll_pause():
    """Nothing: an SM spinning on a flag takes no bandwidth from the peer it waits for."""
    pass


@triton.jit
def round_tf32(x):
    """float32 ``x`` rounded to TF32 (10 mantissa bits), to nearest, ties away from
    zero; the tensor cores themselves drop the low 13 bits (round toward zero)."""
    return tl.inline_asm_elementwise("cvt.rna.tf32.f32 $0, $1;", "=r,r", [x],
                                     dtype=tl.float32, is_pure=True, pack=1)
