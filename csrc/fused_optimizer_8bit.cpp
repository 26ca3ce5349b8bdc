// FusedOptimizer's 8-bit state (OptimKind::kAdam8bit: torchao's AdamW8bit / Adam8bit), see
// fused_optimizer.h: the layout of a bucket's six buffers, its step through adam8bit_step_,
// its entries in torch's format and its moves when the buckets are rebuilt.
#include "fused_optimizer.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/variable.h>

#include <map>
#include <optional>
#include <utility>

namespace leanddp {
namespace {

using OptTensor = std::optional<at::Tensor>;

// The buffers of a bucket's 8-bit state, in flats_ order.
enum Buffer8 : size_t { kCodesM, kCodesV, kScaleM, kScaleV, kPlainM, kPlainV };

void adam8_step(at::TensorList params, at::TensorList grads, at::TensorList m, at::TensorList v,
                at::TensorList scale_m, at::TensorList scale_v, at::TensorList copies,
                const Quant8& quant, const OptimHyper& h, int64_t step, const StepTargets& t) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("leanddp::adam8bit_step_", "")
          .typed<void(at::TensorList, at::TensorList, at::TensorList, at::TensorList,
                      at::TensorList, at::TensorList, at::TensorList, const at::Tensor&,
                      const at::Tensor&, double, double, double, double, double, int64_t, bool,
                      std::optional<double>, const OptTensor&)>();
  op.call(params, grads, m, v, scale_m, scale_v, copies, quant.qmap_signed, quant.qmap_unsigned,
          h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, step, h.decoupled, t.grad_scale,
          t.found_inf.defined() ? OptTensor(t.found_inf) : std::nullopt);
}

}  // namespace

FusedOptimizer::Layout8 FusedOptimizer::layout8(const Bucket& bucket) const {
  Layout8 out;
  for (int64_t p : bucket.params) {
    const at::Tensor& param = params_[static_cast<size_t>(p)];
    const int64_t numel = param.numel();
    const bool quantized =
        state_spec(kind_, param, on_host_, /*momentum=*/false, quant_.block).quantized;
    out.quantized.push_back(quantized);
    if (!can_step(static_cast<size_t>(p))) {  // (stepped by the fallback, which keeps its state)
      out.at.push_back(-1);
      out.scale_at.push_back(-1);
      continue;
    }
    out.at.push_back(quantized ? out.codes : out.plain);
    out.scale_at.push_back(quantized ? out.scales : -1);
    if (quantized) {
      out.codes += numel;
      out.scales += numel / quant_.block;
    } else {
      out.plain += numel;
    }
  }
  return out;
}

void FusedOptimizer::ensure_state8(size_t index, const Bucket& bucket) {
  TORCH_CHECK(!sharded(), "FusedOptimizer: the 8-bit state is not sharded");
  if (layouts8_.size() <= index) layouts8_.resize(index + 1);
  layouts8_[index] = layout8(bucket);
  const Layout8& layout = layouts8_[index];
  auto& flats = flats_[index];
  flats.clear();
  // Zero codes with zero scales dequantize to zero moments, as torchao's fresh state does.
  for (int k = 0; k < 2; ++k)
    flats.push_back(at::zeros({layout.codes}, state_options_.dtype(at::kByte)));
  for (int k = 0; k < 2; ++k)
    flats.push_back(at::zeros({layout.scales}, state_options_.dtype(at::kFloat)));
  for (int k = 0; k < 2; ++k) {
    flats.push_back(at::zeros({layout.plain}, state_options_.dtype(state_dtype(bucket))));
  }
  ++generation_;
}

std::vector<at::Tensor> FusedOptimizer::pieces8(const std::vector<at::Tensor>& flats,
                                                const Layout8& layout, const Bucket& bucket,
                                                size_t slot) const {
  TORCH_CHECK(layout.at[slot] >= 0, "FusedOptimizer: slot ", slot,
              " is not stepped by the 8-bit kernels");
  const int64_t numel = params_[static_cast<size_t>(bucket.params[slot])].numel();
  const int64_t at = layout.at[slot];
  if (!layout.quantized[slot]) {
    return {flats[kPlainM].narrow(0, at, numel), flats[kPlainV].narrow(0, at, numel)};
  }
  const int64_t blocks = numel / quant_.block;
  const int64_t scale_at = layout.scale_at[slot];
  return {flats[kCodesM].narrow(0, at, numel), flats[kCodesV].narrow(0, at, numel),
          flats[kScaleM].narrow(0, scale_at, blocks), flats[kScaleV].narrow(0, scale_at, blocks)};
}

