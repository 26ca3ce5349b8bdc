// InBackwardOptimizer's life, the seam the Reducer calls, and the forward-side waits (see
// in_backward_optimizer.h). Its state accessors: in_backward_optimizer_state.cpp.
#include "in_backward_optimizer.h"

#include "errors.h"

#include <c10/util/Exception.h>

#include <utility>

namespace leanddp {
namespace {

// Bucket records with the layout only: the optimizer never holds the Reducer's storage.
std::vector<Bucket> layouts_of(const std::vector<Bucket>& buckets) {
  std::vector<Bucket> out;
  for (const Bucket& bucket : buckets) {
    Bucket plain;
    plain.params = bucket.params;
    plain.offsets = bucket.offsets;
    plain.numel = bucket.numel;
    plain.sparse = bucket.sparse;
    plain.padded_numel = bucket.padded_numel;
    out.push_back(std::move(plain));
  }
  return out;
}

}  // namespace

InBackwardOptimizer::InBackwardOptimizer(std::vector<at::Tensor> params,
                                         std::vector<std::string> names,
                                         c10::intrusive_ptr<c10d::ProcessGroup> group,
                                         InBackwardOptions options,
                                         std::unique_ptr<BucketStepper> fallback)
    : params_(std::move(params)),
      names_(std::move(names)),
      options_(std::move(options)),
      device_ordered_(!params_.empty() && runs_apart(params_.front().device())),
      group_(std::move(group)) {
  TORCH_CHECK(!params_.empty(), "InBackwardOptimizer: no parameters");
  TORCH_CHECK(names_.size() == params_.size(), "InBackwardOptimizer: one name per parameter");
  TORCH_CHECK(group_, "InBackwardOptimizer: no process group");
  TORCH_CHECK(options_.group_of.size() == params_.size(),
              "InBackwardOptimizer: one group index per parameter");
  TORCH_CHECK(!options_.sharded || options_.kind,
              "leanddp.DistributedDataParallel: shard_optimizer_state steps every bucket with "
              "the fused optimizer");
  TORCH_CHECK(!options_.offload_to_cpu || options_.kind,
              "leanddp.DistributedDataParallel: offload_to_cpu steps every bucket with the fused "
              "optimizer");
  std::unique_ptr<FusedOptimizer> fused;
  if (options_.kind) {
    fused = std::make_unique<FusedOptimizer>(*options_.kind, params_, options_.group_of,
                                             options_.groups, options_.step_device,
                                             /*on_host=*/options_.offload_to_cpu, options_.quant);
  }
  const c10::Device device = params_.front().device();
  if (options_.offload_to_cpu) {
    OffloadOptions host;
    host.threads = options_.offload_threads;
    host.max_grad_norm = options_.max_grad_norm;
    host.last_bucket_first = !options_.sharded;  // (sharded: the Reducer gathers in order)
    auto offload = std::make_unique<HostOffload>(params_, std::move(fused), host);
    host_ = offload.get();
    // (the fallback is not needed: the host steps every bucket)
    steps_ = std::make_unique<HostSteps>(std::move(offload), options_.sharded, device);
    return;
  }
  std::optional<c10::Stream> stream;
  if (device_ordered_) {
    stream = pool_stream(device);
    events_ = std::make_unique<EventPool>(device.type());
  }
  steps_ = std::make_unique<DeviceSteps>(std::move(fused), std::move(fallback), stream,
                                         options_.sharded, params_, names_);
}

InBackwardOptimizer::~InBackwardOptimizer() { steps_->shutdown(); }

void InBackwardOptimizer::attach(const std::vector<Bucket>& buckets,
                                 const std::vector<ShardLayout>& shards, bool checked_first) {
  std::lock_guard<std::mutex> lock(mu_);
  TORCH_CHECK(layout_.empty(), "InBackwardOptimizer: attached to a Reducer already");
  TORCH_CHECK(shards.empty() == !options_.sharded,
              "InBackwardOptimizer: shard_optimizer_state differs from the Reducer's");
  layout_ = layouts_of(buckets);
  shards_ = shards;
  location_.assign(params_.size(), {SIZE_MAX, 0});
  for (size_t b = 0; b < layout_.size(); ++b) {
    for (size_t s = 0; s < layout_[b].params.size(); ++s) {
      location_[static_cast<size_t>(layout_[b].params[s])] = {b, s};
    }
  }
  steps_->attach(layout_, shards_);
  if (host_ && checked_first) host_->hold_steps();
}

bool InBackwardOptimizer::attached() const {
  std::lock_guard<std::mutex> lock(mu_);
  return !layout_.empty();
}

c10::Stream InBackwardOptimizer::stream() const { return steps_->stream(); }

bool InBackwardOptimizer::caller_follows() const { return steps_->caller_follows(); }

void InBackwardOptimizer::take(size_t index, Bucket& bucket, const Take& what) {
  std::lock_guard<std::mutex> lock(mu_);
  in_backward_ = true;
  steps_->step(index, bucket, what);
}

void InBackwardOptimizer::skipped(const std::vector<int64_t>& params) {
  std::lock_guard<std::mutex> lock(mu_);
  FusedOptimizer* fused = steps_->optimizer();
  for (int64_t p : params) fused->unstep(static_cast<size_t>(p));
}

void InBackwardOptimizer::end_of_backward() {
  std::lock_guard<std::mutex> lock(mu_);
  in_backward_ = false;
  ended_since_forward_ = true;
  TORCH_CHECK(group_, "leanddp.DistributedDataParallel: a backward after the wrapper was closed");
  steps_->end_of_backward(*group_);
}

void InBackwardOptimizer::wait_stepped(size_t b) {
  std::lock_guard<std::mutex> lock(mu_);
  if (host_) host_->wait_stepped(b);
}

void InBackwardOptimizer::gathered() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!host_) return;
  host_->wait(/*host_too=*/false);  // (done already; rethrows an error the worker met)
  host_->adopt_versions();
}

