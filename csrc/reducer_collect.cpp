// The Reducer's reduced buckets (see reducer.h): waiting for a bucket's reduction (its work, or
// the communication hook's future), leaving the averaged result in its flat buffer, and writing
// it into the gradients when no optimizer steps inside backward. Sparse buckets:
// reducer_sparse.cpp.
#include "reducer.h"

#include "op_calls.h"

#include <c10/util/Exception.h>

namespace leanddp {

void Reducer::settle(size_t bucket_index) {
  try {
    if (comm_hook_) {
      comm_hook_->settle(bucket_index);
    } else if (works_[bucket_index]) {
      works_[bucket_index]->wait();
    }
  } catch (...) {
    rethrow_collective_error(reduction_of(bucket_index));
  }
}

std::string Reducer::reduction_of(size_t bucket_index) const {
  return "the reduction of bucket " + std::to_string(bucket_index) + " (" +
         join_names(names_, buckets_[bucket_index].params) + ")";
}

void Reducer::collect_reduced(size_t index) {
  if (collected_[index]) return;
  if (buckets_[index].sparse) return collect_sparse(index);
  Bucket& bucket = buckets_[index];
  at::Tensor result;
  if (comm_hook_) {
    try {
      result = comm_hook_->wait(index);
    } catch (...) {
      rethrow_collective_error(reduction_of(index));
    }
  } else {
    settle(index);
  }
  // The work (and its future) hold the bucket's memory: drop them, so that releasing the bucket
  // frees it. NCCL's wait has released its own hold already (ordered by the wait).
  works_[index].reset();
  futures_[index].reset();
  if (comm_hook_ && events_) {
    // A future without CUDA events (gloo's) was completed once its thread had ordered the
    // device's default stream after the result: the current stream follows that stream too.
    const c10::Device device = bucket.flat.device();
    stream_wait(current_stream(device), default_stream(device), *events_);
  }
  if (comm_hook_) {
    TORCH_CHECK(result.numel() == bucket.flat.numel(),
                "leanddp.DistributedDataParallel: the communication hook returned a tensor of ",
                result.numel(), " elements for bucket ", index, " of ", bucket.flat.numel());
    if (!result.is_same(bucket.flat)) {
      bucket.flat.copy_(result.reshape({-1}));
      // The result may come from another stream's memory: keep it until this stream's copy ran.
      if (runs_apart(result.device())) record_on_stream(result, current_stream(result.device()));
    }
  }
  collected_[index] = 1;
}

void Reducer::write_reduced_grads(size_t bucket_index, const std::vector<int32_t>& used) {
  Bucket& bucket = buckets_[bucket_index];
  if (bucket.sparse) return write_sparse_grad(bucket_index, used);
  if (options_.gradient_as_bucket_view) {
    for (size_t s = 0; s < bucket.params.size(); ++s) {
      const auto p = static_cast<size_t>(bucket.params[s]);
      if (!used[p]) continue;  // globally unused: grad left as it was (None stays None)
      at::Tensor& grad = params_[p].mutable_grad();
      if (!is_view(grad, bucket.views[s])) {
        grad = bucket.views[s];
        grad_was_view_[p] = 1;
      }
      view_since_sync_[p] = 1;
    }
    return;
  }
  std::vector<at::Tensor> grads;
  bool all_used = true;
  for (size_t s = 0; s < bucket.params.size(); ++s) {
    const auto p = static_cast<size_t>(bucket.params[s]);
    at::Tensor& grad = params_[p].mutable_grad();
    if (used[p] && !grad.defined()) grad = at::empty_like(params_[p]);
    all_used = all_used && used[p];
    grads.push_back(grad);
  }
  if (all_used) {
    // One pass for the whole bucket, each slice read in its view's memory order.
    std::vector<at::Tensor> targets;
    targets.reserve(grads.size());
    for (size_t s = 0; s < grads.size(); ++s) {
      targets.push_back(in_memory_order_of(grads[s], bucket.views[s]));
    }
    unflatten_from(bucket.flat, targets);
    return;
  }
  for (size_t s = 0; s < bucket.params.size(); ++s) {
    if (used[static_cast<size_t>(bucket.params[s])]) grads[s].copy_(bucket.views[s]);
  }
}

}  // namespace leanddp
