// The prelude every jaxtdist FFI handler runs before its own work: is the
// program current, which mesh position runs the call, its heap, its group,
// and did an earlier wait time out. Written once, so that the prologue,
// launch and copy-engine handlers check the same things in the same order,
// and a new handler (or backend) gets them by calling Resolve.
#ifndef JAXTDIST_CSRC_CALL_CONTEXT_H_
#define JAXTDIST_CSRC_CALL_CONTEXT_H_

#include <cstdint>
#include <optional>
#include <utility>

#include "launch_align.h"
#include "runtime_state.h"
#include "xla/ffi/api/ffi.h"

namespace jaxtdist {

// The attributes every handler takes. BindCallAttrs declares them; the
// handler's last three parameters receive them in this order.
struct CallAttrs {
  std::int64_t generation;                    // the runtime the program was traced for
  xla::ffi::Span<const std::int64_t> groups;  // [positions x world]: each position's group
  std::int64_t world;                         // ranks per group
};

// Appends CallAttrs' attributes to an XLA FFI binding (XLA matches attributes
// by name, so where they sit among a handler's own attributes does not matter).
template <typename Binding>
auto BindCallAttrs(Binding binding) {
  return std::move(binding)
      .template Attr<std::int64_t>("generation")
      .template Attr<xla::ffi::Span<const std::int64_t>>("groups")
      .template Attr<std::int64_t>("world");
}

// Where a call runs. A CUDA handler knows XLA's device and runs for the
// position whose heap lives there; a host handler is told the position by
// the program (one process plays every position on the CPU backend).
struct CallSite {
  const char* who;          // error prefix, e.g. "jaxtdist prologue"
  int device_ordinal = -1;  // CUDA: the device the call runs on
  int position = -1;        // host: the mesh position

  static CallSite OnDevice(const char* who, int device_ordinal) {
    return {who, device_ordinal, -1};
  }
  static CallSite AtPosition(const char* who, int position) { return {who, -1, position}; }
};

// What Resolve must establish beyond a current generation (flags; each
// implies a heap). Without kNeedHeap, a CUDA call's position and heap are
// still looked up, and left empty when the device has none.
inline constexpr unsigned kNeedHeap = 1;
inline constexpr unsigned kNeedGroup = 2 | kNeedHeap;      // the position's group row
inline constexpr unsigned kNeedNoTimeout = 4 | kNeedHeap;  // no wait timed out before

struct CallContext {
  LaunchClock::time_point entered;  // when the handler began (rendezvous statistics)
  int position = -1;                // -1: no heap on this device (only without kNeedHeap)
  std::optional<HeapSlot> heap;
  const std::int64_t* group = nullptr;  // rank-ordered mesh positions (with kNeedGroup)
  std::int64_t world = 0;

  // Meets the group's other host threads right before this call's collective
  // kernel is launched (launch_align.h). Needs kNeedGroup.
  void AlignLaunch(std::int64_t counter, std::int64_t epoch) const {
    RuntimeState::Get().aligner().Arrive(counter, epoch, group[0], world, position, entered);
  }
};

// Runs the prelude. Errors, in the order checked: a stale generation
// (kFailedPrecondition), no heap (kInvalidArgument), a group table that does
// not cover the position (kInvalidArgument), a recorded wait timeout
// (kDeadlineExceeded).
xla::ffi::ErrorOr<CallContext> Resolve(const CallSite& site, const CallAttrs& attrs,
                                       unsigned need);

}  // namespace jaxtdist

#endif  // JAXTDIST_CSRC_CALL_CONTEXT_H_
