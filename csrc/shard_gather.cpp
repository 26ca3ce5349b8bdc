// shard_optimizer_state's gathers and clipping (see shard_gather.h and shard.h).
#include "shard_gather.h"

#include "errors.h"
#include "fused_optimizer.h"  // clip_coefficient
#include "op_calls.h"

#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cmath>

namespace leanddp {

void ShardGather::cut_all(std::vector<Bucket>& buckets, const c10d::ProcessGroup& group,
                          int64_t block, const std::vector<bool>& blocked) {
  shards_.clear();
  for (Bucket& bucket : buckets) {
    bool any = false;  // (buckets without such a parameter keep the finest cut)
    for (int64_t p : bucket.params)
      any = any || (!blocked.empty() && blocked[static_cast<size_t>(p)]);
    shards_.push_back(
        cut_bucket(bucket, params_, group.getSize(), group.getRank(), any ? block : 1));
    bucket.padded_numel = shards_.back().padded;
  }
}

void ShardGather::reset(size_t num_buckets) {
  gathers_.assign(num_buckets, {});
  deferred_.clear();
  clip_scale_.reset();
}

void ShardGather::start(const c10::intrusive_ptr<c10d::ProcessGroup>& group, Bucket& bucket,
                        size_t index) {
  std::vector<at::Tensor> weights;
  for (int64_t p : bucket.params) weights.push_back(memory_1d(params_[static_cast<size_t>(p)]));
  // The reduced gradients in the shard are consumed: the shard now carries the weights.
  pack_shard(bucket.padded, shards_[index], weights);
  try {
    gathers_[index] = gather_shards(group, bucket.padded, shards_[index]);
  } catch (...) {
    rethrow_collective_error(
        rank_, "starting to gather the stepped weights of bucket " + std::to_string(index));
  }
}

void ShardGather::finish(Bucket& bucket, size_t index) {
  const c10::intrusive_ptr<c10d::Work> work = std::move(gathers_[index]);
  try {
    work->wait();  // NCCL: the current (side) stream waits for the gather; the host does not
  } catch (...) {
    rethrow_collective_error(rank_, "gathering the stepped weights of bucket " +
                                        std::to_string(index) + " (" +
                                        join_names(names_, bucket.params) + ")");
  }
  std::vector<at::Tensor> targets;
  for (size_t s = 0; s < bucket.params.size(); ++s) {
    targets.push_back(
        in_memory_order_of(params_[static_cast<size_t>(bucket.params[s])], bucket.views[s]));
  }
  // Every rank's pieces, this rank's own included (the same values), in one pass; then, as an
  // in-place op does, the version counters: autograd knows tensors it saved are stale (pieces
  // stepped on another rank, or on the host, were not counted here).
  unflatten_from(bucket.flat, targets);
  for (const at::Tensor& target : targets) torch::autograd::impl::bump_version(target);
}

void ShardGather::finish_deferred(std::vector<Bucket>& buckets,
                                  const std::function<void(size_t)>& release) {
  while (!deferred_.empty()) {
    const size_t b = deferred_.front();
    deferred_.pop_front();
    finish(buckets[b], b);
    release(b);
  }
}

bool ShardGather::wait_all() {
  bool ok = true;
  for (auto& gather : gathers_) {
    if (!gather) continue;
    try {
      gather->wait();
    } catch (...) {
      ok = false;
    }
  }
  return ok;
}

std::vector<c10::intrusive_ptr<c10d::Work>> ShardGather::take_gathers() {
  std::vector<c10::intrusive_ptr<c10d::Work>> out;
  for (auto& gather : gathers_) {
    if (gather) out.push_back(std::move(gather));
  }
  return out;
}

void ShardGather::clip(c10d::ProcessGroup& group, const std::vector<Bucket>& buckets,
                       double max_norm) {
  // Each rank sums the squares of its shard of every bucket (the padding holds zeros, and so do
  // the slots of parameters without a gradient): the sum over ranks is the whole sum once.
  at::Tensor sum = at::zeros({}, params_.front().options().dtype(at::kDouble));
  for (size_t b = 0; b < buckets.size(); ++b) {
    const ShardLayout& layout = shards_[b];
    const at::Tensor shard = buckets[b].padded.narrow(0, layout.begin, layout.shard_numel);
    sum.add_(at::linalg_vector_norm(shard, 2, std::nullopt, false, at::kDouble).square());
  }
  std::vector<at::Tensor> tensors{sum};
  try {
    group.allreduce(tensors)->wait();
  } catch (...) {
    rethrow_collective_error(rank_, "the reduction of the gradients' norm (max_grad_norm)");
  }
  grad_norm_ = std::sqrt(sum.item<double>());
  clip_scale_ = clip_coefficient(grad_norm_, max_norm);
}

}  // namespace leanddp
