#include "runtime_state.h"

#include <sstream>

namespace jaxtdist {

RuntimeState& RuntimeState::Get() {
  static RuntimeState* state = new RuntimeState();  // never destroyed: handlers may run at exit.
  return *state;
}

void RuntimeState::RegisterHeap(int position, int device_ordinal,
                                std::uintptr_t base, std::int64_t bytes,
                                std::uintptr_t error_record) {
  std::lock_guard<std::mutex> lock(mu_);
  heaps_[position] = HeapSlot{device_ordinal, base, bytes, error_record};
}

void RuntimeState::Reset(std::int64_t generation) {
  std::lock_guard<std::mutex> lock(mu_);
  heaps_.clear();
  epochs_.clear();
  generation_ = generation;
}

std::int64_t RuntimeState::generation() const {
  std::lock_guard<std::mutex> lock(mu_);
  return generation_;
}

std::string CheckGeneration(std::int64_t generation) {
  const std::int64_t current = RuntimeState::Get().generation();
  if (generation == current) return "";
  std::ostringstream msg;
  msg << "jaxtdist: this program was compiled for jaxtdist runtime #" << generation
      << " but runtime #" << current << " is active (jaxtdist.initialize or shutdown "
      << "ran since): its heap offsets and signals are stale. Trace it again: "
      << "jax.clear_caches(), or re-create the jitted function.";
  return msg.str();
}

std::optional<HeapSlot> RuntimeState::Heap(int position) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = heaps_.find(position);
  if (it == heaps_.end()) return std::nullopt;
  return it->second;
}

std::optional<int> RuntimeState::PositionOfDevice(int device_ordinal) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [pos, slot] : heaps_) {
    if (slot.device_ordinal == device_ordinal) return pos;
  }
  return std::nullopt;
}

std::int64_t RuntimeState::NextEpoch(std::int64_t counter, int position) {
  std::lock_guard<std::mutex> lock(mu_);
  return ++epochs_[{counter, position}];
}

std::int64_t RuntimeState::PeekEpoch(std::int64_t counter, int position) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = epochs_.find({counter, position});
  return it == epochs_.end() ? 0 : it->second;
}

std::string RecordedTimeout(const HeapSlot& slot, int position) {
  if (slot.error_record == 0) return "";
  const volatile std::int64_t* rec =
      reinterpret_cast<const volatile std::int64_t*>(slot.error_record);
  if (rec[0] == 0) return "";
  static const char* kCmp[] = {"==", "!=", ">=", ">", "<=", "<"};
  const std::int64_t cmp = rec[6];
  std::ostringstream msg;
  msg << "jaxtdist: a wait timed out in an earlier call on rank " << rec[1]
      << " (mesh position " << position << "): it waited for the signal at heap offset "
      << rec[3] << " (notified by rank " << rec[2] << ") to become "
      << (cmp >= 0 && cmp < 6 ? kCmp[cmp] : "?") << " " << rec[4] << " but last saw "
      << rec[5] << ". A rank did not reach the matching notify (a deadlock, a "
      << "crashed or missing rank, or ops issued in different orders on different "
      << "ranks). Signals are now out of step: call jaxtdist.shutdown() and "
      << "jaxtdist.initialize(mesh) again.";
  return msg.str();
}

std::string CheckStage(const HeapSlot& heap, std::int64_t template_offset,
                       std::int64_t stage_offset, std::int64_t parity_bytes,
                       std::int64_t stage_bytes) {
  std::ostringstream err;
  if (template_offset < 0 ||
      template_offset + kCtxWords * 8 > heap.bytes) {
    err << "context template offset " << template_offset
        << " lies outside the heap of " << heap.bytes << " bytes";
  } else if (stage_bytes > 0 &&
             (stage_offset < 0 || stage_bytes > parity_bytes ||
              stage_offset + 2 * parity_bytes > heap.bytes)) {
    err << "staging " << stage_bytes << " bytes at offset " << stage_offset
        << " (slot of " << parity_bytes << " bytes, two parities) does not fit "
        << "the heap of " << heap.bytes << " bytes";
  }
  return err.str();
}

}  // namespace jaxtdist
