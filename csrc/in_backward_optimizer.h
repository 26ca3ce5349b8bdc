// InBackwardOptimizer: optimizer_in_backward's optimizer. It owns what stepping needs (the step
// strategy of step_strategy.h, and through it the fused optimizer or the HostOffload of
// offload_to_cpu), the optimizer state and master weights, and the forward-side waits for the
// host steps. The Reducer reduces; this class steps what the Reducer hands over.
//
// Two faces:
//   * the seam (the Reducer's side): attach() once, then per bucket take(), at the end of
//     backward end_of_backward() (and, sharded on the host, wait_stepped() per bucket before
//     the Reducer gathers it, then gathered()), or abandon() for a backward that failed;
//     relayout() after a bucket rebuild. The Reducer orders a GPU step on stream() (it makes
//     it wait for the bucket's gradients and reduction, and records the bucket's memory on it)
//     and, where caller_follows(), orders the caller's stream after it at the end of backward.
//     The Reducer calls these with its own lock held; this class then takes its own (lock order:
//     always Reducer, then optimizer) and never calls back into the Reducer.
//   * the Python face (leanddp.optim holds this object and calls it between iterations, on the
//     caller's thread with the GIL released): hyper-parameters and GradScaler before each
//     forward, the forward's waits for the host steps, the state in torch's format and its
//     loading (whole, gathered from the shards, or shard by shard), step counts, master
//     weights, statistics.
// Everything that reads or writes state or parameters first waits for the steps in flight
// (wait()): on a GPU the current stream waits for the device steps' stream, with offload_to_cpu
// the host waits for the worker.
#pragma once

#include "bucket.h"
#include "bucket_stepper.h"
#include "fused_optimizer.h"
#include "host_offload.h"
#include "non_finite_check.h"
#include "shard.h"
#include "step_strategy.h"
#include "streams.h"

#include <ATen/ATen.h>
#include <c10/core/Stream.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <array>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace leanddp {

// How the optimizer steps (fixed at construction).
struct InBackwardOptions {
  // The fused kernels' kind (none: every bucket goes to the fallback stepper).
  std::optional<OptimKind> kind;
  std::vector<int64_t> group_of;  // per parameter: its group
  std::vector<OptimHyper> groups;
  // Where Adam's step counts live (the parameters' device for fused/capturable Adam or with a
  // GradScaler, else the CPU).
  c10::Device step_device{c10::kCPU};
  // offload_to_cpu: every bucket is stepped on the host (HostOffload) by `offload_threads`.
  bool offload_to_cpu = false;
  int offload_threads = 1;
  // shard_optimizer_state: this rank keeps and steps its shard of each bucket (attach()'s cut).
  bool sharded = false;
  // Exact global-norm clipping by the host steps (offload_to_cpu); sharded on the device the
  // Reducer computes the coefficient and hands it to take().
  std::optional<double> max_grad_norm;
  // kAdam8bit: torchao's block size and maps (where the state lives: the parameters' device,
  // or the host with offload_to_cpu).
  Quant8 quant;
};

// Bytes the optimizer accounts for (see memory_stats()).
struct OptimizerMemory {
  int64_t state_bytes = 0;        // the fused optimizer's state (this rank's shard)
  int64_t host_master_bytes = 0;  // offload_to_cpu: float32 master weights on the host
  int64_t host_buffer_bytes = 0;  // staging and low-precision weight buffers on the host
  int64_t host_pinned_bytes = 0;  // of those, page-locked
};

class InBackwardOptimizer {
 public:
  // `params`, `names`: the Reducer's trainable parameters in its order. `group`: the process
  // group (collectives of the sharded state, the host steps' norm). `fallback`: the Python step
  // of what the fused kernels do not cover (unused with offload_to_cpu).
  InBackwardOptimizer(std::vector<at::Tensor> params, std::vector<std::string> names,
                      c10::intrusive_ptr<c10d::ProcessGroup> group, InBackwardOptions options,
                      std::unique_ptr<BucketStepper> fallback);
  // Stops the host worker once its queued steps are done.
  ~InBackwardOptimizer();
  InBackwardOptimizer(const InBackwardOptimizer&) = delete;
  InBackwardOptimizer& operator=(const InBackwardOptimizer&) = delete;

