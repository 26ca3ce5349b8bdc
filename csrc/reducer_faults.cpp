// The failure paths of the Reducer (see reducer.h and docs/reliability.md): winding up a
// backward that raised, rethrowing failed collectives with what they were reducing, and raising
// the NaN check's error (its state and checks: non_finite_check.h).
#include "reducer.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace leanddp {

bool Reducer::abandon_iteration(bool step_launched) {
  bool ok = true;
  if (step_launched && steps_in_hooks()) {
    try {
      advance_steps(StepWindow::Phase::kEnd, options_.static_graph ? &static_used_ : nullptr);
    } catch (...) {  // reported below (ok = false); the other reductions are still waited for
      ok = false;
    }
  }
  try {
    finish_gathers();  // (shard_optimizer_state on the CPU: a gather may still run)
  } catch (...) {
    ok = false;
  }
  ok = shard_.wait_all() && ok;
  for (size_t b = 0; b < works_.size(); ++b) {
    if (!works_[b] || collected_[b]) continue;
    try {
      works_[b]->wait();
    } catch (...) {
      ok = false;
    }
  }
  if (local_used_work_) {
    try {
      local_used_work_->wait();
    } catch (...) {
      ok = false;
    }
  }
  if (comm_hook_) comm_hook_->reset();
  if (nan_.armed()) {
    try {  // the device NaN check: the counts of the steps its flags skipped go back
      follow_side_stream();  // (the flags were set on the side stream)
      optimizer_->skipped(nan_.read_flags(buckets_));
    } catch (...) {
      ok = false;
    }
  }
  if (options_.optimizer_in_backward) {
    for (size_t b = 0; b < buckets_.size(); ++b) release(b);  // this step's gradients are dropped
  }
  if (optimizer_) optimizer_->abandon();
  reset_iteration_state();
  std::fill(local_used_.begin(), local_used_.end(), 0);
  return ok;
}

void Reducer::recover_unfinished() {
  if (!armed_) return;
  const bool started = callback_queued_;  // a hook fired: the backward ran part of the way
  const bool ok = abandon_iteration(/*step_launched=*/started);
  wait_for_optimizer();  // its device or host steps land before this forward
  TORCH_CHECK(ok, "leanddp.DistributedDataParallel: rank ", rank_,
              ": the last backward raised part-way and its gradient reductions failed too; "
              "the process group cannot be used for training any more (another rank has "
              "probably died or raised).");
}

bool Reducer::steps_in_hooks() const {
  return options_.optimizer_in_backward && !tracks_unused() && !clips_on_device() &&
         !(nan_.strict() && !steps_on_host());
}

void Reducer::rethrow_collective_error(const std::string& what) const {
  leanddp::rethrow_collective_error(rank_, what);
}

void Reducer::raise_nonfinite(const std::vector<int32_t>& used) const {
  // (the steps before the bad bucket ran unless they waited for the end of backward:
  // offload_to_cpu holds them, strict defers them)
  nan_.raise(names_, buckets_, used, !steps_on_host() && !nan_.strict());
}

}  // namespace leanddp
