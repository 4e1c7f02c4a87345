// CUDA prologue: everything is enqueued on XLA's stream, with no host
// synchronisation: the staging copy, then the context: written by one small
// kernel from the host's copy of the template with the epoch in it
// (ctx_writer.h), or, where that writer is not loaded, copied from the
// heap's template with the epoch written by value (cuMemsetD32Async).
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <string>

#include "call_context.h"
#include "ctx_writer.h"
#include "cuda_driver.h"
#include "prologue.h"
#include "runtime_state.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxtdist {
namespace {

using MemsetD32AsyncFn = CUresult (*)(CUdeviceptr, unsigned int, size_t, CUstream);

MemsetD32AsyncFn GetMemsetD32Async() {
  static MemsetD32AsyncFn fn = cuda::DriverFunction<MemsetD32AsyncFn>("cuMemsetD32Async");
  return fn;
}

ffi::Error CudaError(const char* what, cudaError_t err) {
  return ffi::Error::Internal(std::string("jaxtdist: ") + what + ": " +
                              cudaGetErrorString(err));
}

// Writes the call's context into `ctx`: with the context writer from the
// host's copy of the template, or, where the writer is not loaded, as a copy
// of the heap's template and a memset of the epoch.
ffi::Error WriteCallContext(cudaStream_t stream, char* ctx, int pos, char* base,
                            std::int64_t template_offset, std::int64_t epoch) {
  std::int64_t words[kCtxWords];
  if (RuntimeState::Get().Template(pos, template_offset, words)) {
    words[kCtxEpochWord] = epoch;
    bool written = false;
    if (std::string e = WriteContext(stream, ctx, words, &written); !e.empty()) {
      return ffi::Error::Internal("jaxtdist: " + e);
    }
    if (written) return ffi::Error::Success();
  }
  CountContextCopy();
  auto memset32 = GetMemsetD32Async();
  if (memset32 == nullptr) {
    return ffi::Error::Internal("jaxtdist: cuMemsetD32Async is not available from the driver");
  }
  cudaError_t err = cudaMemcpyAsync(ctx, base + template_offset, kCtxWords * 8,
                                    cudaMemcpyDeviceToDevice, stream);
  if (err != cudaSuccess) return CudaError("context copy", err);
  // Epochs stay below 2^31; the template's high word is zero.
  CUresult res = memset32(reinterpret_cast<CUdeviceptr>(ctx + kCtxEpochWord * 8),
                          static_cast<unsigned int>(epoch), 1,
                          reinterpret_cast<CUstream>(stream));
  if (res != CUDA_SUCCESS) {
    return ffi::Error::Internal("jaxtdist: " + cuda::DriverError("cuMemsetD32Async", res));
  }
  return ffi::Error::Success();
}

ffi::Error PrologueCuda(cudaStream_t stream, std::int32_t device_ordinal,
                        ffi::Buffer<ffi::S32> position, ffi::RemainingArgs stage,
                        ffi::ResultBuffer<ffi::S32> ctx_out,
                        std::int64_t template_offset, std::int64_t counter_id,
                        std::int64_t stage_offset, std::int64_t parity_bytes,
                        std::int64_t align_launch, std::int64_t stages,
                        std::int64_t generation,
                        ffi::Span<const std::int64_t> groups, std::int64_t world) {
  (void)position;  // device data: the ordinal says which heap is ours.
  auto call = Resolve(CallSite::OnDevice("jaxtdist prologue", device_ordinal),
                      CallAttrs{generation, groups, world}, kNeedGroup | kNeedNoTimeout);
  if (call.has_error()) return call.error();
  const int pos = call->position;
  const HeapSlot& heap = *call->heap;
  auto staged =
      CheckedStage(stage, stages, heap, template_offset, stage_offset, parity_bytes);
  if (staged.has_error()) return staged.error();
  const std::int64_t stage_bytes = staged->bytes;
  const void* stage_data = staged->data;
  const std::int64_t epoch = RuntimeState::Get().NextEpoch(counter_id, pos);
  auto* base = reinterpret_cast<char*>(heap.base);
  if (stage_bytes > 0) {
    cudaError_t err = cudaMemcpyAsync(base + stage_offset + (epoch & 1) * parity_bytes,
                                      stage_data, stage_bytes, cudaMemcpyDeviceToDevice,
                                      stream);
    if (err != cudaSuccess) return CudaError("staging copy", err);
  }
  auto* ctx = reinterpret_cast<char*>(ctx_out->typed_data());
  if (ffi::Error e = WriteCallContext(stream, ctx, pos, base, template_offset, epoch);
      e.failure()) {
    return e;
  }
  // Last host work before the kernel: meet the group's other host threads.
  if (align_launch) call->AlignLaunch(counter_id, epoch);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxtdistPrologueCuda, PrologueCuda,
                              BindPrologueAttrs(ffi::Ffi::Bind()
                                                    .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                                    .Ctx<ffi::DeviceOrdinal>()
                                                    .Arg<ffi::Buffer<ffi::S32>>()
                                                    .RemainingArgs()
                                                    .Ret<ffi::Buffer<ffi::S32>>()));

}  // namespace jaxtdist
