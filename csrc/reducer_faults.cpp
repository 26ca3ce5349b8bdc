// The failure paths of the Reducer (see reducer.h and docs/reliability.md): winding up a
// backward that raised, rethrowing failed collectives with what they were reducing, and the NaN
// check of check_for_nan_in_grad.
#include "reducer.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>
#include <sstream>

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
  for (size_t b = 0; b < gathers_.size(); ++b) {
    if (!gathers_[b]) continue;
    try {
      gathers_[b]->wait();
    } catch (...) {
      ok = false;
    }
  }
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
  if (nan_flags_armed_) {
    try {  // the device NaN check: the counts of the steps its flags skipped go back
      follow_side_stream();  // (the flags were set on the side stream)
      read_nan_flags();
    } catch (...) {
      ok = false;
    }
  }
  if (options_.step_in_backward) {
    for (size_t b = 0; b < buckets_.size(); ++b) release(b);  // this step's gradients are dropped
  }
  if (offload_) offload_->end_iteration(/*completed=*/false);
  reset_iteration_state();
  std::fill(local_used_.begin(), local_used_.end(), 0);
  return ok;
}

void Reducer::recover_unfinished() {
  if (!armed_) return;
  const bool started = callback_queued_;  // a hook fired: the backward ran part of the way
  const bool ok = abandon_iteration(/*step_launched=*/started);
  wait_idle();  // its device or host steps land before this forward
  TORCH_CHECK(ok, "leanddp.DistributedDataParallel: rank ", rank_,
              ": the last backward raised part-way and its gradient reductions failed too; "
              "the process group cannot be used for training any more (another rank has "
              "probably died or raised).");
}

bool Reducer::steps_in_hooks() const {
  return options_.step_in_backward && !tracks_unused() && !clips_on_device() &&
         !(options_.nan_check == NanCheck::kStrict && !offload_);
}

void Reducer::rethrow_collective_error(const std::string& what) const {
  std::ostringstream context;
  context << "leanddp.DistributedDataParallel: rank " << rank_ << ": " << what
          << " failed. Another rank has probably died, raised an exception, or run a different "
             "sequence of forwards and backwards (every rank must run the same ones); this "
             "process group cannot be used for training any more. The error: ";
  try {
    throw;
  } catch (const c10::DistBackendError& e) {
    C10_THROW_ERROR(DistBackendError, context.str() + e.what_without_backtrace());
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, context.str(), e.what_without_backtrace());
  } catch (const std::exception& e) {
    TORCH_CHECK(false, context.str(), e.what());
  }
}

void Reducer::check_finite(const std::vector<size_t>& indices) {
  std::vector<size_t> unchecked;
  for (size_t b : indices) {
    if (collected_[b] != kChecked) unchecked.push_back(b);
  }
  if (nan_bucket_ >= 0 || unchecked.empty()) return;
  std::vector<at::Tensor> flags;
  for (size_t b : unchecked) {
    const Bucket& bucket = buckets_[b];
    const at::Tensor& values = bucket.sparse ? bucket.sparse_grad._values() : bucket.flat;
    flags.push_back(at::isfinite(values).all());
  }
  const at::Tensor finite = at::stack(flags).cpu();
  const bool* is_finite = finite.data_ptr<bool>();
  for (size_t k = 0; k < unchecked.size(); ++k) {
    if (is_finite[k]) {
      collected_[unchecked[k]] = kChecked;
      continue;
    }
    const Bucket& bucket = buckets_[unchecked[k]];
    nan_bucket_ = static_cast<int64_t>(unchecked[k]);
    for (size_t s = 0; s < bucket.params.size(); ++s) {
      if (bucket.sparse || !at::isfinite(bucket.views[s]).all().item<bool>())
        nan_params_.push_back(bucket.params[s]);
    }
    return;
  }
}

bool Reducer::device_nan_check() const {
  // (offload_to_cpu holds its host steps until the end of backward: the flags are read there,
  // once, and a NaN drops every held step)
  return options_.nan_check == NanCheck::kOn && options_.step_in_backward;
}

namespace {

// The first slot of bucket `index` in the per-parameter flags (buckets in order, slot order).
int64_t slot_base(const std::vector<Bucket>& buckets, size_t index) {
  int64_t base = 0;
  for (size_t b = 0; b < index; ++b) base += static_cast<int64_t>(buckets[b].params.size());
  return base;
}

}  // namespace

