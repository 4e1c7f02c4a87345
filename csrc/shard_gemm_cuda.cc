// CUDA backend of the shard-at-a-time GEMM (shard_gemm.h): one cuBLASLt
// matmul per step on XLA's stream.
//
// cuBLASLt is not linked: the handler finds the library XLA has already
// loaded (dlopen RTLD_NOLOAD by soname), else loads it by soname. The few
// declarations below are the C ABI of cuBLASLt 12 and 13 (cublasLt.h).
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <library_types.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "shard_gemm.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxtdist {
namespace {

// --- cuBLASLt ABI (cublasLt.h) ------------------------------------------
using LtStatus = int;  // cublasStatus_t; 0 is CUBLAS_STATUS_SUCCESS
using LtHandle = void*;
using LtMatmulDesc = void*;
using LtLayout = void*;
using LtPreference = void*;
struct LtAlgo {
  std::uint64_t data[8];
};
struct LtHeuristicResult {
  LtAlgo algo;
  std::size_t workspace_size;
  LtStatus state;
  float waves_count;
  int reserved[4];
};
constexpr int kComputeF32 = 68;             // CUBLAS_COMPUTE_32F
constexpr int kPrefMaxWorkspaceBytes = 1;   // CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES
constexpr int kPrefMinAlignmentA = 5;       // CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES (B, C, D follow)

struct Lt {
  LtStatus (*create)(LtHandle*);
  LtStatus (*desc_create)(LtMatmulDesc*, int, cudaDataType_t);
  LtStatus (*layout_create)(LtLayout*, cudaDataType_t, std::uint64_t, std::uint64_t,
                            std::int64_t);
  LtStatus (*pref_create)(LtPreference*);
  LtStatus (*pref_set)(LtPreference, int, const void*, std::size_t);
  LtStatus (*pref_destroy)(LtPreference);
  LtStatus (*heuristic)(LtHandle, LtMatmulDesc, LtLayout, LtLayout, LtLayout, LtLayout,
                        LtPreference, int, LtHeuristicResult*, int*);
  LtStatus (*matmul)(LtHandle, LtMatmulDesc, const void*, const void*, LtLayout, const void*,
                     LtLayout, const void*, const void*, LtLayout, void*, LtLayout,
                     const LtAlgo*, void*, std::size_t, cudaStream_t);
};

// Loads cuBLASLt once; *err says why it failed.
const Lt* LoadLt(std::string* err) {
  static std::string load_error;
  static const Lt* lt = [] () -> const Lt* {
    void* lib = nullptr;
    for (const char* name : {"libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"}) {
      lib = dlopen(name, RTLD_NOW | RTLD_NOLOAD);
      if (lib == nullptr) lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
      if (lib != nullptr) break;
    }
    if (lib == nullptr) {
      load_error = "cannot load libcublasLt.so.13 or .12 (the CUDA plugin of jaxlib ships it)";
      return nullptr;
    }
    auto* fns = new Lt;
    const std::pair<void**, const char*> symbols[] = {
        {reinterpret_cast<void**>(&fns->create), "cublasLtCreate"},
        {reinterpret_cast<void**>(&fns->desc_create), "cublasLtMatmulDescCreate"},
        {reinterpret_cast<void**>(&fns->layout_create), "cublasLtMatrixLayoutCreate"},
        {reinterpret_cast<void**>(&fns->pref_create), "cublasLtMatmulPreferenceCreate"},
        {reinterpret_cast<void**>(&fns->pref_set), "cublasLtMatmulPreferenceSetAttribute"},
        {reinterpret_cast<void**>(&fns->pref_destroy), "cublasLtMatmulPreferenceDestroy"},
        {reinterpret_cast<void**>(&fns->heuristic), "cublasLtMatmulAlgoGetHeuristic"},
        {reinterpret_cast<void**>(&fns->matmul), "cublasLtMatmul"},
    };
    for (const auto& [slot, name] : symbols) {
      *slot = dlsym(lib, name);
      if (*slot == nullptr) {
        load_error = std::string("libcublasLt lacks ") + name;
        return nullptr;
      }
    }
    return fns;
  }();
  if (lt == nullptr) *err = load_error;
  return lt;
}

// cuBLASLt's per-device handle and workspace, and the plans per problem.
constexpr std::size_t kWorkspaceBytes = 32 << 20;  // cuBLAS's recommendation for Hopper

struct Plan {
  LtMatmulDesc desc;
  LtLayout a, b, c;
  LtAlgo algo;
  std::size_t workspace;
};

// Everything one matmul call needs.
struct Prepared {
  const Lt* lt = nullptr;
  LtHandle handle = nullptr;
  void* workspace = nullptr;
  const Plan* plan = nullptr;
};

class LtCache {
 public:
  static LtCache& Get() {
    static auto* cache = new LtCache;
    return *cache;
  }

