// The copy-engine producer of ag_matmul: an XLA FFI handler that pushes
// this rank's shard into every peer's heap inbox with peer copies (the
// copy engines) on side streams and raises a flag per chunk with stream
// memory writes, while the GEMM kernel, launched right after it on XLA's
// stream, uses every SM and waits on those flags. A push thread per device
// can do the enqueuing, off XLA's thread.
#ifndef JAXTDIST_CSRC_CE_GATHER_H_
#define JAXTDIST_CSRC_CE_GATHER_H_

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace jaxtdist {

// Process-wide counts and host times of the copy-engine handler's calls.
struct CePushStats {
  std::int64_t inline_pushes = 0;  // calls whose handler enqueued the pushes
  std::int64_t thread_pushes = 0;  // calls handed to the device's push thread
  double handler_us = 0;           // host time in the handler, launch rendezvous included
  double enqueue_us = 0;           // of which enqueuing or handing over the pushes
  double thread_enqueue_us = 0;    // push threads' time enqueuing
};
CePushStats GetCePushStats();

// Waits until every push thread has enqueued the calls handed to it (before
// the heaps are freed).
void DrainCePushes();

extern "C" XLA_FFI_Error* JaxtdistCeGatherCuda(XLA_FFI_CallFrame* call_frame);

}  // namespace jaxtdist

#endif  // JAXTDIST_CSRC_CE_GATHER_H_
