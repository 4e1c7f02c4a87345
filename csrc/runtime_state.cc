#include "runtime_state.h"

#include <algorithm>
#include <string>

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
  templates_.clear();
  generation_ = generation;
  aligner_.Reset();
}

const std::int64_t* RuntimeState::GroupOf(const std::int64_t* table, std::int64_t entries,
                                          std::int64_t world, int position,
                                          std::string* err) {
  const std::int64_t positions = world >= 1 ? entries / world : 0;
  if (world < 1 || positions * world != entries || position < 0 || position >= positions) {
    *err = "group table of " + std::to_string(entries) +
           " entries does not cover mesh position " + std::to_string(position) +
           " with world " + std::to_string(world);
    return nullptr;
  }
  return table + static_cast<std::int64_t>(position) * world;
}

std::int64_t RuntimeState::generation() const {
  std::lock_guard<std::mutex> lock(mu_);
  return generation_;
}

std::string CheckGeneration(std::int64_t generation) {
  const std::int64_t current = RuntimeState::Get().generation();
  if (generation == current) return "";
  // Named as the CPU backend names JaxtdistError (jaxtdist/_errors.py runtime_status).
  // Generation 0: no runtime (shutdown ran and no initialize since).
  const std::string active = current == 0
                                 ? std::string("no runtime is active (jaxtdist.shutdown ran)")
                                 : "runtime #" + std::to_string(current) +
                                       " is active (jaxtdist.initialize or shutdown ran since)";
  return "jaxtdist.JaxtdistError: this program was compiled for jaxtdist runtime #" +
         std::to_string(generation) + " but " + active +
         ": its heap offsets and signals are stale. " +
         (current == 0 ? "Call jaxtdist.initialize(mesh), then trace" : "Trace") +
         " it again: call the jitted function again after jax.clear_caches() (or "
         "re-create it); an ahead-of-time compiled program (jit(f).lower(...).compile()) "
         "must be lowered and compiled again.";
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

void RuntimeState::RegisterTemplate(int position, std::int64_t offset,
                                    const std::int64_t* words) {
  std::lock_guard<std::mutex> lock(mu_);
  std::copy(words, words + kCtxWords, templates_[{position, offset}].begin());
}

bool RuntimeState::Template(int position, std::int64_t offset, std::int64_t* words) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = templates_.find({position, offset});
  if (it == templates_.end()) return false;
  std::copy(it->second.begin(), it->second.end(), words);
  return true;
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

std::string NoHeapForDevice(int device_ordinal) {
  return "jaxtdist: no symmetric heap is registered for CUDA device " +
         std::to_string(device_ordinal) +
         "; call jaxtdist.initialize(mesh) with a mesh that contains it";
}

std::string NoHeapForPosition(int position) {
  return "jaxtdist: no symmetric heap is registered for mesh position " +
         std::to_string(position) + "; call jaxtdist.initialize(mesh) first";
}

std::string RecordedTimeout(const HeapSlot& slot, int position, bool earlier) {
  if (slot.error_record == 0) return "";
  const volatile std::int64_t* rec =
      reinterpret_cast<const volatile std::int64_t*>(slot.error_record);
  if (rec[kErrFlag] == 0) return "";
  // Plain std::string building: iostreams crashed when another libstdc++
  // (torch's) was loaded in the process.
  static const char* kCmp[] = {"==", "!=", ">=", ">", "<=", "<"};
  std::int64_t words[kErrWords];
  for (int i = 0; i < kErrWords; ++i) words[i] = rec[i];  // one read of each volatile word
  const std::int64_t cmp = words[kErrCmp];
  // Seconds with one decimal, without iostreams.
  const std::int64_t tenths = (words[kErrTimeoutNs] + 50'000'000) / 100'000'000;
  return std::string("jaxtdist.WaitTimeoutError: a wait timed out after ") +
         std::to_string(tenths / 10) + "." + std::to_string(tenths % 10) + " s" +
         (earlier ? " in an earlier call" : "") + " on rank " +
         std::to_string(words[kErrRank]) + " (mesh position " + std::to_string(position) +
         "): it waited for the signal at heap offset " +
         std::to_string(words[kErrSignalOffset]) + " (notified by rank " +
         std::to_string(words[kErrPeer]) + ") to become " +
         (cmp >= 0 && cmp < 6 ? kCmp[cmp] : "?") + " " + std::to_string(words[kErrExpected]) +
         " but last saw " + std::to_string(words[kErrSeen]) +
         ". A rank did not reach the matching notify in time (a deadlock, a crashed, missing "
         "or much slower rank, a lax.cond taken differently on different ranks, or ops "
         "issued in different orders; raise the bound with "
         "jaxtdist.initialize(mesh, wait_timeout_s=...) if a peer is legitimately late). "
         "Signals are now out of step: call jaxtdist.shutdown() and "
         "jaxtdist.initialize(mesh) again.";
}

std::string CheckStage(const HeapSlot& heap, std::int64_t template_offset,
                       std::int64_t stage_offset, std::int64_t parity_bytes,
                       std::int64_t stage_bytes) {
  if (template_offset < 0 || template_offset + kCtxWords * 8 > heap.bytes) {
    return "context template offset " + std::to_string(template_offset) +
           " lies outside the heap of " + std::to_string(heap.bytes) + " bytes";
  }
  if (stage_bytes > 0 && (stage_offset < 0 || stage_bytes > parity_bytes ||
                          stage_offset + 2 * parity_bytes > heap.bytes)) {
    return "staging " + std::to_string(stage_bytes) + " bytes at offset " +
           std::to_string(stage_offset) + " (slot of " + std::to_string(parity_bytes) +
           " bytes, two parities) does not fit the heap of " + std::to_string(heap.bytes) +
           " bytes";
  }
  return "";
}

}  // namespace jaxtdist