  // The handle and workspace of `device` (created on first use) and the plan
  // for out[m, n] = a[m, k] @ b[k, n] (row-major) with the given operand
  // alignments, taking the heuristic's `algo_index`-th algorithm (found on
  // first use); returns "" or what failed. One lock: a handler's host work.
  std::string Prepare(int device, cudaDataType_t type, std::int64_t m, std::int64_t n,
                      std::int64_t k, int align_a, int align_b, int align_c, int algo_index,
                      Prepared* out) {
    std::string err;
    out->lt = LoadLt(&err);
    if (out->lt == nullptr) return err;
    std::lock_guard<std::mutex> lock(mu_);
    auto dev = devices_.find(device);
    if (dev == devices_.end()) {
      std::pair<LtHandle, void*> created;
      if (err = CreateDevice(*out->lt, device, &created); !err.empty()) return err;
      dev = devices_.emplace(device, created).first;
    }
    out->handle = dev->second.first;
    out->workspace = dev->second.second;
    const auto key = std::make_tuple(device, static_cast<int>(type), m, n, k, align_a, align_b,
                                     align_c, algo_index);
    auto it = plans_.find(key);
    if (it == plans_.end()) {
      Plan p{};
      err = FindPlan(*out->lt, out->handle, type, m, n, k, align_a, align_b, align_c,
                     algo_index, &p);
      if (!err.empty()) return err;
      it = plans_.emplace(key, p).first;
    }
    out->plan = &it->second;
    return "";
  }

 private:
  static std::string CreateDevice(const Lt& lt, int device, std::pair<LtHandle, void*>* out) {
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(device);
    LtStatus st = lt.create(&out->first);
    cudaError_t ce = st == 0 ? cudaMalloc(&out->second, kWorkspaceBytes) : cudaSuccess;
    cudaSetDevice(previous);
    if (st != 0) return "cublasLtCreate failed with status " + std::to_string(st);
    if (ce != cudaSuccess) {
      return std::string("cudaMalloc of cuBLASLt's workspace (32 MiB): ") +
             cudaGetErrorString(ce);
    }
    return "";
  }

  static std::string FindPlan(const Lt& lt, LtHandle handle, cudaDataType_t type,
                              std::int64_t m, std::int64_t n, std::int64_t k, int align_a,
                              int align_b, int align_c, int algo_index, Plan* p) {
    // Row-major out = a @ b is column-major out^T = b^T @ a^T: cuBLASLt's A is
    // b ([n, k], ld n), its B is a ([k, m], ld k), its C/D out ([n, m], ld n).
    LtPreference pref = nullptr;
    LtStatus st = lt.desc_create(&p->desc, kComputeF32, CUDA_R_32F);
    if (st == 0) st = lt.layout_create(&p->a, type, n, k, n);
    if (st == 0) st = lt.layout_create(&p->b, type, k, m, k);
    if (st == 0) st = lt.layout_create(&p->c, type, n, m, n);
    if (st == 0) st = lt.pref_create(&pref);
    const std::uint64_t max_ws = kWorkspaceBytes;
    if (st == 0) st = lt.pref_set(pref, kPrefMaxWorkspaceBytes, &max_ws, sizeof(max_ws));
    // Lt's A is our b (w), its B our a (the shard), C and D our out.
    const std::uint32_t aligns[4] = {static_cast<std::uint32_t>(align_b),
                                     static_cast<std::uint32_t>(align_a),
                                     static_cast<std::uint32_t>(align_c),
                                     static_cast<std::uint32_t>(align_c)};
    for (int i = 0; i < 4 && st == 0; ++i) {
      st = lt.pref_set(pref, kPrefMinAlignmentA + i, &aligns[i], sizeof(aligns[i]));
    }
    LtHeuristicResult results[8] = {};
    int found = 0;
    if (st == 0) st = lt.heuristic(handle, p->desc, p->a, p->b, p->c, p->c, pref, 8, results,
                                   &found);
    if (pref != nullptr) lt.pref_destroy(pref);
    if (st != 0 || found == 0) {
      return "cuBLASLt has no algorithm for [" + std::to_string(m) + ", " + std::to_string(k) +
             "] @ [" + std::to_string(k) + ", " + std::to_string(n) + "] (status " +
             std::to_string(st) + ")";
    }
    if (algo_index >= found) {
      return "cuBLASLt offers " + std::to_string(found) + " algorithms for this problem; "
             "GEMM_ALGO=" + std::to_string(algo_index) + " asks for one past them";
    }
    p->algo = results[algo_index].algo;
    p->workspace = results[algo_index].workspace_size;
    return "";
  }

