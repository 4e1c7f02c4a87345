#include "ctx_writer.h"

#include <cuda.h>

#include <atomic>
#include <string>

#include "cuda_driver.h"
#include "runtime_state.h"
#include "triton_launch.h"

namespace jaxtdist {
namespace {

constexpr const char* kWriterName = "jaxtdist_write_ctx";

// PTX, compiled by the driver for whatever GPU loads it: nothing to build
// with nvcc. One thread stores the words parameter by parameter.
std::string WriterPtx() {
  std::string ptx =
      ".version 7.0\n.target sm_75\n.address_size 64\n"
      ".visible .entry " + std::string(kWriterName) +
      "(.param .u64 dst, .param .align 8 .b8 words[" + std::to_string(kCtxWords * 8) +
      "])\n{\n.reg .b64 %rd<4>;\nld.param.u64 %rd1, [dst];\ncvta.to.global.u64 %rd2, %rd1;\n";
  for (int k = 0; k < kCtxWords; ++k) {
    const std::string at = std::to_string(8 * k);
    ptx += "ld.param.u64 %rd3, [words+" + at + "];\nst.global.u64 [%rd2+" + at + "], %rd3;\n";
  }
  return ptx + "ret;\n}\n";
}

// The writer's id in the kernel table, registered on first use.
std::int64_t WriterId() {
  static const std::int64_t id = [] {
    TritonKernelImage image;
    image.cubin = WriterPtx();  // cuModuleLoadData takes NUL-terminated PTX too
    image.name = kWriterName;
    image.threads = 1;
    return RegisterTritonKernel(std::move(image));
  }();
  return id;
}

std::atomic<std::int64_t> kernel_writes{0};
std::atomic<std::int64_t> copy_writes{0};

}  // namespace

std::string PreloadContextWriter(int device_ordinal) {
  return PreloadTritonKernel(WriterId(), device_ordinal);
}

std::string WriteContext(cudaStream_t stream, void* dst, const std::int64_t* words,
                         bool* written) {
  using StreamGetCtxFn = decltype(&cuStreamGetCtx);
  using LaunchFn = decltype(&cuLaunchKernel);
  static StreamGetCtxFn stream_get_ctx = cuda::DriverFunction<StreamGetCtxFn>("cuStreamGetCtx");
  static LaunchFn launch = cuda::DriverFunction<LaunchFn>("cuLaunchKernel");
  *written = false;
  if (stream_get_ctx == nullptr || launch == nullptr) return "";
  CUcontext ctx = nullptr;
  if (stream_get_ctx(reinterpret_cast<CUstream>(stream), &ctx) != CUDA_SUCCESS) return "";
  auto fn = static_cast<CUfunction>(LoadedTritonKernel(WriterId(), ctx));
  if (fn == nullptr) return "";
  void* params[] = {&dst, const_cast<std::int64_t*>(words)};
  CUresult res = launch(fn, 1, 1, 1, 1, 1, 1, 0, reinterpret_cast<CUstream>(stream), params,
                        nullptr);
  if (res != CUDA_SUCCESS) return cuda::DriverError("cuLaunchKernel (context writer)", res);
  *written = true;
  kernel_writes.fetch_add(1, std::memory_order_relaxed);
  return "";
}

void CountContextCopy() { copy_writes.fetch_add(1, std::memory_order_relaxed); }

ContextWriteStats GetContextWriteStats() {
  return {kernel_writes.load(std::memory_order_relaxed),
          copy_writes.load(std::memory_order_relaxed)};
}

}  // namespace jaxtdist
