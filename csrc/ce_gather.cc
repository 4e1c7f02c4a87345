// Copy-engine gather for ag_matmul (see ce_gather.h).
//
// Per call, on device `me` of a group of `world`, with epoch e (advanced by
// this call's prologue, which ran just before on this host thread), this
// rank's shard x is pushed, chunk by chunk, into the heap inbox of every
// other rank (parity e % 2, rows of rank me), that rank's chunk flag being
// raised to e (a 32-bit stream write) after each chunk lands; then the
// local "sent" words are raised. In parallel (default) every peer gets a
// side stream of its own; with `serial`, one side stream pushes to rank
// me+1, me+2, ... in turn: each peer then receives one shard at a time, at
// a single pair's bandwidth, rank me-1's first, the order the GEMM
// consumes them in.
//
// Enqueuing costs the host a driver call per copy and per flag, about 2 us
// each (96 calls a call at 16 chunks and 4 ranks): coarser chunks are the
// lever. Neither a CUDA graph of the pushes (its launch cost as much) nor a
// push thread per device (its driver calls contend with XLA's thread and
// ran twice as slow, late enough to double the kernel time) did better
// (docs/perf, runs BC and BD).
//
// No stream ever waits on another device: streams that share a hardware
// queue cannot then block each other across devices. The side streams fork
// from XLA's stream (an event), so they start after everything before this
// call, the previous call's kernel included; they are never joined back:
// the GEMM kernel that follows waits for every inbox flag and every sent
// word, so x is no longer read once it ends.
// Inbox parity p is rewritten two calls later, by a peer whose previous
// kernel has finished; that kernel waited for this rank's pushes of the
// call in between, which this rank issued only after its own kernel (the
// last reader of parity p) had finished.
#include "ce_gather.h"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "call_context.h"
#include "cuda_driver.h"
#include "runtime_state.h"

namespace ffi = xla::ffi;

namespace jaxtdist {
namespace {

using StreamValue32Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

// One call's pushes: chunk c of this rank's shard (`me`, at `source`) goes to
// rank dst's inbox at rows of `me`, then its flag there is raised to `epoch`;
// last, this rank's sent words are.
struct PushPlan {
  std::int64_t world = 0, me = 0, n_chunks = 0, chunk_bytes = 0, shard_bytes = 0;
  std::int64_t inbox = 0, flags_offset = 0;
  bool serial = false;
  std::vector<std::uintptr_t> bases;  // heap base of each group rank
  const char* source = nullptr;       // this rank's shard
  cuuint32_t epoch = 0;
  std::uintptr_t sent = 0;  // this rank's sent words

  std::int64_t ChunkBytes(std::int64_t c) const {
    return std::min(shard_bytes, (c + 1) * chunk_bytes) - c * chunk_bytes;
  }
  void* Inbox(std::int64_t dst, std::int64_t c) const {
    return reinterpret_cast<void*>(bases[dst] + inbox + me * shard_bytes + c * chunk_bytes);
  }
  std::uintptr_t Flag(std::int64_t dst, std::int64_t c) const {
    return bases[dst] + flags_offset + 4 * (me * n_chunks + c);
  }
};

// CePushStats, as atomics.
struct PushCounters {
  std::atomic<std::int64_t> calls{0}, handler_ns{0}, enqueue_ns{0};
};

PushCounters& Counters() {
  static auto* counters = new PushCounters;
  return *counters;
}

void AddTime(std::atomic<std::int64_t>& total_ns, LaunchClock::time_point since) {
  total_ns.fetch_add(
      std::chrono::duration_cast<std::chrono::nanoseconds>(LaunchClock::now() - since).count(),
      std::memory_order_relaxed);
}

// Enqueues `plan`'s pushes on `streams` ([s]: the peer s ranks ahead; [1]
// alone when serial) after `fork`. Returns "" or what failed.
std::string EnqueuePushes(const std::vector<cudaStream_t>& streams, cudaEvent_t fork,
                          const PushPlan& plan, StreamValue32Fn write32) {
  const std::int64_t lanes = plan.serial ? 1 : plan.world - 1;
  for (std::int64_t lane = 1; lane <= lanes; ++lane) {
    if (auto e = cuda::RuntimeError(cudaStreamWaitEvent(streams[lane], fork, 0),
                                    "cudaStreamWaitEvent");
        !e.empty()) {
      return e;
    }
  }
  auto push = [&](std::int64_t s, std::int64_t c) -> std::string {
    const std::int64_t dst = (plan.me + s) % plan.world;
    cudaStream_t st = streams[plan.serial ? 1 : s];
    if (auto e = cuda::RuntimeError(
            cudaMemcpyAsync(plan.Inbox(dst, c), plan.source + c * plan.chunk_bytes,
                            plan.ChunkBytes(c), cudaMemcpyDefault, st),
            "peer push");
        !e.empty()) {
      return e;
    }
    // Default flags: the write is ordered after the copy's data.
    return cuda::DriverError("cuStreamWriteValue32 (peer chunk flag)",
                             write32(reinterpret_cast<CUstream>(st),
                                     static_cast<CUdeviceptr>(plan.Flag(dst, c)), plan.epoch, 0));
  };
  // Parallel: chunk by chunk over the peers, so that every peer's first
  // chunk is under way while the rest are being enqueued.
  for (std::int64_t outer = 0; outer < (plan.serial ? plan.world - 1 : plan.n_chunks); ++outer) {
    for (std::int64_t inner = 0; inner < (plan.serial ? plan.n_chunks : plan.world - 1);
         ++inner) {
      std::string e = plan.serial ? push(outer + 1, inner) : push(inner + 1, outer);
      if (!e.empty()) return e;
    }
  }
  for (std::int64_t s = 1; s < plan.world; ++s) {
    cudaStream_t st = streams[plan.serial ? 1 : s];
    if (auto e = cuda::DriverError(
            "cuStreamWriteValue32 (sent word)",
            write32(reinterpret_cast<CUstream>(st),
                    static_cast<CUdeviceptr>(plan.sent + 4 * s), plan.epoch, 0));
        !e.empty()) {
      return e;
    }
  }
  return "";
}

// One device's side streams ([s]: the peer s ranks ahead; [1] alone when
// serial) and fork event, created on first use and kept for the process.
class DevicePusher {
 public:
  explicit DevicePusher(int device_ordinal) : device_(device_ordinal) {}

