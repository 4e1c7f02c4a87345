// Host-side CUDA helpers for the single-process heap backend: one
// equal-sized allocation per GPU, peer access between them, a mapped
// pinned page per GPU where kernels record wait timeouts.
#ifndef JAXTDIST_CSRC_CUDA_HEAP_H_
#define JAXTDIST_CSRC_CUDA_HEAP_H_

#include <cstdint>
#include <string>

namespace jaxtdist::cuda {

// Each returns "" on success or a message naming the failed call.
std::string DeviceCount(int* count);
std::string MaxSharedPerBlockOptin(int device, int* bytes);
std::string MemGetInfo(int device, std::int64_t* free_bytes, std::int64_t* total_bytes);
std::string Malloc(int device, std::int64_t bytes, std::uintptr_t* ptr);
std::string Free(int device, std::uintptr_t ptr);
// Zero-fills `bytes` at `ptr` and waits for it.
std::string Zero(int device, std::uintptr_t ptr, std::int64_t bytes);
std::string EnablePeerAccess(int device, int peer);
std::string CopyToDevice(int device, std::uintptr_t dst, const void* src, std::int64_t bytes);
std::string CopyFromDevice(int device, void* dst, std::uintptr_t src, std::int64_t bytes);
std::string HostAllocMapped(std::int64_t bytes, std::uintptr_t* ptr);
std::string FreeHost(std::uintptr_t ptr);

}  // namespace jaxtdist::cuda

#endif  // JAXTDIST_CSRC_CUDA_HEAP_H_
