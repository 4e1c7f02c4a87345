// The copy-engine producer of ag_matmul: an XLA FFI handler that pushes
// this rank's shard into every peer's heap inbox with peer copies (the
// copy engines) on side streams and raises a flag per chunk with stream
// memory writes, while the GEMM kernel, launched right after it on XLA's
// stream, uses every SM and waits on those flags.
#ifndef JAXTDIST_CSRC_CE_GATHER_H_
#define JAXTDIST_CSRC_CE_GATHER_H_

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace jaxtdist {

// Process-wide count and host times of the copy-engine handler's calls.
struct CePushStats {
  std::int64_t calls = 0;
  double handler_us = 0;  // host time in the handler, launch rendezvous included
  double enqueue_us = 0;  // of which enqueuing the pushes
};
CePushStats GetCePushStats();

extern "C" XLA_FFI_Error* JaxtdistCeGatherCuda(XLA_FFI_CallFrame* call_frame);

}  // namespace jaxtdist

#endif  // JAXTDIST_CSRC_CE_GATHER_H_
