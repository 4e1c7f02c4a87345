// CPU prologue: the heap is host shared memory mapped into this process and
// into one interpreter worker per rank.
#include <cstring>
#include <string>

#include "call_context.h"
#include "prologue.h"
#include "runtime_state.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxtdist {
namespace {

ffi::Error PrologueCpu(ffi::Buffer<ffi::S32> position, ffi::RemainingArgs stage,
                       ffi::ResultBuffer<ffi::S32> ctx_out,
                       std::int64_t template_offset, std::int64_t counter_id,
                       std::int64_t stage_offset, std::int64_t parity_bytes,
                       std::int64_t align_launch, std::int64_t stages,
                       std::int64_t generation,
                       ffi::Span<const std::int64_t> groups, std::int64_t world) {
  // The interpreter workers start together; host launches need no alignment.
  (void)align_launch;
  // One process plays every mesh position: the program says which one.
  auto call = Resolve(CallSite::AtPosition("jaxtdist prologue", position.typed_data()[0]),
                      CallAttrs{generation, groups, world}, kNeedGroup | kNeedNoTimeout);
  if (call.has_error()) return call.error();
  const int pos = call->position;
  const HeapSlot& heap = *call->heap;
  auto staged =
      CheckedStage(stage, stages, heap, template_offset, stage_offset, parity_bytes);
  if (staged.has_error()) return staged.error();
  const std::int64_t stage_bytes = staged->bytes;
  const void* stage_data = staged->data;

  const std::int64_t epoch = RuntimeState::Get().NextEpoch(counter_id, pos);
  auto* base = reinterpret_cast<char*>(heap.base);
  if (stage_bytes > 0) {
    std::memcpy(base + stage_offset + (epoch & 1) * parity_bytes, stage_data,
                stage_bytes);
  }
  auto* ctx = reinterpret_cast<std::int64_t*>(ctx_out->typed_data());
  std::memcpy(ctx, base + template_offset, kCtxWords * sizeof(std::int64_t));
  ctx[kCtxEpochWord] = epoch;
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxtdistPrologueCpu, PrologueCpu,
                              BindPrologueAttrs(ffi::Ffi::Bind()
                                                    .Arg<ffi::Buffer<ffi::S32>>()
                                                    .RemainingArgs()
                                                    .Ret<ffi::Buffer<ffi::S32>>()));

}  // namespace jaxtdist
