// NVSHMEM's host library, loaded at run time (dlopen), for the heap of a job
// that runs one process per GPU. Nothing links NVSHMEM: a single-process job
// never loads it, and a missing library is an error naming the file.
//
// One NVSHMEM job per process: NVSHMEM cannot be initialised twice, so the
// first initialisation holds for the life of the process (see
// jaxtdist/runtime/_nvshmem.py, which reuses the heap across runtimes).
#ifndef JAXTDIST_CSRC_NVSHMEM_HOST_H_
#define JAXTDIST_CSRC_NVSHMEM_HOST_H_

#include <cstdint>
#include <string>

namespace jaxtdist::nvshmem {

// Each returns "" on success or a message naming what failed.
std::string Load(const std::string& host_library_path);
bool Loaded();
// A fresh unique id (NVSHMEM's 128-byte nvshmemx_uniqueid_t), made by one PE
// and handed to every PE out of band.
std::string GetUniqueId(std::string* id);
// Initialises this process as PE `rank` of `npes` on CUDA device `device`.
std::string InitWithUniqueId(int device, int rank, int npes, const std::string& id);
bool Initialized();
int MyPe();
int NPes();
// Collective: every PE calls it with the same size; zero-filled.
std::string Malloc(int device, std::int64_t bytes, std::uintptr_t* ptr);
// Collective.
std::string Free(std::uintptr_t ptr);
// `ptr` (symmetric) of PE `pe` as this process can load/store it; 0 when the
// peer is not reachable that way (another node).
std::uintptr_t PeerPtr(std::uintptr_t ptr, int pe);
std::string BarrierAll();
// Binds NVSHMEM's device state in a loaded CUmodule that calls NVSHMEM
// device functions (jaxlib's launcher never does).
std::string CumoduleInit(void* module);

}  // namespace jaxtdist::nvshmem

#endif  // JAXTDIST_CSRC_NVSHMEM_HOST_H_