  // ---- The seam: the Reducer's calls, with the Reducer's lock held ----

  // Reducer::set_optimizer, before the first backward: the buckets' layout (no storage is
  // kept) and, sharded, this rank's cut of each; `checked_first`: the NaN check reads every
  // bucket before the end of backward, so host steps wait for it. Once.
  void attach(const std::vector<Bucket>& buckets, const std::vector<ShardLayout>& shards,
              bool checked_first);
  bool attached() const;
  bool steps_on_host() const { return options_.offload_to_cpu; }
  // GPU: the stream the steps are queued on (the device-to-host copies' with offload_to_cpu).
  c10::Stream stream() const;
  // Whether the end of backward orders the caller's stream after stream() (device steps; host
  // steps are waited for by the next forward instead).
  bool caller_follows() const;
  // Bucket `index`, reduced, collected and checked: steps its used members (on a GPU with
  // stream() current) or hands it to the host. The Reducer releases it afterwards.
  void take(size_t index, Bucket& bucket, const Take& what);
  // The device NaN check found that the kernels skipped these parameters' steps: their step
  // counts go back.
  void skipped(const std::vector<int64_t>& params);
  // Every bucket was taken and the NaN check passed: the host steps may run (with max_grad_norm
  // sharded on the host, once the global norm is allreduced).
  void end_of_backward();
  // Sharded host steps, after end_of_backward(): blocks until bucket b's host step is done
  // (on a GPU the current stream then waits for its copy back), so that the Reducer may gather
  // its pieces; gathered() once every bucket was gathered into the parameters.
  void wait_stepped(size_t b);
  void gathered();
  // A backward abandoned (it raised, or the NaN check found a bucket): held steps are dropped.
  void abandon();
  // Where the Reducer's iteration stands, pushed wherever it changes: `armed`, a forward prepared
  // a synchronized backward that has not ended (state is not read or gathered then); and
  // `forward_waits_all`, the next forward winds up an unfinished backward or rebuilds the
  // buckets, so it waits for every step there and pending_steps() lists none (per-bucket waits
  // would be stale).
  void set_iteration(bool armed, bool forward_waits_all);
  // A bucket rebuild, in two parts so that a failure leaves everything as it was: before the
  // Reducer changes its buckets, begin_relayout() waits for the steps and, sharded, gathers each
  // old bucket's state whole (collectives in bucket order on every rank; raises before any
  // change); then relayout() moves the state to follow its parameters into `buckets` (cut by
  // `shards`).
  void begin_relayout();
  void relayout(const std::vector<Bucket>& buckets, const std::vector<ShardLayout>& shards);
  // Whether the steps are ordered on a device that runs apart (the Reducer's side stream).
  bool device_ordered() const { return device_ordered_; }
  // Whether this optimizer was built over exactly `params` (the same tensors, in order) and
  // `group`.
  bool matches(const std::vector<at::Tensor>& params,
               const c10::intrusive_ptr<c10d::ProcessGroup>& group) const;
  // The host waits for the steps (with `host_too` also for their copies back); with
  // `order_device` the current stream waits for stream()'s device steps. Rethrows an error the
  // host worker met.
  void wait(bool host_too, bool order_device = true);
  // accumulate_on_host: the host worker whose thread and copy streams the Reducer's
  // HostAccumulator shares with the host steps (offload_to_cpu only; else null).
  std::shared_ptr<HostWorker> host_worker() const {
    return host_ ? host_->worker() : std::shared_ptr<HostWorker>();
  }
  // What close() lets go of, for the caller to destroy where it may (the process group without
  // the GIL, the fallback stepper with it).
  struct Detached {
    c10::intrusive_ptr<c10d::ProcessGroup> group;
    std::unique_ptr<BucketStepper> fallback;
  };
  // Stops the host worker (after the steps queued) and lets go of the group and the fallback.
  // State stays readable. Idempotent.
  Detached close();
  // CUDA events created so far (pooled: constant once every bucket went through a step).
  int64_t events_created() const;