void InBackwardOptimizer::abandon() {
  std::lock_guard<std::mutex> lock(mu_);
  in_backward_ = false;
  ended_since_forward_ = true;
  steps_->abandon();
}

void InBackwardOptimizer::set_iteration(bool armed, bool forward_waits_all) {
  std::lock_guard<std::mutex> lock(mu_);
  armed_ = armed;
  forward_waits_all_ = forward_waits_all;
}

bool InBackwardOptimizer::matches(const std::vector<at::Tensor>& params,
                                  const c10::intrusive_ptr<c10d::ProcessGroup>& group) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (group_.get() != group.get() || params.size() != params_.size()) return false;
  for (size_t p = 0; p < params.size(); ++p) {
    if (!params[p].is_same(params_[p])) return false;
  }
  return true;
}

void InBackwardOptimizer::begin_relayout() {
  std::lock_guard<std::mutex> lock(mu_);
  wait_locked(/*host_too=*/false, /*order_device=*/true);
  // Sharded, a parameter's state may move to another rank: each old bucket's state is gathered
  // whole first, and each rank keeps its pieces.
  std::vector<std::vector<at::Tensor>> old_full;
  FusedOptimizer* fused = steps_->optimizer();
  if (fused && fused->sharded()) {
    for (size_t b = 0; b < layout_.size(); ++b) {
      old_full.push_back(gather_state(layout_, shards_, b));
    }
  }
  old_full_ = std::move(old_full);
}

void InBackwardOptimizer::relayout(const std::vector<Bucket>& buckets,
                                   const std::vector<ShardLayout>& shards) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::vector<std::vector<at::Tensor>> old_full = std::exchange(old_full_, {});
  const std::vector<Bucket> old_layout = std::exchange(layout_, layouts_of(buckets));
  shards_ = shards;
  for (size_t b = 0; b < layout_.size(); ++b) {
    for (size_t s = 0; s < layout_[b].params.size(); ++s) {
      location_[static_cast<size_t>(layout_[b].params[s])] = {b, s};
    }
  }
  steps_->relayout(old_layout, layout_, shards_, old_full);
}

void InBackwardOptimizer::wait(bool host_too, bool order_device) {
  std::lock_guard<std::mutex> lock(mu_);
  wait_locked(host_too, order_device);
}

void InBackwardOptimizer::wait_locked(bool host_too, bool order_device) {
  ended_since_forward_ = false;  // (this wait raises an error the worker met)
  steps_->wait(host_too);
  if (order_device && events_ && steps_->caller_follows()) {
    stream_wait(current_stream(params_.front().device()), steps_->stream(), *events_);
  }
}

InBackwardOptimizer::Detached InBackwardOptimizer::close() {
  std::lock_guard<std::mutex> lock(mu_);
  steps_->shutdown();
  Detached detached;
  detached.group = std::move(group_);
  detached.fallback = steps_->take_fallback();
  return detached;
}

int64_t InBackwardOptimizer::events_created() const {
  std::lock_guard<std::mutex> lock(mu_);
  return (events_ ? events_->created() : 0) + steps_->events_created();
}

void InBackwardOptimizer::wait_for_steps(bool host_too) { wait(host_too, /*order_device=*/true); }

std::vector<int64_t> InBackwardOptimizer::pending_steps(bool follow_copies) {
  std::lock_guard<std::mutex> lock(mu_);
  // A forward that winds up an unfinished backward or rebuilds the buckets waits for every
  // step there anyway: nothing to wait for per bucket.
  if (!host_ || forward_waits_all_) return {};
  std::vector<int64_t> pending = host_->pending();
  // (nothing pending: the forward calls follow_steps(), which orders it after every copy back)
  if (follow_copies && !pending.empty()) host_->order_after_copies();
  return pending;
}

