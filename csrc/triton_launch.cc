#include "triton_launch.h"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "nvshmem_host.h"
#include "call_context.h"
#include "cuda_driver.h"
#include "runtime_state.h"

namespace ffi = xla::ffi;

namespace jaxtdist {
namespace {

// One kernel parameter. cuLaunchKernel reads each through a pointer to its
// value, as many bytes as the kernel's parameter takes (union members all
// start at the slot's first byte).
union ParamSlot {
  std::uint64_t pointer;  // a device address (buffers, scratch)
  std::int64_t i64;
  std::int32_t i32;
  std::uint32_t fp32_bits;
  std::int8_t i1;  // Triton passes i1 as a byte
};

struct Driver {
  decltype(&cuStreamGetCtx) stream_get_ctx;
  decltype(&cuCtxPushCurrent) ctx_push;
  decltype(&cuCtxPopCurrent) ctx_pop;
  decltype(&cuModuleLoadData) module_load_data;
  decltype(&cuModuleGetFunction) module_get_function;
  decltype(&cuFuncSetAttribute) func_set_attribute;
  decltype(&cuLaunchKernel) launch_kernel;

  bool ok() const {
    return stream_get_ctx && ctx_push && ctx_pop && module_load_data && module_get_function &&
           func_set_attribute && launch_kernel;
  }
};

const Driver& GetDriver() {
  static const Driver driver = [] {
    using cuda::DriverFunction;
    Driver d;
    d.stream_get_ctx = DriverFunction<decltype(&cuStreamGetCtx)>("cuStreamGetCtx");
    d.ctx_push = DriverFunction<decltype(&cuCtxPushCurrent)>("cuCtxPushCurrent");
    d.ctx_pop = DriverFunction<decltype(&cuCtxPopCurrent)>("cuCtxPopCurrent");
    d.module_load_data = DriverFunction<decltype(&cuModuleLoadData)>("cuModuleLoadData");
    d.module_get_function = DriverFunction<decltype(&cuModuleGetFunction)>("cuModuleGetFunction");
    d.func_set_attribute = DriverFunction<decltype(&cuFuncSetAttribute)>("cuFuncSetAttribute");
    d.launch_kernel = DriverFunction<decltype(&cuLaunchKernel)>("cuLaunchKernel");
    return d;
  }();
  return driver;
}

// Compiled kernels, and the function each is loaded as in each CUDA context.
// Modules stay loaded until the process exits (a few per program shape).
class KernelTable {
 public:
  static KernelTable& Get() {
    static KernelTable* table = new KernelTable();
    return *table;
  }

  std::int64_t Register(TritonKernelImage image) {
    std::lock_guard<std::mutex> lock(mu_);
    images_.push_back(std::make_unique<const TritonKernelImage>(std::move(image)));
    return static_cast<std::int64_t>(images_.size()) - 1;
  }

  // Kernel `id` in `ctx` if it was loaded there, else nullptr.
  CUfunction Loaded(std::int64_t id, CUcontext ctx) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = loaded_.find({id, ctx});
    return it == loaded_.end() ? nullptr : it->second;
  }

