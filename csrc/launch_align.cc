#include "launch_align.h"

#include <algorithm>
#include <chrono>

namespace jaxtdist {
namespace {

// Pending rendezvous kept at most; older ones (a member that never came)
// are dropped, their waiters hold their own reference.
constexpr std::size_t kMaxPending = 4096;

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

}  // namespace

void LaunchAligner::Configure(bool enabled, std::int64_t timeout_us, std::int64_t spin_us) {
  std::lock_guard<std::mutex> lock(mu_);
  configured_on_ = enabled;
  meetings_.clear();
  timeout_us_ = std::max<std::int64_t>(timeout_us, 0);
  spin_us_ = std::clamp<std::int64_t>(spin_us, 0, timeout_us_);
  timeouts_in_a_row_ = 0;
  stats_ = LaunchAlignStats{};
  stats_.enabled = enabled;
  if (!enabled) stats_.disabled_because = "turned off (jaxtdist.initialize(align_launches=False))";
  enabled_.store(enabled, std::memory_order_release);
}

void LaunchAligner::Reset() {
  std::lock_guard<std::mutex> lock(mu_);
  meetings_.clear();
  timeouts_in_a_row_ = 0;
  stats_ = LaunchAlignStats{};
  stats_.enabled = configured_on_;
  enabled_.store(configured_on_, std::memory_order_release);
}

void LaunchAligner::DisableLocked(const std::string& why) {
  if (stats_.disabled_because.empty()) stats_.disabled_because = why;
  stats_.enabled = false;
  enabled_.store(false, std::memory_order_release);
}

void LaunchAligner::Arrive(std::int64_t counter, std::int64_t epoch, std::int64_t leader,
                           std::int64_t world, int position, LaunchClock::time_point entered) {
  if (world <= 1 || !enabled_.load(std::memory_order_acquire)) return;
  const Key key{counter, leader, epoch};
  std::shared_ptr<Meeting> meeting;
  std::int64_t timeout_us, spin_us, arrived;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!enabled_.load(std::memory_order_relaxed)) return;
    if (meetings_.size() >= kMaxPending) meetings_.clear();
    std::shared_ptr<Meeting>& slot = meetings_[key];
    if (!slot) slot = std::make_shared<Meeting>();
    meeting = slot;
    const auto self = std::this_thread::get_id();
    if (std::any_of(meeting->members.begin(), meeting->members.end(),
                    [&](const Meeting::Member& m) { return m.thread == self; })) {
      DisableLocked("one host thread launches several group members' programs, one after "
                    "another");
      return;
    }
    meeting->members.push_back(Meeting::Member{self, position, entered, LaunchClock::now()});
    arrived = meeting->arrived.fetch_add(1, std::memory_order_acq_rel) + 1;
    timeout_us = timeout_us_;
    spin_us = spin_us_;
  }
  bool met = true;
  const auto waiting_since = LaunchClock::now();
  if (arrived == world) {
    // Taking the lock orders this after any sleeper's check of `arrived`:
    // a sleeper either saw it complete or is waiting and gets the notify.
    { std::lock_guard<std::mutex> wake_lock(meeting->wake_mu); }
    meeting->wake.notify_all();
  } else {
    auto complete = [&] { return meeting->arrived.load(std::memory_order_acquire) >= world; };
    const auto start = LaunchClock::now();
    const auto deadline = start + std::chrono::microseconds(timeout_us);
    const auto spin_until = start + std::chrono::microseconds(spin_us);
    bool done = false;
    for (std::int64_t spins = 0; !(done = complete()); ++spins) {
      if ((spins & 63) == 0 && LaunchClock::now() >= spin_until) break;
      CpuRelax();
    }
    if (!done) {
      std::unique_lock<std::mutex> wake_lock(meeting->wake_mu);
      done = meeting->wake.wait_until(wake_lock, deadline, complete);
    }
    met = done;
  }
  const double waited_us =
      std::chrono::duration<double, std::micro>(LaunchClock::now() - waiting_since).count();
  std::lock_guard<std::mutex> lock(mu_);
  stats_.wait_us += waited_us;
  if (!met) meeting->timed_out = true;
  if (++meeting->left == world) {
    auto it = meetings_.find(key);
    if (it != meetings_.end() && it->second == meeting) meetings_.erase(it);
    RecordLocked(*meeting, key);
  }
  if (met) {
    ++stats_.met;
    timeouts_in_a_row_ = 0;
  } else {
    ++stats_.timed_out;
    if (++timeouts_in_a_row_ >= kTimeoutsBeforeDisabling) {
      DisableLocked(std::to_string(kTimeoutsBeforeDisabling) +
                    " rendezvous in a row timed out (group members' programs do not run "
                    "concurrently on their host threads)");
    }
  }
}

void LaunchAligner::RecordLocked(const Meeting& meeting, const Key& key) {
  if (meeting.members.empty()) return;
  const LaunchClock::time_point first = meeting.members.front().arrived;
  auto us = [first](LaunchClock::time_point t) {
    return std::chrono::duration<double, std::micro>(t - first).count();
  };
  stats_.max_spread_us = std::max(stats_.max_spread_us, us(meeting.members.back().arrived));
  if (!meeting.timed_out || stats_.late.size() >= kMaxLateRecords) return;
  LateRendezvous record;
  record.counter = std::get<0>(key);
  record.epoch = std::get<2>(key);
  for (const Meeting::Member& m : meeting.members) {
    record.members.push_back(LateMember{m.position, us(m.entered), us(m.arrived)});
  }
  stats_.late.push_back(std::move(record));
}

LaunchAlignStats LaunchAligner::Stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace jaxtdist
