// HostAccumulator: gradient accumulation on the host for offload_to_cpu (accumulate_on_host).
//
// Inside no_sync() a micro-batch's gradients are not reduced: torch's DDP (and leanddp without
// this class) keeps them on the device, summed in place, until the synchronized micro-batch. So
// with accumulation every bucket stays on the device across the micro-batches. Here instead,
// as soon as a bucket's gradients of a no_sync() micro-batch are complete, the Reducer flattens
// them into the bucket and hands it to add(): one flat copy on the HostWorker's device-to-host
// stream (host_worker.h) into a host buffer, summed into the bucket's host sum by that worker,
// and the device bucket is released. The worker is the one the optimizer's HostOffload steps
// on: one queue, so a bucket's additions run before its step. The device holds no gradient
// between micro-batches.
//
// On the synchronized micro-batch, at the launch of a bucket that holds a host sum (allocated
// then, as without accumulation), the Reducer makes stream() current (on a GPU, after the
// compute stream, where this micro-batch's gradients are final), take() copies the sum into the
// bucket, and the Reducer adds this micro-batch's gradients into their slots, averages the
// bucket and starts its reduction, all on that stream: the compute stream never waits for the
// copy. A parameter without a gradient in this micro-batch keeps its slot of the sum.
//
// Exactness. torch accumulates `grad = grad + new` in the parameter's dtype, micro-batch after
// micro-batch; the worker computes the same sums in the same order, in the bucket's dtype (a
// bfloat16 bucket accumulates in bfloat16, torch's bits), and the last addition, done on the
// device as `sum + new`, is torch's `partial + new` (floating-point addition commutes). A slot
// without a gradient in some micro-batch adds zeros. So the averaged bucket is torch's, bit for
// bit, then reduced and stepped as without accumulation.
//
// Per bucket the host keeps `sum` and, from the second no_sync() micro-batch of a step on,
// `incoming` (where the later copies land), in the bucket's dtype, pinned when the parameters
// are on a GPU: up to 2 x the gradients' bytes of host memory, allocated at first use and kept.
// PCIe carries each no_sync() micro-batch's gradients once to the host, and each bucket's sum
// once to the device per synchronized step.
//
// Threading: every method runs on the Reducer's threads with its lock held; the worker runs the
// additions (HostWorker::post), in order. The host does wait here, inside backward:
// before a bucket's buffers are written again (its next add(), or its take()), if that bucket's
// last addition is not done yet, the caller blocks until it is (on a GPU that addition first
// waits for its copy to the host, so the host then waits for the device to reach that copy).
// It waits for that one addition only, never for the jobs queued after it (other buckets'
// additions, the host steps of this backward). Normally it is done already: the addition ran
// while the rest of the last micro-batch's backward and this one's forward ran. The forward
// itself does not wait for the additions (Reducer::follow_steps): no forward reads them.
#pragma once

#include "bucket.h"
#include "host_worker.h"
#include "streams.h"

#include <ATen/ATen.h>
#include <c10/core/Stream.h>

#include <atomic>
#include <memory>
#include <vector>

namespace leanddp {

class HostAccumulator {
 public:
  // `worker`: its streams and thread (shared with the offload optimizer). `buckets`: the layout.
  HostAccumulator(std::shared_ptr<HostWorker> worker, const std::vector<Bucket>& buckets);
  // The buckets were rebuilt (no sum may be held then: the rebuild follows a synchronized step).
  void set_layout(const std::vector<Bucket>& buckets);
  // Bucket `index`'s `flat` holds this micro-batch's local gradients (on a GPU, final on the
  // current stream): summed into its host sum. The caller then releases the bucket (its memory
  // is recorded on the device-to-host stream here).
  void add(size_t index, const at::Tensor& flat);
  // Whether bucket `index` holds a host sum (none once an error of the worker was taken since
  // the sums were begun: see drop_failed()).
  bool holds(size_t index) const;
  // GPU: the stream take() and what follows it run on (the worker's host-to-device stream).
  c10::Stream stream() const { return worker_->h2d_stream(); }
  // Bucket `index` (holds()) was allocated as `flat`: its sum is copied into it on the current
  // stream (stream() on a GPU, which the caller made wait for the compute stream) and consumed.
  void take(size_t index, const at::Tensor& flat);
  // Drops every held sum (zero_grad() in the middle of an accumulation).
  void discard();
  // Buckets holding a sum.
  int64_t held() const;
  // Host bytes of the sums and incoming buffers, and of those the pinned ones.
  int64_t host_bytes() const { return bytes(/*pinned_only=*/false); }
  int64_t pinned_bytes() const { return bytes(/*pinned_only=*/true); }
  // Tests: the worker sleeps `seconds[b]` before each addition of bucket b from now on (empty:
  // the worker's delay, HostWorker::delay_jobs()).
  void delay_additions(std::vector<double> seconds) { addition_delays_ = std::move(seconds); }

 private:
  struct HostBuffers {
    at::Tensor sum;
    at::Tensor incoming;
  };
  int64_t bytes(bool pinned_only) const;
  // At add(): drops every held sum if the worker handed an error out (HostWorker::
  // errors_taken(), the next forward raising it) since they were begun. A failed addition, or
  // one the worker dropped with its queue after another job's error, left them partial; those
  // posted after the error ran, into sums missing a micro-batch. So no step ever uses a sum
  // begun before an error the training loop saw: the loop that goes on after it (zero_grad()
  // or not) accumulates afresh, as after a backward that raised. (Steps submitted while the
  // error is held are dropped by HostOffload; take() of such a sum only feeds them.)
  void drop_failed();
  // Blocks until bucket `index`'s last addition is done (at once if it is), not for the
  // worker's later jobs.
  void wait_added(size_t index);

  std::shared_ptr<HostWorker> worker_;
  bool on_gpu_;
  std::vector<int64_t> numel_;  // per bucket
  std::vector<HostBuffers> host_;
  std::vector<char> held_;
  // GPU, per bucket: its last take()'s copy, which reads the sum the next add() overwrites.
  std::vector<EventPool::Handle> taken_;
  // The additions posted to the worker are numbered; the worker stores the last one done.
  int64_t posted_ = 0;
  std::vector<int64_t> added_;  // per bucket: its last addition's number
  std::shared_ptr<std::atomic<int64_t>> done_ = std::make_shared<std::atomic<int64_t>>(0);
  std::vector<double> addition_delays_;  // delay_additions()
  // The worker's errors_taken() when the sums held were begun (set by discard()).
  int64_t errors_seen_ = 0;
};

}  // namespace leanddp
