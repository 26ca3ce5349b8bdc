// The Reducer's sparse buckets (see reducer.h): parameters whose gradients are sparse tensors
// (torch's expect_sparse_gradient: nn.Embedding/EmbeddingBag(sparse=True)). Each has a bucket of
// its own with no flat buffer; its gradient is never a view. As in torch's reducer, the gradient
// is divided in place by the world size and reduced with the process group's allreduce of the
// sparse tensor (gloo gathers every rank's indices and values and sums them), or handed to the
// communication hook as the bucket's buffer; the result is copied into param.grad.
//
// A sparse reduction runs alone on its process group. gloo runs a group's collectives on its
// worker threads (two by default), and its sparse allreduce (an allgather of metadata, then
// allgathers of indices and values) running beside another collective of the same group
// corrupts the heap or hangs now and then (torch 2.13 and 2.14.1, reproduced with torch's
// collectives alone: allreduces of a dense, two sparse and an int tensor issued together, a few
// thousand times). So the host waits for the buckets launched before a sparse one, and for the
// sparse one before the next launch. Only gloo reduces sparse tensors, and with it the host waits
// for every reduction before backward returns anyway; what is lost is the overlap of a sparse
// reduction with the others.
#include "reducer.h"

#include <c10/util/Exception.h>

namespace leanddp {
namespace {

// A sparse gradient with no entries, shaped like `param`, with the sparse and dense dimensions
// of an embedding's gradient (one sparse dimension): what a rank without a gradient contributes.
at::Tensor empty_sparse_like(const at::Tensor& param) {
  std::vector<int64_t> value_sizes{0};
  for (int64_t d = 1; d < param.dim(); ++d) value_sizes.push_back(param.size(d));
  const at::Tensor indices = at::empty({1, 0}, param.options().dtype(at::kLong));
  const at::Tensor values = at::empty(value_sizes, param.options());
  return at::sparse_coo_tensor(indices, values, param.sizes(),
                               values.options().layout(at::kSparse));
}

// The reduced tensor of a finished allreduce: the future's value where the backend sets one,
// else `input` (reduced in place).
at::Tensor reduced_result(c10d::Work& work, const at::Tensor& input) {
  try {
    const auto future = work.getFuture();
    if (future && future->completed() && !future->hasError()) {
      const c10::IValue& value = future->value();
      if (value.isTensorList()) {
        const auto tensors = value.toTensorVector();
        if (!tensors.empty() && tensors[0].defined()) return tensors[0];
      } else if (value.isTensor()) {
        return value.toTensor();
      }
    }
  } catch (const c10::Error&) {  // a backend without futures
  }
  return input;
}

std::string message_of(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) {
    return c10_error->what_without_backtrace();
  }
  return e.what();
}

}  // namespace

void Reducer::check_dense_grad(size_t index, const at::Tensor& grad) const {
  LEANDDP_USAGE_CHECK(!grad.is_sparse(), "leanddp.DistributedDataParallel: parameter ",
                      names_[index],
                      " received a sparse gradient, but only parameters of nn.Embedding and "
                      "nn.EmbeddingBag modules built with sparse=True are reduced as sparse "
                      "tensors (torch's DDP has the same rule); give this parameter dense "
                      "gradients.");
}

void Reducer::launch_sparse(size_t bucket_index) {
  for (size_t b = 0; b < bucket_index; ++b) {
    if (!collected_[b]) settle(b);  // alone on the process group (see the top of this file)
  }
  Bucket& bucket = buckets_[bucket_index];
  const auto p = static_cast<size_t>(bucket.params.at(0));
  at::Tensor grad = params_[p].grad();
  if (!grad.defined()) {
    grad = empty_sparse_like(params_[p]);  // no gradient on this rank: contribute nothing
  } else {
    LEANDDP_USAGE_CHECK(
        grad.is_sparse(), "leanddp.DistributedDataParallel: parameter ", names_[p],
        " belongs to a module with sparse=True, so its gradient is reduced as a sparse "
        "tensor, but param.grad holds a ",
        grad.layout(),
        " tensor (was it replaced?). Leave the gradient autograd produced, or set it to "
        "None.");
  }
  if (!comm_hook_) grad.div_(div_factor_);  // in place, as torch's reducer does
  bucket.sparse_grad = grad;
  if (comm_hook_) {
    comm_hook_->launch(bucket_index, buckets_.size(), grad, bucket.params, {}, {});
    settle(bucket_index);
    return;
  }
  std::vector<at::Tensor> tensors{grad};
  try {
    works_[bucket_index] = process_group_->allreduce(tensors);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "leanddp.DistributedDataParallel: rank ", rank_, ": the process group (",
                process_group_->getBackendName(),
                ") could not start the reduction of the sparse gradient of ", names_[p],
                " (a module with sparse=True): ", message_of(e),
                ". As torch's DDP, leanddp reduces sparse gradients with the process group's "
                "allreduce of sparse tensors, which gloo implements and NCCL does not; build the "
                "module with sparse=False, or train with a gloo process group.");
  }
  settle(bucket_index);
}

void Reducer::collect_sparse(size_t bucket_index) {
  Bucket& bucket = buckets_[bucket_index];
  const auto p = static_cast<size_t>(bucket.params.at(0));
  at::Tensor result;
  try {
    if (comm_hook_) {
      result = comm_hook_->wait(bucket_index);
    } else {
      works_[bucket_index]->wait();
      result = reduced_result(*works_[bucket_index], bucket.sparse_grad);
    }
  } catch (...) {
    rethrow_collective_error("the reduction of the sparse gradient of " + names_[p] + " (bucket " +
                             std::to_string(bucket_index) + ")");
  }
  works_[bucket_index].reset();
  futures_[bucket_index].reset();
  const c10::Device device = params_[p].device();
  if (comm_hook_ && events_) {
    // As for dense buckets: a future without CUDA events (gloo's) was completed once its thread
    // had ordered the device's default stream after the result; the current stream follows it.
    stream_wait(current_stream(device), default_stream(device), *events_);
  }
  TORCH_CHECK(result.defined() && result.is_sparse() && result.sizes() == params_[p].sizes(),
              "leanddp.DistributedDataParallel: the communication hook returned ",
              result.defined() ? result.toString() : std::string("an undefined tensor"),
              " for the sparse gradient of ", names_[p], " (bucket ", bucket_index,
              "); a hook's future must hold a sparse tensor shaped like the parameter ",
              params_[p].sizes(), " for a sparse bucket (torch's allreduce hook does).");
  if (runs_apart(device) && !result.is_same(bucket.sparse_grad)) {
    // The result may come from another stream's memory: keep it until this stream's copy into
    // param.grad ran (write_sparse_grad).
    record_on_stream(result._indices(), current_stream(device));
    record_on_stream(result._values(), current_stream(device));
  }
  bucket.sparse_grad = result;
  collected_[bucket_index] = 1;
}

void Reducer::write_sparse_grad(size_t bucket_index, const std::vector<int32_t>& used) {
  Bucket& bucket = buckets_[bucket_index];
  const auto p = static_cast<size_t>(bucket.params.at(0));
  if (used[p]) {  // globally unused: grad left as it was (None stays None)
    at::Tensor& grad = params_[p].mutable_grad();
    if (!grad.defined()) {
      grad = bucket.sparse_grad;
    } else if (!grad.is_same(bucket.sparse_grad)) {
      grad.copy_(bucket.sparse_grad);
    }
  }
  bucket.sparse_grad = at::Tensor();
}

}  // namespace leanddp
