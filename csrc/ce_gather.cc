// Copy-engine gather for ag_matmul (see ce_gather.h).
//
// Per call, on device `me` of a group of `world`, with epoch e (advanced by
// this call's prologue, which ran just before on this host thread), this
// rank's shard x is pushed, chunk by chunk, into the heap inbox of every
// other rank (parity e % 2, rows of rank me), that rank's chunk flag being
// raised to e after each chunk lands; then the local "sent" words are
// raised. In parallel (default) every peer gets its own chain of copies;
// with `serial`, one chain pushes to rank me+1, me+2, ... in turn: each peer
// then receives one shard at a time, at a single pair's bandwidth, rank
// me-1's first, the order the GEMM consumes them in.
//
// `by_graph` (default) enqueues all of that as one CUDA graph launch on a
// side stream (PushGraph, cached per plan), the chunk flags copied from a
// device-side epoch word; otherwise a driver call per chunk and peer does it
// (a copy, then a stream write of the flag) on a side stream per peer.
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
#include <mutex>
#include <string>
#include <vector>

#include "cuda_driver.h"
#include "runtime_state.h"

namespace ffi = xla::ffi;

namespace jaxtdist {
namespace {

using StreamValue32Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

// One call's pushes: chunk c of this rank's shard (`me`) goes to rank dst's
// inbox at rows of `me`, then its flag there is raised to the epoch.
struct PushPlan {
  std::int64_t world = 0, me = 0, n_chunks = 0, chunk_bytes = 0, shard_bytes = 0;
  std::int64_t inbox = 0, flags_offset = 0;
  bool serial = false;
  std::vector<std::uintptr_t> bases;  // heap base of each group rank

