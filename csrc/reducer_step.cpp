// The optimizer side of the Reducer (optimizer_in_backward and offload_to_cpu): stepping reduced
// buckets, and the methods that reach the optimizer's state. See reducer.h.
#include "reducer.h"

namespace leanddp {

void Reducer::advance_steps(StepWindow::Phase phase, const std::vector<int32_t>* used) {
  const auto ready = [this](size_t b) { return reduction_ready(b); };
  while (const auto decision = window_.next(phase, ready)) {
    if (decision->action == StepWindow::Action::kFinish) {
      // The window is full and the device runs behind: the host waits for the oldest bucket's
      // step only (never for the device to drain), so its memory can be handed out again.
      auto& [event, bytes] = finish_events_.front();
      event->synchronize();
      unfinished_bytes_ -= bytes;
      finish_events_.pop_front();
      window_.finished_one();
      continue;
    }
    step_bucket(decision->bucket, used);
    window_.stepped_one();
  }
}

bool Reducer::reduction_ready(size_t index) const {
  if (comm_hook_) return comm_hook_->done(index);
  if (futures_[index]) return futures_[index]->completed();
  return works_[index]->isCompleted();
}

c10::Stream Reducer::side_stream() const {
  return offload_ ? offload_->d2h_stream() : *step_stream_;
}

void Reducer::follow_side_stream() const {
  // (only in-backward steps on a device queue work on a side stream)
  if (!window_.device_ordered() || !options_.step_in_backward) return;
  stream_wait(current_stream(params_.front().device()), side_stream(), *events_);
}

void Reducer::step_bucket(size_t index, const std::vector<int32_t>* used) {
  // GPU: everything below is queued on the side stream, behind this bucket's gradients and its
  // reduction; the host waits for neither (NCCL's wait and a CUDA future's wait make the
  // current stream wait).
  std::optional<c10::Stream> side;
  std::optional<StreamScope> on_side;
  if (window_.device_ordered()) {
    side = side_stream();
    if (launched_events_[index]) {
      launched_events_[index]->block(*side);
      launched_events_[index].reset();
    }
    // Reduced already, on this thread's current stream (the strict NaN check at the end of
    // backward collects every bucket first): the side stream follows that stream.
    if (collected_[index]) {
      stream_wait(*side, current_stream(side->device()), *events_);
    }
    on_side.emplace(*side);
  }
  collect_reduced(index);
  const bool device_check = nan_.on_device();
  if (device_check) {
    // on the device; the kernels skip from the first bucket flagged
    nan_.flag(buckets_, index, params_.size());
  } else if (nan_.enabled()) {
    nan_.check(buckets_, {index});  // read on the host before the step
  }
  Bucket& bucket = buckets_[index];
  // A bucket holding NaN/inf, or after one that did, is not stepped, only released.
  if (!nan_.found()) {
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
    // (sharded, the reduced gradients are valid in this rank's shard only)
    TORCH_CHECK(others.empty() || !options_.shard_optimizer_state,
                "leanddp.DistributedDataParallel: shard_optimizer_state: parameter ",
                names_[static_cast<size_t>(others.front())],
                " cannot be stepped by the fused optimizer");
    if (offload_) {
      offload_->submit(index, bucket, mask);
    } else if (fused) {
      StepTargets targets;
      for (size_t s = 0; s < mask.size(); ++s) {
        targets.params.push_back(params_[static_cast<size_t>(bucket.params[s])]);
      }
      targets.grads = bucket.views;
      targets.grad_scale = shard_.clip_scale();  // (max_grad_norm, sharded)
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
      } else if (device_check) {
        targets.found_inf = nan_.seen();
        for (size_t s = 0; s < mask.size(); ++s) {
          if (mask[s]) nan_.gate(index, bucket.params[s]);
        }
      }
      if (options_.shard_optimizer_state && !side) finish_gathers();  // (the previous bucket's)
      fused->step(index, bucket, mask, targets);
      if (options_.shard_optimizer_state && side) {
        gather_weights(index);  // ordered on the side stream: nothing to wait for
      } else if (options_.shard_optimizer_state) {
        shard_.start(process_group_, bucket, index);  // finished at the next step, or at the end
        shard_.defer(index);
      }
    }
    // The per-bucket Python steps cannot read a device flag: with the device NaN check, the
    // host reads it first (a synchronization, only in buckets the fused kernels cannot step).
    const bool skip_others = device_check && !others.empty() && nan_.seen().item<float>() != 0.0f;
    if (!others.empty() && !skip_others) {
      TORCH_CHECK(fallback_, "leanddp.DistributedDataParallel: no optimizer for bucket ", index);
      fallback_->step(index, others, other_grads);
    }
  }
  if (side) {
    // The bucket is released now; the caching allocator hands its memory out again only after
    // the side stream's work on it. With a comm hook the recycler keeps it instead (its bytes
    // are counted there, not as unfinished).
    const int64_t bytes = bucket.bytes();
    record_on_stream(bucket.flat, *side);
    finish_events_.emplace_back(events_->record(*side), recycler_ ? 0 : bytes);
    unfinished_bytes_ += recycler_ ? 0 : bytes;
    if (recycler_ && bucket.allocated()) {
      const at::Tensor& whole = bucket.padded.defined() ? bucket.padded : bucket.flat;
      recycler_->give(at::Tensor(whole).as_strided({bytes / whole.element_size()}, {1}, 0),
                      events_->record(*side));
    }
  }
  if (!shard_.deferred(index)) release(index);
  if (recycler_) note_peak();  // (kept storage counts as held)
}