  // Enqueues the pushes after everything on `stream`. Returns "" or what failed.
  std::string Push(cudaStream_t stream, const PushPlan& plan, StreamValue32Fn write32) {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto e = Setup(plan.world); !e.empty()) return e;
    if (auto e = cuda::RuntimeError(cudaEventRecord(fork_, stream), "cudaEventRecord");
        !e.empty()) {
      return e;
    }
    return EnqueuePushes(streams_, fork_, plan, write32);
  }

 private:
  std::string Setup(std::int64_t world) {
    if (fork_ != nullptr && static_cast<std::int64_t>(streams_.size()) >= world) return "";
    int previous = 0;
    cudaGetDevice(&previous);
    std::string err = cuda::RuntimeError(cudaSetDevice(device_), "cudaSetDevice");
    if (err.empty() && fork_ == nullptr) {
      err = cuda::RuntimeError(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming),
                               "cudaEventCreate");
    }
    while (err.empty() && static_cast<std::int64_t>(streams_.size()) < world) {
      cudaStream_t s = nullptr;
      err = cuda::RuntimeError(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking),
                               "cudaStreamCreate");
      if (err.empty()) streams_.push_back(s);
    }
    cudaSetDevice(previous);
    return err;
  }

  const int device_;
  std::mutex mu_;
  std::vector<cudaStream_t> streams_;  // [0] unused
  cudaEvent_t fork_ = nullptr;
};

class PusherPool {
 public:
  static PusherPool& Get() {
    static auto* pool = new PusherPool;
    return *pool;
  }
  DevicePusher& Of(int device_ordinal) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& pusher = by_device_[device_ordinal];
    if (!pusher) pusher = std::make_unique<DevicePusher>(device_ordinal);
    return *pusher;
  }

 private:
  std::mutex mu_;
  std::map<int, std::unique_ptr<DevicePusher>> by_device_;
};

ffi::Error Failed(const std::string& what) {
  return ffi::Error::Internal("jaxtdist copy-engine gather: " + what);
}

