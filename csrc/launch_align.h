// Host rendezvous of a group's host threads just before a collective kernel
// is launched.
//
// With one process driving several GPUs, XLA runs each device's program on
// its own host thread. A collective kernel's time on a device includes its
// wait for the slowest peer to be launched; when the GPUs idle between calls
// (host-bound steps, decode-sized ops) that wait is host-thread skew, tens of
// microseconds. XLA rendezvous its own collectives' threads; jaxtdist's last
// handler before a collective kernel does the same: it waits (a short spin,
// then asleep until the last member wakes it; bounded) until every member of
// the group reached the same call. Only host time moves: no kernel's
// correctness depends on the rendezvous.
#ifndef JAXTDIST_CSRC_LAUNCH_ALIGN_H_
#define JAXTDIST_CSRC_LAUNCH_ALIGN_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

namespace jaxtdist {

using LaunchClock = std::chrono::steady_clock;

// One member's part in a rendezvous that some member left at the timeout,
// in microseconds after the first member's arrival: when its handler was
// entered (XLA reached the call on its host thread) and when it arrived
// (the handler's work before the launch was done). Says which device was
// late and whether the time went before the handler or inside it.
struct LateMember {
  int position = -1;  // mesh position (-1: not given)
  double entered_us = 0;
  double arrived_us = 0;
};

struct LateRendezvous {
  std::int64_t counter = 0;
  std::int64_t epoch = 0;
  std::vector<LateMember> members;  // in arrival order
};

struct LaunchAlignStats {
  bool enabled = true;
  std::int64_t met = 0;        // arrivals whose rendezvous every member reached in time
  std::int64_t timed_out = 0;  // arrivals that left at the timeout
  std::string disabled_because;
  double max_spread_us = 0;    // largest first-to-last arrival gap of a completed rendezvous
  double wait_us = 0;          // time all arrivals spent waiting, summed
  std::vector<LateRendezvous> late;  // the first kMaxLateRecords with a timeout
};

class LaunchAligner {
 public:
  // A rendezvous that is not met within `timeout_us` is left (the kernel
  // still runs correctly, only later); this many timeouts in a row turn
  // alignment off, as does one host thread arriving twice for one call (one
  // thread launching several devices' programs in turn could never meet).
  static constexpr int kTimeoutsBeforeDisabling = 8;
  // Rendezvous with a timeout kept in the statistics, at most.
  static constexpr std::size_t kMaxLateRecords = 32;

  // Also forgets pending rendezvous and the statistics. An arrival spins
  // for at most `spin_us`, then sleeps until the last member wakes it or
  // the timeout: spinning threads hold CPUs that the late members' host
  // threads may need (on a VM, vCPUs that share physical cores).
  void Configure(bool enabled, std::int64_t timeout_us, std::int64_t spin_us);
  // Forgets pending rendezvous and re-enables alignment if it was configured on.
  void Reset();
  // Returns once each of the `world` members of the group whose first mesh
  // position is `leader` has arrived for (`counter`, `epoch`), or at the
  // timeout. Every member must be driven by this process. `position` (this
  // member's mesh position) and `entered` (when its handler began) only
  // feed the statistics of late rendezvous.
  void Arrive(std::int64_t counter, std::int64_t epoch, std::int64_t leader,
              std::int64_t world, int position = -1,
              LaunchClock::time_point entered = LaunchClock::now());
  LaunchAlignStats Stats() const;

 private:
  struct Meeting {
    std::atomic<std::int64_t> arrived{0};
    // The last member to arrive wakes the sleeping ones.
    std::mutex wake_mu;
    std::condition_variable wake;
    std::int64_t left = 0;
    bool timed_out = false;  // some member left at the timeout
    struct Member {
      std::thread::id thread;
      int position;
      LaunchClock::time_point entered, arrived;
    };
    std::vector<Member> members;  // in arrival order
  };
  using Key = std::tuple<std::int64_t, std::int64_t, std::int64_t>;

  void DisableLocked(const std::string& why);
  // Updates the spread and, if a member timed out, keeps the meeting's record.
  void RecordLocked(const Meeting& meeting, const Key& key);

  mutable std::mutex mu_;
  std::map<Key, std::shared_ptr<Meeting>> meetings_;
  std::atomic<bool> enabled_{true};
  bool configured_on_ = true;
  // jaxtdist.runtime configures both (LAUNCH_ALIGN_TIMEOUT_US, LAUNCH_ALIGN_SPIN_US).
  std::int64_t timeout_us_ = 50000;
  std::int64_t spin_us_ = 200;
  int timeouts_in_a_row_ = 0;
  LaunchAlignStats stats_;
};

}  // namespace jaxtdist

#endif  // JAXTDIST_CSRC_LAUNCH_ALIGN_H_