void Reducer::set_optimizer(OptimizerSpec spec) {
  std::lock_guard<std::mutex> lock(mu_);
  TORCH_CHECK(options_.step_in_backward,
              "leanddp.DistributedDataParallel: the Reducer was not built for "
              "optimizer_in_backward");
  check_before_first_backward("the in-backward optimizer may be set");
  TORCH_CHECK(!options_.shard_optimizer_state || spec.kind,
              "leanddp.DistributedDataParallel: shard_optimizer_state steps every bucket with "
              "the fused optimizer");
  TORCH_CHECK(!options_.offload_to_cpu || spec.kind,
              "leanddp.DistributedDataParallel: offload_to_cpu steps every bucket with the fused "
              "optimizer");
  std::unique_ptr<FusedOptimizer> fused;
  if (spec.kind) {
    fused = std::make_unique<FusedOptimizer>(*spec.kind, params_, std::move(spec.group_of),
                                             std::move(spec.groups), spec.step_device,
                                             /*on_host=*/options_.offload_to_cpu);
  }
  if (options_.offload_to_cpu) {
    OffloadOptions host;
    host.threads = options_.offload_threads;
    host.max_grad_norm = options_.max_grad_norm;
    offload_ = std::make_unique<HostOffload>(params_, std::move(fused), host);
    offload_->set_layout(buckets_, shard_.shards());
    // The NaN check runs before the host steps: they wait for the end of backward.
    if (nan_.enabled()) offload_->hold_steps();
    return;  // (spec.fallback is not needed: the host steps every bucket)
  }
  fused_ = std::move(fused);
  fallback_ = std::move(spec.fallback);
  if (fused_) fused_->set_shards(shard_.shards());
}

void Reducer::wait_for_steps(bool host_too) {
  std::lock_guard<std::mutex> lock(mu_);
  wait_idle(host_too);
}

OffloadStats Reducer::offload_stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (offload_) return offload_->stats();
  OffloadStats stats;
  stats.grad_norm = options_.max_grad_norm ? shard_.grad_norm() : -1;  // (shard_optimizer_state)
  return stats;
}

void Reducer::wait_idle(bool host_too, bool order_device) const {
  if (offload_) {
    offload_->wait(host_too);
  } else if (order_device) {
    follow_side_stream();
  }
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
  // Host numbers only (kernels take them by value when queued): no device ordering needed.
  wait_idle(/*host_too=*/false, /*order_device=*/false);
  if (FusedOptimizer* fused = fused_optimizer()) fused->set_groups(std::move(groups));
}

void Reducer::set_grad_scaler(at::Tensor scale, at::Tensor found_inf) {
  std::lock_guard<std::mutex> lock(mu_);
  wait_idle(/*host_too=*/false, /*order_device=*/false);  // (the last backward's steps are queued)
  TORCH_CHECK(scale.defined() == found_inf.defined(),
              "Reducer::set_grad_scaler: scale and found_inf go together");
  TORCH_CHECK(!scale.defined() || !options_.shard_optimizer_state,
              "Reducer::set_grad_scaler: shard_optimizer_state does not take a GradScaler");
  TORCH_CHECK(!scale.defined() || !offload_,
              "Reducer::set_grad_scaler: offload_to_cpu does not take a GradScaler");
  TORCH_CHECK(!scale.defined() || options_.nan_check == NanCheck::kOff,
              "Reducer::set_grad_scaler: a GradScaler skips non-finite steps itself; the NaN "
              "check is off with one");
  if (scale.defined() && (!amp_one_.defined() || amp_one_.device() != scale.device())) {
    amp_one_ = at::ones({}, scale.options().dtype(at::kFloat));
  }
  amp_scale_ = std::move(scale);
  amp_found_inf_ = std::move(found_inf);
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

int64_t Reducer::events_created() const {
  std::lock_guard<std::mutex> lock(mu_);
  return (events_ ? events_->created() : 0) + (offload_ ? offload_->events_created() : 0);
}

int64_t Reducer::optimizer_generation() const {
  std::lock_guard<std::mutex> lock(mu_);
  wait_idle(/*host_too=*/false, /*order_device=*/false);  // (reads host counters only)
  FusedOptimizer* fused = fused_optimizer();
  return (fused ? fused->generation() : 0) + (offload_ ? offload_->generation() : 0);
}

}  // namespace leanddp