ffi::Error CeGatherCuda(cudaStream_t stream, std::int32_t device_ordinal, ffi::AnyBuffer x,
                        ffi::Buffer<ffi::S32> ctx, ffi::Result<ffi::Buffer<ffi::S32>> ctx_out,
                        std::int64_t counter_id, std::int64_t inbox_offset,
                        std::int64_t parity_bytes, std::int64_t flags_offset,
                        std::int64_t sent_offset, std::int64_t chunk_rows,
                        std::int64_t align_launch, std::int64_t serial,
                        std::int64_t generation, ffi::Span<const std::int64_t> groups,
                        std::int64_t world) {
  // ctx_out aliases ctx: the kernel that takes it is ordered after this call.
  (void)ctx;
  (void)ctx_out;
  auto call = Resolve(CallSite::OnDevice("jaxtdist copy-engine gather", device_ordinal),
                      CallAttrs{generation, groups, world}, kNeedGroup);
  if (call.has_error()) return call.error();
  static StreamValue32Fn write32 =
      cuda::DriverFunction<StreamValue32Fn>("cuStreamWriteValue32");
  if (write32 == nullptr) return Failed("the driver lacks cuStreamWriteValue32");
  const int pos = call->position;
  const std::int64_t* group = call->group;
  const HeapSlot& heap = *call->heap;
  PushPlan plan;
  plan.me = -1;
  plan.bases.resize(world);
  for (std::int64_t r = 0; r < world; ++r) {
    if (group[r] == pos) plan.me = r;
    auto peer = RuntimeState::Get().Heap(static_cast<int>(group[r]));
    if (!peer) return Failed("no heap for mesh position " + std::to_string(group[r]));
    plan.bases[r] = peer->base;
  }
  if (plan.me < 0) return Failed("mesh position " + std::to_string(pos) + " is not in its group");

  const std::int64_t shard_bytes = static_cast<std::int64_t>(x.size_bytes());
  const std::int64_t rows = x.dimensions().size() == 0 ? 1 : x.dimensions()[0];
  if (rows < 1 || chunk_rows < 1 || shard_bytes % rows) return Failed("bad shard shape");
  const std::int64_t n_chunks = (rows + chunk_rows - 1) / chunk_rows;
  if (parity_bytes < world * shard_bytes || inbox_offset < 0 ||
      inbox_offset + 2 * parity_bytes > heap.bytes || sent_offset < 0 ||
      sent_offset + 4 * world > heap.bytes || flags_offset < 0 ||
      flags_offset + 4 * world * n_chunks > heap.bytes) {
    return ffi::Error::InvalidArgument("jaxtdist copy-engine gather: workspace outside the heap");
  }
  const std::int64_t epoch = RuntimeState::Get().PeekEpoch(counter_id, pos);
  if (world == 1) return ffi::Error::Success();

  plan.world = world;
  plan.n_chunks = n_chunks;
  plan.chunk_bytes = chunk_rows * (shard_bytes / rows);
  plan.shard_bytes = shard_bytes;
  plan.inbox = inbox_offset + (epoch & 1) * parity_bytes;
  plan.flags_offset = flags_offset;
  plan.serial = serial != 0;
  plan.source = static_cast<const char*>(x.untyped_data());
  plan.epoch = static_cast<cuuint32_t>(epoch);
  plan.sent = plan.bases[plan.me] + sent_offset;
  const LaunchClock::time_point enqueuing = LaunchClock::now();
  if (std::string err = PusherPool::Get().Of(device_ordinal).Push(stream, plan, write32);
      !err.empty()) {
    return Failed(err);
  }
  AddTime(Counters().enqueue_ns, enqueuing);
  Counters().calls.fetch_add(1, std::memory_order_relaxed);
  // Every push is enqueued; the GEMM kernel is next: meet the group's other
  // host threads so that no device's kernel starts long before its peers push.
  if (align_launch) call->AlignLaunch(counter_id, epoch);
  AddTime(Counters().handler_ns, call->entered);
  return ffi::Error::Success();
}

}  // namespace

CePushStats GetCePushStats() {
  const PushCounters& c = Counters();
  CePushStats stats;
  stats.calls = c.calls.load(std::memory_order_relaxed);
  stats.handler_us = c.handler_ns.load(std::memory_order_relaxed) * 1e-3;
  stats.enqueue_us = c.enqueue_ns.load(std::memory_order_relaxed) * 1e-3;
  return stats;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxtdistCeGatherCuda, CeGatherCuda,
                              BindCallAttrs(ffi::Ffi::Bind()
                                                .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                                .Ctx<ffi::DeviceOrdinal>()
                                                .Arg<ffi::AnyBuffer>()
                                                .Arg<ffi::Buffer<ffi::S32>>()
                                                .Ret<ffi::Buffer<ffi::S32>>()
                                                .Attr<std::int64_t>("counter_id")
                                                .Attr<std::int64_t>("inbox_offset")
                                                .Attr<std::int64_t>("parity_bytes")
                                                .Attr<std::int64_t>("flags_offset")
                                                .Attr<std::int64_t>("sent_offset")
                                                .Attr<std::int64_t>("chunk_rows")
                                                .Attr<std::int64_t>("align_launch")
                                                .Attr<std::int64_t>("serial")));

}  // namespace jaxtdist
