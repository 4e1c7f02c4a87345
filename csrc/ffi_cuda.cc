// CUDA prologue: everything is enqueued on XLA's stream, with no host
// synchronisation: the staging copy, then the kernel's context. The context
// is written by value from the host copy of its template, epoch included, in
// one batch of stream memory writes (no copy engine, no kernel); without a
// host copy, it is copied from the device-side template and the epoch is set
// with cuMemsetD32Async.
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <string>
#include <vector>

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

using BatchMemOpFn = CUresult (*)(CUstream, unsigned int, CUstreamBatchMemOpParams*,
                                  unsigned int);

// Writes `words` (the context, epoch included) to `ctx` with one batch of
// 64-bit stream writes; false when the driver cannot (the caller copies).
bool WriteContextByValue(CUstream stream, char* ctx, const std::vector<std::int64_t>& words,
                         int count, std::string* err) {
  static BatchMemOpFn batch = cuda::DriverFunction<BatchMemOpFn>("cuStreamBatchMemOp");
  if (batch == nullptr || count > 255) return false;
  std::vector<CUstreamBatchMemOpParams> ops(count);
  for (int i = 0; i < count; ++i) {
    CUstreamBatchMemOpParams op{};
    op.writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
    op.writeValue.address = reinterpret_cast<CUdeviceptr>(ctx + 8 * i);
    op.writeValue.value64 = static_cast<cuuint64_t>(words[i]);
    op.writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
    ops[i] = op;
  }
  CUresult res = batch(stream, static_cast<unsigned int>(count), ops.data(), 0);
  if (res == CUDA_ERROR_NOT_SUPPORTED) return false;
  *err = cuda::DriverError("cuStreamBatchMemOp", res);
  return true;
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
  bool written = false;
  auto words = RuntimeState::Get().Template(*pos, template_offset);
  if (words && static_cast<std::int64_t>(words->size()) >= kCtxFixedWords + world) {
    // Kernels read the fixed words and the group's heap bases, nothing after.
    (*words)[kCtxEpochWord] = epoch;
    std::string batch_err;
    written = WriteContextByValue(reinterpret_cast<CUstream>(stream), ctx, *words,
                                  kCtxFixedWords + static_cast<int>(world), &batch_err);
    if (!batch_err.empty()) return ffi::Error::Internal("jaxtdist: " + batch_err);
  }
  (written ? RuntimeState::Get().contexts_by_value : RuntimeState::Get().contexts_copied)++;
  if (!written) {
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
  }
  // Last host work before the kernel: meet the group's other host threads.
  if (align_launch) RuntimeState::Get().aligner().Arrive(counter_id, epoch, group[0], world);
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