  std::int64_t ChunkBytes(std::int64_t c) const {
    return std::min(shard_bytes, (c + 1) * chunk_bytes) - c * chunk_bytes;
  }
  void* Inbox(std::int64_t dst, std::int64_t c) const {
    return reinterpret_cast<void*>(bases[dst] + inbox + me * shard_bytes + c * chunk_bytes);
  }
  std::uintptr_t Flag(std::int64_t dst, std::int64_t c) const {
    return bases[dst] + flags_offset + 4 * (me * n_chunks + c);
  }
  // What a graph of these pushes depends on besides the source shard.
  std::vector<std::int64_t> Key() const {
    std::vector<std::int64_t> key{world, me, n_chunks, chunk_bytes, shard_bytes, inbox,
                                  flags_offset, serial};
    for (std::uintptr_t base : bases) key.push_back(static_cast<std::int64_t>(base));
    return key;
  }
};

// The pushes of one PushPlan as a CUDA graph: per peer (one chain for all
// peers when serial), the chunk copies back to back, and off each copy a
// 4-byte copy of the device's epoch word into that chunk's flag. One
// launch then replaces a driver call per chunk and peer, which made
// back-to-back calls host-bound (docs/perf, run BB). Flags take the epoch
// from device memory so that the graph does not change from call to call.
struct PushGraph {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  std::vector<cudaGraphNode_t> copies;  // (peer step, chunk) order
  const char* source = nullptr;         // the shard the copies read
};

struct SideStreams {
  cudaEvent_t fork = nullptr;
  std::vector<cudaStream_t> streams;  // [0]: graphs; [s]: the peer s ranks ahead
  cuuint32_t* epoch_word = nullptr;   // device memory the flag copies read
  std::mutex graphs_mu;
  std::map<std::vector<std::int64_t>, PushGraph> graphs;
};

// CePushStats, as atomics.
struct PushCounters {
  std::atomic<std::int64_t> graphs_built{0}, graph_launches{0}, graph_retargets{0},
      call_pushes{0};
  std::atomic<std::int64_t> handler_ns{0}, enqueue_ns{0};
};

void AddTime(std::atomic<std::int64_t>& total_ns, LaunchClock::time_point since) {
  total_ns.fetch_add(
      std::chrono::duration_cast<std::chrono::nanoseconds>(LaunchClock::now() - since).count(),
      std::memory_order_relaxed);
}
PushCounters& Counters() {
  static auto* counters = new PushCounters;
  return *counters;
}

// Graphs kept per device; past this, all are dropped (shapes or heaps churn).
constexpr std::size_t kMaxGraphsPerDevice = 64;

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
    if (side.fork == nullptr || side.epoch_word == nullptr ||
        static_cast<int>(side.streams.size()) < count) {
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
    if (side.epoch_word == nullptr) {
      e = cudaMalloc(reinterpret_cast<void**>(&side.epoch_word), sizeof(cuuint32_t));
      if (e != cudaSuccess) return std::string("cudaMalloc (epoch word): ") + cudaGetErrorString(e);
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

void DestroyGraph(PushGraph& graph) {
  if (graph.exec != nullptr) cudaGraphExecDestroy(graph.exec);
  if (graph.graph != nullptr) cudaGraphDestroy(graph.graph);
  graph = PushGraph{};
}

// Calls fn(copy index, peer rank, chunk) in the graph's copy order.
template <typename Fn>
void ForEachPush(const PushPlan& plan, Fn fn) {
  std::int64_t index = 0;
  for (std::int64_t s = 1; s < plan.world; ++s) {
    for (std::int64_t c = 0; c < plan.n_chunks; ++c) fn(index++, (plan.me + s) % plan.world, c);
  }
}

// Builds `plan`'s pushes from `source` into *graph (see PushGraph), on the
// current device.
ffi::Error BuildPushGraph(const PushPlan& plan, const char* source,
                          const cuuint32_t* epoch_word, PushGraph* graph) {
  JAXTDIST_RETURN_IF_ERROR(Check(cudaGraphCreate(&graph->graph, 0), "cudaGraphCreate"));
  graph->source = source;
  cudaGraphNode_t previous = nullptr;
  cudaError_t err = cudaSuccess;
  ForEachPush(plan, [&](std::int64_t, std::int64_t dst, std::int64_t c) {
    if (err != cudaSuccess) return;
    if (c == 0 && !plan.serial) previous = nullptr;  // a chain per peer
    cudaGraphNode_t copy = nullptr, flag = nullptr;
    err = cudaGraphAddMemcpyNode1D(&copy, graph->graph, previous ? &previous : nullptr,
                                   previous ? 1 : 0, plan.Inbox(dst, c),
                                   source + c * plan.chunk_bytes, plan.ChunkBytes(c),
                                   cudaMemcpyDefault);
    if (err != cudaSuccess) return;
    graph->copies.push_back(copy);
    // Off the chain: the next chunk's copy need not wait for this flag.
    err = cudaGraphAddMemcpyNode1D(&flag, graph->graph, &copy, 1,
                                   reinterpret_cast<void*>(plan.Flag(dst, c)), epoch_word,
                                   sizeof(cuuint32_t), cudaMemcpyDefault);
    previous = copy;
  });
  JAXTDIST_RETURN_IF_ERROR(Check(err, "cudaGraphAddMemcpyNode1D"));
  return Check(cudaGraphInstantiate(&graph->exec, graph->graph, 0), "cudaGraphInstantiate");
}

// Points the graph's copies at `source` (XLA may hand each call a new x).
ffi::Error RetargetPushGraph(const PushPlan& plan, const char* source, PushGraph* graph) {
  cudaError_t err = cudaSuccess;
  ForEachPush(plan, [&](std::int64_t index, std::int64_t dst, std::int64_t c) {
    if (err == cudaSuccess) {
      err = cudaGraphExecMemcpyNodeSetParams1D(graph->exec, graph->copies[index],
                                               plan.Inbox(dst, c), source + c * plan.chunk_bytes,
                                               plan.ChunkBytes(c), cudaMemcpyDefault);
    }
  });
  JAXTDIST_RETURN_IF_ERROR(Check(err, "cudaGraphExecMemcpyNodeSetParams1D"));
  graph->source = source;
  return ffi::Error::Success();
}

// Enqueues `plan`'s pushes after everything on `stream` as one graph launch
// on side stream 0, then raises the sent words.
ffi::Error PushByGraph(cudaStream_t stream, int device_ordinal, const PushPlan& plan,
                       const char* source, cuuint32_t epoch, std::uintptr_t sent,
                       StreamValue32Fn write32) {
  SideStreams* side = nullptr;
  if (std::string err = SideStreamPool::Get().Acquire(device_ordinal, 1, &side); !err.empty()) {
    return Failed(err);
  }
  cudaStream_t side_stream = side->streams[0];
  auto cu_side = reinterpret_cast<CUstream>(side_stream);
  std::lock_guard<std::mutex> lock(side->graphs_mu);
  std::vector<std::int64_t> key = plan.Key();
  auto it = side->graphs.find(key);
  if (it == side->graphs.end()) {
    if (side->graphs.size() >= kMaxGraphsPerDevice) {
      // A launched graph may still run: let it end before destroying it.
      JAXTDIST_RETURN_IF_ERROR(Check(cudaStreamSynchronize(side_stream), "cudaStreamSynchronize"));
      for (auto& entry : side->graphs) DestroyGraph(entry.second);
      side->graphs.clear();
    }
    int previous = 0;
    cudaGetDevice(&previous);
    JAXTDIST_RETURN_IF_ERROR(Check(cudaSetDevice(device_ordinal), "cudaSetDevice"));
    PushGraph graph;
    ffi::Error built = BuildPushGraph(plan, source, side->epoch_word, &graph);
    if (built.success()) {
      built = Check(cudaGraphUpload(graph.exec, side_stream), "cudaGraphUpload");
    }
    cudaSetDevice(previous);
    if (built.failure()) {
      DestroyGraph(graph);
      return built;
    }
    it = side->graphs.emplace(std::move(key), graph).first;
    Counters().graphs_built.fetch_add(1, std::memory_order_relaxed);
  } else if (it->second.source != source) {
    JAXTDIST_RETURN_IF_ERROR(RetargetPushGraph(plan, source, &it->second));
    Counters().graph_retargets.fetch_add(1, std::memory_order_relaxed);
  }
  JAXTDIST_RETURN_IF_ERROR(Check(cudaEventRecord(side->fork, stream), "cudaEventRecord"));
  JAXTDIST_RETURN_IF_ERROR(
      Check(cudaStreamWaitEvent(side_stream, side->fork, 0), "cudaStreamWaitEvent"));
  // Stream order keeps the previous launch's flag copies before this write.
  JAXTDIST_RETURN_IF_ERROR(CheckDriver(
      write32(cu_side, reinterpret_cast<CUdeviceptr>(side->epoch_word), epoch, 0),
      "cuStreamWriteValue32 (epoch word)"));
  JAXTDIST_RETURN_IF_ERROR(Check(cudaGraphLaunch(it->second.exec, side_stream), "cudaGraphLaunch"));
  for (std::int64_t s = 1; s < plan.world; ++s) {
    JAXTDIST_RETURN_IF_ERROR(CheckDriver(
        write32(cu_side, static_cast<CUdeviceptr>(sent + 4 * s), epoch, 0),
        "cuStreamWriteValue32 (sent word)"));
  }
  Counters().graph_launches.fetch_add(1, std::memory_order_relaxed);
  return ffi::Error::Success();
}

// The same pushes as driver calls: per peer a side stream (one for all when
// serial), and per chunk a copy and a stream write of its flag.
ffi::Error PushByCalls(cudaStream_t stream, int device_ordinal, const PushPlan& plan,
                       const char* source, cuuint32_t epoch, std::uintptr_t sent,
                       StreamValue32Fn write32) {
  SideStreams* side = nullptr;
  if (std::string err = SideStreamPool::Get().Acquire(device_ordinal, plan.world, &side);
      !err.empty()) {
    return Failed(err);
  }
  JAXTDIST_RETURN_IF_ERROR(Check(cudaEventRecord(side->fork, stream), "cudaEventRecord"));
  for (std::int64_t s = 1; s < plan.world; ++s) {
    const std::int64_t dst = (plan.me + s) % plan.world;
    cudaStream_t st = side->streams[plan.serial ? 1 : s];
    auto cu_st = reinterpret_cast<CUstream>(st);
    if (!plan.serial || s == 1) {
      JAXTDIST_RETURN_IF_ERROR(
          Check(cudaStreamWaitEvent(st, side->fork, 0), "cudaStreamWaitEvent"));
    }
    for (std::int64_t c = 0; c < plan.n_chunks; ++c) {
      JAXTDIST_RETURN_IF_ERROR(Check(cudaMemcpyAsync(plan.Inbox(dst, c),
                                                     source + c * plan.chunk_bytes,
                                                     plan.ChunkBytes(c), cudaMemcpyDefault, st),
                                     "peer push"));
      // Default flags: the write is ordered after the copy's data.
      JAXTDIST_RETURN_IF_ERROR(
          CheckDriver(write32(cu_st, static_cast<CUdeviceptr>(plan.Flag(dst, c)), epoch, 0),
                      "cuStreamWriteValue32 (peer chunk flag)"));
    }
    JAXTDIST_RETURN_IF_ERROR(
        CheckDriver(write32(cu_st, static_cast<CUdeviceptr>(sent + 4 * s), epoch, 0),
                    "cuStreamWriteValue32 (sent word)"));
  }
  Counters().call_pushes.fetch_add(1, std::memory_order_relaxed);
  return ffi::Error::Success();
}

ffi::Error CeGatherCuda(cudaStream_t stream, std::int32_t device_ordinal, ffi::AnyBuffer x,
                        ffi::Buffer<ffi::S32> ctx, ffi::Result<ffi::Buffer<ffi::S32>> ctx_out,
                        std::int64_t counter_id, std::int64_t world,
                        ffi::Span<const std::int64_t> groups, std::int64_t inbox_offset,
                        std::int64_t parity_bytes, std::int64_t flags_offset,
                        std::int64_t sent_offset, std::int64_t chunk_rows,
                        std::int64_t generation, std::int64_t align_launch,
                        std::int64_t serial, std::int64_t by_graph) {
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
  if (world == 1) return ffi::Error::Success();

  PushPlan plan;
  plan.world = world;
  plan.me = me;
  plan.n_chunks = n_chunks;
  plan.chunk_bytes = chunk_rows * row_bytes;
  plan.shard_bytes = shard_bytes;
  plan.inbox = inbox_offset + (epoch & 1) * parity_bytes;
  plan.flags_offset = flags_offset;
  plan.serial = serial != 0;
  plan.bases = std::move(bases);
  const auto* shard = static_cast<const char*>(x.untyped_data());
  const std::uintptr_t sent = plan.bases[me] + sent_offset;
  const auto e = static_cast<cuuint32_t>(epoch);
  const LaunchClock::time_point enqueuing = LaunchClock::now();
  JAXTDIST_RETURN_IF_ERROR(
      by_graph ? PushByGraph(stream, device_ordinal, plan, shard, e, sent, write32)
               : PushByCalls(stream, device_ordinal, plan, shard, e, sent, write32));
  AddTime(Counters().enqueue_ns, enqueuing);
  // Every push is enqueued; the GEMM kernel is next: meet the group's other
  // host threads so that no device's kernel starts long before its peers push.
  if (align_launch) {
    RuntimeState::Get().aligner().Arrive(counter_id, epoch, group[0], world, *pos, entered);
  }
  AddTime(Counters().handler_ns, entered);
  return ffi::Error::Success();
}

}  // namespace

CePushStats GetCePushStats() {
  const PushCounters& c = Counters();
  CePushStats stats;
  stats.graphs_built = c.graphs_built.load(std::memory_order_relaxed);
  stats.graph_launches = c.graph_launches.load(std::memory_order_relaxed);
  stats.graph_retargets = c.graph_retargets.load(std::memory_order_relaxed);
  stats.call_pushes = c.call_pushes.load(std::memory_order_relaxed);
  stats.handler_us = c.handler_ns.load(std::memory_order_relaxed) * 1e-3;
  stats.enqueue_us = c.enqueue_ns.load(std::memory_order_relaxed) * 1e-3;
  return stats;
}

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
                                  .Attr<std::int64_t>("serial")
                                  .Attr<std::int64_t>("by_graph"));

}  // namespace jaxtdist