void Reducer::flag_nonfinite(size_t index) {
  const Bucket& bucket = buckets_[index];
  const auto options = at::TensorOptions(at::kFloat).device(bucket.flat.device());
  if (!nan_flags_armed_) {
    // The last backward's flags were read at its end: nothing reads them any more.
    const auto n = static_cast<int64_t>(params_.size());
    if (!nan_flags_.defined() || nan_flags_.device() != options.device()) {
      nan_flags_ = at::zeros({n}, options);
      nan_seen_ = at::zeros({}, options);
    } else {
      nan_flags_.zero_();
      nan_seen_.zero_();
    }
    nan_gated_.assign(buckets_.size(), {});
    nan_flags_armed_ = true;
  }
  // The largest magnitude of each gradient: NaN or inf exactly where it holds one (a norm of
  // squares could overflow); one foreach call for the bucket, whose views share one dtype. An
  // empty view (which has no largest magnitude) counts as finite.
  std::vector<at::Tensor> views;
  for (const at::Tensor& view : bucket.views) {
    if (view.numel() > 0) views.push_back(view);
  }
  std::vector<at::Tensor> largest;
  if (!views.empty()) largest = at::_foreach_norm(views, std::numeric_limits<double>::infinity());
  if (largest.size() < bucket.views.size()) {
    std::vector<at::Tensor> per_slot;
    size_t k = 0;
    for (const at::Tensor& view : bucket.views) {
      per_slot.push_back(view.numel() > 0 ? largest[k++] : at::zeros({}, view.options()));
    }
    largest = std::move(per_slot);
  }
  const at::Tensor bad = at::stack(largest).isfinite().logical_not().to(at::kFloat);
  nan_flags_.narrow(0, slot_base(buckets_, index), bad.numel()).copy_(bad);
  nan_seen_.clamp_min_(bad.amax());
}

void Reducer::read_nan_flags() {
  if (!nan_flags_armed_) return;
  nan_flags_armed_ = false;
  const at::Tensor flags = nan_flags_.cpu();  // the check's one host synchronization
  const float* bad = flags.const_data_ptr<float>();
  int64_t base = 0;
  for (size_t b = 0; b < buckets_.size() && nan_bucket_ < 0; ++b) {
    const Bucket& bucket = buckets_[b];
    for (size_t s = 0; s < bucket.params.size(); ++s) {
      if (bad[base + static_cast<int64_t>(s)] != 0.0f) {
        nan_bucket_ = static_cast<int64_t>(b);
        nan_params_.push_back(bucket.params[s]);
      }
    }
    base += static_cast<int64_t>(bucket.params.size());
  }
  if (nan_bucket_ < 0) return;
  // The kernels of this bucket and of every later one saw found_inf set and left their
  // parameters and state as they were: their step counts go back too.
  for (size_t b = static_cast<size_t>(nan_bucket_); b < nan_gated_.size(); ++b) {
    for (int64_t p : nan_gated_[b]) fused_->unstep(static_cast<size_t>(p));
  }
}

void Reducer::raise_nonfinite(const std::vector<int32_t>& used) const {
  std::ostringstream msg;
  msg << "leanddp.DistributedDataParallel: check_for_nan_in_grad: the reduced gradient of "
      << join_names(names_, nan_params_) << " holds NaN or infinity (bucket " << nan_bucket_
      << "; the reduction is the same on every rank, so every rank raises this error).";
  if (!options_.step_in_backward) {
    msg << " No weight was changed (optimizer.step() has not run); the gradients hold the "
           "reduced values.";
  } else {
    // Buckets are stepped in order, each checked first: those before the bad one were stepped,
    // unless the steps wait for the end of backward (offload_to_cpu holds them; strict defers).
    std::vector<int64_t> stepped;
    if (!offload_ && options_.nan_check != NanCheck::kStrict) {
      for (int64_t b = 0; b < nan_bucket_; ++b) {
        for (int64_t p : buckets_[static_cast<size_t>(b)].params) {
          if (used[static_cast<size_t>(p)]) stepped.push_back(p);
        }
      }
    }
    if (stepped.empty()) {
      msg << " No weight was changed: this step's gradients were dropped.";
    } else {
      msg << " optimizer_in_backward had already stepped the buckets reduced before it: "
          << stepped.size() << " parameters (" << join_names(names_, stepped)
          << ") keep this step's update; no other parameter was stepped, and this step's other "
             "gradients were dropped. check_for_nan_in_grad='strict' defers the steps to the "
             "end of backward so that no weight changes, at the cost of holding every gradient "
             "bucket until then.";
    }
  }
  TORCH_CHECK(false, msg.str());
}

}  // namespace leanddp
