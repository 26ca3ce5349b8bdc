// ShardGather: shard_optimizer_state's state inside a backward, for the Reducer: this rank's cut
// of every bucket (shard.h), the all-gathers of stepped weights in flight, and max_grad_norm's
// clipping across the shards.
//
// A sharded bucket is reduce-scattered at launch (the Reducer uses shards()); once this rank's
// shard is stepped, start() packs the stepped pieces into the shard and starts the all-gather of
// every rank's shard, finish() waits for it and writes the whole bucket into the parameters. On
// the CPU the host would block on the gather: defer() keeps the bucket until the next bucket's
// step or the end of backward (finish_deferred()), so the gather overlaps the backward between.
// clip() sums the squares of this rank's shard of every bucket, allreduces the sum and keeps
// clip_grad_norm_'s coefficient for the steps (clip_scale()).
//
// Owned by the Reducer and called only by it, with the Reducer's lock held, on the thread that
// holds it (autograd's threads in backward, the caller's between iterations). `params` and
// `names` are the Reducer's, which outlive this object. The collectives go to the process group
// the caller passes (the Reducer's), in the same order on every rank.
#pragma once

#include "bucket.h"
#include "shard.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace leanddp {

class ShardGather {
 public:
  ShardGather(const std::vector<at::Tensor>& params, const std::vector<std::string>& names,
              int rank)
      : params_(params), names_(names), rank_(rank) {}

  // Cuts this rank's shard of every bucket (a new layout) and pads the buckets to it; the shards
  // of a bucket holding a parameter marked in `blocked` (per parameter; may be empty) are
  // multiples of `block` elements (cut_bucket).
  void cut_all(std::vector<Bucket>& buckets, const c10d::ProcessGroup& group, int64_t block = 1,
               const std::vector<bool>& blocked = {});
  // This rank's shard of each bucket (empty until cut_all: not sharded).
  const std::vector<ShardLayout>& shards() const { return shards_; }

  // At the start of each synchronized backward: no gather in flight, no clipping coefficient.
  void reset(size_t num_buckets);

  // Bucket `index` was stepped: its stepped pieces go into its shard, and the all-gather of
  // every rank's shard starts.
  void start(const c10::intrusive_ptr<c10d::ProcessGroup>& group, Bucket& bucket, size_t index);
  // Waits for bucket `index`'s all-gather (NCCL: the current stream waits, not the host) and
  // writes the bucket into its parameters (their version counters bumped).
  void finish(Bucket& bucket, size_t index);
  // CPU: bucket `index`'s gather is finished later (finish_deferred), and its release with it.
  void defer(size_t index) { deferred_.push_back(index); }
  bool deferred(size_t index) const { return !deferred_.empty() && deferred_.back() == index; }
  // Finishes the deferred gathers in order, releasing each bucket (`release`) after its gather.
  void finish_deferred(std::vector<Bucket>& buckets, const std::function<void(size_t)>& release);
  // A backward that failed: waits for every gather still in flight; false if one failed.
  bool wait_all();
  // close(): the gathers still in flight (a backward that never finished).
  std::vector<c10::intrusive_ptr<c10d::Work>> take_gathers();

  // max_grad_norm (every bucket collected): the global norm of the reduced gradients from every
  // rank's shard, one allreduce of a scalar; the steps then take clip_scale().
  void clip(c10d::ProcessGroup& group, const std::vector<Bucket>& buckets, double max_norm);
  std::optional<double> clip_scale() const { return clip_scale_; }
  // The last clipped backward's global gradient norm (-1 before the first).
  double grad_norm() const { return grad_norm_; }

 private:
  const std::vector<at::Tensor>& params_;
  const std::vector<std::string>& names_;
  int rank_;  // for messages
  std::vector<ShardLayout> shards_;
  std::vector<c10::intrusive_ptr<c10d::Work>> gathers_;  // per bucket, while gathering
  std::deque<size_t> deferred_;       // CPU: buckets stepped, gathers not yet finished
  std::optional<double> clip_scale_;  // this backward's clipping coefficient
  double grad_norm_ = -1;
};

}  // namespace leanddp
