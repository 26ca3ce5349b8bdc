// check_for_nan_in_grad (see non_finite_check.h and docs/reliability.md).
#include "non_finite_check.h"

#include "errors.h"

#include <c10/util/Exception.h>

#include <limits>
#include <sstream>

namespace leanddp {
namespace {

// The first slot of bucket `index` in the per-parameter flags (buckets in order, slot order).
int64_t slot_base(const std::vector<Bucket>& buckets, size_t index) {
  int64_t base = 0;
  for (size_t b = 0; b < index; ++b) base += static_cast<int64_t>(buckets[b].params.size());
  return base;
}

}  // namespace

void NonFiniteCheck::reset(size_t num_buckets) {
  bucket_ = -1;
  params_.clear();
  checked_.assign(num_buckets, 0);
  armed_ = false;
}

void NonFiniteCheck::check(const std::vector<Bucket>& buckets, const std::vector<size_t>& indices) {
  std::vector<size_t> unchecked;
  for (size_t b : indices) {
    if (!checked_[b]) unchecked.push_back(b);
  }
  if (bucket_ >= 0 || unchecked.empty()) return;
  std::vector<at::Tensor> flags;
  for (size_t b : unchecked) {
    const Bucket& bucket = buckets[b];
    const at::Tensor& values = bucket.sparse ? bucket.sparse_grad._values() : bucket.flat;
    flags.push_back(at::isfinite(values).all());
  }
  const at::Tensor finite = at::stack(flags).cpu();
  const bool* is_finite = finite.data_ptr<bool>();
  for (size_t k = 0; k < unchecked.size(); ++k) {
    if (is_finite[k]) {
      checked_[unchecked[k]] = 1;
      continue;
    }
    const Bucket& bucket = buckets[unchecked[k]];
    bucket_ = static_cast<int64_t>(unchecked[k]);
    for (size_t s = 0; s < bucket.params.size(); ++s) {
      if (bucket.sparse || !at::isfinite(bucket.views[s]).all().item<bool>())
        params_.push_back(bucket.params[s]);
    }
    return;
  }
}

void NonFiniteCheck::flag(const std::vector<Bucket>& buckets, size_t index, size_t num_params) {
  const Bucket& bucket = buckets[index];
  const auto options = at::TensorOptions(at::kFloat).device(bucket.flat.device());
  if (!armed_) {
    // The last backward's flags were read at its end: nothing reads them any more.
    const auto n = static_cast<int64_t>(num_params);
    if (!flags_.defined() || flags_.device() != options.device()) {
      flags_ = at::zeros({n}, options);
      seen_ = at::zeros({}, options);
    } else {
      flags_.zero_();
      seen_.zero_();
    }
    gated_.assign(buckets.size(), {});
    armed_ = true;
  }
  // The largest magnitude of each gradient: NaN or inf exactly where it holds one (a norm of
  // squares could overflow); one foreach call for the bucket, whose views share one dtype. An
  // empty view (which has no largest magnitude) counts as finite.
  std::vector<at::Tensor> views;
  for (const at::Tensor& view : bucket.views) {
    if (view.numel() > 0) views.push_back(view);
  }
  std::vector<at::Tensor> largest;
  if (!views.empty()) largest = at::_foreach_norm(views, std::numeric_limits<double>::infinity());
  if (largest.size() < bucket.views.size()) {
    std::vector<at::Tensor> per_slot;
    size_t k = 0;
    for (const at::Tensor& view : bucket.views) {
      per_slot.push_back(view.numel() > 0 ? largest[k++] : at::zeros({}, view.options()));
    }
    largest = std::move(per_slot);
  }
  const at::Tensor bad = at::stack(largest).isfinite().logical_not().to(at::kFloat);
  flags_.narrow(0, slot_base(buckets, index), bad.numel()).copy_(bad);
  seen_.clamp_min_(bad.amax());
}

std::vector<int64_t> NonFiniteCheck::read_flags(const std::vector<Bucket>& buckets) {
  std::vector<int64_t> skipped;
  if (!armed_) return skipped;
  armed_ = false;
  const at::Tensor flags = flags_.cpu();  // the check's one host synchronization
  const float* bad = flags.const_data_ptr<float>();
  int64_t base = 0;
  for (size_t b = 0; b < buckets.size() && bucket_ < 0; ++b) {
    const Bucket& bucket = buckets[b];
    for (size_t s = 0; s < bucket.params.size(); ++s) {
      if (bad[base + static_cast<int64_t>(s)] != 0.0f) {
        bucket_ = static_cast<int64_t>(b);
        params_.push_back(bucket.params[s]);
      }
    }
    base += static_cast<int64_t>(bucket.params.size());
  }
  if (bucket_ < 0) return skipped;
  // The kernels of this bucket and of every later one saw found_inf set and left their
  // parameters and state as they were: their step counts go back too.
  for (size_t b = static_cast<size_t>(bucket_); b < gated_.size(); ++b) {
    skipped.insert(skipped.end(), gated_[b].begin(), gated_[b].end());
  }
  return skipped;
}

void NonFiniteCheck::raise(const std::vector<std::string>& names,
                           const std::vector<Bucket>& buckets, const std::vector<int32_t>& used,
                           bool earlier_stepped) const {
  std::ostringstream msg;
  msg << "leanddp.DistributedDataParallel: check_for_nan_in_grad: the reduced gradient of "
      << join_names(names, params_) << " holds NaN or infinity (bucket " << bucket_
      << "; the reduction is the same on every rank, so every rank raises this error).";
  if (!optimizer_in_backward_) {
    msg << " No weight was changed (optimizer.step() has not run); the gradients hold the "
           "reduced values.";
  } else {
    // Buckets are stepped in order, each checked first: those before the bad one were stepped,
    // unless the steps wait for the end of backward (offload_to_cpu holds them; strict defers).
    std::vector<int64_t> stepped;
    if (earlier_stepped) {
      for (int64_t b = 0; b < bucket_; ++b) {
        for (int64_t p : buckets[static_cast<size_t>(b)].params) {
          if (used[static_cast<size_t>(p)]) stepped.push_back(p);
        }
      }
    }
    if (stepped.empty()) {
      msg << " No weight was changed: this step's gradients were dropped.";
    } else {
      msg << " optimizer_in_backward had already stepped the buckets reduced before it: "
          << stepped.size() << " parameters (" << join_names(names, stepped)
          << ") keep this step's update; no other parameter was stepped, and this step's other "
             "gradients were dropped. check_for_nan_in_grad='strict' defers the steps to the "
             "end of backward so that no weight changes, at the cost of holding every gradient "
             "bucket until then.";
    }
  }
  TORCH_CHECK(false, msg.str());
}

}  // namespace leanddp
