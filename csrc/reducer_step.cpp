// The optimizer side of the Reducer (optimizer_in_backward and offload_to_cpu): the window of
// buckets stepped and released in backward, the step strategy built and called (step_strategy.h),
// and the methods that reach the optimizer's state. See reducer.h.
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

c10::Stream Reducer::side_stream() const { return steps_->stream(); }

void Reducer::follow_side_stream() const {
  // (only in-backward steps on a device queue work on a side stream)
  if (!window_.device_ordered() || !steps_) return;
  stream_wait(current_stream(params_.front().device()), side_stream(), *events_);
}

void Reducer::step_bucket(size_t index, const std::vector<int32_t>* used) {
  TORCH_CHECK(steps_, "leanddp.DistributedDataParallel: no optimizer for bucket ", index);
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
  if (nan_.on_device()) {
    nan_.flag(buckets_, index, params_.size());  // the kernels skip from the first bucket flagged
  } else if (nan_.enabled()) {
    nan_.check(buckets_, {index});  // read on the host before the step
  }
  Bucket& bucket = buckets_[index];
  // A bucket holding NaN/inf, or after one that did, is not stepped, only released.
  if (!nan_.found()) {
    finish_gathers();  // (sharded on the CPU: the previous bucket's gather)
    steps_->step(index, bucket, used, process_group_);
  }
  if (side) {
    // The bucket is released now; the caching allocator hands its memory out again only after
    // the side stream's work on it. With a comm hook the recycler keeps it instead (its bytes
    // are counted there, not as unfinished), its event recorded before the window's: when the
    // window finishes this step, the recycler knows the buffer free.
    const int64_t bytes = bucket.bytes();
    record_on_stream(bucket.flat, *side);
    if (recycler_ && bucket.allocated()) {
      const at::Tensor& whole = bucket.padded.defined() ? bucket.padded : bucket.flat;
      recycler_->give(at::Tensor(whole).as_strided({bytes / whole.element_size()}, {1}, 0),
                      events_->record(*side), index);
    }
    finish_events_.emplace_back(events_->record(*side), recycler_ ? 0 : bytes);
    unfinished_bytes_ += recycler_ ? 0 : bytes;
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
  const c10::Device device = params_.front().device();
  if (options_.offload_to_cpu) {
    OffloadOptions host;
    host.threads = options_.offload_threads;
    host.max_grad_norm = options_.max_grad_norm;
    host.last_bucket_first = !options_.shard_optimizer_state;  // (sharded: gathered in order)
    auto offload = std::make_unique<HostOffload>(params_, std::move(fused), host);
    offload->set_layout(buckets_, shard_.shards());
    // The NaN check runs before the host steps: they wait for the end of backward.
    if (nan_.enabled()) offload->hold_steps();
    // (spec.fallback is not needed: the host steps every bucket)
    steps_ = std::make_unique<HostSteps>(std::move(offload), options_.shard_optimizer_state, device,
                                         options_.accumulate_on_host, buckets_);
    return;
  }
  std::optional<c10::Stream> stream;
  if (window_.device_ordered()) stream = pool_stream(device);
  steps_ =
      std::make_unique<DeviceSteps>(std::move(fused), std::move(spec.fallback), stream,
                                    options_.shard_optimizer_state, params_, names_, shard_, nan_);
}

void Reducer::wait_for_steps(bool host_too) {
  std::lock_guard<std::mutex> lock(mu_);
  wait_idle(host_too);
}

std::vector<int64_t> Reducer::pending_steps(bool follow_copies) const {
  std::lock_guard<std::mutex> lock(mu_);
  HostOffload* host = host_offload();
  // A forward that winds up an unfinished backward or rebuilds the buckets waits for the
  // worker there anyway (prepare_for_forward, rebuild_buckets): nothing to wait for per bucket.
  if (!host || armed_ || rebuild_due()) return {};
  std::vector<int64_t> pending = host->pending();
  // (nothing pending: the forward calls follow_steps(), which orders it after every copy back)
  if (follow_copies && !pending.empty()) host->order_after_copies();
  return pending;
}

void Reducer::follow_steps() {
  std::lock_guard<std::mutex> lock(mu_);
  HostOffload* host = host_offload();
  // (pending_steps() is also empty where the forward waits later, which a forward without
  // gradients does not: a step still pending is waited for here then)
  if (host && host->pending().empty()) return host->follow_copies();
  wait_idle(/*host_too=*/false);
}

void Reducer::wait_for_bucket(int64_t index) {
  std::lock_guard<std::mutex> lock(mu_);
  HostOffload* host = host_offload();
  if (!host) return;
  TORCH_CHECK(index >= 0 && static_cast<size_t>(index) < buckets_.size(), "Reducer: no bucket ",
              index);
  host->wait_stepped(static_cast<size_t>(index));
}

void Reducer::delay_host_steps(double seconds, std::optional<std::vector<double>> additions) {
  std::lock_guard<std::mutex> lock(mu_);
  HostOffload* host = host_offload();
  TORCH_CHECK(host, "Reducer::delay_host_steps: only with offload_to_cpu");
  host->delay_steps(seconds);
  HostAccumulator* acc = accumulator();
  TORCH_CHECK(acc || !additions,
              "Reducer::delay_host_steps: additions only with accumulate_on_host");
  if (acc) acc->delay_additions(additions.value_or(std::vector<double>{}));
}

std::optional<std::tuple<int64_t, int64_t, int64_t>> Reducer::copy_back_stream() const {
  std::lock_guard<std::mutex> lock(mu_);
  HostOffload* host = host_offload();
  if (!host || !host->on_gpu()) return std::nullopt;
  const c10::Stream stream = host->h2d_stream();
  return std::make_tuple(static_cast<int64_t>(stream.id()),
                         static_cast<int64_t>(stream.device_index()),
                         static_cast<int64_t>(stream.device_type()));
}

void Reducer::delay_copies_back(double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  HostOffload* host = host_offload();
  TORCH_CHECK(host, "Reducer::delay_copies_back: only with offload_to_cpu");
  host->delay_copies_back(seconds);
}

OffloadStats Reducer::offload_stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (HostOffload* host = host_offload()) return host->stats();
  OffloadStats stats;
  stats.grad_norm = options_.max_grad_norm ? shard_.grad_norm() : -1;  // (shard_optimizer_state)
  return stats;
}

