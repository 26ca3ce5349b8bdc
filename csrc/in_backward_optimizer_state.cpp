// InBackwardOptimizer's state in torch's format (see in_backward_optimizer.h): per parameter,
// gathered from the shards, shard by shard for checkpoints that stay sharded, step counts and
// master weights.
#include "in_backward_optimizer.h"

#include "errors.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>

namespace leanddp {

void InBackwardOptimizer::check_param(size_t p) const {
  TORCH_CHECK(p < params_.size(), "InBackwardOptimizer: no parameter ", p);
}

void InBackwardOptimizer::check_open(const char* what) const {
  TORCH_CHECK(group_, "leanddp.DistributedDataParallel: ", what,
              " after the wrapper was closed (at interpreter exit, or when it was collected): "
              "it no longer holds its process group");
}

void InBackwardOptimizer::check_idle(const char* what) const {
  TORCH_CHECK(!armed_ && !in_backward_, "leanddp.DistributedDataParallel: ", what,
              " happens between iterations, not during a backward");
}

FusedOptimizer& InBackwardOptimizer::fused(const char* what) const {
  FusedOptimizer* fused = steps_->optimizer();
  TORCH_CHECK(fused, "InBackwardOptimizer: ", what, " needs the fused optimizer");
  return *fused;
}

std::vector<std::pair<std::string, at::Tensor>> InBackwardOptimizer::state(size_t p) {
  std::lock_guard<std::mutex> lock(mu_);
  check_param(p);
  wait_locked(/*host_too=*/false, /*order_device=*/true);
  FusedOptimizer* fused = steps_->optimizer();
  if (!fused || !fused->can_step(p) || location_.empty()) return {};
  const auto [b, s] = location_[p];
  auto state = fused->state(p, b, layout_[b], s);
  if (host_ && host_->master(p).defined()) {  // (a master alone: SGD without momentum)
    state.emplace_back("master_weight", host_->master(p));
  }
  return state;
}

void InBackwardOptimizer::load_state(size_t p, int64_t step,
                                     const std::vector<at::Tensor>& values) {
  at::NoGradGuard no_grad;
  std::lock_guard<std::mutex> lock(mu_);
  check_param(p);
  wait_locked(/*host_too=*/false, /*order_device=*/true);
  FusedOptimizer* fused = steps_->optimizer();
  TORCH_CHECK(fused && fused->can_step(p), "InBackwardOptimizer: parameter ", names_[p],
              " is not stepped by the fused optimizer");
  const auto [b, s] = location_[p];
  fused->load_state(p, b, layout_[b], s, step, values);
}

void InBackwardOptimizer::load_master_weight(size_t p, const at::Tensor& value) {
  at::NoGradGuard no_grad;
  std::lock_guard<std::mutex> lock(mu_);
  check_param(p);
  TORCH_CHECK(host_, "InBackwardOptimizer: master weights exist only with offload_to_cpu");
  wait_locked(/*host_too=*/true, /*order_device=*/true);
  host_->load_master(p, value);
}

void InBackwardOptimizer::adopt_master_weights() {
  std::lock_guard<std::mutex> lock(mu_);
  TORCH_CHECK(host_, "InBackwardOptimizer: master weights exist only with offload_to_cpu");
  wait_locked(/*host_too=*/true, /*order_device=*/true);
  host_->adopt_masters();
}

int64_t InBackwardOptimizer::generation() {
  std::lock_guard<std::mutex> lock(mu_);
  // (reads host counters only, which only steps change: no wait where none is pending, such as
  // while the worker sums no_sync() micro-batches)
  if (!host_ || !host_->pending().empty()) {
    wait_locked(/*host_too=*/false, /*order_device=*/false);
  }
  return steps_->generation();
}

std::vector<at::Tensor> InBackwardOptimizer::gather_state(const std::vector<Bucket>& layout,
                                                          const std::vector<ShardLayout>& shards,
                                                          size_t index) {
  FusedOptimizer& fused = *steps_->optimizer();
  std::vector<at::Tensor> local = fused.state_buffers(index, layout[index]);
  const size_t buffers = local.size();
  // offload_to_cpu: a low-precision bucket's float32 masters too (last).
  if (host_ && low_precision(layout[index])) local.push_back(host_->masters_block(index));
  // Gathered on the parameters' device (the process group's), each buffer in turn, then kept
  // where the state lives (the host, with offload_to_cpu). A shard_numel-long buffer gathers
  // into the padded bucket, shard by shard.
  const c10::Device device = params_.front().device();
  const int64_t world = shards[index].world();
  std::vector<at::Tensor> gathered;
  for (const at::Tensor& mine : local) {
    at::Tensor all = at::empty({world * mine.numel()}, mine.options().device(device));
    if (mine.numel() == 0) {  // (as long on every rank: none gathers)
      gathered.push_back(all.to(mine.device()));
      continue;
    }
    try {
      gather_equal(group_, all, mine.to(device))->wait();
    } catch (...) {
      rethrow_collective_error(group_->getRank(),
                               "gathering the optimizer state of bucket " + std::to_string(index));
    }
    gathered.push_back(mine.device() == device ? std::move(all) : all.to(mine.device()));
  }
  std::vector<at::Tensor> masters(gathered.begin() + static_cast<std::ptrdiff_t>(buffers),
                                  gathered.end());
  gathered.resize(buffers);
  std::vector<at::Tensor> whole = fused.whole_state(index, layout[index], std::move(gathered));
  whole.insert(whole.end(), masters.begin(), masters.end());
  return whole;
}

std::vector<std::vector<std::pair<std::string, at::Tensor>>> InBackwardOptimizer::gathered_state() {
  at::NoGradGuard no_grad;
  std::lock_guard<std::mutex> lock(mu_);
  check_open("gathering the sharded optimizer state");
  check_idle("gathering the sharded optimizer state");
  FusedOptimizer& fused = this->fused("gathered_state");
  TORCH_CHECK(fused.sharded(), "InBackwardOptimizer: gathered_state needs shard_optimizer_state");
  wait_locked(/*host_too=*/true, /*order_device=*/true);
  std::vector<std::vector<std::pair<std::string, at::Tensor>>> out(params_.size());
  for (size_t b = 0; b < layout_.size(); ++b) {
    const std::vector<at::Tensor> full = gather_state(layout_, shards_, b);
    const Bucket& bucket = layout_[b];
    auto entries = fused.state_from(bucket, full);
    for (size_t s = 0; s < bucket.params.size(); ++s) {
      const auto p = static_cast<size_t>(bucket.params[s]);
      out[p] = std::move(entries[s]);
      const at::Tensor& param = params_[p];
      // (a master alone too: SGD without momentum)
      if (host_ && param.scalar_type() != at::kFloat && host_->master_made(p)) {
        out[p].emplace_back("master_weight", slice_like(full.back(), bucket.offsets[s], param));
      }
    }
  }
  return out;
}

std::vector<std::vector<std::array<int64_t, 3>>> InBackwardOptimizer::shard_placement() {
  std::lock_guard<std::mutex> lock(mu_);
  TORCH_CHECK(options_.sharded, "InBackwardOptimizer: shard_placement needs shard_optimizer_state");
  check_open("reading the shard placement");
  const int64_t world = group_->getSize();
  TORCH_CHECK(shards_.size() == layout_.size(), "InBackwardOptimizer: no shards yet");
  std::vector<std::vector<std::array<int64_t, 3>>> out(params_.size());
  for (size_t b = 0; b < layout_.size(); ++b) {
    const Bucket& bucket = layout_[b];
    for (int64_t r = 0; r < world; ++r) {
      for (const ShardPiece& piece : recut(bucket, params_, shards_[b], r).pieces) {
        out[static_cast<size_t>(bucket.params[piece.slot])].push_back(
            {r, piece.slot_offset, piece.numel});
      }
    }
  }
  return out;
}

std::vector<std::tuple<int64_t, std::string, at::Tensor>> InBackwardOptimizer::local_state() {
  at::NoGradGuard no_grad;  // (masters made from the parameters)
  std::lock_guard<std::mutex> lock(mu_);
  check_idle("reading the sharded optimizer state");
  FusedOptimizer& fused = this->fused("local_state");
  TORCH_CHECK(fused.sharded(), "InBackwardOptimizer: local_state needs shard_optimizer_state");
  wait_locked(/*host_too=*/true, /*order_device=*/true);
  std::vector<std::tuple<int64_t, std::string, at::Tensor>> out;
  for (size_t b = 0; b < layout_.size(); ++b) {
    const Bucket& bucket = layout_[b];
    const bool masters = host_ != nullptr && low_precision(bucket);
    // A master not made yet (no step, nothing loaded) is uninitialized memory: it is made now
    // from its parameter, as the first step would make it, so that a checkpoint saved before
    // the first step holds what training starts from. Every rank marks every parameter made
    // (master_made), also those it holds no piece of.
    for (size_t s = 0; masters && s < bucket.params.size(); ++s) {
      const auto p = static_cast<size_t>(bucket.params[s]);
      if (!host_->master_made(p)) host_->load_master(p, params_[p]);
    }
    for (auto& entry : fused.shard_state(b, bucket)) out.push_back(std::move(entry));
    for (const ShardPiece& piece : shards_[b].pieces) {
      if (!masters) break;
      out.emplace_back(bucket.params[piece.slot], "master_weight",
                       host_->masters_block(b).narrow(0, piece.shard_offset, piece.numel));
    }
  }
  return out;
}

std::vector<int64_t> InBackwardOptimizer::steps() {
  std::lock_guard<std::mutex> lock(mu_);
  wait_locked(/*host_too=*/false, /*order_device=*/false);  // (host counters)
  FusedOptimizer& fused = this->fused("steps");
  std::vector<int64_t> out;
  for (size_t p = 0; p < params_.size(); ++p) out.push_back(fused.steps(p));
  return out;
}

void InBackwardOptimizer::set_steps(const std::vector<int64_t>& steps) {
  std::lock_guard<std::mutex> lock(mu_);
  wait_locked(/*host_too=*/true, /*order_device=*/true);
  FusedOptimizer& fused = this->fused("set_steps");
  TORCH_CHECK(steps.size() == params_.size(), "InBackwardOptimizer: ", steps.size(),
              " step counts for ", params_.size(), " parameters");
  for (size_t p = 0; p < params_.size(); ++p) {
    TORCH_CHECK(steps[p] >= 0, "leanddp.DistributedDataParallel: parameter ", names_[p],
                ": negative step count ", steps[p]);
  }
  for (size_t p = 0; p < params_.size(); ++p) fused.set_steps(p, steps[p]);
}

}  // namespace leanddp
