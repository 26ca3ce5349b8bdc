// Reducer: the per-gradient, per-bucket hot path of leanddp.DistributedDataParallel.
//
// It hooks every parameter's gradient accumulator (post hooks added from C++), counts which
// gradients are ready, launches each bucket's reduction on the c10d process group as soon as
// the bucket is complete (in bucket order, identical on every rank), and finishes the iteration
// from an autograd-engine callback queued at the first hook of a backward.
//
// With optimizer_in_backward the Reducer hands each reduced bucket to the InBackwardOptimizer
// (in_backward_optimizer.h, set_optimizer) and then releases the bucket's gradient memory:
// param.grad becomes None and the flat buffer is freed, to be allocated again at the bucket's
// next gradient. What the Reducer knows of the optimizer is that seam: the stream a GPU step is
// queued on and whether the caller's stream follows it, take() a bucket, the end of backward,
// abandon, relayout. When a bucket is handed over is StepWindow's decision (step_window.h):
//   * CPU buckets (host progress): at a hook once its reduction reports done;
//   * GPU buckets (device order): right after a bucket's reduction is launched, the optimizer's
//     stream waits for it (Work::wait / the future's wait with that stream current blocks the
//     stream, not the host), the step is enqueued there, the bucket's memory is recorded on that
//     stream and released at once. The compute stream never waits for a reduction inside
//     backward; the end of backward orders the caller's stream after the optimizer's where the
//     optimizer says so (device steps);
//   * either way at most ReducerOptions::buckets_in_flight buckets are launched but not finished:
//     before another launch the oldest is stepped (waiting for its reduction) and, on a GPU, its
//     step is waited for. Nothing else on the hot path waits for the device.
// With shard_optimizer_state a bucket is reduce-scattered instead of allreduced, the optimizer
// steps this rank's shard, and the Reducer all-gathers the stepped shards back into the
// parameters (on the optimizer's stream on a GPU; on the CPU the host waits for the gather at
// the next bucket's step, the window holding one launched bucket fewer so that no more buckets
// are allocated than unsharded; host steps: at the end of backward, each bucket once the optimizer
// says its host step is done). Steps run only where the window forces them (before a launch
// when it is full, and at the end of backward), never as reductions happen to complete: so
// every rank issues its reduce-scatters and all-gathers in the same order on the one process
// group.
// With accumulate_on_host (an optimizer stepping on the host) a no_sync() backward hands each
// bucket, once its gradients are complete, to the HostAccumulator (host_accumulator.h) and releases
// it; the next synchronized backward adds each bucket's host sum at its launch, before the
// reduction (reducer_accum.cpp).
//
// Failures (see docs/reliability.md): a reduction that fails is rethrown into backward with what
// was being reduced; a backward that raised part-way is wound up at the next forward, the same way
// on every rank (abandon_iteration); with a NaN check the reduced buckets are checked before they
// are stepped or handed back, and every rank raises at the end of backward.
//
// Concerns with state of their own, owned by the Reducer and called under `mu_`: the NaN check
// (NonFiniteCheck, non_finite_check.h), shard_optimizer_state's cut, gathers and clipping
// (ShardGather, shard_gather.h), and the host sums of no_sync() micro-batches (HostAccumulator).
//
// Threading: hooks and the final callback run on autograd's threads; the Python-facing methods
// run on the caller's thread with the GIL released. All mutable state is guarded by `mu_`; the
// optimizer's own lock is taken after it, never before.
#pragma once

#include "bucket.h"
#include "bucket_recycler.h"
#include "bucket_stepper.h"
#include "comm_hook.h"
#include "errors.h"
#include "host_accumulator.h"
#include "in_backward_optimizer.h"
#include "iteration_timer.h"
#include "non_finite_check.h"
#include "shard.h"
#include "shard_gather.h"
#include "step_window.h"
#include "streams.h"

#include <c10/macros/Macros.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <array>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace leanddp {

