// Python binding of the jaxtdist native library: FFI handler capsules for
// jax.ffi.register_ffi_target, the runtime registry, and (when built with
// CUDA) the heap allocation helpers.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "ffi_host_kernel.h"
#include "prologue.h"
#include "runtime_state.h"
#ifdef JAXTDIST_WITH_CUDA
#include "ce_gather.h"
#include "ctx_writer.h"
#include "cuda_heap.h"
#include "nvshmem_host.h"
#include "triton_launch.h"
#endif

namespace py = pybind11;

namespace {

py::capsule Capsule(void* fn) { return py::capsule(fn); }

#ifdef JAXTDIST_WITH_CUDA
void Raise(const std::string& err) {
  if (!err.empty()) throw std::runtime_error("jaxtdist: " + err);
}
#endif

}  // namespace

PYBIND11_MODULE(_jaxtdist_ffi, m) {
  m.doc() = "jaxtdist native library: XLA FFI handlers and heap helpers";
  // {ffi target name: {platform: handler capsule}}.
  m.def("handlers", [] {
    py::dict prologue, launch, ce_gather, host_kernel, targets;
    prologue["cpu"] = Capsule(reinterpret_cast<void*>(&jaxtdist::JaxtdistPrologueCpu));
    host_kernel["cpu"] = Capsule(reinterpret_cast<void*>(&jaxtdist::JaxtdistHostKernelCpu));
#ifdef JAXTDIST_WITH_CUDA
    prologue["CUDA"] = Capsule(reinterpret_cast<void*>(&jaxtdist::JaxtdistPrologueCuda));
    launch["CUDA"] = Capsule(reinterpret_cast<void*>(&jaxtdist::JaxtdistTritonLaunchCuda));
    ce_gather["CUDA"] = Capsule(reinterpret_cast<void*>(&jaxtdist::JaxtdistCeGatherCuda));
#endif
    targets["jaxtdist_prologue"] = prologue;
    targets["jaxtdist_triton_launch"] = launch;
    targets["jaxtdist_ce_gather"] = ce_gather;
    targets["jaxtdist_host_kernel"] = host_kernel;
    return targets;
  });
  // The Python function the CPU backend's kernel launches call (ffi_host_kernel.h).
  m.def("set_host_kernel_dispatch",
        [](py::function dispatch) { jaxtdist::SetHostKernelDispatch(dispatch); });
#ifdef JAXTDIST_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  m.attr("ctx_words") = jaxtdist::kCtxWords;
  // The context and error-record layout this library was built with, under
  // jaxtdist/language/_layout.py's names: jaxtdist/runtime/_native.py checks
  // them against that file when it loads the library (a stale build fails
  // there, not as corrupt contexts in kernels).
  m.def("ctx_layout", [] {
    py::dict d;
    d["CTX_WORDS"] = jaxtdist::kCtxWords;
    d["CTX_EPOCH"] = jaxtdist::kCtxEpochWord;
    d["ERR_WORDS"] = jaxtdist::kErrWords;
    d["ERR_FLAG"] = jaxtdist::kErrFlag;
    d["ERR_RANK"] = jaxtdist::kErrRank;
    d["ERR_PEER"] = jaxtdist::kErrPeer;
    d["ERR_SIGNAL_OFFSET"] = jaxtdist::kErrSignalOffset;
    d["ERR_EXPECTED"] = jaxtdist::kErrExpected;
    d["ERR_SEEN"] = jaxtdist::kErrSeen;
    d["ERR_CMP"] = jaxtdist::kErrCmp;
    d["ERR_TIMEOUT_NS"] = jaxtdist::kErrTimeoutNs;
    return d;
  });
  m.def("register_heap", [](int position, int device_ordinal, std::uintptr_t base,
                            std::int64_t bytes, std::uintptr_t error_record) {
    jaxtdist::RuntimeState::Get().RegisterHeap(position, device_ordinal, base, bytes,
                                               error_record);
  });
  m.def("recorded_timeout", [](int position, bool earlier) -> std::string {
    auto slot = jaxtdist::RuntimeState::Get().Heap(position);
    return slot ? jaxtdist::RecordedTimeout(*slot, position, earlier) : "";
  }, py::arg("position"), py::arg("earlier") = true);
  m.def("reset", [](std::int64_t generation) {
    jaxtdist::RuntimeState::Get().Reset(generation);
  });
  m.def("peek_epoch", [](std::int64_t counter, int position) {
    return jaxtdist::RuntimeState::Get().PeekEpoch(counter, position);
  });
  m.def("configure_launch_alignment",
        [](bool enabled, std::int64_t timeout_us, std::int64_t spin_us) {
          jaxtdist::RuntimeState::Get().aligner().Configure(enabled, timeout_us, spin_us);
        },
        py::arg("enabled"), py::arg("timeout_us"), py::arg("spin_us"));
  m.def("launch_alignment_stats", [] {
    const jaxtdist::LaunchAlignStats st = jaxtdist::RuntimeState::Get().aligner().Stats();
    py::dict d;
    d["enabled"] = st.enabled;
    d["met"] = st.met;
    d["timed_out"] = st.timed_out;
    d["disabled_because"] = st.disabled_because;
    d["max_spread_us"] = st.max_spread_us;
    d["wait_us"] = st.wait_us;
    py::list late;
    for (const auto& r : st.late) {
      py::list members;
      for (const auto& m : r.members) {
        py::dict md;
        md["position"] = m.position;
        md["entered_us"] = m.entered_us;
        md["arrived_us"] = m.arrived_us;
        members.append(md);
      }
      py::dict rd;
      rd["counter"] = r.counter;
      rd["epoch"] = r.epoch;
      rd["members"] = members;
      late.append(rd);
    }
    d["late"] = late;
    return d;
  });
  // What the CUDA handlers call before a collective kernel (tests drive it
  // from several Python threads).
  m.def("register_template", [](int position, std::int64_t offset, py::bytes data) {
    const std::string bytes = data;
    if (bytes.size() != jaxtdist::kCtxWords * sizeof(std::int64_t)) {
      throw std::invalid_argument("register_template: a template is " +
                                  std::to_string(jaxtdist::kCtxWords) + " int64 words, got " +
                                  std::to_string(bytes.size()) + " bytes");
    }
    std::int64_t words[jaxtdist::kCtxWords];
    std::memcpy(words, bytes.data(), bytes.size());
    jaxtdist::RuntimeState::Get().RegisterTemplate(position, offset, words);
  });
  m.def("align_launch",
        [](std::int64_t counter, std::int64_t epoch, std::int64_t leader, std::int64_t world,
           int position) {
          jaxtdist::RuntimeState::Get().aligner().Arrive(counter, epoch, leader, world,
                                                         position);
        },
        py::arg("counter"), py::arg("epoch"), py::arg("leader"), py::arg("world"),
        py::arg("position") = -1, py::call_guard<py::gil_scoped_release>());
#ifdef JAXTDIST_WITH_CUDA
  namespace jc = jaxtdist::cuda;
  m.def("preload_context_writer", [](int device_ordinal) {
    Raise(jaxtdist::PreloadContextWriter(device_ordinal));
  });
  m.def("context_write_stats", [] {
    const jaxtdist::ContextWriteStats st = jaxtdist::GetContextWriteStats();
    py::dict d;
    d["kernel"] = st.kernel;
    d["copy"] = st.copy;
    return d;
  });
  m.def("ce_push_stats", [] {
    const jaxtdist::CePushStats st = jaxtdist::GetCePushStats();
    py::dict d;
    d["calls"] = st.calls;
    d["handler_us"] = st.handler_us;
    d["enqueue_us"] = st.enqueue_us;
    return d;
  });
  m.def("cuda_device_count", [] {
    int n = 0;
    Raise(jc::DeviceCount(&n));
    return n;
  });
  m.def("cuda_max_shared_per_block", [](int device) {
    int bytes = 0;
    Raise(jc::MaxSharedPerBlockOptin(device, &bytes));
    return bytes;
  });
  m.def("cuda_mem_get_info", [](int device) {
    std::int64_t f = 0, t = 0;
    Raise(jc::MemGetInfo(device, &f, &t));
    return py::make_tuple(f, t);
  });
  m.def("cuda_malloc", [](int device, std::int64_t bytes) {
    std::uintptr_t p = 0;
    Raise(jc::Malloc(device, bytes, &p));
    return p;
  });
  m.def("cuda_free", [](int device, std::uintptr_t p) { Raise(jc::Free(device, p)); });
  m.def("cuda_zero", [](int device, std::uintptr_t p, std::int64_t bytes) {
    Raise(jc::Zero(device, p, bytes));
  });
  m.def("cuda_enable_peer_access", [](int device, int peer) {
    Raise(jc::EnablePeerAccess(device, peer));
  });
  m.def("cuda_copy_to_device", [](int device, std::uintptr_t dst, py::bytes data) {
    std::string s = data;
    Raise(jc::CopyToDevice(device, dst, s.data(), static_cast<std::int64_t>(s.size())));
  });
  m.def("cuda_copy_from_device", [](int device, std::uintptr_t src, std::int64_t bytes) {
    std::string s(bytes, '\0');
    Raise(jc::CopyFromDevice(device, s.data(), src, bytes));
    return py::bytes(s);
  });
  m.def("cuda_host_alloc_mapped", [](std::int64_t bytes) {
    std::uintptr_t p = 0;
    Raise(jc::HostAllocMapped(bytes, &p));
    return p;
  });
  m.def("register_triton_kernel", [](py::bytes cubin, std::string name, int num_warps,
                                     int shared_bytes, std::int64_t scratch_bytes,
                                     bool nvshmem) {
    jaxtdist::TritonKernelImage image;
    image.cubin = cubin;
    image.name = std::move(name);
    image.threads = 32 * num_warps;
    image.shared_bytes = shared_bytes;
    image.scratch_bytes = scratch_bytes;
    image.nvshmem = nvshmem;
    return jaxtdist::RegisterTritonKernel(std::move(image));
  }, py::arg("cubin"), py::arg("name"), py::arg("num_warps"), py::arg("shared_bytes"),
     py::arg("scratch_bytes"), py::arg("nvshmem") = false);
  m.def("preload_triton_kernel", [](std::int64_t id, int device_ordinal) {
    Raise(jaxtdist::PreloadTritonKernel(id, device_ordinal));
  });
  // NVSHMEM's host library (jaxtdist/runtime/_nvshmem.py drives it).
  namespace nv = jaxtdist::nvshmem;
  m.def("nvshmem_load", [](const std::string& path) { Raise(nv::Load(path)); });
  m.def("nvshmem_unique_id", [] {
    std::string id;
    Raise(nv::GetUniqueId(&id));
    return py::bytes(id);
  });
  m.def("nvshmem_init", [](int device, int rank, int npes, py::bytes id) {
        std::string s = id;
        std::string err;
        {
          py::gil_scoped_release release;  // the bootstrap waits for every PE
          err = nv::InitWithUniqueId(device, rank, npes, s);
        }
        Raise(err);
      },
      py::arg("device"), py::arg("rank"), py::arg("npes"), py::arg("unique_id"));
  m.def("nvshmem_initialized", [] { return nv::Initialized(); });
  m.def("nvshmem_my_pe", [] { return nv::MyPe(); });
  m.def("nvshmem_n_pes", [] { return nv::NPes(); });
  m.def("nvshmem_malloc", [](int device, std::int64_t bytes) {
    std::uintptr_t p = 0;
    std::string err;
    {
      py::gil_scoped_release release;  // collective
      err = nv::Malloc(device, bytes, &p);
    }
    Raise(err);
    return p;
  });
  m.def("nvshmem_free", [](std::uintptr_t p) {
    std::string err;
    {
      py::gil_scoped_release release;  // collective
      err = nv::Free(p);
    }
    Raise(err);
  });
  m.def("nvshmem_ptr", [](std::uintptr_t p, int pe) { return nv::PeerPtr(p, pe); });
  m.def("nvshmem_barrier_all", [] {
    std::string err;
    {
      py::gil_scoped_release release;
      err = nv::BarrierAll();
    }
    Raise(err);
  });
  m.def("cuda_free_host", [](std::uintptr_t p) { Raise(jc::FreeHost(p)); });
#endif
}
