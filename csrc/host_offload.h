// HostOffload: offload_to_cpu's optimizer side. Optimizer state and float32 master weights live
// in host memory; the HostWorker's thread (host_worker.h) steps them with the fused CPU kernels
// and writes the updated weights back to the parameters. It creates that worker, and the
// Reducer's HostAccumulator (host_accumulator.h) is its other client.
//
// Per bucket, the host holds two flat staging buffers in the bucket's dtype, pinned when the
// parameters are on a GPU because they cross PCIe: `grads`, the averaged gradients copied from
// the device, and `weights`, the updated weights copied back. A float32 bucket's masters live in
// `weights` itself; a bfloat16/float16 bucket's masters are one float32 block of ordinary
// (pageable) memory, `masters`, and the step kernel writes the rounded weights into `weights` in
// the same pass. So each way a bucket crosses PCIe in one flat copy, and only what is copied is
// pinned: the optimizer state and low-precision masters never cross PCIe and stay in ordinary
// memory, first touched by the worker thread that steps them.
//
// Data flow per bucket (Reducer::step_bucket calls submit()):
//   1. on the worker's device-to-host stream, which the caller made wait for the bucket's
//      reduction: the averaged gradients go to `grads` in one copy, and parameters changed
//      since our last write (first step, a loaded checkpoint) are copied into their slots of
//      `weights` (for float32 that is the master itself; for bf16/fp16 the worker upcasts the
//      slot into the master before the step); an event from the pool marks the copies; the
//      caller records the device bucket's memory on that stream and releases it at once;
//   2. the worker waits for that bucket's event only, steps the bucket's masters and state (for
//      bf16/fp16 parameters the kernel upcasts the gradients and writes the rounded copy), and,
//      on the worker's host-to-device stream, copies `weights` to the device in one piece and
//      scatters it into the parameters with one unflatten launch. The two copy streams are
//      separate, so PCIe carries both directions at once.
// With max_grad_norm, the worker accumulates each bucket's squared norm as it arrives and holds
// the steps until end_iteration(): the global norm is then known and every gradient is scaled
// by torch.nn.utils.clip_grad_norm_'s coefficient inside the step kernel. hold_steps() holds
// them the same way without clipping (the Reducer's NaN check decides at the end of backward
// whether the iteration is completed or dropped).
//
// Sharded (shard_optimizer_state, set_layout with shards): the host holds this rank's shard of
// each bucket only: the staging buffers, float32 masters and optimizer state are shard-sized,
// the gradients copied to the host are the shard's (reduce-scattered), and the copy back writes
// the stepped pieces into their parameters; the Reducer then gathers every rank's pieces, each
// bucket after wait_stepped() for it (the host and the worker never wait for all). With
// max_grad_norm the Reducer sums every rank's held_sum_squares() and hands the total to
// end_iteration(). The layout is then fixed (no relayout).
//
// The next forward waits for each bucket as it reads it (pending(), wait_stepped(); see
// python/leanddp/_waits.py), the first layers' buckets stepped first (last_bucket_first); wait()
// is where everything else reading parameters or state waits: for the worker to finish, then
// (GPU) the current stream waits for the host-to-device stream: the host step overlaps the rest
// of backward, whatever the loop does between steps, and the next forward. On a CPU-only machine
// the same pipeline runs, with synchronous copies.
//
// Threading: submit(), end_iteration() and the accessors run with InBackwardOptimizer's lock held
// (inside backward the Reducer's too); HostAccumulator, the worker's other client, posts its
// additions with the Reducer's lock only, and they never touch the optimizer, masters or
// buffers. The worker's jobs take neither lock. The worker's lock guards the queue and what the
// steps publish (the buckets stepped, their copies back, the counters). The optimizer, masters
// and host buffers are touched by the worker only while steps are queued or running, and by the
// other methods only after wait() (or before the first job of an iteration, for the buffers and
// masters of a submitted bucket).
#pragma once

#include "bucket.h"
#include "fused_optimizer.h"
#include "host_worker.h"
#include "shard.h"
#include "streams.h"

#include <ATen/ATen.h>
#include <c10/core/Stream.h>

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