void Reducer::wait_idle(bool host_too, bool order_device) const {
  if (!steps_) return;
  steps_->wait(host_too);
  if (order_device && steps_->caller_follows()) follow_side_stream();
}

FusedOptimizer* Reducer::fused_optimizer() const { return steps_ ? steps_->optimizer() : nullptr; }

void Reducer::load_master_weight(size_t p, const at::Tensor& value) {
  at::NoGradGuard no_grad;
  std::lock_guard<std::mutex> lock(mu_);
  TORCH_CHECK(p < params_.size(), "Reducer: no parameter ", p);
  HostOffload* host = host_offload();
  TORCH_CHECK(host, "Reducer: master weights exist only with offload_to_cpu");
  wait_idle(/*host_too=*/true);
  host->load_master(p, value);
}

void Reducer::adopt_master_weights() {
  std::lock_guard<std::mutex> lock(mu_);
  HostOffload* host = host_offload();
  TORCH_CHECK(host, "Reducer: master weights exist only with offload_to_cpu");
  wait_idle(/*host_too=*/true);
  host->adopt_masters();
}

void Reducer::set_optimizer_groups(std::vector<OptimHyper> groups) {
  std::lock_guard<std::mutex> lock(mu_);
  // Host steps: set by the worker after the steps queued (the next forward does not wait).
  if (HostOffload* host = host_offload()) return host->set_groups(std::move(groups));
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
  TORCH_CHECK(!scale.defined() || options_.nan_check == NanCheck::kOff,
              "Reducer::set_grad_scaler: a GradScaler skips non-finite steps itself; the NaN "
              "check is off with one");
  TORCH_CHECK(!scale.defined() || steps_,
              "Reducer::set_grad_scaler: no in-backward optimizer is set");
  if (steps_) steps_->set_grad_scaler(std::move(scale), std::move(found_inf));
}

std::vector<std::pair<std::string, at::Tensor>> Reducer::optimizer_state(size_t p) const {
  std::lock_guard<std::mutex> lock(mu_);
  TORCH_CHECK(p < params_.size(), "Reducer: no parameter ", p);
  wait_idle();
  FusedOptimizer* fused = fused_optimizer();
  if (!fused || !fused->can_step(p)) return {};
  const auto [b, s] = location_[p];
  auto state = fused->state(p, b, buckets_[b], s);
  HostOffload* host = host_offload();  // (a master alone: SGD without momentum)
  if (host && host->master(p).defined()) {
    state.emplace_back("master_weight", host->master(p));
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

std::vector<std::tuple<int64_t, int64_t, bool>> Reducer::recycler_reuses() const {
  std::lock_guard<std::mutex> lock(mu_);
  return reuses_;
}

int64_t Reducer::events_created() const {
  std::lock_guard<std::mutex> lock(mu_);
  return (events_ ? events_->created() : 0) + (steps_ ? steps_->events_created() : 0);
}

int64_t Reducer::optimizer_generation() const {
  std::lock_guard<std::mutex> lock(mu_);
  // (reads host counters only, which only steps change: no wait where none is pending, such as
  // while the worker sums no_sync() micro-batches)
  const HostOffload* host = host_offload();
  if (!host || !host->pending().empty()) wait_idle(/*host_too=*/false, /*order_device=*/false);
  return steps_ ? steps_->generation() : 0;
}

}  // namespace leanddp
