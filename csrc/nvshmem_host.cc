#include "nvshmem_host.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <cstddef>
#include <cstring>
#include <mutex>

#include "cuda_driver.h"

namespace jaxtdist::nvshmem {
namespace {

// NVSHMEM's init ABI (nvshmem_uniqueid.h, nvshmem_types.h of NVSHMEM 3.x):
// versioned structs of fixed size, so that a library built without NVSHMEM's
// headers can fill them.
struct UniqueId {
  int version;
  char internal[124];
};
static_assert(sizeof(UniqueId) == 128);
struct UniqueIdArgs {
  int version;
  UniqueId* id;
  int myrank;
  int nranks;
};
static_assert(sizeof(UniqueIdArgs) == 24);
struct InitArgs {
  int version;
  UniqueIdArgs uid_args;
  int cuda_device_id;
  char content[92];
};
static_assert(sizeof(InitArgs) == 128);
struct InitAttr {
  int version;
  void* mpi_comm;
  InitArgs args;
};
static_assert(sizeof(InitAttr) == 144);
constexpr unsigned kInitWithUniqueId = 1u << 3;

struct Api {
  void* handle = nullptr;
  int (*get_uniqueid)(UniqueId*) = nullptr;
  int (*set_attr_uniqueid_args)(int, int, const UniqueId*, InitAttr*) = nullptr;
  int (*hostlib_init_attr)(unsigned, InitAttr*) = nullptr;
  int (*init_status)() = nullptr;
  int (*my_pe)() = nullptr;
  int (*n_pes)() = nullptr;
  void* (*malloc)(std::size_t) = nullptr;
  void (*free)(void*) = nullptr;
  void* (*ptr)(const void*, int) = nullptr;
  void (*barrier_all)() = nullptr;
  int (*cumodule_init)(void*) = nullptr;
};

std::mutex mu;
Api api;
bool initialized = false;

template <typename Fn>
bool Resolve(Fn* fn, const char* name, std::string* missing) {
  *fn = reinterpret_cast<Fn>(dlsym(api.handle, name));
  if (*fn == nullptr) *missing += std::string(missing->empty() ? "" : ", ") + name;
  return *fn != nullptr;
}

std::string NotLoaded() {
  return "NVSHMEM's host library is not loaded (jaxtdist.runtime._nvshmem loads it)";
}

}  // namespace

std::string Load(const std::string& path) {
  std::lock_guard<std::mutex> lock(mu);
  if (api.handle != nullptr) return "";
  // RTLD_GLOBAL: NVSHMEM's bootstrap and transport plugins resolve against it.
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
  if (handle == nullptr) {
    const char* why = dlerror();
    return "cannot load NVSHMEM's host library " + path + ": " + (why ? why : "dlopen failed");
  }
  api.handle = handle;
  std::string missing;
  Resolve(&api.get_uniqueid, "nvshmemx_get_uniqueid", &missing);
  Resolve(&api.set_attr_uniqueid_args, "nvshmemx_set_attr_uniqueid_args", &missing);
  Resolve(&api.hostlib_init_attr, "nvshmemx_hostlib_init_attr", &missing);
  Resolve(&api.init_status, "nvshmemx_init_status", &missing);
  Resolve(&api.my_pe, "nvshmem_my_pe", &missing);
  Resolve(&api.n_pes, "nvshmem_n_pes", &missing);
  Resolve(&api.malloc, "nvshmem_malloc", &missing);
  Resolve(&api.free, "nvshmem_free", &missing);
  Resolve(&api.ptr, "nvshmem_ptr", &missing);
  Resolve(&api.barrier_all, "nvshmem_barrier_all", &missing);
  Resolve(&api.cumodule_init, "nvshmemx_cumodule_init", &missing);
  if (!missing.empty()) {
    dlclose(handle);
    api = Api{};
    return path + " lacks " + missing + " (jaxtdist needs NVSHMEM 3.x)";
  }
  return "";
}

bool Loaded() {
  std::lock_guard<std::mutex> lock(mu);
  return api.handle != nullptr;
}

std::string GetUniqueId(std::string* id) {
  std::lock_guard<std::mutex> lock(mu);
  if (api.handle == nullptr) return NotLoaded();
  UniqueId uid{};
  uid.version = (1 << 16) + static_cast<int>(sizeof(UniqueId));
  if (int rc = api.get_uniqueid(&uid); rc != 0) {
    return "nvshmemx_get_uniqueid failed with " + std::to_string(rc);
  }
  id->assign(reinterpret_cast<const char*>(&uid), sizeof(uid));
  return "";
}

std::string InitWithUniqueId(int device, int rank, int npes, const std::string& id) {
  std::lock_guard<std::mutex> lock(mu);
  if (api.handle == nullptr) return NotLoaded();
  if (initialized) return "";
  if (id.size() != sizeof(UniqueId)) {
    return "an NVSHMEM unique id has " + std::to_string(sizeof(UniqueId)) + " bytes, not " +
           std::to_string(id.size());
  }
  if (auto e = cuda::RuntimeError(cudaSetDevice(device), "cudaSetDevice"); !e.empty()) return e;
  UniqueId uid;
  std::memcpy(&uid, id.data(), sizeof(uid));
  InitAttr attr{};
  attr.version = (2 << 16) + static_cast<int>(sizeof(InitAttr));
  attr.args.version = (2 << 16) + static_cast<int>(sizeof(InitArgs));
  attr.args.uid_args.version = (1 << 16) + static_cast<int>(sizeof(UniqueIdArgs));
  attr.args.uid_args.myrank = -1;
  attr.args.uid_args.nranks = -1;
  attr.args.cuda_device_id = device;
  if (int rc = api.set_attr_uniqueid_args(rank, npes, &uid, &attr); rc != 0) {
    return "nvshmemx_set_attr_uniqueid_args failed with " + std::to_string(rc);
  }
  if (int rc = api.hostlib_init_attr(kInitWithUniqueId, &attr); rc != 0) {
    return "nvshmemx_hostlib_init_attr failed with " + std::to_string(rc) +
           " (NVSHMEM prints why when NVSHMEM_DEBUG=WARN is set)";
  }
  if (api.my_pe() != rank || api.n_pes() != npes) {
    return "NVSHMEM initialised as PE " + std::to_string(api.my_pe()) + " of " +
           std::to_string(api.n_pes()) + ", asked for PE " + std::to_string(rank) + " of " +
           std::to_string(npes);
  }
  initialized = true;
  return "";
}

bool Initialized() {
  std::lock_guard<std::mutex> lock(mu);
  return initialized;
}

int MyPe() { return initialized ? api.my_pe() : -1; }
int NPes() { return initialized ? api.n_pes() : 0; }

std::string Malloc(int device, std::int64_t bytes, std::uintptr_t* ptr) {
  if (!Initialized()) return "NVSHMEM is not initialised";
  if (auto e = cuda::RuntimeError(cudaSetDevice(device), "cudaSetDevice"); !e.empty()) return e;
  void* p = api.malloc(static_cast<std::size_t>(bytes));
  if (p == nullptr) {
    return "nvshmem_malloc(" + std::to_string(bytes) +
           ") returned null (NVSHMEM_SYMMETRIC_SIZE too small, or the GPU is out of memory)";
  }
  // Signals must start at zero: epochs count up from one.
  if (auto e = cuda::RuntimeError(cudaMemset(p, 0, bytes), "cudaMemset"); !e.empty()) return e;
  if (auto e = cuda::RuntimeError(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); !e.empty()) {
    return e;
  }
  *ptr = reinterpret_cast<std::uintptr_t>(p);
  return "";
}

std::string Free(std::uintptr_t ptr) {
  if (!Initialized()) return "NVSHMEM is not initialised";
  api.free(reinterpret_cast<void*>(ptr));
  return "";
}

std::uintptr_t PeerPtr(std::uintptr_t ptr, int pe) {
  if (!Initialized()) return 0;
  return reinterpret_cast<std::uintptr_t>(api.ptr(reinterpret_cast<const void*>(ptr), pe));
}

std::string BarrierAll() {
  if (!Initialized()) return "NVSHMEM is not initialised";
  api.barrier_all();
  return "";
}

std::string CumoduleInit(void* module) {
  if (!Initialized()) return "NVSHMEM is not initialised";
  if (int rc = api.cumodule_init(module); rc != 0) {
    return "nvshmemx_cumodule_init failed with " + std::to_string(rc);
  }
  return "";
}

}  // namespace jaxtdist::nvshmem
