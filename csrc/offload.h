// HostOffload: offload_to_cpu. Optimizer state and float32 master weights live in host memory
// (pinned when the parameters are on a GPU); a worker thread steps them with the fused CPU
// kernels and writes the updated weights back to the parameters.
//
// Data flow per bucket, once its reduction is complete (Reducer::step_bucket calls submit()):
//   1. on the device's copy stream, after the work queued so far on the current (backward)
//      stream: the averaged gradients go to the bucket's host staging buffer, and the masters
//      of parameters changed since our last write (first step, a loaded checkpoint) are
//      refreshed from the parameters; the device bucket may be released at once (its memory is
//      recorded on the copy stream, so the caching allocator reuses it only after the copy);
//   2. the worker waits for those copies (an event), steps the bucket's masters and state (for
//      bf16/fp16 parameters the kernel upcasts the gradients and writes the low-precision copy),
//      and copies the weights back to the parameters on the copy stream.
// With max_grad_norm, the worker accumulates each bucket's squared norm as it arrives and holds
// the steps until end_iteration(): the global norm is then known and every gradient is scaled
// by torch.nn.utils.clip_grad_norm_'s coefficient inside the step kernel. hold_steps() holds
// them the same way without clipping (the Reducer's NaN check decides at the end of backward
// whether the iteration is completed or dropped).
//
// wait() is where the next forward (or anything reading parameters or state) waits: for the
// worker to finish, then (GPU) the current stream waits for the copies back: the host step
// overlaps the rest of backward and whatever the loop does between steps. On a CPU-only machine
// the same pipeline runs, with synchronous copies.
//
// Threading: submit(), end_iteration() and the accessors run on the Reducer's threads with the
// Reducer's lock held; the worker never takes that lock. `mu_` guards the queue and the
// worker's results. The optimizer, masters and staging buffers are touched by the worker only
// while jobs are queued or running, and by the other methods only after wait() (or before the
// first job of an iteration, for the staging buffer and masters of a submitted bucket).
#pragma once

#include "bucket.h"
#include "fused_optim.h"

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <condition_variable>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

namespace leanddp {

struct OffloadOptions {
  int threads = 1;                      // threads of the host step (the worker's OpenMP team)
  std::optional<double> max_grad_norm;  // exact global-norm clipping (torch's clip_grad_norm_)
};

// What the host side has done and holds (counters since construction).
struct OffloadStats {
  int64_t iterations = 0;         // synchronized iterations whose host steps finished
  int64_t buckets = 0;            // bucket steps
  double step_seconds = 0;        // worker busy time: copies awaited, norms, steps, copies back
  double wait_seconds = 0;        // time callers of wait() were blocked
  double grad_norm = -1;          // the last iteration's total gradient norm (-1: no clipping)
  int64_t master_bytes = 0;       // float32 master weights on the host
  int64_t host_buffer_bytes = 0;  // host staging buffers (gradients) and low-precision copies
};

class HostOffload {
 public:
  // `params`: the Reducer's parameters (all can_step for `optimizer`, which was built with
  // on_host). Starts the worker thread.
  HostOffload(std::vector<at::Tensor> params, std::unique_ptr<FusedOptimizer> optimizer,
              OffloadOptions options);
  // Stops the worker after the jobs already queued (the updates of a finished backward: dropping
  // them would lose a step), then joins it. Buckets held for an unfinished iteration are dropped.
  ~HostOffload();
  HostOffload(const HostOffload&) = delete;
  HostOffload& operator=(const HostOffload&) = delete;

  // Bucket `index` holds its averaged gradients (`bucket.flat`): queues its host step for the
  // members whose `mask[slot]` is set. After it returns the device bucket may be released.
  void submit(size_t index, const Bucket& bucket, const std::vector<char>& mask);
  // Every bucket of this synchronized backward was submitted (clipping may now step them); or,
  // if not `completed`, the backward failed: buckets held for clipping are dropped unstepped.
  void end_iteration(bool completed);
  // Blocks until the worker is idle; then, on a GPU, the current stream waits for the copies
  // back (and the host too, if `host_too`: before the host buffers are read or written).
  // Rethrows (once) an error the worker met; its later jobs were dropped.
  void wait(bool host_too);
  // The buckets were rebuilt (worker idle): state moves to the new layout, staging is dropped.
  void relayout(const std::vector<Bucket>& old_buckets, const std::vector<Bucket>& new_buckets);
  // Stops the worker for good (see the destructor); later submits are dropped.
  void shutdown();
  // From now on (before the first submit) steps wait for end_iteration(), as with clipping.
  void hold_steps() { hold_ = true; }

  // Worker idle (after wait(true)) for the rest.
  FusedOptimizer& optimizer() { return *optimizer_; }
  // Parameter p's float32 master if p is low-precision and has one (else undefined).
  at::Tensor master(size_t p) const;
  // Sets parameter p's master (from a checkpoint); it is kept until p is changed by others.
  void load_master(size_t p, const at::Tensor& value);
  int64_t generation() const { return generation_; }
  OffloadStats stats() const;

 private:
  struct Job {
    size_t index = 0;
    Bucket layout;  // params/offsets/numel (no storage)
    std::vector<char> mask;
    at::Tensor staging;                  // the gradients, on the host
    std::shared_ptr<c10::Event> copied;  // GPU: the copies to the host are done
    bool end = false;                    // marks the end of an iteration
    bool completed = true;               // (end) false: the iteration was abandoned
  };

  void run_worker();
  void process(Job& job);
  void step_job(const Job& job, std::optional<double> grad_scale);
  void finish_iteration(bool completed);
  bool low_precision(size_t p) const { return params_[p].scalar_type() != at::kFloat; }
  bool holds() const { return hold_ || options_.max_grad_norm.has_value(); }
  // Parameter p's master (and, low-precision, its copy), allocated at first use.
  at::Tensor& ensure_master(size_t p);

  std::vector<at::Tensor> params_;
  std::unique_ptr<FusedOptimizer> optimizer_;
  OffloadOptions options_;
  bool on_gpu_ = false;
  bool hold_ = false;                       // steps wait for end_iteration() (hold_steps())
  std::optional<c10::Stream> copy_stream_;  // GPU only
  at::TensorOptions host_options_;          // host memory, pinned on a GPU machine

  // Per parameter: the float32 master (undefined until its first step), the low-precision copy
  // the step writes (bf16/fp16 parameters), and the parameter's version counter after our
  // last write (a different version means someone else changed it: refresh the master).
  std::vector<at::Tensor> masters_;
  std::vector<at::Tensor> copies_;
  std::vector<uint32_t> versions_;
  std::vector<at::Tensor> staging_;  // per bucket: host gradients (kept across iterations)
  int64_t generation_ = 0;           // changes when a master appears or is loaded

  // The worker's queue and results, guarded by mu_.
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> queue_;
  bool busy_ = false;
  bool stop_ = false;
  std::exception_ptr error_;
  OffloadStats stats_;      // counters (the byte counts are filled in by stats())
  std::vector<Job> held_;   // clipping: stepped once the norm is known
  double sum_squares_ = 0;  // clipping: of the buckets of this iteration so far
  std::thread worker_;
};

}  // namespace leanddp
