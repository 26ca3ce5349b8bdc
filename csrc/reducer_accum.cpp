// The Reducer's accumulate_on_host paths (offload_to_cpu): no_sync() micro-batches' gradients
// summed on the host, bucket by bucket, and added back at the synchronized micro-batch
// (host_accumulator.h has the data flow and why the result is torch's, bit for bit). See reducer.h.
#include "op_calls.h"
#include "reducer.h"

#include <torch/csrc/autograd/engine.h>

namespace leanddp {

void Reducer::accumulate_locally(size_t index) {
  if (!local_callback_queued_) {
    local_callback_queued_ = true;
    local_pending_.clear();
    for (const Bucket& bucket : buckets_) local_pending_.push_back(bucket.params.size());
    torch::autograd::Engine::get_default_engine().queue_callback([this] { finish_local(); });
  }
  const size_t b = location_[index].first;
  if (local_pending_[b] > 0 && --local_pending_[b] == 0) flush_local(b);
}

void Reducer::flush_local(size_t b) {
  Bucket& bucket = buckets_[b];
  bool any = false;
  for (int64_t p : bucket.params) any = any || params_[static_cast<size_t>(p)].grad().defined();
  if (!any) return;
  ensure_allocated(b);
  std::vector<at::Tensor> sources;
  for (size_t s = 0; s < bucket.params.size(); ++s) {
    const auto p = static_cast<size_t>(bucket.params[s]);
    const at::Tensor& grad = params_[p].grad();
    if (grad.defined()) {
      check_dense_grad(p, grad);
      sources.push_back(in_memory_order_of(grad, bucket.views[s]));
    } else {
      bucket.views[s].zero_();  // no gradient in this micro-batch: its sum is unchanged
      sources.push_back(bucket.views[s]);
    }
  }
  flatten_into(sources, bucket.flat, std::nullopt);
  accumulator()->add(b, bucket.flat);  // (records the bucket's memory on the copy's stream)
  release(b);                          // every param.grad of the bucket is None again
}

void Reducer::finish_local() {
  at::NoGradGuard no_grad;
  std::lock_guard<std::mutex> lock(mu_);
  if (!local_callback_queued_) return;  // (flushed by the forward after a backward that raised)
  local_callback_queued_ = false;
  if (!accumulator()) return;  // closed
  for (size_t b = 0; b < buckets_.size(); ++b) flush_local(b);
}

c10::Stream Reducer::sum_stream(size_t b) {
  // The sum's stream starts after this micro-batch's gradients (and the bucket's zeroed slots)
  // are final on the compute stream; it reads those gradients, which the caller drops.
  const Bucket& bucket = buckets_[b];
  const c10::Stream stream = accumulator()->stream();
  stream_wait(stream, current_stream(bucket.flat.device()), *events_);
  for (int64_t p : bucket.params) {
    const at::Tensor& src = sources_[static_cast<size_t>(p)];
    if (src.defined()) record_on_stream(src, stream);
  }
  return stream;
}

void Reducer::add_host_sum(size_t b, std::optional<double> scale) {
  Bucket& bucket = buckets_[b];
  accumulator()->take(b, bucket.flat);  // every slot: the sum of the no_sync() micro-batches
  // `sum + new` is torch's `partial + new` (addition commutes); the other slots keep the sum.
  for (size_t s = 0; s < bucket.params.size(); ++s) {
    const at::Tensor& src = sources_[static_cast<size_t>(bucket.params[s])];
    if (src.defined()) bucket.views[s].add_(src);
  }
  // torch copies the accumulated gradient into its bucket times 1/world (at::mul_out).
  if (scale) bucket.flat.mul_(*scale);
}

void Reducer::discard_host_gradients() {
  std::lock_guard<std::mutex> lock(mu_);
  if (HostAccumulator* acc = accumulator()) acc->discard();
}

}  // namespace leanddp
