// The prologue every jaxtdist op runs before its kernel: it advances the
// op's epoch, stages one XLA buffer into this rank's symmetric heap slot and
// writes the kernel context (rank, peers' heap bases, epoch, ...) into an
// XLA buffer, so one SPMD executable serves every device.
#ifndef JAXTDIST_CSRC_PROLOGUE_H_
#define JAXTDIST_CSRC_PROLOGUE_H_

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace jaxtdist {

// Attributes shared by the CPU and CUDA prologue handlers.
struct PrologueAttrs {
  std::int64_t template_offset;  // heap offset of this layout's context template
  std::int64_t counter_id;       // which epoch counter advances
  std::int64_t stage_offset;     // heap offset of the staging slot (parity 0)
  std::int64_t parity_bytes;     // distance between the two parity slots
};

// Handler symbols exported to Python as PyCapsules.
extern "C" XLA_FFI_Error* JaxtdistPrologueCpu(XLA_FFI_CallFrame* call_frame);
#ifdef JAXTDIST_WITH_CUDA
extern "C" XLA_FFI_Error* JaxtdistPrologueCuda(XLA_FFI_CallFrame* call_frame);
#endif

}  // namespace jaxtdist

#endif  // JAXTDIST_CSRC_PROLOGUE_H_