void FusedOptimizer::step8(size_t index, const Bucket& bucket, const std::vector<char>& mask,
                           const StepTargets& targets) {
  TORCH_CHECK(!targets.amp_scale.defined(),
              "FusedOptimizer: the 8-bit kernels take no GradScaler scale");
  TORCH_CHECK(targets.copies.empty() || targets.copies.size() == mask.size(),
              "FusedOptimizer: one low-precision copy per slot, or none");
  ensure_state(index, bucket, kBuffers8);
  const auto& flats = flats_[index];
  const Layout8& layout = layouts8_[index];
  const at::Tensor no_scale = at::empty({0}, state_options_.dtype(at::kFloat));
  // Members sharing a group and a step count are stepped by one kernel launch.
  std::map<std::pair<int64_t, int64_t>, std::vector<size_t>> calls;
  for (size_t s = 0; s < mask.size(); ++s) {
    if (!mask[s]) continue;
    const auto p = static_cast<size_t>(bucket.params[s]);
    calls[{group_of_[p], steps_[p] + 1}].push_back(s);
  }
  for (const auto& [key, slots] : calls) {
    const OptimHyper& h = groups_[static_cast<size_t>(key.first)];
    std::vector<at::Tensor> params, grads, m, v, scale_m, scale_v, copies;
    for (size_t s : slots) {
      const at::Tensor& param = targets.params[s];
      std::vector<at::Tensor> state = pieces8(flats, layout, bucket, s);
      params.push_back(param);
      grads.push_back(targets.grads[s]);
      m.push_back(state[0].view(param.sizes()));
      v.push_back(state[1].view(param.sizes()));
      scale_m.push_back(state.size() > 2 ? state[2] : no_scale);
      scale_v.push_back(state.size() > 2 ? state[3] : no_scale);
      if (!targets.copies.empty() && targets.copies[s].defined()) {
        copies.push_back(targets.copies[s]);
      }
    }
    TORCH_CHECK(copies.empty() || copies.size() == params.size(),
                "FusedOptimizer: low-precision copies for some members of a call only");
    adam8_step(params, grads, m, v, scale_m, scale_v, copies, quant_, h, key.second, targets);
  }
  // Every masked member counts the step; torchao's counts are float32 tensors on the CPU. With
  // found_inf beside them (training on the CPU) a skipped step's count is taken back here, as
  // step() does for Adam; else unstep() takes it back once the flags are read.
  std::vector<at::Tensor> counters, beside;
  for (size_t s = 0; s < mask.size(); ++s) {
    if (!mask[s]) continue;
    const auto p = static_cast<size_t>(bucket.params[s]);
    // As torch's in-place ops do (see step()).
    torch::autograd::impl::bump_version(targets.params[s]);
    if (steps_[p]++ == 0) ++generation_;  // a parameter's state appears
    at::Tensor& count = step_tensors_[p];
    if (!count.defined()) count = at::zeros({}, at::TensorOptions(at::kFloat).device(step_device_));
    counters.push_back(count);
    if (targets.found_inf.defined() && counts_beside(p)) beside.push_back(count);
  }
  at::_foreach_add_(counters, 1.0);
  if (!beside.empty()) at::_foreach_add_(beside, targets.found_inf, -1);
}

std::vector<std::pair<std::string, at::Tensor>> FusedOptimizer::state8(size_t p, size_t index,
                                                                       const Bucket& bucket,
                                                                       size_t slot) const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  if (steps_[p] == 0 || flats_[index].size() < kBuffers8) return out;
  const std::vector<at::Tensor> pieces = pieces8(flats_[index], layouts8_[index], bucket, slot);
  const at::Tensor& param = params_[p];
  out.emplace_back("step", step_tensors_[p]);
  out.emplace_back("exp_avg", pieces[0].view(param.sizes()));
  out.emplace_back("exp_avg_sq", pieces[1].view(param.sizes()));
  if (pieces.size() > 2) {
    out.emplace_back("exp_avg.scale", pieces[2]);
    out.emplace_back("exp_avg_sq.scale", pieces[3]);
  }
  return out;
}

void FusedOptimizer::relayout8(const std::vector<Bucket>& old_buckets,
                               const std::vector<Bucket>& new_buckets) {
  std::vector<std::pair<size_t, size_t>> old_at(params_.size(), {SIZE_MAX, 0});
  for (size_t b = 0; b < old_buckets.size(); ++b) {
    for (size_t s = 0; s < old_buckets[b].params.size(); ++s) {
      old_at[static_cast<size_t>(old_buckets[b].params[s])] = {b, s};
    }
  }
  std::vector<std::vector<at::Tensor>> old_flats = std::exchange(flats_, {});
  const auto held = [&](size_t b) { return b < old_flats.size() && !old_flats[b].empty(); };
  const std::vector<Layout8> old_layouts = std::exchange(layouts8_, {});
  flats_.assign(new_buckets.size(), {});
  for (size_t b = 0; b < new_buckets.size(); ++b) {
    const Bucket& bucket = new_buckets[b];
    bool any = false;
    for (int64_t p : bucket.params) any = any || held(old_at[static_cast<size_t>(p)].first);
    if (!any) continue;
    ensure_state(b, bucket, kBuffers8);
    const Layout8& layout = layouts8_[b];
    for (size_t s = 0; s < bucket.params.size(); ++s) {
      const auto p = static_cast<size_t>(bucket.params[s]);
      const auto [ob, os] = old_at[p];
      if (!held(ob) || !can_step(p)) continue;
      const std::vector<at::Tensor> from =
          pieces8(old_flats[ob], old_layouts[ob], old_buckets[ob], os);
      const std::vector<at::Tensor> to = pieces8(flats_[b], layout, bucket, s);
      for (size_t k = 0; k < to.size(); ++k) to[k].copy_(from[k]);
    }
  }
  ++generation_;
}

}  // namespace leanddp
