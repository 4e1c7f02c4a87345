"""Maps a POSIX shared-memory segment by name, without Python's resource tracker.

``multiprocessing.shared_memory.SharedMemory(name=...)`` registers the
segment with a resource tracker that unlinks it when this process exits,
taking it away from every other process that still uses it: only its
creator may own its lifetime. Interpreter workers and the non-creating
processes of a multi-process CPU heap map it with this instead.

Example:
  >>> segment = map_segment("psm_1a2b3c")       # an mmap.mmap of the whole segment
  >>> base = ctypes.addressof(ctypes.c_char.from_buffer(segment))
"""

from __future__ import annotations

import mmap
import os

SHM_DIR = "/dev/shm"


def map_segment(name: str) -> mmap.mmap:
    """The whole segment ``name``, mapped shared read-write.

    Raises ``FileNotFoundError`` naming the segment when it does not exist on
    this host (another host's segment, or one already unlinked).
    """
    path = os.path.join(SHM_DIR, name.lstrip("/"))
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"jaxtdist: shared-memory segment {path} does not exist on this host; the CPU "
            "heap of a multi-process mesh needs every process on one host") from None
    try:
        return mmap.mmap(fd, 0)
    finally:
        os.close(fd)
