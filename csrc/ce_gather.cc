// Copy-engine gather for ag_matmul (see ce_gather.h).
//
// Per call, on device `me` of a group of `world`, with epoch e (advanced by
// this call's prologue, which ran just before on this host thread):
//   side stream 0: stage x into this rank's heap slot of parity e % 2, tell
//     every peer (a 32-bit stream write of e into the peer's ready word),
//     then copy x into this rank's rows of `gathered` and raise their flags;
//   side stream s (1 <= s < world): wait until peer me+s has staged
//     (stream wait on the local ready word), then copy its slot chunk by
//     chunk into `gathered`, raising each chunk's flag after its copy.
// The side streams fork from XLA's stream (an event), so they start after
// everything before this call, the previous call's kernel included. They
// are never joined back: the GEMM kernel that follows on XLA's stream
// waits for every flag, so when it finishes every copy has finished.
// Reuse of a slot parity two calls later is safe for the same reason as
// in the SM producer (jaxtdist/kernels/_gather.py): a peer stages call k+1
// only after its kernel of call k, the last reader of the other parity,
// has finished.
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
                        ffi::Buffer<ffi::S32> ctx, ffi::Result<ffi::AnyBuffer> gathered,
                        std::int64_t counter_id, std::int64_t world,
                        ffi::Span<const std::int64_t> groups, std::int64_t stage_offset,
                        std::int64_t parity_bytes, std::int64_t ready_offset,
                        std::int64_t flags_offset, std::int64_t chunk_rows,
                        std::int64_t generation) {
  (void)ctx;  // device data; taken so that XLA orders this call after the prologue.
  if (std::string stale = CheckGeneration(generation); !stale.empty()) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition, stale);
  }
  static StreamValue32Fn write32 =
      cuda::DriverFunction<StreamValue32Fn>("cuStreamWriteValue32");
  static StreamValue32Fn wait32 = cuda::DriverFunction<StreamValue32Fn>("cuStreamWaitValue32");
  if (write32 == nullptr || wait32 == nullptr) {
    return Failed("the driver lacks cuStreamWriteValue32/cuStreamWaitValue32");
  }
  auto pos = RuntimeState::Get().PositionOfDevice(device_ordinal);
  if (!pos) {
    return ffi::Error::InvalidArgument("jaxtdist: no symmetric heap is registered for CUDA "
                                       "device " + std::to_string(device_ordinal));
  }
  const std::int64_t positions = static_cast<std::int64_t>(groups.size()) / std::max<std::int64_t>(world, 1);
  if (world < 1 || positions * world != static_cast<std::int64_t>(groups.size()) ||
      *pos >= positions) {
    return ffi::Error::InvalidArgument(
        "jaxtdist copy-engine gather: group table of " + std::to_string(groups.size()) +
        " entries does not cover mesh position " + std::to_string(*pos) + " with world " +
        std::to_string(world));
  }
  const std::int64_t* group = groups.begin() + *pos * world;
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
  if (static_cast<std::int64_t>(gathered->size_bytes()) != world * shard_bytes) {
    return ffi::Error::InvalidArgument("jaxtdist copy-engine gather: output of " +
                                       std::to_string(gathered->size_bytes()) +
                                       " bytes, expected world * shard = " +
                                       std::to_string(world * shard_bytes));
  }
  if (parity_bytes < shard_bytes || stage_offset < 0 ||
      stage_offset + 2 * parity_bytes > heap->bytes || ready_offset < 0 ||
      ready_offset + 4 * world > heap->bytes || flags_offset < 0 ||
      flags_offset + 4 * world * n_chunks > heap->bytes) {
    return ffi::Error::InvalidArgument("jaxtdist copy-engine gather: workspace outside the heap");
  }
  const std::int64_t epoch = RuntimeState::Get().PeekEpoch(counter_id, *pos);
  const auto e = static_cast<cuuint32_t>(epoch);
  const std::int64_t slot = stage_offset + (epoch & 1) * parity_bytes;

  SideStreams* side = nullptr;
  if (std::string err = SideStreamPool::Get().Acquire(device_ordinal, world, &side);
      !err.empty()) {
    return Failed(err);
  }
  JAXTDIST_RETURN_IF_ERROR(Check(cudaEventRecord(side->fork, stream), "cudaEventRecord"));
  for (std::int64_t s = 0; s < world; ++s) {
    JAXTDIST_RETURN_IF_ERROR(
        Check(cudaStreamWaitEvent(side->streams[s], side->fork, 0), "cudaStreamWaitEvent"));
  }
  auto* out = static_cast<char*>(gathered->untyped_data());
  const auto local_flag = [&](std::int64_t src, std::int64_t chunk) {
    return static_cast<CUdeviceptr>(bases[me] + flags_offset + 4 * (src * n_chunks + chunk));
  };

  // Local: stage, tell peers, then fill this rank's rows of the output.
  auto local = reinterpret_cast<CUstream>(side->streams[0]);
  JAXTDIST_RETURN_IF_ERROR(Check(
      cudaMemcpyAsync(reinterpret_cast<void*>(bases[me] + slot), x.untyped_data(), shard_bytes,
                      cudaMemcpyDeviceToDevice, side->streams[0]), "staging copy"));
  for (std::int64_t r = 0; r < world; ++r) {
    if (r == me) continue;
    // The default flags order the write after the staging copy's data.
    JAXTDIST_RETURN_IF_ERROR(CheckDriver(
        write32(local, static_cast<CUdeviceptr>(bases[r] + ready_offset + 4 * me), e, 0),
        "cuStreamWriteValue32 (peer ready word)"));
  }
  JAXTDIST_RETURN_IF_ERROR(Check(
      cudaMemcpyAsync(out + me * shard_bytes, x.untyped_data(), shard_bytes,
                      cudaMemcpyDeviceToDevice, side->streams[0]), "local rows copy"));
  for (std::int64_t c = 0; c < n_chunks; ++c) {
    JAXTDIST_RETURN_IF_ERROR(
        CheckDriver(write32(local, local_flag(me, c), e, 0), "cuStreamWriteValue32"));
  }
  // Peers: nearest first, one stream (and copy engine queue) per peer.
  for (std::int64_t s = 1; s < world; ++s) {
    const std::int64_t src = (me + s) % world;
    auto st = reinterpret_cast<CUstream>(side->streams[s]);
    JAXTDIST_RETURN_IF_ERROR(CheckDriver(
        wait32(st, static_cast<CUdeviceptr>(bases[me] + ready_offset + 4 * src), e,
               CU_STREAM_WAIT_VALUE_GEQ),
        "cuStreamWaitValue32"));
    for (std::int64_t c = 0; c < n_chunks; ++c) {
      const std::int64_t first = c * chunk_rows * row_bytes;
      const std::int64_t bytes = (std::min(rows, (c + 1) * chunk_rows) - c * chunk_rows) *
                                 row_bytes;
      JAXTDIST_RETURN_IF_ERROR(Check(
          cudaMemcpyAsync(out + src * shard_bytes + first,
                          reinterpret_cast<const void*>(bases[src] + slot + first), bytes,
                          cudaMemcpyDeviceToDevice, side->streams[s]), "peer copy"));
      JAXTDIST_RETURN_IF_ERROR(
          CheckDriver(write32(st, local_flag(src, c), e, 0), "cuStreamWriteValue32"));
    }
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
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<std::int64_t>("counter_id")
                                  .Attr<std::int64_t>("world")
                                  .Attr<ffi::Span<const std::int64_t>>("groups")
                                  .Attr<std::int64_t>("stage_offset")
                                  .Attr<std::int64_t>("parity_bytes")
                                  .Attr<std::int64_t>("ready_offset")
                                  .Attr<std::int64_t>("flags_offset")
                                  .Attr<std::int64_t>("chunk_rows")
                                  .Attr<std::int64_t>("generation"));

}  // namespace jaxtdist
