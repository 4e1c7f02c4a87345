#include "cuda_heap.h"

#include <cuda_runtime_api.h>

#include <cstring>

namespace jaxtdist::cuda {
namespace {

std::string Check(cudaError_t err, const char* call) {
  if (err == cudaSuccess) return "";
  return std::string(call) + " failed: " + cudaGetErrorString(err);
}

}  // namespace

std::string DeviceCount(int* count) {
  return Check(cudaGetDeviceCount(count), "cudaGetDeviceCount");
}

std::string MaxSharedPerBlockOptin(int device, int* bytes) {
  return Check(cudaDeviceGetAttribute(bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
               "cudaDeviceGetAttribute(MaxSharedMemoryPerBlockOptin)");
}

std::string MemGetInfo(int device, std::int64_t* free_bytes, std::int64_t* total_bytes) {
  if (auto e = Check(cudaSetDevice(device), "cudaSetDevice"); !e.empty()) return e;
  size_t f = 0, t = 0;
  auto e = Check(cudaMemGetInfo(&f, &t), "cudaMemGetInfo");
  *free_bytes = static_cast<std::int64_t>(f);
  *total_bytes = static_cast<std::int64_t>(t);
  return e;
}

std::string Malloc(int device, std::int64_t bytes, std::uintptr_t* ptr) {
  if (auto e = Check(cudaSetDevice(device), "cudaSetDevice"); !e.empty()) return e;
  void* p = nullptr;
  if (auto e = Check(cudaMalloc(&p, bytes), "cudaMalloc"); !e.empty()) return e;
  // Signals must start at zero: epochs count up from one.
  if (auto e = Check(cudaMemset(p, 0, bytes), "cudaMemset"); !e.empty()) return e;
  if (auto e = Check(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); !e.empty()) return e;
  *ptr = reinterpret_cast<std::uintptr_t>(p);
  return "";
}

std::string Free(int device, std::uintptr_t ptr) {
  if (auto e = Check(cudaSetDevice(device), "cudaSetDevice"); !e.empty()) return e;
  return Check(cudaFree(reinterpret_cast<void*>(ptr)), "cudaFree");
}

std::string EnablePeerAccess(int device, int peer) {
  if (device == peer) return "";
  int can = 0;
  if (auto e = Check(cudaDeviceCanAccessPeer(&can, device, peer), "cudaDeviceCanAccessPeer");
      !e.empty()) {
    return e;
  }
  if (!can) {
    return "CUDA device " + std::to_string(device) + " cannot access device " +
           std::to_string(peer) + " as a peer (no NVLink/PCIe peer path)";
  }
  if (auto e = Check(cudaSetDevice(device), "cudaSetDevice"); !e.empty()) return e;
  cudaError_t err = cudaDeviceEnablePeerAccess(peer, 0);
  if (err == cudaErrorPeerAccessAlreadyEnabled) {
    cudaGetLastError();  // XLA often enabled it already; clear the sticky-free error.
    return "";
  }
  return Check(err, "cudaDeviceEnablePeerAccess");
}

std::string CopyToDevice(int device, std::uintptr_t dst, const void* src, std::int64_t bytes) {
  if (auto e = Check(cudaSetDevice(device), "cudaSetDevice"); !e.empty()) return e;
  return Check(cudaMemcpy(reinterpret_cast<void*>(dst), src, bytes, cudaMemcpyHostToDevice),
               "cudaMemcpy(HostToDevice)");
}

std::string CopyFromDevice(int device, void* dst, std::uintptr_t src, std::int64_t bytes) {
  if (auto e = Check(cudaSetDevice(device), "cudaSetDevice"); !e.empty()) return e;
  return Check(cudaMemcpy(dst, reinterpret_cast<const void*>(src), bytes, cudaMemcpyDeviceToHost),
               "cudaMemcpy(DeviceToHost)");
}

std::string HostAllocMapped(std::int64_t bytes, std::uintptr_t* ptr) {
  void* p = nullptr;
  auto e = Check(cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable),
                 "cudaHostAlloc");
  if (!e.empty()) return e;
  std::memset(p, 0, bytes);
  *ptr = reinterpret_cast<std::uintptr_t>(p);
  return "";
}

std::string FreeHost(std::uintptr_t ptr) {
  return Check(cudaFreeHost(reinterpret_cast<void*>(ptr)), "cudaFreeHost");
}

}  // namespace jaxtdist::cuda
