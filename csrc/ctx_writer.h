// The CUDA prologue's context write: one single-thread kernel whose parameters
// carry the call's context words (the layout's template with this call's
// epoch) stores them into XLA's context buffer. One stream operation where a
// device-to-device copy of the heap's template and a memset of the epoch took
// two. On one H200: 1.7 us against 3.0 us of GPU time per call between
// kernels queued back to back, about 2.2 us less host time per call, and
// 0.5-1.1 us less per call in a chain of flash_decode calls under jax.jit.
// (One batch of 72 stream memory writes took 53 us; a host-to-device copy
// from pinned memory 2.8 us.)
#ifndef JAXTDIST_CSRC_CTX_WRITER_H_
#define JAXTDIST_CSRC_CTX_WRITER_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

namespace jaxtdist {

// Loads the writer on a device (its primary context) ahead of any call, as
// PreloadTritonKernel does for kernels (loading while our kernels run could
// wait for them); returns "" or what failed.
std::string PreloadContextWriter(int device_ordinal);

// Enqueues the write of kCtxWords `words` to `dst` on `stream`. Sets *written
// to false, enqueuing nothing, where the writer was not loaded in the stream's
// context (the caller then copies the template instead); returns "" or what
// failed.
std::string WriteContext(cudaStream_t stream, void* dst, const std::int64_t* words,
                         bool* written);

// Calls that wrote their context with the writer and with the copy.
struct ContextWriteStats {
  std::int64_t kernel = 0;
  std::int64_t copy = 0;
};
ContextWriteStats GetContextWriteStats();
void CountContextCopy();

}  // namespace jaxtdist

#endif  // JAXTDIST_CSRC_CTX_WRITER_H_
