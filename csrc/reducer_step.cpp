// The Reducer's side of optimizer_in_backward: the window of buckets handed to the optimizer
// (in_backward_optimizer.h) and released in backward, and the seam's other calls. See reducer.h.
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

c10::Stream Reducer::side_stream() const { return optimizer_->stream(); }

void Reducer::follow_side_stream() const {
  // (only in-backward steps on a device queue work on a side stream)
  if (!window_.device_ordered() || !optimizer_) return;
  stream_wait(current_stream(params_.front().device()), side_stream(), *events_);
}

void Reducer::step_bucket(size_t index, const std::vector<int32_t>* used) {
  TORCH_CHECK(optimizer_, "leanddp.DistributedDataParallel: no optimizer for bucket ", index);
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
    optimizer_->take(index, bucket, Take{used, shard_.clip_scale(), &nan_});
    // Sharded device steps: the stepped shards are gathered into the parameters right away (on
    // a GPU ordered on the side stream: nothing to wait for; on the CPU finished at the next
    // bucket's step or the end of backward). Host steps are gathered at the end of backward.
    if (options_.shard_optimizer_state && !steps_on_host()) {
      shard_.start(process_group_, bucket, index);
      if (side) {
        shard_.finish(bucket, index);
      } else {
        shard_.defer(index);
      }
    }
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

void Reducer::set_optimizer(std::shared_ptr<InBackwardOptimizer> optimizer) {
  std::lock_guard<std::mutex> lock(mu_);
  TORCH_CHECK(options_.optimizer_in_backward,
              "leanddp.DistributedDataParallel: the Reducer was not built for "
              "optimizer_in_backward");
  TORCH_CHECK(optimizer && !optimizer_, "Reducer::set_optimizer: one optimizer, once");
  TORCH_CHECK(optimizer->matches(params_, process_group_) &&
                  optimizer->device_ordered() == window_.device_ordered(),
              "Reducer::set_optimizer: the optimizer was built over other parameters, another "
              "process group, or with other device ordering (host ordering, streams.h)");
  check_before_first_backward("the in-backward optimizer may be set");
  TORCH_CHECK(!options_.accumulate_on_host || optimizer->host_worker(),
              "leanddp.DistributedDataParallel: accumulate_on_host needs an optimizer that "
              "steps on the host (offload_to_cpu)");
  // (the NaN check reads every bucket before the host steps: they wait for the end of backward)
  optimizer->attach(buckets_, shard_.shards(), /*checked_first=*/nan_.enabled());
  optimizer_ = std::move(optimizer);
  // Sharded device steps on the CPU keep a stepped bucket until its gather is finished at the
  // next bucket's step (ShardGather::defer): the window holds one launched bucket fewer, so that
  // as many buckets are allocated at once as unsharded. Bucket k's reduction still overlaps the
  // backward that fills bucket k + 1, and its gather the one that fills bucket k + 2.
  if (options_.shard_optimizer_state && !window_.device_ordered() && !steps_on_host() &&
      options_.buckets_in_flight > 1) {
    window_ = StepWindow(options_.buckets_in_flight - 1, /*device_ordered=*/false);
  }
  if (options_.accumulate_on_host) {
    accumulator_ = std::make_unique<HostAccumulator>(optimizer_->host_worker(), buckets_);
  }
  tell_iteration();
}

void Reducer::tell_iteration() {
  if (optimizer_) optimizer_->set_iteration(armed_, armed_ || rebuild_due());
}

void Reducer::wait_for_optimizer() {
  if (optimizer_) optimizer_->wait(/*host_too=*/false);
}

void Reducer::delay_additions(std::vector<double> seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  TORCH_CHECK(accumulator_, "Reducer::delay_additions: only with accumulate_on_host");
  accumulator_->delay_additions(std::move(seconds));
}

std::vector<std::tuple<int64_t, int64_t, bool>> Reducer::recycler_reuses() const {
  std::lock_guard<std::mutex> lock(mu_);
  return reuses_;
}

int64_t Reducer::events_created() const {
  std::lock_guard<std::mutex> lock(mu_);
  return events_ ? events_->created() : 0;  // (the accumulator's are the host worker's)
}

}  // namespace leanddp
