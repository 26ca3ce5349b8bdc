// StepStrategy: how optimizer_in_backward steps a reduced bucket, for the Reducer. The Reducer
// owns a bucket's life (collect its reduction, check it, hand it to the strategy, release it)
// and the ordering around it (the side stream a GPU step is queued on, the window of buckets in
// flight); the strategy owns the optimizer and what a step needs:
//   * DeviceSteps: the fused kernels step the bucket where it lives (on a GPU queued on a side
//     stream of its own), a Python fallback steps the parameters they cannot; GradScaler and the
//     device NaN check's gating ride on the kernels' found_inf. Sharded, this rank's shard is
//     stepped and the stepped shards all-gathered back into the parameters right after.
//   * HostSteps: offload_to_cpu. Every bucket is copied to the host and stepped there by
//     HostOffload (offload.h) on its device-to-host stream; the next forward waits. Sharded,
//     the pieces are gathered back into the parameters at the end of backward, each bucket as
//     soon as its own host step is done. With
//     accumulate_on_host it also owns the HostAccumulator (host_accum.h) that holds no_sync()
//     micro-batches' gradients on the host.
// Both steps' sharded cut, gathers and clipping are ShardGather's (shard_gather.h); the NaN
// check's state is NonFiniteCheck's (nan_check.h).
//
// Built by Reducer::set_optimizer and owned by the Reducer; every method is called by the
// Reducer only, with its lock held, on the thread holding it (autograd's threads in backward,
// the caller's between iterations). The references a strategy keeps (parameters, names, the
// ShardGather, the NonFiniteCheck) are the Reducer's members, which outlive it.
#pragma once

#include "bucket.h"
#include "fused_optim.h"
#include "host_accum.h"
#include "nan_check.h"
#include "offload.h"
#include "shard_gather.h"
#include "stepper.h"

#include <ATen/ATen.h>
#include <c10/core/Stream.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace leanddp {

class StepStrategy {
 public:
  virtual ~StepStrategy() = default;
  // The fused optimizer (null: every parameter goes to the fallback). HostSteps: read it only
  // once the host is idle (wait()).
  virtual FusedOptimizer* optimizer() const = 0;
  // HostSteps' HostOffload (its masters and statistics); null for DeviceSteps.
  virtual HostOffload* host() const { return nullptr; }
  // HostSteps' HostAccumulator (accumulate_on_host); null otherwise.
  virtual HostAccumulator* accumulator() const { return nullptr; }
  // GPU: the stream the steps are queued on; the Reducer makes it wait for each bucket's
  // gradients and reduction before step(), and records the bucket's memory on it after.
  virtual c10::Stream stream() const = 0;
  // Whether the end of backward orders the caller's stream after stream() (the device steps);
  // host steps are waited for by the next forward instead (wait()).
  virtual bool caller_follows() const = 0;
  // Steps bucket `index`, collected and checked, of which the parameters `used` marks (null:
  // all); on a GPU, with stream() current. The Reducer releases the bucket after, unless
  // `shard`.deferred(index) (a CPU gather still reads it).
  virtual void step(size_t index, Bucket& bucket, const std::vector<int32_t>* used,
                    const c10::intrusive_ptr<c10d::ProcessGroup>& group) = 0;
  // Every bucket went through step() and the NaN check passed: what finishes the iteration.
  // `gather_back(stepped)` gathers every rank's stepped pieces of every bucket into the
  // parameters, in bucket order, at most two buckets allocated, calling `stepped(b)` before
  // bucket b's gather: it returns once b's pieces are in this rank's parameters (on a GPU, in
  // the current stream's order) (sharded HostSteps).
  using Gather = std::function<void(const std::function<void(size_t)>& stepped)>;
  virtual void end_of_backward(c10d::ProcessGroup& group, const Gather& gather_back) = 0;
  // A backward abandoned (it raised, or the NaN check found a bucket): held steps are dropped.
  virtual void abandon() {}
  // The host waits for the host steps (and with `host_too` for their copies back); device
  // ordering is the Reducer's (the caller's stream follows stream()).
  virtual void wait(bool host_too) { (void)host_too; }
  // A bucket rebuild: the state follows its parameters from `old_buckets` into `buckets` (cut
  // by `shards`; sharded, `old_full` holds each old bucket's state gathered whole).
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
              const std::vector<at::Tensor>& params, const std::vector<std::string>& names,
              ShardGather& shard, NonFiniteCheck& nan);
  FusedOptimizer* optimizer() const override { return fused_.get(); }
  c10::Stream stream() const override { return *stream_; }
  bool caller_follows() const override { return true; }
  void step(size_t index, Bucket& bucket, const std::vector<int32_t>* used,
            const c10::intrusive_ptr<c10d::ProcessGroup>& group) override;
  void end_of_backward(c10d::ProcessGroup&, const Gather&) override {}
  void relayout(const std::vector<Bucket>& old_buckets, const std::vector<Bucket>& buckets,
                const std::vector<ShardLayout>& shards,
                const std::vector<std::vector<at::Tensor>>& old_full) override;
  void set_grad_scaler(at::Tensor scale, at::Tensor found_inf) override;
  std::unique_ptr<BucketStepper> take_fallback() override { return std::move(fallback_); }

 private:
  // The fused kernels' targets for the members `mask` of `bucket`: GradScaler's check of their
  // gradients (on the device), or the device NaN check's flag and gating.
  StepTargets targets(size_t index, const Bucket& bucket, const std::vector<char>& mask);

  std::unique_ptr<FusedOptimizer> fused_;
  std::unique_ptr<BucketStepper> fallback_;
  std::optional<c10::Stream> stream_;
  bool sharded_;
  const std::vector<at::Tensor>& params_;
  const std::vector<std::string>& names_;
  ShardGather& shard_;
  NonFiniteCheck& nan_;
  at::Tensor amp_scale_, amp_found_inf_, amp_one_;  // set_grad_scaler (amp_one_: 1.0 there)
};

