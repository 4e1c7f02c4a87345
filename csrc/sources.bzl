# The one list of csrc's sources, read by both builds: csrc/BUILD loads it
# (Bazel) and csrc/CMakeLists.txt parses it (pip), so a new file is added
# here only. Keep the plain form: one quoted file name per line inside each
# list, which is all CMake's parser understands.

# Every build: the runtime registry, the handlers' shared prelude, the CPU
# prologue and host-kernel handlers and the Python binding.
COMMON_SRCS = [
    "call_context.cc",
    "ffi_cpu.cc",
    "ffi_host_kernel.cc",
    "launch_align.cc",
    "module.cc",
    "runtime_state.cc",
]

COMMON_HDRS = [
    "call_context.h",
    "cuda_heap.h",
    "ffi_host_kernel.h",
    "launch_align.h",
    "prologue.h",
    "runtime_state.h",
]

# Builds with CUDA headers (JAXTDIST_WITH_CUDA=1): the CUDA handlers and the
# heap helpers.
CUDA_SRCS = [
    "ce_gather.cc",
    "ctx_writer.cc",
    "cuda_heap.cc",
    "ffi_cuda.cc",
    "nvshmem_host.cc",
    "triton_launch.cc",
]

CUDA_HDRS = [
    "ce_gather.h",
    "ctx_writer.h",
    "cuda_driver.h",
    "nvshmem_host.h",
    "triton_launch.h",
]
