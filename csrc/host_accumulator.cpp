#include "host_accumulator.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

namespace leanddp {

HostAccumulator::HostAccumulator(std::shared_ptr<HostWorker> worker,
                                 const std::vector<Bucket>& buckets)
    : worker_(std::move(worker)), on_gpu_(worker_->on_gpu()) {
  errors_seen_ = worker_->errors_taken();
  set_layout(buckets);
}

void HostAccumulator::set_layout(const std::vector<Bucket>& buckets) {
  TORCH_CHECK(held_.empty() || held() == 0,
              "HostAccumulator: the buckets were rebuilt while holding sums");
  numel_.clear();
  for (const Bucket& bucket : buckets) numel_.push_back(bucket.numel);
  host_.assign(buckets.size(), HostBuffers{});
  held_.assign(buckets.size(), 0);
  taken_.clear();
  taken_.resize(buckets.size());
  added_.assign(buckets.size(), 0);
}

void HostAccumulator::add(size_t index, const at::Tensor& flat) {
  TORCH_CHECK(index < numel_.size() && flat.numel() == numel_[index], "HostAccumulator: bucket ",
              index, " does not match the layout it was given");
  drop_failed();
  HostBuffers& host = host_[index];
  const bool first = !held_[index];
  at::Tensor& target = first ? host.sum : host.incoming;
  if (!target.defined()) {
    target = at::empty({numel_[index]}, worker_->staging_options().dtype(flat.scalar_type()));
  }
  // The worker may still be adding into this bucket's buffers (the previous micro-batch's
  // addition; after discard(), one into the sum this copy overwrites): wait for it.
  wait_added(index);
  EventPool::Handle copied;
  {
    std::optional<StreamScope> scope;
    if (on_gpu_) {
      const c10::Stream d2h = worker_->d2h_stream();
      stream_wait(d2h, current_stream(flat.device()), worker_->events());
      if (taken_[index]) taken_[index]->block(d2h);  // the last take() read the sum
      taken_[index].reset();
      scope.emplace(d2h);
    }
    target.copy_(flat, /*non_blocking=*/on_gpu_);
    if (on_gpu_) {
      record_on_stream(flat, worker_->d2h_stream());
      copied = worker_->events().record(worker_->d2h_stream());
    }
  }
  held_[index] = 1;
  // The worker waits for the copy, then adds (torch's `grad = grad + new`, in the bucket's
  // dtype); the first micro-batch's copy is the sum itself.
  const int64_t sequence = ++posted_;
  added_[index] = sequence;
  at::Tensor sum = first ? at::Tensor() : host.sum;
  at::Tensor incoming = first ? at::Tensor() : host.incoming;
  const double delay = addition_delays_.empty()          ? worker_->delay()
                       : index < addition_delays_.size() ? addition_delays_[index]
                                                         : 0.0;
  HostWorker::Job job;
  job.after = std::move(copied);
  // (the job runs on the worker, which is alive then: it does not own it)
  job.run = [sum, incoming, done = done_, sequence, delay, worker = worker_.get(), index] {
    if (delay > 0) std::this_thread::sleep_for(std::chrono::duration<double>(delay));
    worker->check_fault(HostWorker::Fault::kAddition, static_cast<int64_t>(index));
    if (sum.defined()) {
      at::NoGradGuard no_grad;
      sum.add_(incoming);
    }
    done->store(sequence);  // (the worker runs the jobs in order)
  };
  worker_->post(std::move(job));
}

void HostAccumulator::wait_added(size_t index) {
  // Often done already. If not, the host waits for this bucket's last addition only, not for
  // the jobs queued after it (other buckets' additions, host steps of this backward). A failed
  // addition dropped the worker's queue; the wait returns then, and the error surfaces at the
  // next forward (the steps submitted meanwhile are dropped: no step uses a partial sum).
  const int64_t added = added_[index];
  if (done_->load() >= added) return;
  std::unique_lock<std::mutex> lock = worker_->lock();
  // (not on an error alone: jobs posted after it still run; the failed job's queue was dropped)
  worker_->wait(lock, [&done = *done_, added](const HostWorker::Status& status) {
    return done.load() >= added || status.stopped || status.idle;
  });
}

void HostAccumulator::take(size_t index, const at::Tensor& flat) {
  TORCH_CHECK(holds(index), "HostAccumulator: bucket ", index, " holds no sum");
  wait_added(index);  // its additions are done (and with them its copies to the host)
  flat.copy_(host_[index].sum, /*non_blocking=*/on_gpu_);
  if (on_gpu_) {
    const c10::Stream current = current_stream(flat.device());
    record_on_stream(flat, current);
    taken_[index] = worker_->events().record(current);
  }
  held_[index] = 0;
}

void HostAccumulator::discard() {
  std::fill(held_.begin(), held_.end(), 0);
  errors_seen_ = worker_->errors_taken();  // (nothing is held that an error could have left)
}

void HostAccumulator::drop_failed() {
  if (worker_->errors_taken() != errors_seen_) discard();
}

bool HostAccumulator::holds(size_t index) const {
  return held_[index] != 0 && worker_->errors_taken() == errors_seen_;
}

int64_t HostAccumulator::held() const {
  if (worker_->errors_taken() != errors_seen_) return 0;  // (dropped at the next add())
  return static_cast<int64_t>(std::count(held_.begin(), held_.end(), 1));
}

int64_t HostAccumulator::bytes(bool pinned_only) const {
  int64_t bytes = 0;
  for (const HostBuffers& host : host_) {
    for (const at::Tensor* t : {&host.sum, &host.incoming}) {
      // (pinned on a GPU only: not under host ordering, as HostOffload's staging buffers)
      if (t->defined() && (!pinned_only || t->is_pinned())) {
        bytes += static_cast<int64_t>(t->nbytes());
      }
    }
  }
  return bytes;
}

}  // namespace leanddp