// TORCH_CHECK for the Reducer's checks of how it is used (torch's REDUCER_CHECK): a failure is
// recorded for the logging data (Reducer::take_usage_error) and raised as a RuntimeError. Only
// inside Reducer members, with `mu_` held.
#define LEANDDP_USAGE_CHECK(cond, ...)                             \
  do {                                                             \
    if (C10_UNLIKELY(!(cond))) usage_error(c10::str(__VA_ARGS__)); \
  } while (0)

struct ReducerOptions {
  // Byte caps of consecutive buckets per (device, dtype); the last one repeats.
  std::vector<int64_t> caps_bytes{kFirstBucketCapBytes, 25 * (int64_t{1} << 20)};
  // The caps of the layout before the first rebuild (empty: caps_bytes). torch's DDP puts every
  // parameter of a (device, dtype) in one bucket then, unless find_unused_parameters without
  // static_graph (or per-bucket caps) keep the caps: its layout decides the order of gloo's
  // additions on three or more ranks, so ours follows it (see the constructor).
  std::vector<int64_t> initial_caps_bytes;
  // param.grad becomes a view into its bucket (else gradients are copied in and out).
  bool gradient_as_bucket_view = true;
  // Each synchronized backward finds the parameters its outputs do not reach and reports
  // globally unused ones by leaving their grad untouched (None stays None).
  bool find_unused_parameters = false;
  // The set of used parameters is the same every iteration: found once, in the first one.
  bool static_graph = false;
  // optimizer_in_backward: buckets are stepped (set_optimizer) and released inside backward.
  bool optimizer_in_backward = false;
  // The parameters (by name) whose gradient is a sparse tensor (torch's
  // expect_sparse_gradient: nn.Embedding/EmbeddingBag(sparse=True)). Each gets a bucket of its
  // own, is never a view, and is reduced with the process group's allreduce of the sparse
  // tensor (reducer_sparse.cpp). Not with optimizer_in_backward.
  std::vector<std::string> sparse_names;
  // optimizer_in_backward: most buckets launched but not yet stepped and finished (StepWindow);
  // one fewer for sharded device steps on the CPU, beside the bucket kept for its gather
  // (set_optimizer).
  size_t buckets_in_flight = kBucketsInFlight;
  NanCheck nan_check = NanCheck::kOff;
  // shard_optimizer_state (with optimizer_in_backward and a fused optimizer): each bucket is padded
  // to equal shards and reduce-scattered (shard.h); this rank steps, and keeps optimizer state
  // for, its shard only, then the stepped shards are all-gathered into the parameters before
  // the bucket is released. No communication hook, NaN check or GradScaler with it.
  bool shard_optimizer_state = false;
  // shard_optimizer_state with 8-bit optimizer state: its block size (elements; 1: none) and
  // the parameters (by name) it quantizes by blocks of it (their numel a multiple of it). Those
  // come first in each bucket, so each starts on a multiple of the block, and the shards of a
  // bucket holding any are multiples of it: every cut inside such a parameter falls on one of
  // its block boundaries, so each rank steps whole blocks, the ones the optimizer quantizes.
  int64_t shard_block = 1;
  std::vector<std::string> shard_block_names;
  // With an optimizer that steps on the host (offload_to_cpu): no_sync() micro-batches'
  // gradients are summed on the host (HostAccumulator, host_accumulator.h) by the optimizer's host
  // worker, each bucket released from the device as soon as it is complete.
  bool accumulate_on_host = false;
  // Clip the gradients' global 2-norm to this (torch's clip_grad_norm_). Host steps clip
  // themselves; sharded on the device, the steps wait for the end of backward, where the
  // squared norms of every rank's shards are summed by one allreduce of a scalar (on a GPU the
  // host reads it: one synchronization), and each step takes the coefficient.
  std::optional<double> max_grad_norm;
};