  // ---- The Python face: between iterations, on the caller's thread ----

  // The last backward's steps visible to the caller: the host waits for the host steps (and
  // with `host_too` for their copies back); on a GPU the current stream is ordered after them.
  void wait_for_steps(bool host_too);
  // offload_to_cpu: the buckets whose host steps are not done yet; empty otherwise, once the
  // worker met an error (wait_for_steps raises it), and where the next forward waits for every
  // step anyway (set_iteration). A bucket whose step was dropped (an abandoned backward,
  // the NaN check) is not pending. With `follow_copies` (the forward's call) and something
  // pending, on a GPU the current stream is then ordered after every copy back queued so far
  // (one event, the host does not wait): the buckets not listed were stepped, but their copies
  // back may still run, and the forward reads them without a wait of its own.
  std::vector<int64_t> pending_steps(bool follow_copies);
  // The next forward where pending_steps() is empty: as wait_for_steps(false), except that with
  // offload_to_cpu and no host step pending the host does not wait for the worker (it may be
  // summing no_sync() micro-batches); on a GPU the current stream waits for the copies back,
  // and an error the worker met is rethrown if a synchronized backward ended (or was
  // abandoned) since the last forward, else kept (see the .cpp: every rank raises it at the
  // same forward). While a synchronized backward is armed (prepared by a forward, not ended),
  // a pending step is waited for and the error is kept either way, for the Reducer's wind-up
  // of that backward at the next forward with gradients (or the forward after it) to raise.
  void follow_steps();
  // The host waits for bucket `index`'s host step (only), then on a GPU the current stream
  // waits for its copy back; a no-op without offload_to_cpu. The next forward calls it for each
  // pending bucket as it reads the bucket's parameters.
  void wait_for_bucket(int64_t index);
  // The live hyper-parameters, one per group (at each forward): for the steps after the last
  // backward's (with offload_to_cpu set by the worker after those, so the caller does not wait).
  void set_groups(std::vector<OptimHyper> groups);
  // torch.amp.GradScaler for the next backward's steps (at each forward; undefined tensors:
  // none): each bucket's gradients are checked on the device before its step (found_inf set to
  // 1 on an inf/NaN) and the kernels skip the step while it is set. Fused buckets only.
  void set_grad_scaler(at::Tensor scale, at::Tensor found_inf);
  // Parameter p's fused state in torch's format (empty if none, or not fused); with
  // offload_to_cpu a low-precision parameter's float32 master is added as "master_weight".
  std::vector<std::pair<std::string, at::Tensor>> state(size_t p);
  // Loads parameter p's fused state (see FusedOptimizer::load_state).
  void load_state(size_t p, int64_t step, const std::vector<at::Tensor>& values);
  // offload_to_cpu: sets a low-precision parameter's float32 master (checkpoints).
  void load_master_weight(size_t p, const at::Tensor& value);
  // offload_to_cpu: the masters were loaded in place, into the views local_state() handed out
  // (torch.distributed.checkpoint): they, not the parameters' rounded values, are what the
  // next steps start from.
  void adopt_master_weights();
  // Changes when the fused state's tensors are created, moved or loaded.
  int64_t generation();
  // Sharded: every parameter's state in torch's format, gathered from every rank's shard (a
  // collective: every rank calls it, outside backward, and gets the whole state); one entry per
  // parameter, empty where it has none.
  std::vector<std::vector<std::pair<std::string, at::Tensor>>> gathered_state();
  // Sharded, between iterations, for checkpoints that stay sharded: every parameter's pieces on
  // every rank, as (rank, first element, elements) of the parameter seen 1-D in memory order;
  // this rank's pieces of the state as (parameter, torch's key, a live 1-D view;
  // FusedOptimizer::shard_state: 8-bit codes, and their scales' blocks), float32
  // masters included with offload_to_cpu ("master_weight"; one not made yet is made from its
  // parameter first, on every rank); and the step counts (the same on every rank), which
  // set_steps() sets, leaving the buffers as they are.
  std::vector<std::vector<std::array<int64_t, 3>>> shard_placement();
  std::vector<std::tuple<int64_t, std::string, at::Tensor>> local_state();
  std::vector<int64_t> steps();
  void set_steps(const std::vector<int64_t>& steps);
  // What the host side has done and holds (offload_to_cpu; otherwise zeros, with the sharded
  // device clipping's last norm).
  OffloadStats stats();
  // The last sharded device clipping's global norm (the Reducer computes it), for stats().
  void note_grad_norm(double norm);
  OptimizerMemory memory_stats();

