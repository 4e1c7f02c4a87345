// CUDA prologue: everything is enqueued on XLA's stream, with no host
// synchronisation: the staging copy, the context copy from the device-side
// template, and the epoch (written by value with cuMemsetD32Async).
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <string>

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

ffi::Error PrologueCuda(cudaStream_t stream, std::int32_t device_ordinal,
                        ffi::Buffer<ffi::S32> position, ffi::RemainingArgs stage,
                        ffi::ResultBuffer<ffi::S32> ctx_out,
                        std::int64_t template_offset, std::int64_t counter_id,
                        std::int64_t stage_offset, std::int64_t parity_bytes,
                        std::int64_t generation, ffi::Span<const std::int64_t> groups,
                        std::int64_t world, std::int64_t align_launch) {
  const LaunchClock::time_point entered = LaunchClock::now();
  if (std::string stale = CheckGeneration(generation); !stale.empty()) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition, stale);
  }
  (void)position;  // device data: the ordinal says which heap is ours.
  auto pos = RuntimeState::Get().PositionOfDevice(device_ordinal);
  if (!pos) {
    return ffi::Error::InvalidArgument(NoHeapForDevice(device_ordinal));
  }
  auto heap = RuntimeState::Get().Heap(*pos);
  std::string group_err;
  const std::int64_t* group = RuntimeState::GroupOf(
      groups.begin(), static_cast<std::int64_t>(groups.size()), world, *pos, &group_err);
  if (group == nullptr) return ffi::Error::InvalidArgument("jaxtdist prologue: " + group_err);
  if (stage.size() > 1) {
    return ffi::Error::InvalidArgument("jaxtdist prologue stages at most one buffer");
  }
  std::int64_t stage_bytes = 0;
  const void* stage_data = nullptr;
  if (stage.size() == 1) {
    auto buf = stage.get<ffi::AnyBuffer>(0);
    if (buf.has_error()) return buf.error();
    stage_bytes = static_cast<std::int64_t>(buf->size_bytes());
    stage_data = buf->untyped_data();
  }
  if (std::string t = RecordedTimeout(*heap, *pos); !t.empty()) {
    return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, t);
  }
  std::string bad = CheckStage(*heap, template_offset, stage_offset,
                               parity_bytes, stage_bytes);
  if (!bad.empty()) return ffi::Error::InvalidArgument("jaxtdist: " + bad);
  auto memset32 = GetMemsetD32Async();
  if (memset32 == nullptr) {
    return ffi::Error::Internal("jaxtdist: cuMemsetD32Async is not available from the driver");
  }

  const std::int64_t epoch = RuntimeState::Get().NextEpoch(counter_id, *pos);
  auto* base = reinterpret_cast<char*>(heap->base);
  cudaError_t err;
  if (stage_bytes > 0) {
    err = cudaMemcpyAsync(base + stage_offset + (epoch & 1) * parity_bytes,
                          stage_data, stage_bytes, cudaMemcpyDeviceToDevice, stream);
    if (err != cudaSuccess) return CudaError("staging copy", err);
  }
  auto* ctx = reinterpret_cast<char*>(ctx_out->typed_data());
  err = cudaMemcpyAsync(ctx, base + template_offset, kCtxWords * 8,
                        cudaMemcpyDeviceToDevice, stream);
  if (err != cudaSuccess) return CudaError("context copy", err);
  // Epochs stay below 2^31; the template's high word is zero.
  CUresult res = memset32(reinterpret_cast<CUdeviceptr>(ctx + kCtxEpochWord * 8),
                          static_cast<unsigned int>(epoch), 1,
                          reinterpret_cast<CUstream>(stream));
  if (res != CUDA_SUCCESS) {
    return ffi::Error::Internal("jaxtdist: " + cuda::DriverError("cuMemsetD32Async", res));
  }
  // Last host work before the kernel: meet the group's other host threads.
  if (align_launch) {
    RuntimeState::Get().aligner().Arrive(counter_id, epoch, group[0], world, *pos, entered);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxtdistPrologueCuda, PrologueCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<std::int64_t>("template_offset")
                                  .Attr<std::int64_t>("counter_id")
                                  .Attr<std::int64_t>("stage_offset")
                                  .Attr<std::int64_t>("parity_bytes")
                                  .Attr<std::int64_t>("generation")
                                  .Attr<ffi::Span<const std::int64_t>>("groups")
                                  .Attr<std::int64_t>("world")
                                  .Attr<std::int64_t>("align_launch"));

}  // namespace jaxtdist