// Bytes the Reducer accounts for (see Reducer::memory_stats()).
struct MemoryStats {
  int64_t bucket_bytes = 0;    // flat bucket storage
  int64_t grad_bytes = 0;      // param.grad storage outside the buckets
  int64_t grads_as_views = 0;  // parameters whose grad is a view into its bucket
  int64_t grads_outside = 0;   // parameters whose grad is a tensor of its own
  int64_t num_buckets = 0;
  // During the last synchronized backward: the most bucket bytes allocated at once (on a GPU,
  // counting released buckets whose step may still be running on the device), and the most
  // buckets launched but not yet stepped and finished (optimizer_in_backward).
  int64_t peak_bucket_bytes = 0;
  int64_t max_buckets_in_flight = 0;
  // Released bucket storage kept for the next buckets (a comm hook with optimizer_in_backward on
  // a GPU: bucket_recycler.h); counted in peak_bucket_bytes, not in bucket_bytes.
  int64_t recycled_bucket_bytes = 0;
  // accumulate_on_host: the no_sync() micro-batches' sums and incoming copies on the host, and
  // how many of those bytes are pinned (page-locked).
  int64_t host_accumulation_bytes = 0;
  int64_t host_pinned_bytes = 0;
};

class Reducer {
 public:
  using NodePtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<at::Tensor>()));

  // `params`: the trainable parameters, registration order, no duplicates, all on one device,
  // dense. `names` names them in errors. Allocates the buckets and installs the hooks; performs
  // no collective. Which options combine is check_modes' (modes.h), asked before this.
  Reducer(std::vector<at::Tensor> params, std::vector<std::string> names,
          c10::intrusive_ptr<c10d::ProcessGroup> process_group, ReducerOptions options);
  // Removes the hooks. In-flight reductions keep their own references to the buckets.
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  // Called by every forward when gradients may be taken (before the module runs). Returns the
  // names of parameters whose grad was a bucket view and has since been replaced by a tensor
  // of its own (the caller warns once); their values are copied into the bucket on the next
  // backward, so results stay right. Winds up a backward that raised part-way first
  // (abandon_iteration) and raises if its reductions failed too.
  std::vector<std::string> prepare_for_forward();

  // Arms the hooks for the next backward, which will reduce. `outputs` are the forward's
  // outputs: with find_unused_parameters (and no static graph) the autograd graph behind them
  // is searched for parameters it cannot reach. Not calling it (no_sync) makes the next
  // backward accumulate locally, in the bucket views.
  void prepare_for_backward(const std::vector<at::Tensor>& outputs);

  // Rebuilds the buckets once, from the order gradients became ready in the first synchronized
  // backward (rank 0's order, broadcast: a collective every rank must enter). Called at the
  // start of a forward; returns whether it rebuilt. Gradients held so far move into the new
  // buckets.
  bool rebuild_buckets();

  // Declares the graph static (torch's `_set_static_graph`); only before the first backward.
  void set_static_graph();
  // Replaces the built-in allreduce by `hook` (before the first backward).
  void register_comm_hook(std::unique_ptr<CommHook> hook);

  // optimizer_in_backward (before the first backward, once): every reduced bucket is handed to
  // `optimizer` (its layout given to it now), which the Reducer keeps. With accumulate_on_host
  // the optimizer steps on the host, and its host worker sums the no_sync() micro-batches.
  void set_optimizer(std::shared_ptr<InBackwardOptimizer> optimizer);
  // What the Reducer was built with (static_graph as set since).
  const ReducerOptions& options() const { return options_; }
  // accumulate_on_host: drops the no_sync() micro-batches' gradients summed on the host
  // (zero_grad() during an accumulation); a no-op otherwise.
  void discard_host_gradients();
  // Tests, accumulate_on_host: the host worker sleeps `seconds[b]` before each addition of
  // bucket b from now on (empty: the worker's step delay).
  void delay_additions(std::vector<double> seconds);
  // What close() lets go of, for the caller to destroy where it may: the process groups (the
  // Reducer's and the optimizer's) and in-flight works without the GIL (tearing down a process
  // group joins its threads), the communication hook and fallback stepper (they hold Python
  // objects) with it.
  struct Detached {
    c10::intrusive_ptr<c10d::ProcessGroup> process_group;
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    std::vector<c10::intrusive_ptr<c10::ivalue::Future>> futures;
    std::unique_ptr<CommHook> comm_hook;
    InBackwardOptimizer::Detached optimizer;
  };
  // At interpreter exit (Python's atexit) or when the wrapper is collected, whichever comes
  // first: closes the optimizer (its host worker stops once the host steps already queued are
  // done; later ones are dropped) and detaches the process group, the in-flight works, the
  // communication hook and the fallback stepper, so that none of them is torn down during
  // interpreter finalization, when threads other than the main one can no longer take the GIL.
  // Parameters, gradients and optimizer state stay readable. Afterwards a forward that prepares
  // a synchronized backward, or a bucket rebuild, raises. Idempotent.
  Detached close();
  bool closed() const;
  MemoryStats memory_stats() const;
  // CUDA events created so far for ordering the optimizer's stream and the host sums' copies
  // (they are pooled: this stays constant once every bucket has been through a step).
  int64_t events_created() const;
  // Tests: since the last forward that prepared a synchronized backward, each bucket that got
  // released storage from the recycler (a comm hook with in-backward steps on a GPU), as
  // (bucket, the bucket it came from, whether that bucket's step was not known finished): if
  // not, the compute stream waits there for that step and its collective, so only the
  // collectives launched after that one overlap the backward computation from then on.
  std::vector<std::tuple<int64_t, int64_t, bool>> recycler_reuses() const;
  // Parameter indices per bucket, in launch order.
  std::vector<std::vector<int64_t>> bucket_indices() const;
  std::vector<int64_t> bucket_bytes() const;
  bool has_rebuilt_buckets() const;
  int64_t num_iterations() const;  // synchronized backwards finished
  // torch's runtime statistics (see iteration_timer.h): called at each forward that prepares a
  // synchronized backward, before the module runs; `sampled` measures this iteration.
  void time_iteration(bool sampled);
  // The last measured iteration's statistics (valid=false if none completed since the last
  // call); on a GPU the host waits for that iteration's timing events.
  IterationTimes collect_times();
  // The parameters found unused by the last forward that prepared a synchronized backward
  // (torch's `unused_parameters_`, which its logging data sums): with find_unused_parameters,
  // those its outputs cannot reach; with a static graph, those whose gradient this rank did not
  // compute in the first iteration (from its end on); otherwise none.
  std::vector<int64_t> unused_parameters() const;
  // The message of the last usage check that failed (LEANDDP_USAGE_CHECK: a parameter without
  // a gradient, a gradient twice, a dense/sparse mismatch) since the previous call, or nullopt.
  // torch's DDP records its reducer's checks in its logging data (has_error, error) as they
  // raise; the Python logger records these when it next looks.
  std::optional<std::string> take_usage_error();

 private:
  // The post hook of parameter `index`'s gradient accumulator: runs after each accumulation.
  void autograd_hook(size_t index);
  // Records that parameter `index`'s gradient for this iteration is final (its hook fired, or
  // it was found unused). Launches every bucket that is complete and next in order.
  void mark_ready(size_t index);
  // Copies/scales the bucket's gradients into its flat buffer and starts its reduction.
  void launch(size_t bucket_index);
  // The bucket's gradients copied into its flat buffer and averaged (`scale`: 1/world; none
  // with a comm hook), as torch's reducer does.
  void average_into(size_t bucket_index, std::optional<double> scale);
  // accumulate_on_host (reducer_accum.cpp). A no_sync() backward's hook: counts the bucket's
  // gradients and hands it to the host once complete (the first hook queues finish_local).
  void accumulate_locally(size_t index);
  // Bucket b's local gradients (zeros where a parameter has none) flattened into it, added to
  // its host sum, the bucket and the gradients released. Nothing if no parameter has one.
  void flush_local(size_t b);
  // The end of a no_sync() backward (or the forward after one that raised): flushes the rest.
  void finish_local();
  // At the launch of bucket b holding a host sum, on a GPU: the stream the sum is added and the
  // reduction started on (the HostAccumulator's), made to wait for the compute stream.
  c10::Stream sum_stream(size_t b);
  // At the launch of bucket b holding a host sum: the sum copied into it, this micro-batch's
  // gradients added into their slots, then the bucket averaged (`scale`).
  void add_host_sum(size_t b, std::optional<double> scale);
  // The end-of-backward callback: waits for every reduction and writes the results to grads.
  void finalize();
  // After an error in an armed iteration (raised in finalize, or a backward that stopped part-way,
  // found at the next forward): waits for every launched reduction and disarms. With
  // optimizer_in_backward, `step_launched` steps the launched buckets not stepped yet where hooks
  // step (every rank launched the same ones, so every rank then holds the same weights); the
  // other gradients of the step are released. Returns false if a reduction failed.
  bool abandon_iteration(bool step_launched);
  // A backward prepared by a forward has not finished (it raised): abandon it; throws if its
  // reductions failed (the process group is then unusable).
  void recover_unfinished();
  // Whether buckets are stepped from the hooks as their reductions finish (else at the end).
  bool steps_in_hooks() const;
  // Whether the optimizer steps on the host (offload_to_cpu; false before set_optimizer).
  bool steps_on_host() const { return optimizer_ && optimizer_->steps_on_host(); }
  // max_grad_norm applied by the device steps (sharded; host steps clip themselves): they wait
  // for the end of backward (ShardGather::clip).
  bool clips_on_device() const { return options_.max_grad_norm && !steps_on_host(); }
  // Tells the optimizer where the iteration stands (armed_, and whether the next forward waits
  // for every step: it winds up an unfinished backward or rebuilds the buckets), after armed_ or
  // rebuild_due() may change.
  void tell_iteration();
  // Before the buckets or parameters are changed from outside backward: waits for the
  // optimizer's steps (InBackwardOptimizer::wait).
  void wait_for_optimizer();
  // Rethrows the exception being handled with `what` failed, and what that usually means.
  [[noreturn]] void rethrow_collective_error(const std::string& what) const;
  // Records `message` for take_usage_error() and raises it (see LEANDDP_USAGE_CHECK).
  [[noreturn]] void usage_error(const std::string& message) const;
  // Raises the NaN check's error (non_finite_check.h; `used`: this iteration's globally-used
  // verdict).
  [[noreturn]] void raise_nonfinite(const std::vector<int32_t>& used) const;
  void reset_iteration_state();
  // Before a backward (and after one ended): forgets the side stream's steps known finished
  // (a non-blocking query, oldest first), and all of them if the coming backward steps only at
  // its end (it never finishes them: they would pile up, one event and one bucket's bytes per
  // bucket per iteration); their bytes no longer count as in use.
  void settle_finished_steps();
  // Lays out new buckets (storage allocated unless optimizer_in_backward).
  void build_buckets(const std::vector<std::vector<int64_t>>& assignment);
  bool tracks_unused() const;  // this iteration learns which parameters are globally unused
  bool should_rebuild() const;
  // Whether the next rebuild_buckets() rebuilds (an order was recorded, no backward is armed).
  bool rebuild_due() const { return should_rebuild() && !ready_order_.empty() && !armed_; }
  void write_reduced_grads(size_t bucket_index, const std::vector<int32_t>& used);
  // Waits for bucket `index`'s reduction and leaves the averaged result in its flat buffer
  // (once per iteration; later calls return at once).
  void collect_reduced(size_t index);
  // Blocks the host until bucket `bucket_index`'s reduction (work or hook future) is complete,
  // keeping its result for collect_reduced; raises a failed one as collect_reduced would.
  void settle(size_t bucket_index);
  // "the reduction of bucket i (names)": what a failed reduction's error names.
  std::string reduction_of(size_t bucket_index) const;
  // Sparse buckets (reducer_sparse.cpp), called where the dense path would run for them.
  bool expects_sparse(size_t index) const { return sparse_[index] != 0; }
  // At launch: takes the parameter's gradient (an empty sparse tensor if it has none on this
  // rank), divides it in place by the world size (unless a comm hook reduces), and starts its
  // allreduce, or hands it to the comm hook as the bucket's buffer (torch's contract). The
  // reduction runs alone on the process group: the host waits for the buckets launched before
  // it, and for it before returning (gloo's sparse allreduce beside another collective of the
  // same group corrupts memory; see reducer_sparse.cpp).
  void launch_sparse(size_t bucket_index);
  // Waits for the sparse reduction and keeps the result in the bucket's `sparse_grad`.
  void collect_sparse(size_t bucket_index);
  // Writes the reduced sparse gradient into param.grad (copied into it if defined, as torch
  // does; globally unused: left as it was).
  void write_sparse_grad(size_t bucket_index, const std::vector<int32_t>& used);
  // Raises, naming the parameter, if a parameter bucketed dense received a sparse gradient.
  void check_dense_grad(size_t index, const at::Tensor& grad) const;
  // optimizer_in_backward: carries out the window's decisions for `phase` (step_window.h): steps
  // launched buckets in launch order and releases them, waiting only where the window says so.
  // `used`: the per-parameter "globally used" verdict (null: all used); parameters not used are
  // not stepped.
  void advance_steps(StepWindow::Phase phase, const std::vector<int32_t>* used);
  // Whether bucket `index`'s reduction is ready to be consumed: done (CPU), or ordered on the
  // device so that a stream can wait for it (GPU: the work's future is complete on the host).
  bool reduction_ready(size_t index) const;
  // Hands bucket `index` to the optimizer (on a GPU: its step is enqueued on the side stream,
  // behind its reduction), gathers it back where sharded device steps stepped it, and releases
  // it.
  void step_bucket(size_t index, const std::vector<int32_t>* used);
  // GPU: the stream buckets are stepped on (the optimizer's).
  c10::Stream side_stream() const;
  // GPU, optimizer_in_backward: the current stream waits for the work queued so far on the side
  // stream (the host does not wait); nothing otherwise.
  void follow_side_stream() const;
  void ensure_allocated(size_t bucket_index);
  // Raises peak_bucket_bytes_ to what is held now: buckets allocated, released ones whose device
  // work may still run, and recycled storage.
  void note_peak();
  // Throws "<what> only before the first backward" once a backward has been prepared or run.
  void check_before_first_backward(const char* what) const;
  void check_open(const char* what) const;  // raises once closed
  void release(size_t bucket_index);
  // shard_optimizer_state (shard_gather.h): gather_back() gathers every rank's stepped pieces
  // of every bucket into the parameters, in bucket order, calling `stepped(b)` before bucket
  // b's gather (host steps: its host step is done); b's gather is in flight while b + 1's step
  // is waited for, so at most two buckets are allocated (on a GPU the current stream waits for
  // the gathers, on the CPU the host). finish_gathers() finishes the gathers a CPU backward
  // deferred and releases their buckets (at the next bucket's step or the end of backward, so
  // that each gather overlaps the backward computation in between).
  void gather_back(const std::function<void(size_t)>& stepped);
  void finish_gathers();
  HostAccumulator* accumulator() const { return accumulator_.get(); }

  // Fixed at construction.
  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  c10::intrusive_ptr<c10d::ProcessGroup> process_group_;  // null once closed (only then)
  int rank_;                                              // process_group_'s, for messages
  ReducerOptions options_;
  std::vector<NodePtr> grad_accumulators_;  // kept alive: the hooks live on them
  std::vector<uintptr_t> hook_keys_;
  std::unordered_map<const torch::autograd::Node*, size_t> accumulator_index_;
  double div_factor_;
  std::vector<bool> sparse_;   // per parameter: named in options_.sparse_names
  std::vector<bool> blocked_;  // per parameter: named in options_.shard_block_names
  // GPU only: the events that order the side stream and the compute stream.
  std::unique_ptr<EventPool> events_;

  mutable std::mutex mu_;
  // Layout: replaced once by rebuild_buckets().
  std::vector<Bucket> buckets_;
  std::vector<std::pair<size_t, size_t>> location_;  // param -> (bucket, slot)
  ShardGather shard_;  // shard_optimizer_state: the cut, the gathers in flight, the clipping
  bool has_rebuilt_ = false;
  // The order in which gradients arrived in the backward the rebuild learns from (the first
  // synchronized one; a static graph's second), each parameter once.
  std::vector<int64_t> ready_order_;
  std::unique_ptr<CommHook> comm_hook_;
  // optimizer_in_backward (set_optimizer): the optimizer the reduced buckets are handed to (also
  // held by leanddp.optim), and with accumulate_on_host the host sums (declared after it:
  // destroyed first, as they use its host worker).
  std::shared_ptr<InBackwardOptimizer> optimizer_;
  std::unique_ptr<HostAccumulator> accumulator_;

  // Per synchronized backward; reset by prepare_for_backward().
  bool armed_ = false;  // hooks count readiness (false: no_sync / no forward)
  bool callback_queued_ = false;
  // accumulate_on_host, per no_sync() backward: finish_local is queued; per bucket, the
  // parameters whose hook has not fired yet.
  bool local_callback_queued_ = false;
  std::vector<size_t> local_pending_;
  bool unused_marked_ = false;    // parameters found unused were marked ready
  bool recording_order_ = false;  // this backward's readiness order feeds the rebuild
  size_t next_bucket_ = 0;        // next bucket to launch
  StepWindow window_;             // which launched buckets are stepped and finished
  std::vector<char> ready_;
  std::vector<at::Tensor> sources_;  // per param: the tensor to copy into its slice at launch
  std::vector<int64_t> unused_;      // parameters this iteration expects no gradient for
  // Per param: 1 if its hook fired on this rank since the last synchronized backward (no_sync
  // micro-batches included); reset when a synchronized backward ends or is abandoned.
  std::vector<int32_t> local_used_;
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;  // per launched bucket
  // GPU, per launched bucket: the work's future (its readiness on the host; null if the backend
  // has none), and an event recorded on the compute stream after the bucket's gradients were
  // final, which the side stream waits for before stepping it.
  std::vector<c10::intrusive_ptr<c10::ivalue::Future>> futures_;
  std::vector<EventPool::Handle> launched_events_;
  // GPU, per bucket stepped but not known to be finished, in order: an event recorded on the
  // side stream after its step, and the bucket's bytes (released, but in use until then).
  std::deque<std::pair<EventPool::Handle, int64_t>> finish_events_;
  int64_t unfinished_bytes_ = 0;
  // A comm hook with in-backward steps on a GPU: released buckets' storage, reused for the next
  // buckets (bucket_recycler.h); null otherwise. Set by register_comm_hook.
  std::unique_ptr<BucketRecycler> recycler_;
  // Reuses of released storage since the last prepare_for_backward (recycler_reuses()).
  std::vector<std::tuple<int64_t, int64_t, bool>> reuses_;
  std::vector<char> collected_;    // per bucket: its result is in `flat` (collect_reduced)
  NonFiniteCheck nan_;             // check_for_nan_in_grad (reset with the iteration)
  at::Tensor local_used_reduced_;  // the allreduced local_used_ (when tracked)
  c10::intrusive_ptr<c10d::Work> local_used_work_;

  // Bucket bytes (and buckets) allocated now, and the most bytes during the current/last
  // synchronized backward.
  int64_t allocated_bytes_ = 0;
  size_t allocated_buckets_ = 0;
  int64_t peak_bucket_bytes_ = 0;
  int64_t max_in_flight_ = 0;

  // Across iterations.
  int64_t iterations_ = 0;
  // A synchronized backward finished since the last forward: a hook firing now is a second
  // backward through one forward's outputs (an error, not local accumulation).
  bool reduced_since_forward_ = false;
  std::vector<int64_t> static_unused_;  // static graph: unused on this rank in the first iteration
  std::vector<int32_t> static_used_;    // static graph: used on any rank in the first iteration
  std::vector<char> grad_was_view_;     // we set param.grad to its bucket view
  IterationTimer timer_;                // sampled iterations' moments (torch's logging data)
  // unused_parameters(): set by each prepare_for_backward() that searches the graph, and by the
  // end of a static graph's first iteration.
  std::vector<int64_t> found_unused_;
  // take_usage_error(): set by usage_error(), cleared when taken.
  mutable std::optional<std::string> usage_error_;
  // Per parameter: param.grad is its bucket view since a synchronized backward (or a rebuild)
  // left it so, not since a no_sync() backward put it there. torch's reducer finds such a
  // gradient aliasing its bucket and divides it in place by the world size; any other gradient
  // it multiplies by 1/world while copying it in. launch() does the same, for the same bits.
  std::vector<char> view_since_sync_;
};

}  // namespace leanddp
