"""Where NVSHMEM's host library is (the ``nvidia-nvshmem-cu*`` package, or a path).

Both the NVSHMEM heap (``_nvshmem``, which loads the library) and kernel
linking (``_shmem_link``, which links against NVSHMEM's device library next
to it) need this; it lives here, below both, so that the CUDA launcher that
links kernels does not import the NVSHMEM backend (which builds on the CUDA
heap, which uses the launcher).

Example:
  >>> from jaxtdist.runtime._nvshmem_lib import host_library_path
  >>> host_library_path()  # doctest: +SKIP
  '.../site-packages/nvidia/nvshmem/lib/libnvshmem_host.so.3'
"""

from __future__ import annotations

import os

from jaxtdist._errors import JaxtdistError

__all__ = ["ENV_LIBRARY", "host_library_path"]

ENV_LIBRARY = "JAXTDIST_NVSHMEM_LIB"
_HOST_LIBRARY = "nvidia/nvshmem/lib/libnvshmem_host.so.3"


def _cuda_major_of_jaxlib() -> int | None:
    """12 or 13: the CUDA major of the installed jaxlib's CUDA plugin (None: unknown)."""
    from importlib import metadata

    for major in (13, 12):
        for dist in (f"jax-cuda{major}-plugin", f"jax_cuda{major}_plugin",
                     f"jax-cuda{major}-pjrt"):
            try:
                metadata.version(dist)
                return major
            except metadata.PackageNotFoundError:
                continue
    return None


def host_library_path() -> str:
    """Where NVSHMEM's host library is; a ``JaxtdistError`` naming the package if absent."""
    given = os.environ.get(ENV_LIBRARY)
    if given:
        if not os.path.exists(given):
            raise JaxtdistError(f"jaxtdist: ${ENV_LIBRARY}={given!r} does not exist")
        return given
    from importlib import metadata

    major = _cuda_major_of_jaxlib()
    majors = [major] if major else [13, 12]
    for m in majors:
        try:
            path = str(metadata.distribution(f"nvidia-nvshmem-cu{m}").locate_file(_HOST_LIBRARY))
        except metadata.PackageNotFoundError:
            continue
        if os.path.exists(path):
            return path
    want = f"nvidia-nvshmem-cu{major}" if major else "nvidia-nvshmem-cu13 (or -cu12)"
    raise JaxtdistError(
        f"jaxtdist: a GPU mesh spanning processes needs NVSHMEM's host library "
        f"({_HOST_LIBRARY}), which was not found: pip install {want} (the CUDA major of "
        f"your jaxlib), or point ${ENV_LIBRARY} at libnvshmem_host.so.3.")
