// CPU prologue: the heap is host shared memory mapped into this process and
// into one interpreter worker per rank.
#include <cstring>
#include <string>

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
                       std::int64_t generation, ffi::Span<const std::int64_t> groups,
                       std::int64_t world, std::int64_t align_launch) {
  // The interpreter workers start together; host launches need no alignment.
  (void)align_launch;
  if (std::string stale = CheckGeneration(generation); !stale.empty()) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition, stale);
  }
  const int pos = position.typed_data()[0];
  auto heap = RuntimeState::Get().Heap(pos);
  if (!heap) {
    return ffi::Error::InvalidArgument(
        "jaxtdist: no symmetric heap is registered for mesh position " +
        std::to_string(pos) + "; call jaxtdist.initialize(mesh) first");
  }
  std::string group_err;
  if (RuntimeState::GroupOf(groups.begin(), static_cast<std::int64_t>(groups.size()), world,
                            pos, &group_err) == nullptr) {
    return ffi::Error::InvalidArgument("jaxtdist prologue: " + group_err);
  }
  if (stage.size() > 1) {
    return ffi::Error::InvalidArgument("jaxtdist prologue stages at most one buffer");
  }
  std::int64_t stage_bytes = 0;
  const void* stage_data = nullptr;
  if (stage.size() == 1) {
    auto buf = stage.get<ffi::AnyBuffer>(0);
    if (buf.has_error()) return buf.error();
    stage_bytes = static_cast<std::int64_t>(buf->size_bytes());
    stage_data = buf->untyped_data();
  }
  if (std::string t = RecordedTimeout(*heap, pos); !t.empty()) {
    return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, t);
  }
  std::string bad = CheckStage(*heap, template_offset, stage_offset,
                               parity_bytes, stage_bytes);
  if (!bad.empty()) return ffi::Error::InvalidArgument("jaxtdist: " + bad);

  const std::int64_t epoch = RuntimeState::Get().NextEpoch(counter_id, pos);
  auto* base = reinterpret_cast<char*>(heap->base);
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
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<std::int64_t>("template_offset")
                                  .Attr<std::int64_t>("counter_id")
                                  .Attr<std::int64_t>("stage_offset")
                                  .Attr<std::int64_t>("parity_bytes")
                                  .Attr<std::int64_t>("generation")
                                  .Attr<ffi::Span<const std::int64_t>>("groups")
                                  .Attr<std::int64_t>("world")
                                  .Attr<std::int64_t>("align_launch"));

}  // namespace jaxtdist
