// Copy-engine gather for ag_matmul (see ce_gather.h).
//
// Per call, on device `me` of a group of `world`, with epoch e (advanced by
// this call's prologue, which ran just before on this host thread), side
// stream s (1 <= s < world) pushes x, chunk by chunk, into the heap inbox
// of rank me+s (parity e % 2, rows of rank me), writing that rank's chunk
// flag (a 32-bit stream write of e) after each chunk, then raises the local
// "sent" word s. With `serial`, one side stream does the same for s = 1,
// 2, ... in turn: each peer then receives one shard at a time, at a single
// pair's bandwidth, rank me-1's first, the order the GEMM consumes them in
// (in parallel, every shard lands at the end of the whole exchange).
// No stream ever waits on another device: streams that
// share a hardware queue cannot then block each other across devices.
// The side streams fork from XLA's stream (an event), so they start after
// everything before this call, the previous call's kernel included; they
// are never joined back: the GEMM kernel that follows waits for every
// inbox flag and every sent word, so x is no longer read once it ends.
// Inbox parity p is rewritten two calls later, by a peer whose previous
// kernel has finished; that kernel waited for this rank's pushes of the
// call in between, which this rank issued only after its own kernel (the
// last reader of parity p) had finished.
#include "ce_gather.h"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "cuda_driver.h"
#include "runtime_state.h"

namespace ffi = xla::ffi;

namespace jaxtdist {
namespace {

using StreamValue32Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

struct SideStreams {
  cudaEvent_t fork = nullptr;
  std::vector<cudaStream_t> streams;  // [0]: local copies; [s]: the peer s ranks ahead
};

// Side streams per device, created on first use and kept for the process.
class SideStreamPool {
 public:
  static SideStreamPool& Get() {
    static auto* pool = new SideStreamPool;
    return *pool;
  }

  // Returns "" and sets *out, or what failed. Only the device's own host
  // thread uses the returned streams, so the lock covers creation only.
  std::string Acquire(int device_ordinal, int count, SideStreams** out) {
    std::lock_guard<std::mutex> lock(mu_);
    SideStreams& side = by_device_[device_ordinal];
    if (side.fork == nullptr || static_cast<int>(side.streams.size()) < count) {
      int previous = 0;
      cudaGetDevice(&previous);
      std::string err = Create(device_ordinal, count, side);
      cudaSetDevice(previous);
      if (!err.empty()) return err;
    }
    *out = &side;
    return "";
  }

 private:
  static std::string Create(int device_ordinal, int count, SideStreams& side) {
    cudaError_t e = cudaSetDevice(device_ordinal);
    if (e != cudaSuccess) return std::string("cudaSetDevice: ") + cudaGetErrorString(e);
    if (side.fork == nullptr) {
      e = cudaEventCreateWithFlags(&side.fork, cudaEventDisableTiming);
      if (e != cudaSuccess) return std::string("cudaEventCreate: ") + cudaGetErrorString(e);
    }
    while (static_cast<int>(side.streams.size()) < count) {
      cudaStream_t s = nullptr;
      e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
      if (e != cudaSuccess) return std::string("cudaStreamCreate: ") + cudaGetErrorString(e);
      side.streams.push_back(s);
    }
    return "";
  }

