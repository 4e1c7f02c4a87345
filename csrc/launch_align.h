// Host rendezvous of a group's host threads just before a collective kernel
// is launched.
//
// With one process driving several GPUs, XLA runs each device's program on
// its own host thread. A collective kernel's time on a device includes its
// wait for the slowest peer to be launched; when the GPUs idle between calls
// (host-bound steps, decode-sized ops) that wait is host-thread skew, tens of
// microseconds. XLA rendezvous its own collectives' threads; jaxtdist's last
// handler before a collective kernel does the same: it waits, spinning and
// bounded, until every member of the group reached the same call. Only host
// time moves: no kernel's correctness depends on the rendezvous.
#ifndef JAXTDIST_CSRC_LAUNCH_ALIGN_H_
#define JAXTDIST_CSRC_LAUNCH_ALIGN_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

namespace jaxtdist {

struct LaunchAlignStats {
  bool enabled = true;
  std::int64_t met = 0;        // arrivals whose rendezvous every member reached in time
  std::int64_t timed_out = 0;  // arrivals that left at the timeout
  std::string disabled_because;
};

class LaunchAligner {
 public:
  // A rendezvous that is not met within `timeout_us` is left (the kernel
  // still runs correctly, only later); this many timeouts in a row turn
  // alignment off, as does one host thread arriving twice for one call (one
  // thread launching several devices' programs in turn could never meet).
  static constexpr int kTimeoutsBeforeDisabling = 8;

  // Also forgets pending rendezvous and the statistics.
  void Configure(bool enabled, std::int64_t timeout_us);
  // Forgets pending rendezvous and re-enables alignment if it was configured on.
  void Reset();
  // Returns once each of the `world` members of the group whose first mesh
  // position is `leader` has arrived for (`counter`, `epoch`), or at the
  // timeout. Every member must be driven by this process.
  void Arrive(std::int64_t counter, std::int64_t epoch, std::int64_t leader,
              std::int64_t world);
  LaunchAlignStats Stats() const;

 private:
  struct Meeting {
    std::atomic<std::int64_t> arrived{0};
    std::int64_t left = 0;
    std::vector<std::thread::id> threads;
  };
  using Key = std::tuple<std::int64_t, std::int64_t, std::int64_t>;

  void DisableLocked(const std::string& why);

  mutable std::mutex mu_;
  std::map<Key, std::shared_ptr<Meeting>> meetings_;
  std::atomic<bool> enabled_{true};
  bool configured_on_ = true;
  std::int64_t timeout_us_ = 10000;
  int timeouts_in_a_row_ = 0;
  LaunchAlignStats stats_;
};

}  // namespace jaxtdist

#endif  // JAXTDIST_CSRC_LAUNCH_ALIGN_H_