  // Finds or loads kernel `id` in `ctx`; returns "" or what failed.
  //
  // The table's lock is never held while loading: loading a module can wait
  // for the kernels running on that device, and those may spin on peers
  // whose host threads need this table to launch (a cross-device deadlock).
  std::string Function(std::int64_t id, CUcontext ctx, CUfunction* fn,
                       const TritonKernelImage** image) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (id < 0 || id >= static_cast<std::int64_t>(images_.size())) {
        return "unknown kernel id " + std::to_string(id) + " (" +
               std::to_string(images_.size()) + " registered)";
      }
      // Images are never removed: the pointer stays valid (no cubin copy per launch).
      *image = images_[id].get();
      auto it = loaded_.find({id, ctx});
      if (it != loaded_.end()) {
        *fn = it->second;
        return "";
      }
    }
    CUfunction function = nullptr;
    if (std::string e = Load(**image, ctx, &function); !e.empty()) return e;
    std::lock_guard<std::mutex> lock(mu_);
    // Two threads may load the same kernel for one context; both copies work.
    *fn = loaded_.emplace(std::make_pair(id, ctx), function).first->second;
    return "";
  }

 private:
  static std::string Load(const TritonKernelImage& img, CUcontext ctx, CUfunction* fn) {
    const Driver& drv = GetDriver();
    if (std::string e = cuda::DriverError("cuCtxPushCurrent", drv.ctx_push(ctx)); !e.empty()) {
      return e;
    }
    CUmodule module = nullptr;
    std::string err =
        cuda::DriverError("cuModuleLoadData", drv.module_load_data(&module, img.cubin.data()));
    if (err.empty() && img.nvshmem) err = nvshmem::CumoduleInit(module);
    if (err.empty()) {
      err = cuda::DriverError("cuModuleGetFunction",
                              drv.module_get_function(fn, module, img.name.c_str()));
    }
    // Above 48 KiB, dynamic shared memory must be opted into per function.
    // Setting it also makes the driver load the function now, not at its first
    // launch (CUDA's lazy loading), when kernels may already be spinning.
    if (err.empty()) {
      err = cuda::DriverError(
          "cuFuncSetAttribute",
          drv.func_set_attribute(*fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                 img.shared_bytes));
    }
    CUcontext popped = nullptr;
    drv.ctx_pop(&popped);
    return err.empty() ? "" : err + " for kernel " + img.name;
  }

  std::mutex mu_;
  std::vector<std::unique_ptr<const TritonKernelImage>> images_;
  std::map<std::pair<std::int64_t, CUcontext>, CUfunction> loaded_;
};

// Fills `slots` with the kernel's parameters in Triton's order: its
// arguments (`kinds` says which is an XLA buffer, taken in order from
// `buffers`, and which a scalar, taken in order from `scalars`), then the
// global and the profile scratch pointers. Returns "" or what is wrong.
std::string PackParams(const std::vector<void*>& buffers,
                       ffi::Span<const std::int64_t> kinds,
                       ffi::Span<const std::int64_t> scalars, CUdeviceptr global_scratch,
                       CUdeviceptr profile_scratch, std::vector<ParamSlot>* slots) {
  const size_t n_buffers = static_cast<size_t>(
      std::count(kinds.begin(), kinds.end(), static_cast<std::int64_t>(kParamBuffer)));
  if (n_buffers != buffers.size() || kinds.size() - n_buffers != scalars.size()) {
    return "arg_kinds names " + std::to_string(n_buffers) + " buffers and " +
           std::to_string(kinds.size() - n_buffers) + " scalars; the call has " +
           std::to_string(buffers.size()) + " buffers and " + std::to_string(scalars.size()) +
           " scalars";
  }
  slots->assign(kinds.size() + 2, ParamSlot{});
  size_t next_buffer = 0, next_scalar = 0;
  for (size_t i = 0; i < kinds.size(); ++i) {
    ParamSlot& slot = (*slots)[i];
    if (kinds[i] == kParamBuffer) {
      slot.pointer = reinterpret_cast<std::uintptr_t>(buffers[next_buffer++]);
      continue;
    }
    const std::int64_t value = scalars[next_scalar++];
    switch (kinds[i]) {
      case kParamI1: slot.i1 = static_cast<std::int8_t>(value != 0); break;
      case kParamI32: slot.i32 = static_cast<std::int32_t>(value); break;
      case kParamI64: slot.i64 = value; break;
      case kParamFp32: slot.fp32_bits = static_cast<std::uint32_t>(value); break;
      default: return "unknown parameter kind " + std::to_string(kinds[i]);
    }
  }
  (*slots)[kinds.size()].pointer = global_scratch;
  (*slots)[kinds.size() + 1].pointer = profile_scratch;
  return "";
}

