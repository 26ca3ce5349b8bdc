// StepStrategy: how InBackwardOptimizer (in_backward_optimizer.h) steps a bucket the Reducer
// handed over, an implementation detail of that class:
//   * DeviceSteps: the fused kernels step the bucket where it lives (on a GPU queued on a side
//     stream of its own), a Python fallback steps the parameters they cannot; GradScaler and the
//     device NaN check's gating ride on the kernels' found_inf. Sharded, this rank's shard is
//     stepped (the Reducer then gathers the stepped shards back into the parameters).
//   * HostSteps: offload_to_cpu. Every bucket is copied to the host and stepped there by
//     HostOffload (host_offload.h) on its device-to-host stream; the next forward waits. Sharded,
//     with max_grad_norm, the global norm is allreduced at the end of backward.
//
// Owned by InBackwardOptimizer and called with its lock held, on the thread holding it
// (autograd's threads in backward, the caller's between iterations). The references a strategy
// keeps (parameters, names) are the optimizer's members, which outlive it.
#pragma once

#include "bucket.h"
#include "bucket_stepper.h"
#include "fused_optimizer.h"
#include "host_offload.h"
#include "non_finite_check.h"
#include "shard.h"

#include <ATen/ATen.h>
#include <c10/core/Stream.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace leanddp {

// What the Reducer hands over with a reduced bucket (InBackwardOptimizer::take()).
struct Take {
  // Per parameter: whether it is used in this iteration (null: all are); unused ones are not
  // stepped.
  const std::vector<int32_t>* used = nullptr;
  // max_grad_norm sharded on the device: clip_grad_norm_'s coefficient for every gradient.
  std::optional<double> clip_scale;
  // The NaN check (its device flag gates the fused kernels; the fallback reads it first).
  NonFiniteCheck* nan = nullptr;
};

class StepStrategy {
 public:
  virtual ~StepStrategy() = default;
  // The fused optimizer (null: every parameter goes to the fallback). HostSteps: read it only
  // once the host is idle (wait()).
  virtual FusedOptimizer* optimizer() const = 0;
  // The buckets' layout (no storage) and, sharded, this rank's cut of each: once, before the
  // first step.
  virtual void attach(const std::vector<Bucket>& buckets,
                      const std::vector<ShardLayout>& shards) = 0;
  // GPU: the stream the steps are queued on; the Reducer makes it wait for each bucket's
  // gradients and reduction before the step, and records the bucket's memory on it after.
  virtual c10::Stream stream() const = 0;
  // Whether the end of backward orders the caller's stream after stream() (the device steps);
  // host steps are waited for by the next forward instead (wait()).
  virtual bool caller_follows() const = 0;
  // Steps bucket `index`, collected and checked, of which the parameters `what.used` marks
  // (null: all); on a GPU, with stream() current.
  virtual void step(size_t index, Bucket& bucket, const Take& what) = 0;
  // Every bucket went through step() and the NaN check passed: what finishes the iteration
  // (`group`: for the sharded host steps' global norm).
  virtual void end_of_backward(c10d::ProcessGroup& group) = 0;
  // A backward abandoned (it raised, or the NaN check found a bucket): held steps are dropped.
  virtual void abandon() {}
  // The host waits for the host steps (and with `host_too` for their copies back); device
  // ordering is the Reducer's (the caller's stream follows stream()).
  virtual void wait(bool host_too) { (void)host_too; }
  // A bucket rebuild: the state follows its parameters from `old_buckets` into `buckets` (cut
  // by `shards`; sharded, `old_full` holds each old bucket's state gathered whole). Layouts
  // only (no storage).
  virtual void relayout(const std::vector<Bucket>& old_buckets, const std::vector<Bucket>& buckets,
                        const std::vector<ShardLayout>& shards,
                        const std::vector<std::vector<at::Tensor>>& old_full) = 0;
  // torch.amp.GradScaler's scale and found_inf for the next backward (undefined: none).
  virtual void set_grad_scaler(at::Tensor scale, at::Tensor found_inf) = 0;
  // close(): the Python fallback stepper, for the caller to destroy with the GIL.
  virtual std::unique_ptr<BucketStepper> take_fallback() { return nullptr; }
  // Stops a worker thread (HostSteps), once its queued steps are done.
  virtual void shutdown() {}
  // Changes of the optimizer's state from outside a step (loads, relayouts), and events made.
  virtual int64_t generation() const;
  virtual int64_t events_created() const { return 0; }
};