namespace leanddp {

struct OffloadOptions {
  int threads = 1;                      // threads of the host step (the worker's OpenMP team)
  std::optional<double> max_grad_norm;  // exact global-norm clipping (torch's clip_grad_norm_)
  // At the end of an iteration, the steps not started yet run from the highest bucket index to
  // the lowest: buckets are cut in the order gradients become ready, the reverse of the order
  // the next forward reads them, so the forward's first reads are stepped first. (Sharded: off,
  // the Reducer gathers the buckets in index order.)
  bool last_bucket_first = false;
};

// What the host side has done and holds (counters since construction).
struct OffloadStats {
  int64_t iterations = 0;         // synchronized iterations whose host steps finished
  int64_t buckets = 0;            // bucket steps
  double step_seconds = 0;        // worker busy time: copies awaited, norms, steps, copies back
  double wait_seconds = 0;        // time callers of wait(), wait_stepped() were blocked
  double grad_norm = -1;          // the last iteration's total gradient norm (-1: no clipping)
  int64_t master_bytes = 0;       // float32 master weights on the host
  int64_t host_buffer_bytes = 0;  // host gradient buffers, and low-precision weight buffers
  int64_t pinned_bytes = 0;       // of those, page-locked (the staging buffers, on a GPU)
};

class HostOffload {
 public:
  // `params`: the Reducer's parameters (all can_step for `optimizer`, which was built with
  // on_host). Starts its worker (options.threads).
  HostOffload(std::vector<at::Tensor> params, std::unique_ptr<FusedOptimizer> optimizer,
              OffloadOptions options);
  // Stops the worker after the jobs already queued (the updates of a finished backward: dropping
  // them would lose a step), then joins it (HostWorker::shutdown(): safe on any thread, the
  // worker's too). Buckets held for an unfinished iteration are dropped.
  ~HostOffload();
  HostOffload(const HostOffload&) = delete;
  HostOffload& operator=(const HostOffload&) = delete;

  // The buckets' layout (params, offsets, numel; storage unused): once before the first submit.
  // `shards` (sharded; else empty): this rank's shard of each bucket, given to the optimizer too.
  void set_layout(const std::vector<Bucket>& buckets, std::vector<ShardLayout> shards = {});
  // The worker, shared with the Reducer's HostAccumulator. Its streams (GPU): the caller orders
  // the device-to-host stream after a bucket's reduction before submit(), and records the
  // bucket's memory on it before releasing it; the copies back run on the host-to-device one.
  const std::shared_ptr<HostWorker>& worker() const { return worker_; }
  // Bucket `index` holds its averaged gradients (`bucket.flat`): queues its host step for the
  // members whose `mask[slot]` is set. On a GPU the d2h stream must be ordered after the
  // reduction of the bucket (see worker()); after it returns the bucket may be released.
  void submit(size_t index, const Bucket& bucket, const std::vector<char>& mask);
  // Every bucket of this synchronized backward was submitted (clipping may now step them); or,
  // if not `completed`, the backward failed: buckets held for clipping are dropped unstepped.
  // `sum_squares`: clipping's sum of squared gradients over every rank's shard (sharded; else
  // the worker's own sum over the buckets it holds).
  void end_iteration(bool completed, std::optional<double> sum_squares = std::nullopt);
  // Clipping, worker idle (after wait()): the sum of squared gradients of the buckets held.
  double held_sum_squares() const;
  bool clips() const { return options_.max_grad_norm.has_value(); }
  // Sharded, worker idle: the Reducer wrote into the parameters what the last host steps wrote
  // (every rank's pieces, gathered): their versions now are this object's writes, so the
  // masters are kept (not refreshed from the rounded parameters).
  void adopt_versions();
  // Sharded, worker idle: bucket b's float32 masters block (bfloat16/float16 buckets;
  // allocated if missing, so that every rank has one to gather).
  at::Tensor masters_block(size_t b);
  // Blocks until the worker has stepped bucket `index` (its last submit) and queued the copy
  // back; then, on a GPU, the current stream waits for that copy only (the host does not; after
  // an error, for every copy back queued so far). The time blocked counts as waited (stats). An
  // error the worker met is left for wait().
  void wait_stepped(size_t index);
  // The buckets submitted and not stepped yet (wait_stepped() would block for them), in index
  // order; none while the worker is idle (a job dropped by an abandoned iteration or an error is
  // not pending), has met an error (wait() raises it) or was stopped.
  std::vector<int64_t> pending() const;
  // Replaces the optimizer's hyper-parameters for the steps submitted from now on: checked here,
  // set by the worker after the steps queued before (at once if it is idle), so that the caller
  // never waits for the worker (an LR scheduler's step between iterations).
  void set_groups(std::vector<OptimHyper> groups);
  // Blocks until the worker is idle; then, on a GPU, the current stream waits for the copies
  // back (and the host too, if `host_too`: before the host buffers are read or written).
  // Rethrows (once) an error the worker met; its later jobs were dropped.
  void wait(bool host_too);
  // wait() that keeps an error the worker met for the next wait() or follow_copies(): for a
  // forward whose full wait comes later, at the same point on every rank (an armed backward
  // that never ended, wound up by the Reducer).
  void wait_keeping_error(bool host_too = false);
  // wait() without waiting for the worker, for a forward with no step pending (pending()
  // empty): on a GPU the current stream waits for the copies back queued so far (and the host
  // too, if `host_too`); rethrows (once) an error the worker met. The worker may still be
  // summing no_sync() micro-batches (HostAccumulator), which no forward reads.
  void follow_copies(bool host_too = false);
  // GPU: the current stream waits for the copies back queued so far (and the host too, if
  // `host_too`; an error stays for wait()). Called after pending(), it orders a forward after
  // the copies back of every bucket pending() did not list: stepped, maybe still being copied.
  void order_after_copies(bool host_too = false);
  // The buckets were rebuilt (worker idle): state and float32 masters move to the new layout,
  // the other host buffers are dropped.
  void relayout(const std::vector<Bucket>& old_buckets, const std::vector<Bucket>& new_buckets);
  // Stops the worker for good (HostWorker::shutdown(); the accumulator's later additions are
  // dropped too); later submits are dropped. Idempotent.
  void shutdown() { worker_->shutdown(); }
  // From now on (before the first submit) steps wait for end_iteration(), as with clipping.
  void hold_steps() { hold_ = true; }

