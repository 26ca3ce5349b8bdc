// The Reducer's buckets (see reducer.h): building them from an assignment, their storage
// allocated and released (bucket bytes held and their peak), rebuilding them once from the
// order in which gradients became ready, and what the Reducer reports (bucket indices and bytes,
// memory statistics, iterations, timings, unused parameters).
#include "reducer.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace leanddp {

void Reducer::build_buckets(const std::vector<std::vector<int64_t>>& assignment) {
  buckets_.clear();
  allocated_bytes_ = 0;
  allocated_buckets_ = 0;
  location_.assign(params_.size(), {0, 0});
  for (auto indices : assignment) {
    // Parameters quantized by blocks first, each then on a multiple of the block (ReducerOptions).
    std::stable_partition(indices.begin(), indices.end(),
                          [this](int64_t p) { return blocked_[static_cast<size_t>(p)]; });
    for (size_t s = 0; s < indices.size(); ++s) {
      location_[static_cast<size_t>(indices[s])] = {buckets_.size(), s};
    }
    const bool sparse = indices.size() == 1 && expects_sparse(static_cast<size_t>(indices[0]));
    buckets_.push_back(make_bucket(params_, indices, !options_.optimizer_in_backward, sparse));
    if (buckets_.back().allocated()) {
      allocated_bytes_ += buckets_.back().bytes();
      ++allocated_buckets_;
    }
  }
  // (shard_optimizer_state implies optimizer_in_backward: nothing is allocated yet)
  if (options_.shard_optimizer_state)
    shard_.cut_all(buckets_, *process_group_, options_.shard_block, blocked_);
}

void Reducer::ensure_allocated(size_t bucket_index) {
  Bucket& bucket = buckets_[bucket_index];
  if (bucket.allocated()) return;
  // Each slot is written before the bucket is read: a gradient copied or accumulated into its
  // view, or zeros at mark_ready for a parameter without one. So no zero fill here.
  at::Tensor storage;
  if (recycler_) {  // (the stream that writes the gradients waits for the buffer's last use)
    const at::Tensor& like = params_[static_cast<size_t>(bucket.params.front())];
    if (auto reused = recycler_->take(std::max(bucket.numel, bucket.padded_numel), like,
                                      current_stream(like.device()), allocated_buckets_)) {
      storage = std::move(reused->storage);
      if (reuses_.size() < 4 * buckets_.size()) {  // (bounded: no_sync() backwards add to it)
        reuses_.emplace_back(static_cast<int64_t>(bucket_index),
                             static_cast<int64_t>(reused->giver), reused->waits);
      }
    }
  }
  allocate_bucket(bucket, params_, /*zeroed=*/false, storage);
  allocated_bytes_ += bucket.bytes();
  ++allocated_buckets_;
  note_peak();
}

void Reducer::note_peak() {
  const int64_t recycled = recycler_ ? recycler_->bytes() : 0;
  peak_bucket_bytes_ =
      std::max(peak_bucket_bytes_, allocated_bytes_ + unfinished_bytes_ + recycled);
}

void Reducer::release(size_t bucket_index) {
  Bucket& bucket = buckets_[bucket_index];
  for (int64_t p : bucket.params) {
    params_[static_cast<size_t>(p)].mutable_grad().reset();
    grad_was_view_[static_cast<size_t>(p)] = 0;
    view_since_sync_[static_cast<size_t>(p)] = 0;
  }
  if (!bucket.allocated()) return;
  allocated_bytes_ -= bucket.bytes();
  --allocated_buckets_;
  release_bucket(bucket);
}

