// IterationTimer: the runtime statistics of torch's DDP logging data (`_get_ddp_logging_data`),
// measured only at the iterations torch's DDP samples (the caller decides which), so that the
// other iterations pay one branch per moment.
//
// Five moments of a sampled iteration: the forward starts; the forward ends (backward compute
// starts: torch's DDP marks it when the backward is prepared); the last gradient is ready
// (backward compute ends); the first bucket's reduction is launched (communication starts); the
// end-of-backward callback has every reduced bucket (communication ends). Each gets a host
// timestamp (steady clock, ns). On a device whose work runs apart from the host (a GPU) each
// also gets a timing event recorded on the stream current at that moment; the durations are
// read from the events only in collect(), at a later forward, where the host waits for them: no
// iteration waits for the device because of this timer except while its statistics are read.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/Event.h>

#include <array>
#include <cstdint>
#include <optional>
#include <vector>

namespace leanddp {

// One sampled iteration's statistics, in nanoseconds (torch's keys in comments).
struct IterationTimes {
  bool valid = false;  // a sampled iteration completed its backward since the last collect()
  // Host timestamps: forward_compute_time_start, backward_compute_time_start,
  // backward_compute_time_end, backward_comm_time_start, backward_comm_time_end.
  std::array<int64_t, 5> host_ns{};
  int64_t forward_compute = 0;            // forward start -> backward compute start
  int64_t backward_compute = 0;           // backward compute start -> last gradient ready
  int64_t backward_comm = 0;              // first reduction launched -> every reduction collected
  int64_t overlap = 0;                    // first reduction launched -> last gradient ready
  std::vector<int64_t> grad_ready_order;  // parameter indices, in the order they became ready
};

class IterationTimer {
 public:
  enum Moment : int {
    kForwardStart = 0,
    kBackwardComputeStart,
    kBackwardComputeEnd,
    kBackwardCommStart,
    kBackwardCommEnd,
  };

  // Called at each forward that may take gradients: `sampled` starts measuring this iteration
  // (marks kForwardStart), otherwise measuring stops until the next sampled forward.
  void start(bool sampled, const c10::Device& device);
  // Marks `moment` of the iteration being measured (a no-op otherwise). Called with the
  // Reducer's lock held; the first call per moment and iteration counts.
  void mark(Moment moment);
  // Parameter `index`'s hook fired in a synchronized backward (recorded only while measuring).
  void ready(int64_t index) {
    if (active_) order_.push_back(index);
  }
  // Returns the last measured iteration whose communication ended (valid=false if none since
  // the previous call) and forgets it; on a GPU waits for its events.
  IterationTimes collect();

 private:
  bool active_ = false;                // measuring the current iteration
  bool complete_ = false;              // the measured iteration reached kBackwardCommEnd
  std::optional<c10::Device> device_;  // set when events are used (a GPU)
  std::array<bool, 5> marked_{};
  std::array<int64_t, 5> host_ns_{};
  std::array<std::optional<c10::Event>, 5> events_;  // created at the first sampled GPU forward
  std::vector<int64_t> order_;
};

}  // namespace leanddp
