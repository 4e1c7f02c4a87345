// jaxtdist's own launcher for Triton kernels compiled to cubins by jaxtdist.
//
// jaxlib's Triton launcher (the one jax-triton uses) passes a null pointer
// as Triton's global scratch, which kernels that build TMA descriptors on
// the device write to. This launcher gives each program a slice of the
// symmetric heap instead; everything else follows Triton's kernel ABI:
// the kernel's arguments in order, then the global and the profile scratch
// pointers. The arguments are XLA's buffers (operands, then results) and
// scalars passed as attributes, so that one cubin serves every value of a
// scalar (a shape, a heap offset) rather than one per value:
//   arg_kinds: one ParamKind per kernel argument, in argument order;
//   scalars:   the scalar arguments' values in order, an int64 each (an
//              fp32's bit pattern, zero-extended, for kParamFp32).
#ifndef JAXTDIST_CSRC_TRITON_LAUNCH_H_
#define JAXTDIST_CSRC_TRITON_LAUNCH_H_

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace jaxtdist {

// The kinds in a launch's `arg_kinds` (jaxtdist/runtime/_cuda_launch.py
// writes the same numbers).
enum ParamKind : std::int64_t {
  kParamBuffer = 0,  // the next XLA buffer
  kParamI32 = 1,
  kParamI64 = 2,
  kParamFp32 = 3,
  kParamI1 = 4,
};

struct TritonKernelImage {
  std::string cubin;
  std::string name;             // the kernel's symbol in the cubin
  int threads = 0;              // 32 * num_warps
  int shared_bytes = 0;         // dynamic shared memory per program
  std::int64_t scratch_bytes = 0;  // global scratch per program (0: none)
  // The cubin calls NVSHMEM device functions: its module's NVSHMEM device
  // state is bound (nvshmemx_cumodule_init) when it is loaded.
  bool nvshmem = false;
};

// Registers a compiled kernel for every device; returns its id.
std::int64_t RegisterTritonKernel(TritonKernelImage image);

// Loads kernel `id` on a device (its primary context) ahead of any launch;
// returns "" or what failed. Loading while kernels of ours run on the device
// could wait for them, and they may wait for peers that need to launch.
std::string PreloadTritonKernel(std::int64_t id, int device_ordinal);

// Kernel `id` as loaded in CUDA context `ctx` (opaque CUcontext), or nullptr
// (opaque CUfunction) when it was never loaded there: never loads it.
void* LoadedTritonKernel(std::int64_t id, void* ctx);

extern "C" XLA_FFI_Error* JaxtdistTritonLaunchCuda(XLA_FFI_CallFrame* call_frame);

}  // namespace jaxtdist

#endif  // JAXTDIST_CSRC_TRITON_LAUNCH_H_
