#include "call_context.h"

#include <string>

namespace ffi = xla::ffi;

namespace jaxtdist {
namespace {

ffi::Unexpected<ffi::Error> Fail(ffi::ErrorCode code, std::string message) {
  return ffi::Unexpected<ffi::Error>(ffi::Error(code, std::move(message)));
}

}  // namespace

ffi::ErrorOr<CallContext> Resolve(const CallSite& site, const CallAttrs& attrs, unsigned need) {
  CallContext call;
  call.entered = LaunchClock::now();
  call.world = attrs.world;
  // First: a stale program's offsets and signals mean nothing in this runtime.
  if (std::string stale = CheckGeneration(attrs.generation); !stale.empty()) {
    return Fail(ffi::ErrorCode::kFailedPrecondition, std::move(stale));
  }
  const RuntimeState& state = RuntimeState::Get();
  std::optional<int> pos = site.position;
  if (site.device_ordinal >= 0) pos = state.PositionOfDevice(site.device_ordinal);
  if (pos) call.heap = state.Heap(*pos);
  if (!call.heap) {
    if ((need & kNeedHeap) == 0) return call;
    return Fail(ffi::ErrorCode::kInvalidArgument, site.device_ordinal >= 0
                                                      ? NoHeapForDevice(site.device_ordinal)
                                                      : NoHeapForPosition(site.position));
  }
  call.position = *pos;
  if ((need & kNeedGroup) == kNeedGroup) {
    std::string err;
    call.group = RuntimeState::GroupOf(attrs.groups.begin(),
                                       static_cast<std::int64_t>(attrs.groups.size()),
                                       attrs.world, call.position, &err);
    if (call.group == nullptr) {
      return Fail(ffi::ErrorCode::kInvalidArgument, std::string(site.who) + ": " + err);
    }
  }
  if ((need & kNeedNoTimeout) == kNeedNoTimeout) {
    if (std::string t = RecordedTimeout(*call.heap, call.position); !t.empty()) {
      return Fail(ffi::ErrorCode::kDeadlineExceeded, std::move(t));
    }
  }
  return call;
}

}  // namespace jaxtdist
