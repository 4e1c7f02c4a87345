#include "cuda_heap.h"

#include <cuda_runtime_api.h>

#include <cstring>

#include "cuda_driver.h"

namespace jaxtdist::cuda {
std::string DeviceCount(int* count) {
  return RuntimeError(cudaGetDeviceCount(count), "cudaGetDeviceCount");
}

std::string MaxSharedPerBlockOptin(int device, int* bytes) {
  return RuntimeError(
      cudaDeviceGetAttribute(bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
      "cudaDeviceGetAttribute(MaxSharedMemoryPerBlockOptin)");
}

std::string MemGetInfo(int device, std::int64_t* free_bytes, std::int64_t* total_bytes) {
  if (auto e = RuntimeError(cudaSetDevice(device), "cudaSetDevice"); !e.empty()) return e;
  size_t f = 0, t = 0;
  auto e = RuntimeError(cudaMemGetInfo(&f, &t), "cudaMemGetInfo");
  *free_bytes = static_cast<std::int64_t>(f);
  *total_bytes = static_cast<std::int64_t>(t);
  return e;
}

std::string Malloc(int device, std::int64_t bytes, std::uintptr_t* ptr) {
  if (auto e = RuntimeError(cudaSetDevice(device), "cudaSetDevice"); !e.empty()) return e;
  void* p = nullptr;
  if (auto e = RuntimeError(cudaMalloc(&p, bytes), "cudaMalloc"); !e.empty()) return e;
  // Signals must start at zero: epochs count up from one.
  if (auto e = RuntimeError(cudaMemset(p, 0, bytes), "cudaMemset"); !e.empty()) return e;
  if (auto e = RuntimeError(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); !e.empty()) return e;
  *ptr = reinterpret_cast<std::uintptr_t>(p);
  return "";
}

std::string Free(int device, std::uintptr_t ptr) {
  if (auto e = RuntimeError(cudaSetDevice(device), "cudaSetDevice"); !e.empty()) return e;
  return RuntimeError(cudaFree(reinterpret_cast<void*>(ptr)), "cudaFree");
}

std::string Zero(int device, std::uintptr_t ptr, std::int64_t bytes) {
  if (auto e = RuntimeError(cudaSetDevice(device), "cudaSetDevice"); !e.empty()) return e;
  if (auto e = RuntimeError(cudaMemset(reinterpret_cast<void*>(ptr), 0, bytes), "cudaMemset");
      !e.empty()) {
    return e;
  }
  return RuntimeError(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

std::string EnablePeerAccess(int device, int peer) {
  if (device == peer) return "";
  int can = 0;
  if (auto e = RuntimeError(cudaDeviceCanAccessPeer(&can, device, peer), "cudaDeviceCanAccessPeer");
      !e.empty()) {
    return e;
  }
  if (!can) {
    return "CUDA device " + std::to_string(device) + " cannot access device " +
           std::to_string(peer) + " as a peer (no NVLink/PCIe peer path)";
  }
  if (auto e = RuntimeError(cudaSetDevice(device), "cudaSetDevice"); !e.empty()) return e;
  cudaError_t err = cudaDeviceEnablePeerAccess(peer, 0);
  if (err == cudaErrorPeerAccessAlreadyEnabled) {
    cudaGetLastError();  // XLA often enabled it already; clear the sticky-free error.
    return "";
  }
  return RuntimeError(err, "cudaDeviceEnablePeerAccess");
}

std::string CopyToDevice(int device, std::uintptr_t dst, const void* src, std::int64_t bytes) {
  if (auto e = RuntimeError(cudaSetDevice(device), "cudaSetDevice"); !e.empty()) return e;
  return RuntimeError(cudaMemcpy(reinterpret_cast<void*>(dst), src, bytes, cudaMemcpyHostToDevice),
                      "cudaMemcpy(HostToDevice)");
}

std::string CopyFromDevice(int device, void* dst, std::uintptr_t src, std::int64_t bytes) {
  if (auto e = RuntimeError(cudaSetDevice(device), "cudaSetDevice"); !e.empty()) return e;
  return RuntimeError(
      cudaMemcpy(dst, reinterpret_cast<const void*>(src), bytes, cudaMemcpyDeviceToHost),
      "cudaMemcpy(DeviceToHost)");
}

std::string HostAllocMapped(std::int64_t bytes, std::uintptr_t* ptr) {
  void* p = nullptr;
  auto e = RuntimeError(cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable),
                 "cudaHostAlloc");
  if (!e.empty()) return e;
  std::memset(p, 0, bytes);
  *ptr = reinterpret_cast<std::uintptr_t>(p);
  return "";
}

std::string FreeHost(std::uintptr_t ptr) {
  return RuntimeError(cudaFreeHost(reinterpret_cast<void*>(ptr)), "cudaFreeHost");
}

}  // namespace jaxtdist::cuda