ffi::Error TritonLaunchCuda(cudaStream_t stream, std::int32_t device_ordinal,
                            ffi::RemainingArgs args, ffi::RemainingRets rets,
                            std::int64_t kernel_id, std::int64_t grid_x, std::int64_t grid_y,
                            std::int64_t grid_z, std::int64_t scratch_offset,
                            std::int64_t align_counter, ffi::Span<const std::int64_t> arg_kinds,
                            ffi::Span<const std::int64_t> scalars, std::int64_t generation,
                            ffi::Span<const std::int64_t> groups, std::int64_t world) {
  // align_counter >= 0: the launch rendezvous of the call whose prologue
  // advanced that workspace counter (launch_align.h); it needs the group.
  // Otherwise the heap is needed only for a scratch slice (checked below).
  auto call = Resolve(CallSite::OnDevice("jaxtdist: Triton launcher", device_ordinal),
                      CallAttrs{generation, groups, world},
                      align_counter >= 0 ? kNeedGroup : 0);
  if (call.has_error()) return call.error();
  const Driver& drv = GetDriver();
  if (!drv.ok()) {
    return ffi::Error::Internal("jaxtdist: the CUDA driver lacks a function the Triton "
                                "launcher needs (driver older than CUDA 12.0?)");
  }
  CUstream cu_stream = reinterpret_cast<CUstream>(stream);
  CUcontext ctx = nullptr;
  if (std::string e = cuda::DriverError("cuStreamGetCtx", drv.stream_get_ctx(cu_stream, &ctx));
      !e.empty()) {
    return ffi::Error::Internal("jaxtdist: " + e);
  }
  CUfunction fn = nullptr;
  const TritonKernelImage* image = nullptr;
  if (std::string e = KernelTable::Get().Function(kernel_id, ctx, &fn, &image); !e.empty()) {
    return ffi::Error::Internal("jaxtdist: Triton launcher: " + e);
  }
  const std::int64_t programs = grid_x * grid_y * grid_z;
  CUdeviceptr global_scratch = 0;
  if (image->scratch_bytes > 0) {
    if (!call->heap) return ffi::Error::InvalidArgument(NoHeapForDevice(device_ordinal));
    const HeapSlot& heap = *call->heap;
    const std::int64_t need = programs * image->scratch_bytes;
    if (scratch_offset < 0 || scratch_offset + need > heap.bytes) {
      return ffi::Error::InvalidArgument(
          "jaxtdist: Triton launcher: scratch [" + std::to_string(scratch_offset) + ", +" +
          std::to_string(need) + ") lies outside the " + std::to_string(heap.bytes) +
          "-byte heap");
    }
    global_scratch = static_cast<CUdeviceptr>(heap.base + scratch_offset);
  }
  const size_t n_args = args.size(), n_rets = rets.size();
  std::vector<void*> buffers(n_args + n_rets);
  for (size_t i = 0; i < n_args; ++i) {
    auto buf = args.get<ffi::AnyBuffer>(i);
    if (buf.has_error()) return buf.error();
    buffers[i] = buf->untyped_data();
  }
  for (size_t i = 0; i < n_rets; ++i) {
    auto buf = rets.get<ffi::AnyBuffer>(i);
    if (buf.has_error()) return buf.error();
    buffers[n_args + i] = (*buf)->untyped_data();
  }
  std::vector<ParamSlot> slots;
  if (std::string e = PackParams(buffers, arg_kinds, scalars, global_scratch,
                                 /*profile_scratch=*/0, &slots);
      !e.empty()) {
    return ffi::Error::InvalidArgument("jaxtdist: Triton launcher: " + e + " for kernel " +
                                       image->name);
  }
  // cuLaunchKernel reads each parameter through a pointer to its value.
  std::vector<void*> params(slots.size());
  for (size_t i = 0; i < slots.size(); ++i) params[i] = &slots[i];
  // Held here rather than in the prologue, so that only cuLaunchKernel runs
  // after the rendezvous.
  const bool align = align_counter >= 0;
  const std::int64_t align_epoch =
      align ? RuntimeState::Get().PeekEpoch(align_counter, call->position) : 0;
  // The function belongs to `ctx`; make it current for the launch too.
  if (std::string e = cuda::DriverError("cuCtxPushCurrent", drv.ctx_push(ctx)); !e.empty()) {
    return ffi::Error::Internal("jaxtdist: " + e);
  }
  if (align) call->AlignLaunch(align_counter, align_epoch);
  CUresult res = drv.launch_kernel(fn, static_cast<unsigned>(grid_x),
                                   static_cast<unsigned>(grid_y), static_cast<unsigned>(grid_z),
                                   image->threads, 1, 1, image->shared_bytes, cu_stream,
                                   params.data(), nullptr);
  CUcontext popped = nullptr;
  drv.ctx_pop(&popped);
  if (res != CUDA_SUCCESS) {
    return ffi::Error::Internal("jaxtdist: " + cuda::DriverError("cuLaunchKernel", res) +
                                " for kernel " + image->name);
  }
  return ffi::Error::Success();
}

}  // namespace