  std::mutex mu_;
  std::map<int, SideStreams> by_device_;
};

ffi::Error Failed(const std::string& what) {
  return ffi::Error::Internal("jaxtdist copy-engine gather: " + what);
}

ffi::Error Check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return Failed(std::string(what) + ": " + cudaGetErrorString(err));
}

ffi::Error CheckDriver(CUresult res, const char* what) {
  if (res == CUDA_SUCCESS) return ffi::Error::Success();
  return Failed(cuda::DriverError(what, res));
}

#define JAXTDIST_RETURN_IF_ERROR(expr)     \
  do {                                     \
    ffi::Error _err = (expr);              \
    if (_err.failure()) return _err;       \
  } while (0)

ffi::Error CeGatherCuda(cudaStream_t stream, std::int32_t device_ordinal, ffi::AnyBuffer x,
                        ffi::Buffer<ffi::S32> ctx, ffi::Result<ffi::Buffer<ffi::S32>> ctx_out,
                        std::int64_t counter_id, std::int64_t world,
                        ffi::Span<const std::int64_t> groups, std::int64_t inbox_offset,
                        std::int64_t parity_bytes, std::int64_t flags_offset,
                        std::int64_t sent_offset, std::int64_t chunk_rows,
                        std::int64_t generation, std::int64_t align_launch,
                        std::int64_t serial) {
  const LaunchClock::time_point entered = LaunchClock::now();
  // ctx_out aliases ctx: the kernel that takes it is ordered after this call.
  (void)ctx;
  (void)ctx_out;
  if (std::string stale = CheckGeneration(generation); !stale.empty()) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition, stale);
  }
  static StreamValue32Fn write32 =
      cuda::DriverFunction<StreamValue32Fn>("cuStreamWriteValue32");
  if (write32 == nullptr) return Failed("the driver lacks cuStreamWriteValue32");
  auto pos = RuntimeState::Get().PositionOfDevice(device_ordinal);
  if (!pos) return ffi::Error::InvalidArgument(NoHeapForDevice(device_ordinal));
  std::string group_err;
  const std::int64_t* group = RuntimeState::GroupOf(
      groups.begin(), static_cast<std::int64_t>(groups.size()), world, *pos, &group_err);
  if (group == nullptr) return ffi::Error::InvalidArgument("jaxtdist copy-engine gather: " + group_err);
  std::int64_t me = -1;
  std::vector<std::uintptr_t> bases(world);
  for (std::int64_t r = 0; r < world; ++r) {
    if (group[r] == *pos) me = r;
    auto peer = RuntimeState::Get().Heap(static_cast<int>(group[r]));
    if (!peer) return Failed("no heap for mesh position " + std::to_string(group[r]));
    bases[r] = peer->base;
  }
  auto heap = RuntimeState::Get().Heap(*pos);
  if (me < 0) return Failed("mesh position " + std::to_string(*pos) + " is not in its group");

  const std::int64_t shard_bytes = static_cast<std::int64_t>(x.size_bytes());
  const std::int64_t rows = x.dimensions().size() == 0 ? 1 : x.dimensions()[0];
  if (rows < 1 || chunk_rows < 1 || shard_bytes % rows) return Failed("bad shard shape");
  const std::int64_t row_bytes = shard_bytes / rows;
  const std::int64_t n_chunks = (rows + chunk_rows - 1) / chunk_rows;
  if (parity_bytes < world * shard_bytes || inbox_offset < 0 ||
      inbox_offset + 2 * parity_bytes > heap->bytes || sent_offset < 0 ||
      sent_offset + 4 * world > heap->bytes || flags_offset < 0 ||
      flags_offset + 4 * world * n_chunks > heap->bytes) {
    return ffi::Error::InvalidArgument("jaxtdist copy-engine gather: workspace outside the heap");
  }
  const std::int64_t epoch = RuntimeState::Get().PeekEpoch(counter_id, *pos);
  const auto e = static_cast<cuuint32_t>(epoch);
  const std::int64_t inbox = inbox_offset + (epoch & 1) * parity_bytes;
  if (world == 1) return ffi::Error::Success();

  SideStreams* side = nullptr;
  if (std::string err = SideStreamPool::Get().Acquire(device_ordinal, world, &side);
      !err.empty()) {
    return Failed(err);
  }
  JAXTDIST_RETURN_IF_ERROR(Check(cudaEventRecord(side->fork, stream), "cudaEventRecord"));
  const auto* shard = static_cast<const char*>(x.untyped_data());
  for (std::int64_t s = 1; s < world; ++s) {
    const std::int64_t dst = (me + s) % world;
    cudaStream_t st = side->streams[serial ? 1 : s];
    auto cu_st = reinterpret_cast<CUstream>(st);
    if (!serial || s == 1) {
      JAXTDIST_RETURN_IF_ERROR(
          Check(cudaStreamWaitEvent(st, side->fork, 0), "cudaStreamWaitEvent"));
    }
    for (std::int64_t c = 0; c < n_chunks; ++c) {
      const std::int64_t first = c * chunk_rows * row_bytes;
      const std::int64_t bytes =
          (std::min(rows, (c + 1) * chunk_rows) - c * chunk_rows) * row_bytes;
      JAXTDIST_RETURN_IF_ERROR(Check(
          cudaMemcpyAsync(reinterpret_cast<void*>(bases[dst] + inbox + me * shard_bytes + first),
                          shard + first, bytes, cudaMemcpyDefault, st), "peer push"));
      // Default flags: the write is ordered after the copy's data.
      JAXTDIST_RETURN_IF_ERROR(CheckDriver(
          write32(cu_st, static_cast<CUdeviceptr>(bases[dst] + flags_offset +
                                                  4 * (me * n_chunks + c)), e, 0),
          "cuStreamWriteValue32 (peer chunk flag)"));
    }
    JAXTDIST_RETURN_IF_ERROR(CheckDriver(
        write32(cu_st, static_cast<CUdeviceptr>(bases[me] + sent_offset + 4 * s), e, 0),
        "cuStreamWriteValue32 (sent word)"));
  }
  // Every push is enqueued; the GEMM kernel is next: meet the group's other
  // host threads so that no device's kernel starts long before its peers push.
  if (align_launch) {
    RuntimeState::Get().aligner().Arrive(counter_id, epoch, group[0], world, *pos, entered);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxtdistCeGatherCuda, CeGatherCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<std::int64_t>("counter_id")
                                  .Attr<std::int64_t>("world")
                                  .Attr<ffi::Span<const std::int64_t>>("groups")
                                  .Attr<std::int64_t>("inbox_offset")
                                  .Attr<std::int64_t>("parity_bytes")
                                  .Attr<std::int64_t>("flags_offset")
                                  .Attr<std::int64_t>("sent_offset")
                                  .Attr<std::int64_t>("chunk_rows")
                                  .Attr<std::int64_t>("generation")
                                  .Attr<std::int64_t>("align_launch")
                                  .Attr<std::int64_t>("serial"));

}  // namespace jaxtdist
