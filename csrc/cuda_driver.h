// CUDA driver API entry points, resolved through the runtime
// (cudaGetDriverEntryPointByVersion) so that nothing links libcuda directly:
// the library then loads on machines whose driver lives only in the
// process's already-loaded libcuda (XLA's).
#ifndef JAXTDIST_CSRC_CUDA_DRIVER_H_
#define JAXTDIST_CSRC_CUDA_DRIVER_H_

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <string>

namespace jaxtdist::cuda {

// Returns the driver function `name` (ABI of CUDA 12.0), or nullptr.
template <typename Fn>
Fn DriverFunction(const char* name) {
  void* sym = nullptr;
  cudaDriverEntryPointQueryResult status;
  if (cudaGetDriverEntryPointByVersion(name, &sym, 12000, cudaEnableDefault, &status) !=
          cudaSuccess ||
      status != cudaDriverEntryPointSuccess) {
    return nullptr;
  }
  return reinterpret_cast<Fn>(sym);
}

// "" for cudaSuccess, else "<call> failed: <CUDA's description>".
inline std::string RuntimeError(cudaError_t err, const char* call) {
  if (err == cudaSuccess) return "";
  return std::string(call) + " failed: " + cudaGetErrorString(err);
}

// "" for CUDA_SUCCESS, else "<call> failed with CUresult <code>".
inline std::string DriverError(const char* call, CUresult res) {
  if (res == CUDA_SUCCESS) return "";
  return std::string(call) + " failed with CUresult " + std::to_string(static_cast<int>(res));
}

}  // namespace jaxtdist::cuda

#endif  // JAXTDIST_CSRC_CUDA_DRIVER_H_
