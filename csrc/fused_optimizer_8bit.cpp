// FusedOptimizer's 8-bit state (OptimKind::kAdam8bit: torchao's AdamW8bit / Adam8bit), see
// fused_optimizer.h: the layout of a bucket's six buffers, its step through adam8bit_step_,
// its entries in torch's format and its moves when the buckets are rebuilt.
#include "fused_optimizer.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
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

FusedOptimizer::Layout8 FusedOptimizer::layout8(const Bucket& bucket,
                                                std::vector<ShardPiece> members) const {
  Layout8 out;
  out.members = std::move(members);
  for (const ShardPiece& member : out.members) {
    const auto p = static_cast<size_t>(bucket.params[member.slot]);
    const bool quantized =
        state_spec(kind_, params_[p], on_host_, /*momentum=*/false, quant_.block).quantized;
    out.quantized.push_back(quantized);
    if (!can_step(p)) {  // (stepped by the fallback, which keeps its state)
      out.at.push_back(-1);
      out.scale_at.push_back(-1);
      continue;
    }
    TORCH_CHECK(
        !quantized || (member.slot_offset % quant_.block == 0 && member.numel % quant_.block == 0),
        "FusedOptimizer: a shard cuts a block of 8-bit state (slot ", member.slot, ", elements ",
        member.slot_offset, " to ", member.slot_offset + member.numel, ")");
    out.at.push_back(quantized ? out.codes : out.plain);
    out.scale_at.push_back(quantized ? out.scales : -1);
    if (quantized) {
      out.codes += member.numel;
      out.scales += member.numel / quant_.block;
    } else {
      out.plain += member.numel;
    }
  }
  return out;
}

FusedOptimizer::Layout8 FusedOptimizer::whole_layout8(const Bucket& bucket) const {
  std::vector<ShardPiece> slots;
  for (size_t s = 0; s < bucket.params.size(); ++s) {
    slots.push_back(ShardPiece{s, 0, bucket.offsets[s],
                               params_[static_cast<size_t>(bucket.params[s])].numel()});
  }
  return layout8(bucket, std::move(slots));
}

void FusedOptimizer::ensure_state8(size_t index, const Bucket& bucket) {
  if (layouts8_.size() <= index) layouts8_.resize(index + 1);
  Layout8& layout = layouts8_[index];
  if (!sharded()) {
    layout = whole_layout8(bucket);
  } else {
    const ShardLayout& mine = shards_.at(index);
    layout = layout8(bucket, mine.pieces);
    for (int64_t r = 0; r < mine.world(); ++r) {
      const Layout8 other = layout8(bucket, recut(bucket, params_, mine, r).pieces);
      layout.codes = std::max(layout.codes, other.codes);
      layout.scales = std::max(layout.scales, other.scales);
      layout.plain = std::max(layout.plain, other.plain);
    }
  }
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
                                                const Layout8& layout, size_t m) const {
  TORCH_CHECK(layout.at[m] >= 0, "FusedOptimizer: slot ", layout.members[m].slot,
              " is not stepped by the 8-bit kernels");
  const int64_t numel = layout.members[m].numel;
  const int64_t at = layout.at[m];
  if (!layout.quantized[m]) {
    return {flats[kPlainM].narrow(0, at, numel), flats[kPlainV].narrow(0, at, numel)};
  }
  const int64_t blocks = numel / quant_.block;
  const int64_t scale_at = layout.scale_at[m];
  return {flats[kCodesM].narrow(0, at, numel), flats[kCodesV].narrow(0, at, numel),
          flats[kScaleM].narrow(0, scale_at, blocks), flats[kScaleV].narrow(0, scale_at, blocks)};
}

std::vector<at::Tensor> FusedOptimizer::narrow8(const std::vector<at::Tensor>& whole,
                                                const ShardPiece& piece) const {
  std::vector<at::Tensor> out;
  for (size_t k = 0; k < whole.size(); ++k) {
    const bool scale = k >= 2;  // (only quantized state has them: its pieces are whole blocks)
    const int64_t unit = scale ? quant_.block : 1;
    out.push_back(whole[k].reshape({-1}).narrow(0, piece.slot_offset / unit, piece.numel / unit));
  }
  return out;
}

void FusedOptimizer::copy_in8(size_t index, const Bucket& bucket, size_t slot,
                              const std::vector<at::Tensor>& whole) {
  const Layout8& layout = layouts8_[index];
  // (checked on every rank, also one without a piece of the slot: each raises alike)
  const at::Tensor& param = params_[static_cast<size_t>(bucket.params[slot])];
  const size_t expected =
      state_spec(kind_, param, on_host_, /*momentum=*/false, quant_.block).quantized ? 4 : 2;
  TORCH_CHECK(whole.size() == expected, "FusedOptimizer: expected ", expected,
              " 8-bit state tensors, got ", whole.size());
  for (size_t m = 0; m < layout.members.size(); ++m) {
    if (layout.members[m].slot != slot) continue;
    const std::vector<at::Tensor> to = pieces8(flats_[index], layout, m);
    const std::vector<at::Tensor> from = narrow8(whole, layout.members[m]);
    for (size_t k = 0; k < to.size(); ++k) to[k].copy_(from[k]);
  }
}