// offload_to_cpu: every used parameter of a bucket is stepped on the host by `offload`.
class HostSteps final : public StepStrategy {
 public:
  // `device`: the parameters' (where the norm of max_grad_norm is allreduced). `buckets`: with
  // `accumulate_on_host`, the layout of the HostAccumulator built over `offload`.
  HostSteps(std::unique_ptr<HostOffload> offload, bool sharded, c10::Device device,
            bool accumulate_on_host, const std::vector<Bucket>& buckets);
  FusedOptimizer* optimizer() const override { return &offload_->optimizer(); }
  HostOffload* host() const override { return offload_.get(); }
  HostAccumulator* accumulator() const override { return accumulator_.get(); }
  c10::Stream stream() const override { return offload_->d2h_stream(); }
  bool caller_follows() const override { return false; }
  void step(size_t index, Bucket& bucket, const std::vector<int32_t>* used,
            const c10::intrusive_ptr<c10d::ProcessGroup>& group) override;
  void end_of_backward(c10d::ProcessGroup& group, const Gather& gather_back) override;
  void abandon() override { offload_->end_iteration(/*completed=*/false); }
  void set_grad_scaler(at::Tensor scale, at::Tensor found_inf) override;  // (refuses one)
  void wait(bool host_too) override { offload_->wait(host_too); }
  void relayout(const std::vector<Bucket>& old_buckets, const std::vector<Bucket>& buckets,
                const std::vector<ShardLayout>& shards,
                const std::vector<std::vector<at::Tensor>>& old_full) override;
  void shutdown() override { offload_->shutdown(); }
  int64_t generation() const override;
  int64_t events_created() const override {
    return offload_->events_created() + (accumulator_ ? accumulator_->events_created() : 0);
  }

 private:
  std::unique_ptr<HostOffload> offload_;
  std::unique_ptr<HostAccumulator> accumulator_;  // (declared after offload_: destroyed first)
  bool sharded_;
  c10::Device device_;
};

}  // namespace leanddp