bool Reducer::rebuild_buckets() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!rebuild_due()) return false;
  check_open("rebuilding the buckets");
  wait_for_optimizer();  // the optimizer's state is relaid below (raises before any change)
  const size_t n = params_.size();
  std::vector<char> seen(n, 0);
  std::vector<int64_t> order;
  for (int64_t i : ready_order_) {
    if (!seen[static_cast<size_t>(i)]) order.push_back(i);
    seen[static_cast<size_t>(i)] = 1;
  }
  // Parameters without a gradient in that backward go last, in registration order (torch's).
  for (size_t i = 0; i < n; ++i) {
    if (!seen[i]) order.push_back(static_cast<int64_t>(i));
  }
  // Every rank adopts rank 0's order, so every rank launches the same buckets in the same order.
  at::Tensor shared = at::tensor(order, at::kLong).to(params_[0].device());
  std::vector<at::Tensor> tensors{shared};
  try {
    process_group_->broadcast(tensors)->wait();
  } catch (...) {
    rethrow_collective_error("broadcasting the gradient order from rank 0 (rebuilding buckets)");
  }
  const at::Tensor agreed = shared.cpu();
  order.assign(agreed.data_ptr<int64_t>(), agreed.data_ptr<int64_t>() + n);
  std::fill(seen.begin(), seen.end(), 0);
  for (int64_t i : order) {
    TORCH_CHECK(i >= 0 && static_cast<size_t>(i) < n && !seen[static_cast<size_t>(i)],
                "leanddp.DistributedDataParallel: ranks disagree on the parameters being "
                "trained (rank 0 sent an invalid gradient order); wrap the same model on every "
                "rank");
    seen[static_cast<size_t>(i)] = 1;
  }
  at::NoGradGuard no_grad;
  // (the optimizer's collectives and waits first: raises before the buckets change)
  if (optimizer_) optimizer_->begin_relayout();
  build_buckets(assign_buckets(params_, order, options_.caps_bytes, sparse_));
  if (recycler_) recycler_->clear();  // buffers cut for the old layout's bucket sizes
  // The state follows its parameters (sharded: from the old state begin_relayout() gathered).
  if (optimizer_) optimizer_->relayout(buckets_, shard_.shards());
  if (accumulator_) accumulator_->set_layout(buckets_);
  if (options_.gradient_as_bucket_view) {
    for (size_t i = 0; i < n; ++i) {
      at::Tensor& grad = params_[i].mutable_grad();
      if (!grad.defined() || expects_sparse(i)) continue;  // sparse: never a view
      const auto [b, s] = location_[i];
      ensure_allocated(b);
      buckets_[b].views[s].copy_(grad);
      grad = buckets_[b].views[s];
      grad_was_view_[i] = 1;
      view_since_sync_[i] = 1;
    }
  }
  reset_iteration_state();
  has_rebuilt_ = true;
  ready_order_.clear();
  tell_iteration();
  return true;
}

MemoryStats Reducer::memory_stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  MemoryStats stats;
  stats.num_buckets = static_cast<int64_t>(buckets_.size());
  stats.bucket_bytes = allocated_bytes_;
  if (HostAccumulator* acc = accumulator()) {
    stats.host_accumulation_bytes = acc->host_bytes();
    stats.host_pinned_bytes = acc->pinned_bytes();
  }
  stats.peak_bucket_bytes = peak_bucket_bytes_;
  stats.max_buckets_in_flight = max_in_flight_;
  stats.recycled_bucket_bytes = recycler_ ? recycler_->bytes() : 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& grad = params_[i].grad();
    if (!grad.defined()) continue;
    const auto [b, s] = location_[i];
    if (grad.is_sparse()) {
      ++stats.grads_outside;
      stats.grad_bytes += static_cast<int64_t>(grad._indices().nbytes() + grad._values().nbytes());
    } else if (buckets_[b].allocated() && is_view(grad, buckets_[b].views[s])) {
      ++stats.grads_as_views;
    } else {
      ++stats.grads_outside;
      stats.grad_bytes += static_cast<int64_t>(grad.nbytes());
    }
  }
  return stats;
}

std::vector<std::vector<int64_t>> Reducer::bucket_indices() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::vector<int64_t>> out;
  for (const Bucket& b : buckets_) out.push_back(b.params);
  return out;
}

std::vector<int64_t> Reducer::bucket_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int64_t> out;
  for (const Bucket& b : buckets_) {
    out.push_back(b.numel *
                  static_cast<int64_t>(params_[static_cast<size_t>(b.params[0])].element_size()));
  }
  return out;
}

bool Reducer::has_rebuilt_buckets() const {
  std::lock_guard<std::mutex> lock(mu_);
  return has_rebuilt_;
}

int64_t Reducer::num_iterations() const {
  std::lock_guard<std::mutex> lock(mu_);
  return iterations_;
}

IterationTimes Reducer::collect_times() {
  std::lock_guard<std::mutex> lock(mu_);
  return timer_.collect();
}

std::vector<int64_t> Reducer::unused_parameters() const {
  std::lock_guard<std::mutex> lock(mu_);
  return found_unused_;
}

}  // namespace leanddp