void FusedOptimizer::step8(size_t index, const Bucket& bucket, const std::vector<char>& mask,
                           const StepTargets& targets) {
  TORCH_CHECK(!targets.amp_scale.defined(),
              "FusedOptimizer: the 8-bit kernels take no GradScaler scale");
  TORCH_CHECK(targets.copies.empty() || targets.copies.size() == mask.size(),
              "FusedOptimizer: one low-precision copy per slot, or none");
  TORCH_CHECK(!sharded() || !targets.found_inf.defined(),
              "FusedOptimizer: a sharded step takes no found_inf");
  ensure_state(index, bucket, kBuffers8);
  const auto& flats = flats_[index];
  const Layout8& layout = layouts8_[index];
  const at::Tensor no_scale = at::empty({0}, state_options_.dtype(at::kFloat));
  // A member's part of a per-slot target: whole, or its piece (as step() cuts them).
  const auto cut = [&](const at::Tensor& t, const ShardPiece& member) {
    return !sharded() || targets.cut || !t.defined() ? t : piece_of(t, member);
  };
  // Members sharing a group and a step count are stepped by one kernel launch.
  std::map<std::pair<int64_t, int64_t>, std::vector<size_t>> calls;
  for (size_t m = 0; m < layout.members.size(); ++m) {
    const size_t s = layout.members[m].slot;
    if (!mask[s]) continue;
    const auto p = static_cast<size_t>(bucket.params[s]);
    calls[{group_of_[p], steps_[p] + 1}].push_back(m);
  }
  for (const auto& [key, members] : calls) {
    const OptimHyper& h = groups_[static_cast<size_t>(key.first)];
    std::vector<at::Tensor> params, grads, m, v, scale_m, scale_v, copies;
    for (size_t i : members) {
      const ShardPiece& member = layout.members[i];
      const size_t s = member.slot;
      const at::Tensor param = cut(targets.params[s], member);
      std::vector<at::Tensor> state = pieces8(flats, layout, i);
      params.push_back(param);
      grads.push_back(cut(targets.grads[s], member));
      m.push_back(state[0].view(param.sizes()));
      v.push_back(state[1].view(param.sizes()));
      scale_m.push_back(state.size() > 2 ? state[2] : no_scale);
      scale_v.push_back(state.size() > 2 ? state[3] : no_scale);
      if (!targets.copies.empty() && targets.copies[s].defined()) {
        copies.push_back(cut(targets.copies[s], member));
      }
    }
    TORCH_CHECK(copies.empty() || copies.size() == params.size(),
                "FusedOptimizer: low-precision copies for some members of a call only");
    adam8_step(params, grads, m, v, scale_m, scale_v, copies, quant_, h, key.second, targets);
  }
  // torchao's counts are float32 tensors on the CPU: with found_inf beside them (training on
  // the CPU) a skipped step's count is taken back at once; else unstep() takes it back once
  // the flags are read.
  count_steps(bucket, mask, targets, [](size_t) { return false; }, /*take_back=*/true);
}

std::vector<std::pair<std::string, at::Tensor>> FusedOptimizer::state8(
    size_t p, size_t slot, const std::vector<at::Tensor>& flats, const Layout8& layout) const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  if (steps_[p] == 0 || flats.size() < kBuffers8) return out;
  const std::vector<at::Tensor> pieces = pieces8(flats, layout, slot);
  const at::Tensor& param = params_[p];
  out.emplace_back("step", step_tensors_[p]);
  for (size_t k = 0; k < pieces.size(); ++k) {  // (the moments shaped like the parameter)
    out.emplace_back(kKeys8[k], k < 2 ? pieces[k].view(param.sizes()) : pieces[k]);
  }
  return out;
}

void FusedOptimizer::relayout8(const std::vector<Bucket>& old_buckets,
                               const std::vector<Bucket>& new_buckets,
                               const std::vector<std::vector<at::Tensor>>& old_full) {
  std::vector<std::pair<size_t, size_t>> old_at(params_.size(), {SIZE_MAX, 0});
  for (size_t b = 0; b < old_buckets.size(); ++b) {
    for (size_t s = 0; s < old_buckets[b].params.size(); ++s) {
      old_at[static_cast<size_t>(old_buckets[b].params[s])] = {b, s};
    }
  }
  // Each old bucket's state whole: its buffers, or (sharded) gathered by the caller.
  std::vector<std::vector<at::Tensor>> old_flats = std::exchange(flats_, {});
  std::vector<Layout8> old_layouts = std::exchange(layouts8_, {});
  if (sharded()) {
    old_flats = old_full;
    old_layouts.clear();
    for (const Bucket& bucket : old_buckets) old_layouts.push_back(whole_layout8(bucket));
  }
  const auto held = [&](size_t b) {
    return b < old_flats.size() && old_flats[b].size() >= kBuffers8;
  };
  flats_.assign(new_buckets.size(), {});
  for (size_t b = 0; b < new_buckets.size(); ++b) {
    const Bucket& bucket = new_buckets[b];
    bool any = false;
    for (int64_t p : bucket.params) any = any || held(old_at[static_cast<size_t>(p)].first);
    if (!any) continue;
    ensure_state(b, bucket, kBuffers8);
    for (size_t s = 0; s < bucket.params.size(); ++s) {
      const auto p = static_cast<size_t>(bucket.params[s]);
      const auto [ob, os] = old_at[p];
      if (!held(ob) || !can_step(p)) continue;
      copy_in8(b, bucket, s, pieces8(old_flats[ob], old_layouts[ob], os));
    }
  }
  ++generation_;
}

}  // namespace leanddp