  // Tests: the host worker sleeps `seconds` before each host step (and each addition of a
  // no_sync() micro-batch, the accumulator's own delays aside) from now on (0: not).
  void delay_host_steps(double seconds);
  // Tests, offload_to_cpu: the next `count` host jobs of `kind` (of bucket `bucket` only, if
  // >= 0) raise instead of running (HostWorker::inject_faults()): a host step, or an addition
  // of a no_sync() micro-batch (accumulate_on_host). The error surfaces as the worker's own do.
  void inject_host_faults(HostWorker::Fault kind, int64_t count, int64_t bucket);
  // Tests, offload_to_cpu under host ordering (streams.h): the copies back to the parameters
  // run `seconds` after the worker queued them, as a GPU's may.
  void delay_copies_back(double seconds);
  // Tests, offload_to_cpu on a GPU: the stream the copies back run on, as (stream id, device
  // index, device type); none otherwise.
  std::optional<std::tuple<int64_t, int64_t, int64_t>> copy_back_stream() const;

 private:
  // (with mu_ held)
  void wait_locked(bool host_too, bool order_device);
  void check_param(size_t p) const;
  void check_open(const char* what) const;  // raises once closed
  void check_idle(const char* what) const;  // raises inside a synchronized iteration
  FusedOptimizer& fused(const char* what) const;
  // Sharded: the state buffers of bucket `index` of `layout` (cut by `shards`), and with
  // offload_to_cpu a low-precision bucket's masters (last), gathered whole (a collective):
  // FusedOptimizer::whole_state(), the masters padded.
  std::vector<at::Tensor> gather_state(const std::vector<Bucket>& layout,
                                       const std::vector<ShardLayout>& shards, size_t index);
  bool low_precision(const Bucket& bucket) const {
    return params_[static_cast<size_t>(bucket.params[0])].scalar_type() != at::kFloat;
  }

  // Fixed at construction.
  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  InBackwardOptions options_;
  bool device_ordered_;  // the parameters live on a device that runs apart (a GPU)

  mutable std::mutex mu_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;  // null once closed
  std::unique_ptr<StepStrategy> steps_;
  HostOffload* host_ = nullptr;        // offload_to_cpu: steps_'s (it owns it)
  std::unique_ptr<EventPool> events_;  // GPU: orders the caller's stream after stream()
  // The buckets' layout (attach, relayout; no storage) and, per parameter, its (bucket, slot);
  // sharded, this rank's cut of each bucket.
  std::vector<Bucket> layout_;
  std::vector<std::pair<size_t, size_t>> location_;
  std::vector<ShardLayout> shards_;
  bool in_backward_ = false;  // a bucket was taken and the backward not ended or abandoned
  bool armed_ = false;        // set_iteration
  // A synchronized backward ended or was abandoned since the last follow_steps() or full
  // wait (which clear it): the next follow_steps() raises an error the host worker met.
  bool ended_since_forward_ = false;
  bool forward_waits_all_ = true;
  // begin_relayout(), sharded: each old bucket's state buffers gathered whole, for relayout().
  std::vector<std::vector<at::Tensor>> old_full_;
  double grad_norm_ = -1;  // note_grad_norm
};

}  // namespace leanddp
