// The prologue every jaxtdist op runs before its kernel: it advances the
// op's epoch, stages one XLA buffer into this rank's symmetric heap slot and
// writes the kernel context (rank, peers' heap bases, epoch, ...) into an
// XLA buffer, so one SPMD executable serves every device.
#ifndef JAXTDIST_CSRC_PROLOGUE_H_
#define JAXTDIST_CSRC_PROLOGUE_H_

#include <cstdint>
#include <string>
#include <utility>

#include "call_context.h"
#include "runtime_state.h"
#include "xla/ffi/api/ffi.h"

namespace jaxtdist {

// Appends the prologue's attributes, shared by the CPU and CUDA handlers, to
// a binding; the handler takes them in this order, the CallAttrs last:
//   template_offset  heap offset of this layout's context template
//   counter_id       which epoch counter advances
//   stage_offset     heap offset of the staging slot (parity 0)
//   parity_bytes     distance between the two parity slots
//   align_launch     nonzero: hold the launch rendezvous here (CUDA)
template <typename Binding>
auto BindPrologueAttrs(Binding binding) {
  return BindCallAttrs(std::move(binding)
                           .template Attr<std::int64_t>("template_offset")
                           .template Attr<std::int64_t>("counter_id")
                           .template Attr<std::int64_t>("stage_offset")
                           .template Attr<std::int64_t>("parity_bytes")
                           .template Attr<std::int64_t>("align_launch")
                           .template Attr<std::int64_t>("stages"));
}

// The XLA buffer a prologue stages into its heap slot (none: 0 bytes).
struct StageSource {
  const void* data = nullptr;
  std::int64_t bytes = 0;
};

// The prologue's staged buffer (at most one) once it and the context
// template are known to fit `heap`; else an InvalidArgument error.
// The first `stages` (0 or 1) of a prologue's remaining operands are the buffer to
// stage; the rest are the call's ordering dependencies (the previous jaxtdist op's
// output, the op's inputs): operands only, so that XLA cannot run the prologue,
// which advances the epoch, before them.
inline xla::ffi::ErrorOr<StageSource> CheckedStage(const xla::ffi::RemainingArgs& stage,
                                                   std::int64_t stages,
                                                   const HeapSlot& heap,
                                                   std::int64_t template_offset,
                                                   std::int64_t stage_offset,
                                                   std::int64_t parity_bytes) {
  using xla::ffi::Error;
  using xla::ffi::Unexpected;
  if (stages < 0 || stages > 1 || static_cast<std::int64_t>(stage.size()) < stages) {
    return Unexpected<Error>(Error::InvalidArgument(
        "jaxtdist prologue stages at most one buffer (stages=" + std::to_string(stages) +
        ", operands=" + std::to_string(stage.size()) + ")"));
  }
  StageSource src;
  if (stages == 1) {
    auto buf = stage.get<xla::ffi::AnyBuffer>(0);
    if (buf.has_error()) return Unexpected<Error>(buf.error());
    src.bytes = static_cast<std::int64_t>(buf->size_bytes());
    src.data = buf->untyped_data();
  }
  std::string bad = CheckStage(heap, template_offset, stage_offset, parity_bytes, src.bytes);
  if (!bad.empty()) return Unexpected<Error>(Error::InvalidArgument("jaxtdist: " + bad));
  return src;
}

// Handler symbols exported to Python as PyCapsules.
extern "C" XLA_FFI_Error* JaxtdistPrologueCpu(XLA_FFI_CallFrame* call_frame);
#ifdef JAXTDIST_WITH_CUDA
extern "C" XLA_FFI_Error* JaxtdistPrologueCuda(XLA_FFI_CallFrame* call_frame);
#endif

}  // namespace jaxtdist

#endif  // JAXTDIST_CSRC_PROLOGUE_H_
