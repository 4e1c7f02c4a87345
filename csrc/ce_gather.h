// The copy-engine producer of ag_matmul: an XLA FFI handler that pushes
// this rank's shard into every peer's heap inbox with peer copies (the
// copy engines; one CUDA graph launch per call) on a side stream and raises
// a flag per chunk, while the GEMM kernel, launched right after it on XLA's
// stream, uses every SM and waits on those flags.
#ifndef JAXTDIST_CSRC_CE_GATHER_H_
#define JAXTDIST_CSRC_CE_GATHER_H_

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace jaxtdist {

// Process-wide counts of how the copy-engine handler enqueued its pushes.
struct CePushStats {
  std::int64_t graphs_built = 0;     // CUDA graphs built (one per plan and device)
  std::int64_t graph_launches = 0;   // calls pushed by one graph launch
  std::int64_t graph_retargets = 0;  // cached graphs re-pointed at a new x
  std::int64_t call_pushes = 0;      // calls pushed by a driver call per chunk
  double handler_us = 0;             // host time in the handler, launch rendezvous included
  double enqueue_us = 0;             // of which enqueuing the pushes
};
CePushStats GetCePushStats();

extern "C" XLA_FFI_Error* JaxtdistCeGatherCuda(XLA_FFI_CallFrame* call_frame);

}  // namespace jaxtdist

#endif  // JAXTDIST_CSRC_CE_GATHER_H_
