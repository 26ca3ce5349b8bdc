// The optimizer side of the Reducer (optimizer_in_backward and offload_to_cpu): stepping reduced
// buckets, and the methods that reach the optimizer's state. See reducer.h.
#include "reducer.h"

namespace leanddp {

void Reducer::step_reduced_buckets(bool wait, const std::vector<int32_t>* used) {
  while (next_step_ < next_bucket_) {
    if (!wait && !(comm_hook_ ? comm_hook_->done(next_step_) : works_[next_step_]->isCompleted())) {
      break;
    }
    step_bucket(next_step_++, used);
  }
}

void Reducer::step_bucket(size_t index, const std::vector<int32_t>* used) {
  collect_reduced(index);
  if (options_.nan_check != NanCheck::kOff) check_finite({index});
  if (nan_bucket_ >= 0) {  // this bucket, or one stepped before it, holds NaN/inf: not stepped
    release(index);
    return;
  }
  Bucket& bucket = buckets_[index];
  // Used members the fused kernels can step go to them (`mask`); the others to the fallback.
  std::vector<char> mask(bucket.params.size(), 0);
  std::vector<int64_t> others;
  std::vector<at::Tensor> other_grads;
  FusedOptimizer* fused = offload_ ? nullptr : fused_.get();
  for (size_t s = 0; s < mask.size(); ++s) {
    const auto p = static_cast<size_t>(bucket.params[s]);
    if (used != nullptr && (*used)[p] == 0) continue;
    if (offload_ || (fused && fused->can_step(p))) {
      mask[s] = 1;
    } else {
      others.push_back(bucket.params[s]);
      other_grads.push_back(bucket.views[s]);
    }
  }
  if (offload_) {
    offload_->submit(index, bucket, mask);
  } else if (fused) {
    StepTargets targets;
    for (size_t s = 0; s < mask.size(); ++s) {
      targets.params.push_back(params_[static_cast<size_t>(bucket.params[s])]);
    }
    targets.grads = bucket.views;
    fused->step(index, bucket, mask, targets);
  }
  if (!others.empty()) {
    TORCH_CHECK(fallback_, "leanddp.DistributedDataParallel: no optimizer for bucket ", index);
    fallback_->step(index, others, other_grads);
  }
  release(index);
}

void Reducer::set_optimizer(std::unique_ptr<FusedOptimizer> fused,
                            std::unique_ptr<BucketStepper> fallback,
                            std::unique_ptr<HostOffload> offload) {
  std::lock_guard<std::mutex> lock(mu_);
  TORCH_CHECK(options_.step_in_backward,
              "leanddp.DistributedDataParallel: the Reducer was not built for "
              "optimizer_in_backward");
  TORCH_CHECK(!offload || (!fused && !fallback),
              "Reducer::set_optimizer: offload_to_cpu steps every bucket on the host");
  check_before_first_backward("the in-backward optimizer may be set");
  fused_ = std::move(fused);
  fallback_ = std::move(fallback);
  offload_ = std::move(offload);
  // The NaN check runs before the host steps: they wait for the end of backward.
  if (offload_ && options_.nan_check != NanCheck::kOff) offload_->hold_steps();
}

void Reducer::wait_for_offload(bool host_too) {
  std::lock_guard<std::mutex> lock(mu_);
  if (offload_) offload_->wait(host_too);
}

void Reducer::shutdown_offload() {
  std::lock_guard<std::mutex> lock(mu_);
  if (offload_) offload_->shutdown();
}

OffloadStats Reducer::offload_stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return offload_ ? offload_->stats() : OffloadStats{};
}

void Reducer::wait_idle(bool host_too) const {
  if (offload_) offload_->wait(host_too);
}

FusedOptimizer* Reducer::fused_optimizer() const {
  return offload_ ? &offload_->optimizer() : fused_.get();
}

void Reducer::load_master_weight(size_t p, const at::Tensor& value) {
  at::NoGradGuard no_grad;
  std::lock_guard<std::mutex> lock(mu_);
  TORCH_CHECK(p < params_.size(), "Reducer: no parameter ", p);
  TORCH_CHECK(offload_, "Reducer: master weights exist only with offload_to_cpu");
  wait_idle(/*host_too=*/true);
  offload_->load_master(p, value);
}

void Reducer::set_optimizer_groups(std::vector<OptimHyper> groups) {
  std::lock_guard<std::mutex> lock(mu_);
  wait_idle();
  if (FusedOptimizer* fused = fused_optimizer()) fused->set_groups(std::move(groups));
}

std::vector<std::pair<std::string, at::Tensor>> Reducer::optimizer_state(size_t p) const {
  std::lock_guard<std::mutex> lock(mu_);
  TORCH_CHECK(p < params_.size(), "Reducer: no parameter ", p);
  wait_idle();
  FusedOptimizer* fused = fused_optimizer();
  if (!fused || !fused->can_step(p)) return {};
  const auto [b, s] = location_[p];
  auto state = fused->state(p, b, buckets_[b], s);
  if (offload_ && !state.empty() && offload_->master(p).defined()) {
    state.emplace_back("master_weight", offload_->master(p));
  }
  return state;
}

void Reducer::load_optimizer_state(size_t p, int64_t step, const std::vector<at::Tensor>& values) {
  at::NoGradGuard no_grad;
  std::lock_guard<std::mutex> lock(mu_);
  TORCH_CHECK(p < params_.size(), "Reducer: no parameter ", p);
  wait_idle();
  FusedOptimizer* fused = fused_optimizer();
  TORCH_CHECK(fused && fused->can_step(p), "Reducer: parameter ", names_[p],
              " is not stepped by the fused optimizer");
  const auto [b, s] = location_[p];
  fused->load_state(p, b, buckets_[b], s, step, values);
}

int64_t Reducer::optimizer_generation() const {
  std::lock_guard<std::mutex> lock(mu_);
  wait_idle();
  FusedOptimizer* fused = fused_optimizer();
  return (fused ? fused->generation() : 0) + (offload_ ? offload_->generation() : 0);
}

}  // namespace leanddp