// The fused kernels on the parameters' device, and the Python fallback for what they cannot
// step. `fused` may be null (every parameter to `fallback`); sharded, it must step every
// parameter. `stream`: GPU only (device-ordered steps).
class DeviceSteps final : public StepStrategy {
 public:
  DeviceSteps(std::unique_ptr<FusedOptimizer> fused, std::unique_ptr<BucketStepper> fallback,
              std::optional<c10::Stream> stream, bool sharded,
              const std::vector<at::Tensor>& params, const std::vector<std::string>& names);
  void attach(const std::vector<Bucket>& buckets, const std::vector<ShardLayout>& shards) override;
  FusedOptimizer* optimizer() const override { return fused_.get(); }
  c10::Stream stream() const override { return *stream_; }
  bool caller_follows() const override { return true; }
  void step(size_t index, Bucket& bucket, const Take& what) override;
  void end_of_backward(c10d::ProcessGroup&) override {}
  void relayout(const std::vector<Bucket>& old_buckets, const std::vector<Bucket>& buckets,
                const std::vector<ShardLayout>& shards,
                const std::vector<std::vector<at::Tensor>>& old_full) override;
  void set_grad_scaler(at::Tensor scale, at::Tensor found_inf) override;
  std::unique_ptr<BucketStepper> take_fallback() override { return std::move(fallback_); }

 private:
  // The fused kernels' targets for the members `mask` of `bucket`: GradScaler's check of their
  // gradients (on the device), or the device NaN check's flag and gating.
  StepTargets targets(size_t index, const Bucket& bucket, const std::vector<char>& mask,
                      const Take& what);

  std::unique_ptr<FusedOptimizer> fused_;
  std::unique_ptr<BucketStepper> fallback_;
  std::optional<c10::Stream> stream_;
  bool sharded_;
  const std::vector<at::Tensor>& params_;
  const std::vector<std::string>& names_;
  at::Tensor amp_scale_, amp_found_inf_, amp_one_;  // set_grad_scaler (amp_one_: 1.0 there)
};

// offload_to_cpu: every used parameter of a bucket is stepped on the host by `offload`.
class HostSteps final : public StepStrategy {
 public:
  // `device`: the parameters' (where the norm of max_grad_norm is allreduced).
  HostSteps(std::unique_ptr<HostOffload> offload, bool sharded, c10::Device device);
  void attach(const std::vector<Bucket>& buckets, const std::vector<ShardLayout>& shards) override {
    offload_->set_layout(buckets, shards);
  }
  FusedOptimizer* optimizer() const override { return &offload_->optimizer(); }
  c10::Stream stream() const override { return offload_->worker()->d2h_stream(); }
  bool caller_follows() const override { return false; }
  void step(size_t index, Bucket& bucket, const Take& what) override;
  void end_of_backward(c10d::ProcessGroup& group) override;
  void abandon() override { offload_->end_iteration(/*completed=*/false); }
  void set_grad_scaler(at::Tensor scale, at::Tensor found_inf) override;  // (refuses one)
  void wait(bool host_too) override { offload_->wait(host_too); }
  void relayout(const std::vector<Bucket>& old_buckets, const std::vector<Bucket>& buckets,
                const std::vector<ShardLayout>& shards,
                const std::vector<std::vector<at::Tensor>>& old_full) override;
  void shutdown() override { offload_->shutdown(); }
  int64_t generation() const override;
  int64_t events_created() const override { return offload_->worker()->events_created(); }

 private:
  std::unique_ptr<HostOffload> offload_;
  bool sharded_;
  c10::Device device_;
};

}  // namespace leanddp