  // Worker idle (after wait(true)) for the rest.
  FusedOptimizer& optimizer() { return *optimizer_; }
  // Parameter p's float32 master if p is low-precision and has one (else undefined).
  at::Tensor master(size_t p) const;
  // Whether low-precision parameter p's master was made (stepped or loaded), on every rank
  // alike: sharded, also where this rank holds no piece of it. Worker idle.
  bool master_made(size_t p) const { return made_[p] != 0; }
  // Sets parameter p's master (from a checkpoint); it is kept until p is changed by others.
  void load_master(size_t p, const at::Tensor& value);
  // The masters blocks were written in place (a checkpoint loaded into masters_block's views):
  // each low-precision parameter's master is kept, as after load_master, until p is changed
  // by others.
  void adopt_masters();
  int64_t generation() const { return generation_; }
  OffloadStats stats() const;

 private:
  // A bucket's step, queued on the worker by submit().
  struct Step {
    size_t index = 0;
    Bucket layout;  // params/offsets/numel (no storage)
    std::vector<char> mask;
    std::vector<char> refresh;  // low-precision slots whose master is read from `weights` first
    at::Tensor grads;           // the gradients, on the host
    int64_t sequence = 0;       // submit()'s count, in submission order
  };
  // One bucket's host buffers (see the top of this file), allocated at its first submit.
  struct HostBucket {
    at::Tensor grads;
    at::Tensor weights;
    at::Tensor masters;  // bf16/fp16 buckets: float32, ordinary memory
  };

  // Blocks (with `lock`, the worker's, held) until `ready()` holds, asked whenever a job finished
  // (and first); the time is added to stats_.wait_seconds only where the caller was blocked
  // (ready() false at first), so that a wait with nothing to wait for counts nothing.
  void block_until(std::unique_lock<std::mutex>& lock,
                   const std::function<bool(const HostWorker::Status&)>& ready);