  std::mutex mu_;
  std::map<int, std::pair<LtHandle, void*>> devices_;
  std::map<std::tuple<int, int, std::int64_t, std::int64_t, std::int64_t, int, int, int, int>,
           Plan>
      plans_;
};

// The largest power of two (at most 256) that divides `p`: the alignment
// cuBLASLt may assume of an operand.
int Alignment(const void* p) {
  auto v = reinterpret_cast<std::uintptr_t>(p);
  int align = 256;
  while (align > 1 && v % align) align /= 2;
  return align;
}

ffi::Error ShardGemmCuda(cudaStream_t stream, std::int32_t device_ordinal, ffi::AnyBuffer x,
                         ffi::AnyBuffer w, ffi::AnyBuffer token, ffi::RemainingArgs previous,
                         ffi::Result<ffi::AnyBuffer> out, std::int64_t world,
                         ffi::Span<const std::int64_t> groups, std::int64_t step,
                         std::int64_t counter_id, std::int64_t inbox_offset,
                         std::int64_t parity_bytes, std::int64_t generation,
                         std::int64_t algo_index) {
  (void)token;     // orders this step after its wait kernel
  (void)previous;  // the output so far: XLA aliases it to `out`
  if (std::string stale = CheckGeneration(generation); !stale.empty()) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition, stale);
  }
  auto pos = RuntimeState::Get().PositionOfDevice(device_ordinal);
  if (!pos) return ffi::Error::InvalidArgument(NoHeapForDevice(device_ordinal));
  ShardGemm g;
  std::string err = PlanShardGemm(*pos, x, w, *out, world, groups, step, counter_id,
                                  inbox_offset, parity_bytes, &g);
  if (!err.empty()) return ffi::Error::InvalidArgument("jaxtdist shard GEMM: " + err);
  const cudaDataType_t type = g.type == ffi::DataType::BF16  ? CUDA_R_16BF
                              : g.type == ffi::DataType::F16 ? CUDA_R_16F
                                                             : CUDA_R_32F;
  Prepared lt;
  err = LtCache::Get().Prepare(device_ordinal, type, g.m, g.n, g.k, Alignment(g.a),
                               Alignment(g.w), Alignment(g.c), static_cast<int>(algo_index), &lt);
  if (!err.empty()) return ffi::Error::InvalidArgument("jaxtdist shard GEMM: " + err);
  const float one = 1.0f, zero = 0.0f;
  const Plan& p = *lt.plan;
  LtStatus st = lt.lt->matmul(lt.handle, p.desc, &one, g.w, p.a, g.a, p.b, &zero, g.c, p.c, g.c,
                              p.c, &p.algo, lt.workspace, p.workspace, stream);
  if (st != 0) {
    return ffi::Error::Internal("jaxtdist shard GEMM: cublasLtMatmul failed with status " +
                                std::to_string(st));
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxtdistShardGemmCuda, ShardGemmCuda,
                              BindShardGemmOperands(ffi::Ffi::Bind()
                                                     .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                                     .Ctx<ffi::DeviceOrdinal>()));

}  // namespace jaxtdist
