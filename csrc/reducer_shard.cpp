// The Reducer's shard_optimizer_state paths (see reducer.h and shard.h): gathering the stepped
// weights back into the parameters (the gathers and the cut themselves: shard_gather.h; the end
// of a sharded offloaded backward: HostSteps, step_strategy.h), and gathering the sharded
// optimizer state for checkpoints and for a bucket rebuild.
#include "reducer.h"

#include "op_calls.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/variable.h>

namespace leanddp {

void Reducer::gather_back(const std::function<void(size_t)>& stepped) {
  const auto finish = [this](size_t b) {
    shard_.finish(buckets_[b], b);
    release(b);
  };
  for (size_t b = 0; b < buckets_.size(); ++b) {
    stepped(b);
    ensure_allocated(b);
    shard_.start(process_group_, buckets_[b], b);
    if (b > 0) finish(b - 1);  // (in flight while bucket b's step was waited for)
  }
  if (!buckets_.empty()) finish(buckets_.size() - 1);
}

void Reducer::finish_gathers() {
  shard_.finish_deferred(buckets_, [this](size_t b) { release(b); });
}

std::vector<at::Tensor> Reducer::gather_state(const std::vector<Bucket>& buckets,
                                              const std::vector<ShardLayout>& shards,
                                              size_t index) {
  FusedOptimizer* fused = fused_optimizer();
  const ShardLayout& layout = shards[index];
  std::vector<at::Tensor> local = fused->state_buffers(index, buckets[index]);
  const auto low = [this](const Bucket& bucket) {
    return params_[static_cast<size_t>(bucket.params[0])].scalar_type() != at::kFloat;
  };
  // offload_to_cpu: a low-precision bucket's float32 masters too (last).
  HostOffload* host = host_offload();
  if (host && low(buckets[index])) local.push_back(host->masters_block(index));
  // Gathered on the parameters' device (the process group's), each buffer in turn, then kept
  // where the state lives (the host, with offload_to_cpu).
  const c10::Device device = params_.front().device();
  std::vector<at::Tensor> whole;
  for (const at::Tensor& shard : local) {
    at::Tensor full = at::zeros({layout.padded}, shard.options().device(device));
    full.narrow(0, layout.begin, layout.shard_numel).copy_(shard);
    try {
      gather_shards(process_group_, full, layout)->wait();
    } catch (...) {
      rethrow_collective_error("gathering the optimizer state of bucket " + std::to_string(index));
    }
    whole.push_back(shard.device() == device ? std::move(full) : full.to(shard.device()));
  }
  return whole;
}

std::vector<std::vector<std::pair<std::string, at::Tensor>>> Reducer::gathered_optimizer_state() {
  at::NoGradGuard no_grad;
  std::lock_guard<std::mutex> lock(mu_);
  check_open("gathering the optimizer state");
  TORCH_CHECK(!armed_,
              "leanddp.DistributedDataParallel: the sharded optimizer state is gathered "
              "between iterations, not during a backward");
  FusedOptimizer* fused = fused_optimizer();
  TORCH_CHECK(fused && fused->sharded(),
              "Reducer: gathered_optimizer_state needs shard_optimizer_state");
  wait_idle(/*host_too=*/true);
  HostOffload* host = host_offload();  // (a master alone too: SGD without momentum)
  std::vector<std::vector<std::pair<std::string, at::Tensor>>> out(params_.size());
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const std::vector<at::Tensor> full = gather_state(buckets_, shard_.shards(), b);
    const Bucket& bucket = buckets_[b];
    for (size_t s = 0; s < bucket.params.size(); ++s) {
      const auto p = static_cast<size_t>(bucket.params[s]);
      out[p] = fused->state_from(p, full, bucket.offsets[s]);
      const at::Tensor& param = params_[p];
      if (host && param.scalar_type() != at::kFloat && host->master_made(p)) {
        out[p].emplace_back("master_weight", slice_like(full.back(), bucket.offsets[s], param));
      }
    }
  }
  return out;
}

