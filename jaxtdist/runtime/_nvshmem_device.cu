// Device-side entry points that jaxtdist.language.shmem calls from Triton
// kernels, linked (nvlink) with NVSHMEM's device library into the kernel's
// cubin by jaxtdist/runtime/_shmem_link.py.
//
// Why wrappers: Triton's extern calls return a value and take integer
// arguments, while NVSHMEM's functions return void and take pointers; the
// prototypes must match exactly at link time. Every wrapper is called by
// every thread of the program (Triton has no single-thread calls), so the
// functions that NVSHMEM defines per thread issue from thread 0 only.
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstdint>

namespace {
__device__ bool FirstThread() { return threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0; }
template <typename T>
__device__ T* Ptr(long long address) { return reinterpret_cast<T*>(address); }
}  // namespace

extern "C" {

// Block-wide: every thread of the program takes part.
__device__ int jaxtdist_shmem_putmem_nbi_block(long long dest, long long source,
                                               long long nbytes, int pe) {
  nvshmemx_putmem_nbi_block(Ptr<void>(dest), Ptr<const void>(source),
                            static_cast<size_t>(nbytes), pe);
  return 0;
}

__device__ int jaxtdist_shmem_putmem_signal_nbi_block(long long dest, long long source,
                                                      long long nbytes, long long sig_addr,
                                                      long long signal, int sig_op, int pe) {
  nvshmemx_putmem_signal_nbi_block(Ptr<void>(dest), Ptr<const void>(source),
                                   static_cast<size_t>(nbytes), Ptr<uint64_t>(sig_addr),
                                   static_cast<uint64_t>(signal), sig_op, pe);
  return 0;
}

__device__ int jaxtdist_shmem_barrier_all_block(int) {
  nvshmemx_barrier_all_block();
  return 0;
}

// Per thread in NVSHMEM: issued once, after every thread's earlier work.
__device__ int jaxtdist_shmem_signal_op(long long sig_addr, long long signal, int sig_op,
                                        int pe) {
  __syncthreads();
  if (FirstThread()) {
    nvshmemx_signal_op(Ptr<uint64_t>(sig_addr), static_cast<uint64_t>(signal), sig_op, pe);
  }
  __syncthreads();
  return 0;
}

__device__ int jaxtdist_shmem_fence(int) {
  __syncthreads();
  nvshmem_fence();
  __syncthreads();
  return 0;
}

__device__ int jaxtdist_shmem_quiet(int) {
  __syncthreads();
  nvshmem_quiet();
  __syncthreads();
  return 0;
}

__device__ int jaxtdist_shmem_my_pe(int) { return nvshmem_my_pe(); }
__device__ int jaxtdist_shmem_n_pes(int) { return nvshmem_n_pes(); }

}  // extern "C"
