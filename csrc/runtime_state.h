// Per-process state shared by the jaxtdist FFI handlers: where each mesh
// position's symmetric heap lives and the per-(counter, position) epochs.
#ifndef JAXTDIST_CSRC_RUNTIME_STATE_H_
#define JAXTDIST_CSRC_RUNTIME_STATE_H_

#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include "launch_align.h"

namespace jaxtdist {

// The layout of the context buffer a kernel receives and of the error record
// a timed-out wait writes. jaxtdist/language/_layout.py states it for Python
// and the kernels; the Python binding exports these (ctx_layout()) so that
// loading the library checks that both say the same (a stale build would not).
inline constexpr int kCtxWords = 72;     // CTX_WORDS: int64 words of the context
inline constexpr int kCtxEpochWord = 2;  // CTX_EPOCH: the word the prologue writes
inline constexpr int kErrWords = 8;      // ERR_WORDS: int64 words of the error record
// The error record's words that RecordedTimeout reads (ERR_*).
inline constexpr int kErrFlag = 0;
inline constexpr int kErrRank = 1;
inline constexpr int kErrPeer = 2;
inline constexpr int kErrSignalOffset = 3;
inline constexpr int kErrExpected = 4;
inline constexpr int kErrSeen = 5;
inline constexpr int kErrCmp = 6;
inline constexpr int kErrTimeoutNs = 7;  // the bound the wait gave up after

inline constexpr int kRemoteHeap = -2;

struct HeapSlot {
  // -1 for host (CPU backend) heaps; kRemoteHeap for another process's heap
  // mapped into this one (NVSHMEM): a destination for copies, never a call's.
  int device_ordinal = -1;
  std::uintptr_t base = 0;  // address of the heap as this process sees it.
  std::int64_t bytes = 0;
  std::uintptr_t error_record = 0;  // where waits record a timeout (host-visible).
};

// The one registry behind every handler. Python fills it at initialize().
class RuntimeState {
 public:
  static RuntimeState& Get();

  void RegisterHeap(int position, int device_ordinal, std::uintptr_t base,
                    std::int64_t bytes, std::uintptr_t error_record);
  // Forgets every heap and epoch; `generation` names the new runtime.
  void Reset(std::int64_t generation);
  std::int64_t generation() const;
  std::optional<HeapSlot> Heap(int position) const;
  std::optional<int> PositionOfDevice(int device_ordinal) const;
  // Increments and returns the epoch of `counter` on `position` (first call: 1).
  std::int64_t NextEpoch(std::int64_t counter, int position);
  std::int64_t PeekEpoch(std::int64_t counter, int position) const;
  // The context template Python wrote at heap offset `offset` of `position`
  // (kCtxWords words): the host's copy, from which the CUDA prologue writes a
  // call's context without reading the heap.
  void RegisterTemplate(int position, std::int64_t offset, const std::int64_t* words);
  // Copies that template into `words`; false when none was registered.
  bool Template(int position, std::int64_t offset, std::int64_t* words) const;
  // The host rendezvous before collective kernel launches (launch_align.h).
  LaunchAligner& aligner() { return aligner_; }
  // Rank-ordered mesh positions of `position`'s group in a handler's group
  // table ([positions x world]); an error message in *err when it does not
  // cover `position`.
  static const std::int64_t* GroupOf(const std::int64_t* table, std::int64_t entries,
                                     std::int64_t world, int position, std::string* err);

 private:
  mutable std::mutex mu_;
  std::map<int, HeapSlot> heaps_;
  std::map<std::pair<std::int64_t, int>, std::int64_t> epochs_;
  std::map<std::pair<int, std::int64_t>, std::array<std::int64_t, kCtxWords>> templates_;
  std::int64_t generation_ = 0;
  LaunchAligner aligner_;
};

// The error text of a CUDA handler running on a device that has no heap.
std::string NoHeapForDevice(int device_ordinal);
// The error text of a host handler called for a mesh position without a heap.
std::string NoHeapForPosition(int position);

// Describes a wait timeout recorded in `slot`'s error record, or "" if none.
// `earlier`: the timeout happened in an earlier call than the one reporting it.
std::string RecordedTimeout(const HeapSlot& slot, int position, bool earlier = true);

// "" if a program compiled for runtime `generation` may run now.
std::string CheckGeneration(std::int64_t generation);

// Validates a prologue request; returns an error message or "" when fine.
std::string CheckStage(const HeapSlot& heap, std::int64_t template_offset,
                       std::int64_t stage_offset, std::int64_t parity_bytes,
                       std::int64_t stage_bytes);

}  // namespace jaxtdist

#endif  // JAXTDIST_CSRC_RUNTIME_STATE_H_