std::vector<std::vector<std::array<int64_t, 3>>> Reducer::shard_placement() const {
  std::lock_guard<std::mutex> lock(mu_);
  TORCH_CHECK(options_.shard_optimizer_state,
              "Reducer: shard_placement needs shard_optimizer_state");
  check_open("reading the shard placement");
  std::vector<std::vector<std::array<int64_t, 3>>> out(params_.size());
  for (const Bucket& bucket : buckets_) {
    for (int64_t r = 0; r < process_group_->getSize(); ++r) {
      for (const ShardPiece& piece : shard_.cut(bucket, process_group_->getSize(), r).pieces) {
        out[static_cast<size_t>(bucket.params[piece.slot])].push_back(
            {r, piece.slot_offset, piece.numel});
      }
    }
  }
  return out;
}

std::vector<std::tuple<int64_t, std::string, at::Tensor>> Reducer::local_optimizer_state() {
  at::NoGradGuard no_grad;  // (masters made from the parameters)
  std::lock_guard<std::mutex> lock(mu_);
  TORCH_CHECK(!armed_,
              "leanddp.DistributedDataParallel: the sharded optimizer state is read "
              "between iterations, not during a backward");
  FusedOptimizer* fused = fused_optimizer();
  TORCH_CHECK(fused && fused->sharded(),
              "Reducer: local_optimizer_state needs shard_optimizer_state");
  wait_idle(/*host_too=*/true);
  HostOffload* host = host_offload();
  std::vector<std::tuple<int64_t, std::string, at::Tensor>> out;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const Bucket& bucket = buckets_[b];
    const std::vector<at::Tensor>& buffers = fused->state_buffers(b, bucket);
    const bool masters = host != nullptr &&
                         params_[static_cast<size_t>(bucket.params[0])].scalar_type() != at::kFloat;
    // A master not made yet (no step, nothing loaded) is uninitialized memory: it is made now
    // from its parameter, as the first step would make it, so that a checkpoint saved before
    // the first step holds what training starts from. Every rank marks every parameter made
    // (master_made), also those it holds no piece of.
    for (size_t s = 0; masters && s < bucket.params.size(); ++s) {
      const auto p = static_cast<size_t>(bucket.params[s]);
      if (!host->master_made(p)) host->load_master(p, params_[p]);
    }
    for (const ShardPiece& piece : shard_.shards()[b].pieces) {
      const int64_t p = bucket.params[piece.slot];
      const std::vector<std::string> keys = fused->buffer_keys(static_cast<size_t>(p));
      for (size_t k = 0; k < keys.size(); ++k) {
        out.emplace_back(p, keys[k], buffers[k].narrow(0, piece.shard_offset, piece.numel));
      }
      if (masters) {
        out.emplace_back(p, "master_weight",
                         host->masters_block(b).narrow(0, piece.shard_offset, piece.numel));
      }
    }
  }
  return out;
}

std::vector<int64_t> Reducer::optimizer_steps() const {
  std::lock_guard<std::mutex> lock(mu_);
  wait_idle(/*host_too=*/false, /*order_device=*/false);  // (host counters)
  FusedOptimizer* fused = fused_optimizer();
  TORCH_CHECK(fused, "Reducer: no fused optimizer");
  std::vector<int64_t> out;
  for (size_t p = 0; p < params_.size(); ++p) out.push_back(fused->steps(p));
  return out;
}

void Reducer::set_optimizer_steps(const std::vector<int64_t>& steps) {
  std::lock_guard<std::mutex> lock(mu_);
  wait_idle(/*host_too=*/true);
  FusedOptimizer* fused = fused_optimizer();
  TORCH_CHECK(fused, "Reducer: no fused optimizer");
  TORCH_CHECK(steps.size() == params_.size(), "Reducer: ", steps.size(), " step counts for ",
              params_.size(), " parameters");
  for (size_t p = 0; p < params_.size(); ++p) {
    TORCH_CHECK(steps[p] >= 0, "leanddp.DistributedDataParallel: parameter ", names_[p],
                ": negative step count ", steps[p]);
  }
  for (size_t p = 0; p < params_.size(); ++p) fused->set_steps(p, steps[p]);
}

}  // namespace leanddp
