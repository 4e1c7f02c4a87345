"""Layout of the kernel context buffer and the wait-error record.

Pure Python constants shared by the runtime (which writes them) and the
Triton primitives (which read them). The context is ``CTX_WORDS`` int64
words; XLA carries it as twice as many int32 words so that it needs no x64.
"""

CTX_WORDS = 72
MAX_WORLD = CTX_WORDS - 8

CTX_RANK = 0
CTX_WORLD = 1
CTX_EPOCH = 2
CTX_WAIT_TIMEOUT_NS = 3  # a wait gives up after this many nanoseconds
CTX_ERR_ADDR = 4
CTX_HEAP_BASE = 5
CTX_POSITION = 6
CTX_SCRATCH_ADDR = 7
CTX_PEER_BASES = 8

# Words of the error record a timed-out wait writes (int64 each).
ERR_FLAG = 0
ERR_RANK = 1
ERR_PEER = 2
ERR_SIGNAL_OFFSET = 3
ERR_EXPECTED = 4
ERR_SEEN = 5
ERR_CMP = 6
ERR_TIMEOUT_NS = 7  # the bound the wait gave up after
ERR_WORDS = 8

CMP_CODES = {"eq": 0, "ne": 1, "ge": 2, "gt": 3, "le": 4, "lt": 5}
CMP_NAMES = {v: k for k, v in CMP_CODES.items()}