void InBackwardOptimizer::follow_steps() {
  std::lock_guard<std::mutex> lock(mu_);
  const bool ended = std::exchange(ended_since_forward_, false);
  // An error the worker met is kept here (not raised) in two cases:
  // - After no_sync() backwards only (an addition's error): whether it is met yet depends on
  //   this rank's timing, so a rank whose worker is slower would not raise at this forward and
  //   be left alone in the next collective. It is raised, on every rank alike, at the forward
  //   after the synchronized backward (whose take() of each sum waited for its additions, and
  //   whose steps the held error dropped), or by any full wait before.
  // - While a synchronized backward is armed (a forward prepared it; it raised part-way, or has
  //   not run yet): the next forward with gradients winds it up (Reducer::recover_unfinished),
  //   and that full wait raises it, before the module's forward, on every rank alike. Taken here
  //   by a rank whose worker was still stepping and not by one whose worker was done, it would
  //   be raised at different points of the forward, and the wind-up would step the remaining
  //   buckets on one rank and drop them on the other (a held error drops them on every rank).
  //   (If that backward runs to its end instead, the forward after it raises it.)
  const bool keep = armed_ || !ended;
  // (pending_steps() is also empty where the forward waits later, which a forward without
  // gradients does not: a step still pending is waited for here then)
  if (host_ && host_->pending().empty()) {
    return keep ? host_->order_after_copies() : host_->follow_copies();
  }
  if (host_ && armed_) return host_->wait_keeping_error();  // (the steps land before the read)
  wait_locked(/*host_too=*/false, /*order_device=*/true);
}

void InBackwardOptimizer::wait_for_bucket(int64_t index) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!host_) return;
  TORCH_CHECK(index >= 0 && static_cast<size_t>(index) < layout_.size(),
              "InBackwardOptimizer: no bucket ", index);
  host_->wait_stepped(static_cast<size_t>(index));
}

void InBackwardOptimizer::set_groups(std::vector<OptimHyper> groups) {
  std::lock_guard<std::mutex> lock(mu_);
  // Host steps: set by the worker after the steps queued (the next forward does not wait).
  if (host_) return host_->set_groups(std::move(groups));
  // Host numbers only (kernels take them by value when queued): no device ordering needed.
  wait_locked(/*host_too=*/false, /*order_device=*/false);
  if (FusedOptimizer* fused = steps_->optimizer()) fused->set_groups(std::move(groups));
}

void InBackwardOptimizer::set_grad_scaler(at::Tensor scale, at::Tensor found_inf) {
  std::lock_guard<std::mutex> lock(mu_);
  wait_locked(/*host_too=*/false, /*order_device=*/false);  // (the last steps are queued)
  TORCH_CHECK(scale.defined() == found_inf.defined(),
              "InBackwardOptimizer::set_grad_scaler: scale and found_inf go together");
  // (check_modes refuses a GradScaler with shard_optimizer_state before anything is built)
  TORCH_CHECK(!scale.defined() || !options_.sharded,
              "InBackwardOptimizer::set_grad_scaler: sharded steps take no GradScaler");
  steps_->set_grad_scaler(std::move(scale), std::move(found_inf));
}

OffloadStats InBackwardOptimizer::stats() {
  std::lock_guard<std::mutex> lock(mu_);
  if (host_) return host_->stats();
  OffloadStats stats;
  stats.grad_norm = grad_norm_;  // (shard_optimizer_state's device clipping, or -1)
  return stats;
}

void InBackwardOptimizer::note_grad_norm(double norm) {
  std::lock_guard<std::mutex> lock(mu_);
  grad_norm_ = norm;
}

OptimizerMemory InBackwardOptimizer::memory_stats() {
  std::lock_guard<std::mutex> lock(mu_);
  wait_locked(/*host_too=*/false, /*order_device=*/false);  // (reads host counters only)
  OptimizerMemory out;
  if (host_) {
    const OffloadStats host = host_->stats();
    out.host_master_bytes = host.master_bytes;
    out.host_buffer_bytes = host.host_buffer_bytes;
    out.host_pinned_bytes = host.pinned_bytes;
  }
  const FusedOptimizer* fused = steps_->optimizer();
  out.state_bytes = fused ? fused->state_bytes() : 0;
  return out;
}

void InBackwardOptimizer::delay_host_steps(double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  TORCH_CHECK(host_, "InBackwardOptimizer::delay_host_steps: only with offload_to_cpu");
  host_->worker()->delay_jobs(seconds);
}

void InBackwardOptimizer::inject_host_faults(HostWorker::Fault kind, int64_t count,
                                             int64_t bucket) {
  std::lock_guard<std::mutex> lock(mu_);
  TORCH_CHECK(host_, "InBackwardOptimizer::inject_host_faults: only with offload_to_cpu");
  host_->worker()->inject_faults(kind, count, bucket);
}

void InBackwardOptimizer::delay_copies_back(double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  TORCH_CHECK(host_, "InBackwardOptimizer::delay_copies_back: only with offload_to_cpu");
  host_->worker()->delay_copies_back(seconds);
}

std::optional<std::tuple<int64_t, int64_t, int64_t>> InBackwardOptimizer::copy_back_stream() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!host_ || !host_->worker()->on_gpu()) return std::nullopt;
  const c10::Stream stream = host_->worker()->h2d_stream();
  return std::make_tuple(static_cast<int64_t>(stream.id()),
                         static_cast<int64_t>(stream.device_index()),
                         static_cast<int64_t>(stream.device_type()));
}

}  // namespace leanddp
