"""Links Triton kernels that call NVSHMEM device functions (``jaxtdist.language.shmem``).

Triton compiles such a kernel to PTX with the calls left external. Its last
stage (ptxas to a cubin) is replaced, while jaxtdist compiles, by: ptxas to a
relocatable object, then nvlink with jaxtdist's device wrappers
(``_nvshmem_device.cu``, built once with nvcc against NVSHMEM's headers) and
NVSHMEM's device library (``libnvshmem_device.a``). NVSHMEM's bitcode library
cannot be used instead: it is written by a newer LLVM than Triton's.

The launcher then binds NVSHMEM's device state in the loaded module
(``nvshmemx_cumodule_init``, ``csrc/triton_launch.cc``); jaxlib's Triton
launcher never does, so these kernels always run through jaxtdist's.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile

from jaxtdist._errors import JaxtdistError

# The wrappers' symbols start with this; a kernel whose PTX declares one needs linking.
SYMBOL_PREFIX = "jaxtdist_shmem_"
_WRAPPERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_nvshmem_device.cu")


def uses_shmem(ptx: str) -> bool:
    """Whether a kernel's PTX calls jaxtdist's NVSHMEM device wrappers."""
    return f") {SYMBOL_PREFIX}" in ptx or f".func {SYMBOL_PREFIX}" in ptx


def _nvshmem_root() -> str:
    from jaxtdist.runtime._nvshmem_lib import host_library_path

    return os.path.dirname(os.path.dirname(host_library_path()))  # .../nvidia/nvshmem


def _tool(name: str) -> str:
    for candidate in ([os.path.join(os.environ[v], "bin", name) for v in ("CUDA_HOME", "CUDA_PATH")
                       if os.environ.get(v)] + [shutil.which(name) or "",
                                                os.path.join("/usr/local/cuda/bin", name)]):
        if candidate and os.path.exists(candidate):
            return candidate
    raise JaxtdistError(
        f"jaxtdist: kernels that call NVSHMEM device functions are linked with the CUDA "
        f"toolkit's {name}, which was not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin). "
        "Install the CUDA toolkit or set CUDA_HOME.")


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise JaxtdistError(f"jaxtdist: {what} failed ({' '.join(cmd)}):\n{proc.stdout[-4000:]}")


def _cache_dir() -> str:
    from triton import knobs

    base = knobs.cache.dir or os.path.join(tempfile.gettempdir(),
                                           f"jaxtdist-triton-cache-{os.getuid()}")
    path = os.path.join(base, "jaxtdist-shmem")
    os.makedirs(path, exist_ok=True)
    return path


@functools.lru_cache(maxsize=None)
def wrapper_object(arch: str) -> str:
    """The wrappers compiled for ``arch`` (e.g. "sm_90a"), built once and cached on disk."""
    root = _nvshmem_root()
    with open(_WRAPPERS, "rb") as f:
        key = hashlib.sha256(f.read() + root.encode() + arch.encode()).hexdigest()[:16]
    out = os.path.join(_cache_dir(), f"nvshmem_device_{arch}_{key}.o")
    if not os.path.exists(out):
        tmp = f"{out}.{os.getpid()}.tmp"
        _run([_tool("nvcc"), "-rdc=true", "-c", f"-arch={arch}", "-O3",
              f"-I{os.path.join(root, 'include')}", _WRAPPERS, "-o", tmp],
             "building jaxtdist's NVSHMEM device wrappers")
        os.replace(tmp, out)
    return out


def link(ptx: str, arch: str, ptxas: str) -> bytes:
    """A cubin of ``ptx`` linked with the wrappers and NVSHMEM's device library."""
    device_lib = os.path.join(_nvshmem_root(), "lib", "libnvshmem_device.a")
    if not os.path.exists(device_lib):
        raise JaxtdistError(f"jaxtdist: NVSHMEM's device library {device_lib} is missing")
    with tempfile.TemporaryDirectory(prefix="jaxtdist-link-") as tmp:
        src, obj, cubin = (os.path.join(tmp, n) for n in ("k.ptx", "k.o", "k.cubin"))
        with open(src, "w") as f:
            f.write(ptx)
        _run([ptxas, "-c", "-lineinfo", f"--gpu-name={arch}", src, "-o", obj],
             "ptxas (relocatable) of an NVSHMEM kernel")
        _run([_tool("nvlink"), f"-arch={arch}", obj, wrapper_object(arch), device_lib,
              "-o", cubin], "nvlink of an NVSHMEM kernel")
        with open(cubin, "rb") as f:
            return f.read()


def needs_nvshmem_error() -> JaxtdistError:
    return JaxtdistError(
        "jaxtdist: this kernel calls NVSHMEM device functions (jaxtdist.language.shmem), "
        "which need the NVSHMEM heap: a mesh of one process per GPU (jax.distributed; see "
        "docs/multiprocess.md). On a mesh driven by one process use jaxtdist.language's "
        "put/notify/wait.")


@contextlib.contextmanager
def linking(enabled: bool):
    """While compiling: kernels calling NVSHMEM are linked (``enabled``), or refused
    with an error saying they need the NVSHMEM backend."""
    from triton import knobs

    def hook(backend, stages, options, language, capability):
        plain = stages["cubin"]

        def cubin(src, metadata):
            if not uses_shmem(src):
                return plain(src, metadata)
            if not enabled:
                raise needs_nvshmem_error()
            from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

            return link(src, sm_arch_from_capability(capability),
                        get_ptxas(backend.target.arch).path)

        stages["cubin"] = cubin

    before = knobs.runtime.add_stages_inspection_hook
    knobs.runtime.add_stages_inspection_hook = hook
    try:
        yield
    finally:
        knobs.runtime.add_stages_inspection_hook = before