std::int64_t RegisterTritonKernel(TritonKernelImage image) {
  return KernelTable::Get().Register(std::move(image));
}

std::string PreloadTritonKernel(std::int64_t id, int device_ordinal) {
  using DeviceGetFn = decltype(&cuDeviceGet);
  using RetainFn = decltype(&cuDevicePrimaryCtxRetain);
  using ReleaseFn = decltype(&cuDevicePrimaryCtxRelease);
  static DeviceGetFn device_get = cuda::DriverFunction<DeviceGetFn>("cuDeviceGet");
  static RetainFn retain = cuda::DriverFunction<RetainFn>("cuDevicePrimaryCtxRetain");
  static ReleaseFn release = cuda::DriverFunction<ReleaseFn>("cuDevicePrimaryCtxRelease");
  if (device_get == nullptr || retain == nullptr || release == nullptr) {
    return "the CUDA driver lacks cuDeviceGet or the primary-context calls";
  }
  CUdevice device;
  if (std::string e = cuda::DriverError("cuDeviceGet", device_get(&device, device_ordinal));
      !e.empty()) {
    return e;
  }
  // XLA runs on each device's primary context (and keeps it retained).
  CUcontext ctx = nullptr;
  if (std::string e = cuda::DriverError("cuDevicePrimaryCtxRetain", retain(&ctx, device));
      !e.empty()) {
    return e;
  }
  CUfunction fn = nullptr;
  const TritonKernelImage* image = nullptr;
  std::string err = KernelTable::Get().Function(id, ctx, &fn, &image);
  release(device);
  return err;
}

void* LoadedTritonKernel(std::int64_t id, void* ctx) {
  return KernelTable::Get().Loaded(id, static_cast<CUcontext>(ctx));
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxtdistTritonLaunchCuda, TritonLaunchCuda,
                              BindCallAttrs(ffi::Ffi::Bind()
                                                .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                                .Ctx<ffi::DeviceOrdinal>()
                                                .RemainingArgs()
                                                .RemainingRets()
                                                .Attr<std::int64_t>("kernel_id")
                                                .Attr<std::int64_t>("grid_x")
                                                .Attr<std::int64_t>("grid_y")
                                                .Attr<std::int64_t>("grid_z")
                                                .Attr<std::int64_t>("scratch_offset")
                                                .Attr<std::int64_t>("align_counter")
                                                .Attr<ffi::Span<const std::int64_t>>("arg_kinds")
                                                .Attr<ffi::Span<const std::int64_t>>("scalars")));

}  // namespace jaxtdist
