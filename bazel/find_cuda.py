"""Prints 'include_dir;cudart_library' from NVIDIA's pip packages, if present.

Used by CMake (and the Bazel repository rule) when no CUDA toolkit is
installed: NVIDIA ships the CUDA runtime headers and library as wheels.
"""
import glob
import os
import sys
import sysconfig


def find() -> tuple[str, str] | None:
    roots = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    for root in roots:
        for header in glob.glob(os.path.join(root, "nvidia", "*", "include", "cuda_runtime_api.h")):
            include = os.path.dirname(header)
            libs = sorted(glob.glob(os.path.join(os.path.dirname(include), "lib", "libcudart.so*")))
            if libs and os.path.exists(os.path.join(include, "cuda.h")):
                return include, libs[0]
    return None


if __name__ == "__main__":
    found = find()
    if found is None:
        sys.exit(1)
    print(";".join(found))
