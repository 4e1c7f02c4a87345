"""How kernel arguments and outputs cross the pipe between a process and its
interpreter workers.

bfloat16 (an ml_dtypes type) travels as its uint16 bits, tagged, so that workers
never import ml_dtypes: with ml_dtypes 0.7 that import costs each worker about
0.6 s of CPU, more than the rest of its start. Everything else travels as is.
"""

from __future__ import annotations

import numpy as np

BF16 = "bfloat16"

# bfloat16's quiet NaN, as bits: the poison of outputs a kernel leaves unwritten.
BF16_NAN_BITS = 0x7FC0


def to_wire(value):
    """A kernel argument as sent: a bfloat16 array as (BF16, its uint16 bits)."""
    if isinstance(value, np.ndarray) and value.dtype.name == BF16:
        return (BF16, np.ascontiguousarray(value).view(np.uint16))
    return value


def is_bf16(arg) -> bool:
    """Whether a received argument is ``to_wire``'s bfloat16 form."""
    return isinstance(arg, tuple) and len(arg) == 2 and arg[0] == BF16


def spec_to_wire(spec: tuple) -> tuple:
    """An output's (shape, dtype) as sent: bfloat16 as the BF16 tag."""
    shape, dtype = spec
    return (shape, BF16 if np.dtype(dtype).name == BF16 else dtype)


def spec_is_bf16(dtype) -> bool:
    """Whether a received output dtype is the BF16 tag."""
    return isinstance(dtype, str) and dtype == BF16


def from_wire(out: np.ndarray, dtype) -> np.ndarray:
    """A worker's output as the caller asked it: bfloat16 bits viewed as bfloat16."""
    return out.view(np.dtype(dtype)) if np.dtype(dtype).name == BF16 else out