  // On the worker: a step arrived (its copies to the host done): stepped now, or held.
  void process(Step& step);
  void step_job(const Step& step, std::optional<double> grad_scale);
  // The updated `weights` of the step's bucket into the parameters of the slots it stepped.
  void copy_back(const Step& step, const at::Tensor& weights);
  void finish_iteration(bool completed, std::optional<double> total);
  // Bucket `index`'s submit number `sequence` is no longer pending: stepped, or dropped unstepped
  // (the worker's lock held).
  void settle(size_t index, int64_t sequence);
  // The worker's error, taken: the held steps are dropped with it (the worker ran no step
  // since it, none being queued while it is held).
  std::exception_ptr take_error();
  bool low_precision(size_t p) const { return params_[p].scalar_type() != at::kFloat; }
  bool holds() const { return hold_ || options_.max_grad_norm.has_value(); }
  // Parameter p's master, allocated at first use: a view into its bucket's `weights` (float32)
  // or `masters` (bf16/fp16).
  at::Tensor& ensure_master(size_t p);
  // Parameter p's region of its bucket's `weights` (allocated at first use).
  at::Tensor weights_slot(size_t p);
  // The bucket holding parameter p (checked).
  size_t bucket_of(size_t p) const;
  // What of parameter p this rank steps, within its bucket's flat host `block`: p's slot shaped
  // like p; sharded, p's piece in this rank's shard, 1-D (undefined if p has none here).
  at::Tensor slot(size_t p, const at::Tensor& block) const;
  // The same part of `t`, a tensor shaped like p (p itself, a checkpoint's value): `t`, or
  // sharded its piece, 1-D in p's (contiguous) memory order (undefined if none here).
  at::Tensor part(size_t p, const at::Tensor& t) const;
  // Elements of bucket b's host buffers: the bucket's, or sharded its shard's.
  int64_t extent(size_t b) const {
    return shards_.empty() ? layout_[b].numel : shards_[b].shard_numel;
  }
  // Bucket b's `weights` buffer, allocated at first use.
  at::Tensor& ensure_weights(size_t b);

  std::vector<at::Tensor> params_;
  std::unique_ptr<FusedOptimizer> optimizer_;
  OffloadOptions options_;
  std::shared_ptr<HostWorker> worker_;
  bool on_gpu_ = false;  // worker_->on_gpu()
  bool hold_ = false;    // steps wait for end_iteration() (hold_steps())

  // The buckets' layout (set_layout, relayout) and, per parameter, its (bucket, slot).
  std::vector<Bucket> layout_;
  std::vector<std::pair<size_t, size_t>> location_;
  std::vector<ShardLayout> shards_;  // sharded: this rank's shard of each bucket
  std::vector<int64_t> piece_of_;    // sharded, per parameter: its piece's index there, or -1
  std::vector<HostBucket> host_;     // per bucket (kept across iterations)
  // Per parameter: the float32 master (undefined until its first step), and the parameter's
  // version counter after our last write (a different version means someone else changed it:
  // refresh the master).
  std::vector<at::Tensor> masters_;
  std::vector<uint32_t> versions_;
  std::vector<char> made_;  // per parameter: master_made()
  // Changes when a master appears or is loaded: on the worker (ensure_master in a step) and on
  // the caller's thread (loads, reads), hence atomic.
  std::atomic<int64_t> generation_{0};

  // Guarded by the worker's lock: the counters (the byte counts are filled in by stats()), and
  // for wait_stepped(), per bucket the sequence of its last submit (written by the caller, under
  // InBackwardOptimizer's lock), the last sequence stepped or dropped unstepped (an abandoned
  // iteration, an error), and, GPU, its last copy back. (Per bucket: last_bucket_first steps
  // the buckets out of submission order.)
  OffloadStats stats_;
  int64_t submitted_ = 0;
  std::vector<int64_t> last_submit_;
  std::vector<int64_t> stepped_;
  std::vector<std::shared_ptr<const PooledEvent>> copied_back_;  // (shared: waited for unlocked)
  // The worker's own (steps held for clipping or the NaN check, and the sum of their squared
  // norms; read by the caller only while the worker is idle or failed).
  std::vector<Step> held_;
  double sum_squares_ = 0;  // clipping: of the buckets of this iteration so far
};

}  // namespace leanddp
