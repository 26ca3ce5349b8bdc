// The step strategies of optimizer_in_backward (see step_strategy.h).
#include "step_strategy.h"

#include "errors.h"

#include <c10/util/Exception.h>

namespace leanddp {

int64_t StepStrategy::generation() const {
  const FusedOptimizer* fused = optimizer();
  return fused ? fused->generation() : 0;
}

DeviceSteps::DeviceSteps(std::unique_ptr<FusedOptimizer> fused,
                         std::unique_ptr<BucketStepper> fallback, std::optional<c10::Stream> stream,
                         bool sharded, const std::vector<at::Tensor>& params,
                         const std::vector<std::string>& names)
    : fused_(std::move(fused)),
      fallback_(std::move(fallback)),
      stream_(stream),
      sharded_(sharded),
      params_(params),
      names_(names) {}

void DeviceSteps::attach(const std::vector<Bucket>&, const std::vector<ShardLayout>& shards) {
  if (fused_) fused_->set_shards(shards);
}

void DeviceSteps::step(size_t index, Bucket& bucket, const Take& what) {
  const std::vector<int32_t>* used = what.used;
  // Used members the fused kernels can step go to them (`mask`); the others to the fallback.
  std::vector<char> mask(bucket.params.size(), 0);
  std::vector<int64_t> others;
  std::vector<at::Tensor> other_grads;
  for (size_t s = 0; s < mask.size(); ++s) {
    const auto p = static_cast<size_t>(bucket.params[s]);
    if (used != nullptr && (*used)[p] == 0) continue;
    if (fused_ && fused_->can_step(p)) {
      mask[s] = 1;
    } else {
      others.push_back(bucket.params[s]);
      other_grads.push_back(bucket.views[s]);
    }
  }
  // (sharded, the reduced gradients are valid in this rank's shard only)
  TORCH_CHECK(others.empty() || !sharded_,
              "leanddp.DistributedDataParallel: shard_optimizer_state: parameter ",
              names_[static_cast<size_t>(others.front())],
              " cannot be stepped by the fused optimizer");
  if (fused_) {
    fused_->step(index, bucket, mask, targets(index, bucket, mask, what));
  }
  // The per-bucket Python steps cannot read a device flag: with the device NaN check, the host
  // reads it first (a synchronization, only in buckets the fused kernels cannot step).
  const NonFiniteCheck* nan = what.nan;
  const bool skip_others =
      nan != nullptr && nan->on_device() && !others.empty() && nan->seen().item<float>() != 0.0f;
  if (!others.empty() && !skip_others) {
    TORCH_CHECK(fallback_, "leanddp.DistributedDataParallel: no optimizer for bucket ", index);
    fallback_->step(index, others, other_grads);
  }
}

StepTargets DeviceSteps::targets(size_t index, const Bucket& bucket, const std::vector<char>& mask,
                                 const Take& what) {
  StepTargets targets;
  for (size_t s = 0; s < mask.size(); ++s) {
    targets.params.push_back(params_[static_cast<size_t>(bucket.params[s])]);
  }
  targets.grads = bucket.views;
  targets.grad_scale = what.clip_scale;  // (max_grad_norm, sharded)
  if (amp_scale_.defined()) {
    // GradScaler: inf/NaN in the (scaled) gradients of this bucket sets found_inf, on the
    // device, as GradScaler's check for fused optimizers does; the kernels read it.
    std::vector<at::Tensor> checked;
    for (size_t s = 0; s < mask.size(); ++s) {
      if (mask[s]) checked.push_back(bucket.views[s]);
    }
    if (!checked.empty()) {
      at::_amp_foreach_non_finite_check_and_unscale_(checked, amp_found_inf_, amp_one_);
    }
    targets.amp_scale = amp_scale_;
    targets.found_inf = amp_found_inf_;
  } else if (what.nan != nullptr && what.nan->on_device()) {
    targets.found_inf = what.nan->seen();  // the kernels skip from the first bucket flagged
    for (size_t s = 0; s < mask.size(); ++s) {
      if (mask[s]) what.nan->gate(index, bucket.params[s]);
    }
  }
  return targets;
}

void DeviceSteps::relayout(const std::vector<Bucket>& old_buckets,
                           const std::vector<Bucket>& buckets,
                           const std::vector<ShardLayout>& shards,
                           const std::vector<std::vector<at::Tensor>>& old_full) {
  if (!fused_) return;
  fused_->set_shards(shards);
  fused_->relayout(old_buckets, buckets, old_full);
}

void DeviceSteps::set_grad_scaler(at::Tensor scale, at::Tensor found_inf) {
  if (scale.defined() && (!amp_one_.defined() || amp_one_.device() != scale.device())) {
    amp_one_ = at::ones({}, scale.options().dtype(at::kFloat));
  }
  amp_scale_ = std::move(scale);
  amp_found_inf_ = std::move(found_inf);
}

HostSteps::HostSteps(std::unique_ptr<HostOffload> offload, bool sharded, c10::Device device)
    : offload_(std::move(offload)), sharded_(sharded), device_(device) {}

void HostSteps::step(size_t index, Bucket& bucket, const Take& what) {
  const std::vector<int32_t>* used = what.used;
  std::vector<char> mask(bucket.params.size(), 1);  // the host steps every used member
  for (size_t s = 0; s < mask.size() && used != nullptr; ++s) {
    mask[s] = (*used)[static_cast<size_t>(bucket.params[s])] != 0;
  }
  offload_->submit(index, bucket, mask);
}

void HostSteps::end_of_backward(c10d::ProcessGroup& group) {
  if (!sharded_) {
    offload_->end_iteration(/*completed=*/true);
    return;
  }
  // Sharded: with max_grad_norm the global norm from every rank's held buckets. (The Reducer
  // then gathers each bucket's stepped pieces into the parameters as soon as its own host step
  // is done, so the gathers overlap the remaining host steps.)
  std::optional<double> sum_squares;
  if (offload_->clips()) {
    offload_->wait(/*host_too=*/false);  // every bucket's squares taken (its step is held)
    at::Tensor sum = at::scalar_tensor(offload_->held_sum_squares(),
                                       at::TensorOptions(at::kDouble).device(device_));
    std::vector<at::Tensor> tensors{sum};
    try {
      group.allreduce(tensors)->wait();
    } catch (...) {
      rethrow_collective_error(group.getRank(),
                               "the reduction of the gradients' norm (max_grad_norm)");
    }
    sum_squares = sum.item<double>();
  }
  offload_->end_iteration(/*completed=*/true, sum_squares);
}

void HostSteps::relayout(const std::vector<Bucket>& old_buckets, const std::vector<Bucket>& buckets,
                         const std::vector<ShardLayout>&,
                         const std::vector<std::vector<at::Tensor>>&) {
  offload_->relayout(old_buckets, buckets);  // (sharded: never; the layout is fixed)
}

void HostSteps::set_grad_scaler(at::Tensor scale, at::Tensor found_inf) {
  (void)found_inf;
  TORCH_CHECK(!scale.defined(), "InBackwardOptimizer: host steps take no GradScaler (check_modes)");
}

int64_t HostSteps::generation() const {
  return offload_->optimizer().generation() + offload_->generation();
}

}  // namespace leanddp
