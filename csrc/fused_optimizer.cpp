#include "fused_optimizer.h"

#include "ops/cpu_kernels.h"  // adam_tail_start

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <utility>

namespace leanddp {
namespace {

using OptTensor = std::optional<at::Tensor>;

OptTensor opt(const at::Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

void adam_step(at::TensorList params, at::TensorList grads, at::TensorList exp_avg,
               at::TensorList exp_avg_sq, at::TensorList copies, const OptimHyper& h, int64_t step,
               at::TensorList state_steps, const StepTargets& t,
               at::OptionalIntArrayRef tail_from) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("leanddp::adam_step_", "")
          .typed<void(at::TensorList, at::TensorList, at::TensorList, at::TensorList,
                      at::TensorList, double, double, double, double, double, int64_t, bool, bool,
                      std::optional<double>, at::TensorList, const OptTensor&, const OptTensor&,
                      const OptTensor&, at::OptionalIntArrayRef)>();
  op.call(params, grads, exp_avg, exp_avg_sq, copies, h.lr, h.beta1, h.beta2, h.eps, h.weight_decay,
          step, h.decoupled, h.maximize, t.grad_scale, state_steps, opt(h.lr_tensor),
          opt(t.amp_scale), opt(t.found_inf), tail_from);
}

void sgd_step(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffer,
              at::TensorList copies, const OptimHyper& h, bool first_step, const StepTargets& t) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("leanddp::sgd_step_", "")
          .typed<void(at::TensorList, at::TensorList, at::TensorList, at::TensorList, double,
                      double, double, bool, double, bool, bool, std::optional<double>,
                      const OptTensor&, const OptTensor&, const OptTensor&)>();
  op.call(params, grads, momentum_buffer, copies, h.lr, h.momentum, h.dampening, h.nesterov,
          h.weight_decay, h.maximize, first_step, t.grad_scale, opt(h.lr_tensor), opt(t.amp_scale),
          opt(t.found_inf));
}

// torch's state buffers of a kind (StateSpec::buffers), as constants: a step counts them.
const std::vector<std::string>& buffer_names(OptimKind kind, bool momentum) {
  static const std::vector<std::string> adam{"exp_avg", "exp_avg_sq"};
  static const std::vector<std::string> sgd{"momentum_buffer"};
  static const std::vector<std::string> none;
  if (kind != OptimKind::kSgd) return adam;
  return momentum ? sgd : none;
}

}  // namespace

std::vector<std::string> StateSpec::keys() const {
  std::vector<std::string> out;
  if (counted) out.emplace_back("step");
  out.insert(out.end(), buffers.begin(), buffers.end());
  if (master) out.emplace_back("master_weight");
  return out;
}

StateSpec state_spec(OptimKind kind, const at::Tensor& param, bool on_host, bool momentum,
                     int64_t block) {
  StateSpec spec;
  const auto dtype = param.scalar_type();
  // The 8-bit kernel reads a parameter's codes and blocks in its logical order, which is its
  // memory order only when it is contiguous (torchao's blocks are of the flattened tensor).
  const bool contiguous = on_host || kind == OptimKind::kAdam8bit;
  if (dtype != at::kFloat && dtype != at::kBFloat16 && dtype != at::kHalf) {
    spec.unfit = "dtype";
    spec.needs = "float32, bfloat16 and float16";
  } else if (contiguous ? !param.is_contiguous() : !param.is_non_overlapping_and_dense()) {
    // The device kernels step the parameter, its bucket view and its state (state_view) with
    // its strides, element by element in memory order; the host copies through flat buffers.
    spec.unfit = "layout";
    spec.needs = contiguous ? "contiguous" : "dense";
  }
  spec.stepped = spec.unfit.empty();
  spec.dtype = on_host ? at::kFloat : dtype;
  spec.device = on_host ? c10::Device(c10::kCPU) : param.device();
  if (!spec.stepped) return spec;
  spec.counted = kind != OptimKind::kSgd;
  spec.buffers = buffer_names(kind, momentum);
  spec.master = on_host && dtype != at::kFloat;
  if (kind == OptimKind::kAdam8bit) {
    TORCH_CHECK(block > 0, "state_spec: the 8-bit kind needs its block size, got ", block);
    spec.block = block;
    spec.quantized = param.numel() >= kMinQuantized8 && param.numel() % block == 0;
    if (spec.quantized) spec.dtype = at::kByte;
  }
  return spec;
}

double clip_coefficient(double total_norm, double max_norm) {
  const float denom = static_cast<float>(total_norm) + 1e-6f;
  const float coef = (1.0f / denom) * static_cast<float>(max_norm);
  return std::isnan(coef) ? coef : std::min(coef, 1.0f);
}

FusedOptimizer::FusedOptimizer(OptimKind kind, std::vector<at::Tensor> params,
                               std::vector<int64_t> group_of, std::vector<OptimHyper> groups,
                               c10::Device step_device, bool on_host, Quant8 quant)
    : kind_(kind),
      params_(std::move(params)),
      group_of_(std::move(group_of)),
      step_device_(step_device),
      steps_(params_.size(), 0),
      step_tensors_(params_.size()) {
  TORCH_CHECK(group_of_.size() == params_.size(), "FusedOptimizer: one group per parameter");
  TORCH_CHECK(!params_.empty(), "FusedOptimizer: no parameters");
  const c10::Device device = params_[0].device();
  // On the host the state is ordinary memory: it never crosses PCIe (only offload's staging
  // buffers are pinned), and the worker thread that steps it allocates and first touches it.
  // Its dtype is chosen per bucket (state_dtype).
  state_options_ = at::TensorOptions().device(on_host ? c10::Device(at::kCPU) : device);
  on_host_ = on_host;
  quant_ = std::move(quant);
  if (kind_ == OptimKind::kAdam8bit) {
    TORCH_CHECK(quant_.block > 0 && quant_.qmap_signed.defined() && quant_.qmap_unsigned.defined(),
                "FusedOptimizer: the 8-bit kind needs a block size and both maps");
  }
  for (const at::Tensor& param : params_) {
    stepped_.push_back(
        state_spec(kind_, param, on_host_, /*momentum=*/false, quant_.block).stepped);
  }
  set_groups(std::move(groups));
}

void FusedOptimizer::set_groups(std::vector<OptimHyper> groups) {
  check_groups(groups);
  groups_ = std::move(groups);
}

void FusedOptimizer::check_groups(const std::vector<OptimHyper>& groups) const {
  for (int64_t g : group_of_) {
    TORCH_CHECK(g >= 0 && static_cast<size_t>(g) < groups.size(),
                "FusedOptimizer: parameter group ", g, " has no hyper-parameters");
  }
  for (const OptimHyper& h : groups) {
    TORCH_CHECK(kind_ != OptimKind::kAdam8bit || !h.lr_tensor.defined(),
                "FusedOptimizer: the 8-bit kernels take the learning rate as a number");
  }
}

size_t FusedOptimizer::num_buffers(int64_t group) const {
  if (kind_ == OptimKind::kAdam8bit) return kBuffers8;
  return buffer_names(kind_, groups_[static_cast<size_t>(group)].momentum != 0.0).size();
}

bool FusedOptimizer::counts_beside(size_t p) const { return step_device_ == params_[p].device(); }

at::ScalarType FusedOptimizer::state_dtype(const Bucket& bucket) const {
  // A bucket holds parameters of one dtype.
  if (bucket.params.empty()) return at::kFloat;
  const at::Tensor& param = params_[static_cast<size_t>(bucket.params[0])];
  // (kAdam8bit: of the plain moments; the codes and scales have their own)
  return state_spec(OptimKind::kAdam, param, on_host_, /*momentum=*/false).dtype;
}

void FusedOptimizer::ensure_state(size_t index, const Bucket& bucket, size_t buffers) {
  if (flats_.size() <= index) flats_.resize(index + 1);
  auto& flats = flats_[index];
  if (flats.size() >= buffers) return;
  if (kind_ == OptimKind::kAdam8bit) return ensure_state8(index, bucket);
  const auto options = state_options_.dtype(state_dtype(bucket));
  const int64_t numel = sharded() ? shards_.at(index).shard_numel : bucket.numel;
  while (flats.size() < buffers) flats.push_back(at::zeros({numel}, options));
  ++generation_;
}

at::Tensor FusedOptimizer::state_view(size_t index, const Bucket& bucket, size_t slot,
                                      size_t k) const {
  return slice_like(flats_[index][k], bucket.offsets[slot],
                    params_[static_cast<size_t>(bucket.params[slot])]);
}

void FusedOptimizer::step(size_t index, const Bucket& bucket, const std::vector<char>& mask,
                          const StepTargets& targets) {
  size_t buffers = 0;
  bool any = false;
  for (size_t s = 0; s < bucket.params.size(); ++s) {
    if (!mask[s]) continue;
    any = true;
    buffers = std::max(buffers, num_buffers(group_of_[static_cast<size_t>(bucket.params[s])]));
  }
  if (!any) return;
  if (kind_ == OptimKind::kAdam8bit) return step8(index, bucket, mask, targets);
  TORCH_CHECK(!sharded() || !targets.found_inf.defined(),
              "FusedOptimizer: a sharded step takes no found_inf");
  ensure_state(index, bucket, buffers);
  // What one kernel list entry steps: a masked slot, or (sharded) its piece in this rank's
  // shard, with its state at `state_offset` of the shard's buffers.
  // `tail`: where the CPU kernel's tail arithmetic starts in `param` (a piece takes its
  // parameter's tail, as torch steps whole tensors).
  struct Member {
    size_t slot;
    at::Tensor param, grad, copy;
    int64_t state_offset;
    int64_t tail;
  };
  const bool with_copies = !targets.copies.empty();
  std::vector<Member> members;
  if (sharded()) {
    for (const ShardPiece& piece : shards_.at(index).pieces) {
      const size_t s = piece.slot;
      if (!mask[s]) continue;
      const auto cut = [&](const at::Tensor& t) {
        return !t.defined() || targets.cut ? t : piece_of(t, piece);
      };
      // (the whole parameter's numel; the width of the dtype stepped, the host masters' with
      // offload_to_cpu)
      const int64_t numel = params_[static_cast<size_t>(bucket.params[s])].numel();
      const int64_t tail = ops::adam_tail_start(numel, targets.params[s].element_size());
      members.push_back({s, cut(targets.params[s]), cut(targets.grads[s]),
                         with_copies ? cut(targets.copies[s]) : at::Tensor(), piece.shard_offset,
                         tail - piece.slot_offset});
    }
  } else {
    for (size_t s = 0; s < mask.size(); ++s) {
      if (!mask[s]) continue;
      members.push_back({s, targets.params[s], targets.grads[s],
                         with_copies ? targets.copies[s] : at::Tensor(), -1, -1});
    }
  }
  const auto state_of = [&](const Member& m, size_t k) {
    return m.state_offset < 0 ? state_view(index, bucket, m.slot, k)
                              : flats_[index][k].narrow(0, m.state_offset, m.param.numel());
  };
  const auto param_of = [&](size_t s) { return static_cast<size_t>(bucket.params[s]); };
  // found_inf (GradScaler, the NaN check) with Adam's counts on the parameters' device: they
  // are advanced there before the kernel reads them and taken back where found_inf is set,
  // as torch's fused Adam does. Counts on the host (a plain Adam on a GPU under the NaN
  // check) are advanced here and taken back by unstep().
  const auto device_steps = [&](size_t p) {
    return kind_ == OptimKind::kAdam && targets.found_inf.defined() && counts_beside(p);
  };
  // Members sharing a group and (Adam) a step count, or (SGD) whether their momentum buffer is
  // fresh, are stepped by one kernel launch.
  std::map<std::pair<int64_t, int64_t>, std::vector<size_t>> calls;
  for (size_t m = 0; m < members.size(); ++m) {
    const size_t p = param_of(members[m].slot);
    const int64_t key = kind_ == OptimKind::kAdam ? steps_[p] + 1 : int64_t{steps_[p] == 0};
    calls[{group_of_[p], key}].push_back(m);
  }
  for (const auto& [key, chosen] : calls) {
    const OptimHyper& h = groups_[static_cast<size_t>(key.first)];
    const size_t nbuf = num_buffers(key.first);
    std::vector<at::Tensor> params, grads, copies;
    std::vector<int64_t> tails;
    std::vector<std::vector<at::Tensor>> state(nbuf);
    for (size_t m : chosen) {
      tails.push_back(members[m].tail);
      params.push_back(members[m].param);
      grads.push_back(members[m].grad);
      if (members[m].copy.defined()) copies.push_back(members[m].copy);
      for (size_t k = 0; k < nbuf; ++k) state[k].push_back(state_of(members[m], k));
    }
    TORCH_CHECK(copies.empty() || copies.size() == params.size(),
                "FusedOptimizer: low-precision copies for some members of a call only");
    const bool on_device = device_steps(param_of(members[chosen[0]].slot));
    std::vector<at::Tensor> steps;
    if (on_device) {
      for (size_t m : chosen) {
        at::Tensor& step = step_tensors_[param_of(members[m].slot)];
        if (!step.defined()) {
          step = at::zeros({}, at::TensorOptions(at::kFloat).device(step_device_));
        }
        steps.push_back(step);
      }
      at::_foreach_add_(steps, 1.0);
    }
    if (kind_ == OptimKind::kAdam) {
      adam_step(params, grads, state[0], state[1], copies, h, key.second, steps, targets,
                sharded() ? at::OptionalIntArrayRef(tails) : std::nullopt);
    } else {
      sgd_step(params, grads, nbuf ? state[0] : std::vector<at::Tensor>{}, copies, h,
               key.second != 0, targets);
    }
    if (on_device) at::_foreach_add_(steps, targets.found_inf, -1);
  }
  count_steps(
      bucket, mask, targets, [&](size_t p) { return !counted() || device_steps(p); },
      /*take_back=*/false);
}

void FusedOptimizer::count_steps(const Bucket& bucket, const std::vector<char>& mask,
                                 const StepTargets& targets,
                                 const std::function<bool(size_t)>& advanced, bool take_back) {
  std::vector<at::Tensor> counters, beside;
  for (size_t s = 0; s < mask.size(); ++s) {
    if (!mask[s]) continue;
    const auto p = static_cast<size_t>(bucket.params[s]);
    // As torch's in-place ops do: a tensor autograd saved from this parameter is now stale,
    // and autograd raises if a node that has not run yet still needs it.
    if (targets.params[s].defined()) torch::autograd::impl::bump_version(targets.params[s]);
    if (steps_[p]++ == 0) ++generation_;  // a parameter's state appears
    if (advanced(p)) continue;
    at::Tensor& count = step_tensors_[p];
    if (!count.defined()) count = at::zeros({}, at::TensorOptions(at::kFloat).device(step_device_));
    counters.push_back(count);
    if (take_back && targets.found_inf.defined() && counts_beside(p)) beside.push_back(count);
  }
  if (!counters.empty()) at::_foreach_add_(counters, 1.0);
  if (!beside.empty()) at::_foreach_add_(beside, targets.found_inf, -1);
}

void FusedOptimizer::unstep(size_t p) {
  TORCH_CHECK(p < steps_.size() && steps_[p] > 0, "FusedOptimizer: parameter ", p,
              " has no step to take back");
  if (--steps_[p] == 0) ++generation_;  // its state is gone from state() again
  // Counts kept apart from the parameters were advanced whatever found_inf said (step()).
  if (counted() && step_tensors_[p].defined() && !counts_beside(p)) {
    step_tensors_[p].sub_(1);
  }
}

void FusedOptimizer::copy_in(size_t index, const Bucket& bucket, size_t slot, size_t k,
                             const at::Tensor& values) {
  if (!sharded()) {
    memory_1d(state_view(index, bucket, slot, k)).copy_(values);
    return;
  }
  for (const ShardPiece& piece : shards_.at(index).pieces) {
    if (piece.slot != slot) continue;
    flats_[index][k]
        .narrow(0, piece.shard_offset, piece.numel)
        .copy_(values.narrow(0, piece.slot_offset, piece.numel));
  }
}

void FusedOptimizer::relayout(const std::vector<Bucket>& old_buckets,
                              const std::vector<Bucket>& new_buckets,
                              const std::vector<std::vector<at::Tensor>>& old_full) {
  TORCH_CHECK(!sharded() || old_full.size() == old_buckets.size(),
              "FusedOptimizer: a sharded relayout needs the old state gathered whole");
  if (kind_ == OptimKind::kAdam8bit) return relayout8(old_buckets, new_buckets, old_full);
  std::vector<std::pair<size_t, size_t>> old_at(params_.size(), {SIZE_MAX, 0});
  for (size_t b = 0; b < old_buckets.size(); ++b) {
    for (size_t s = 0; s < old_buckets[b].params.size(); ++s) {
      old_at[static_cast<size_t>(old_buckets[b].params[s])] = {b, s};
    }
  }
  const std::vector<std::vector<at::Tensor>> old_flats =
      sharded() ? old_full : std::exchange(flats_, {});
  flats_.assign(new_buckets.size(), {});
  for (size_t b = 0; b < new_buckets.size(); ++b) {
    const Bucket& bucket = new_buckets[b];
    size_t buffers = 0;
    for (int64_t p : bucket.params) {
      const auto [ob, os] = old_at[static_cast<size_t>(p)];
      if (ob < old_flats.size()) buffers = std::max(buffers, old_flats[ob].size());
    }
    if (buffers == 0) continue;
    ensure_state(b, bucket, buffers);
    for (size_t s = 0; s < bucket.params.size(); ++s) {
      const auto p = static_cast<size_t>(bucket.params[s]);
      const auto [ob, os] = old_at[p];
      if (ob >= old_flats.size()) continue;
      for (size_t k = 0; k < old_flats[ob].size(); ++k) {
        const int64_t offset = old_buckets[ob].offsets[os];
        copy_in(b, bucket, s, k, old_flats[ob][k].narrow(0, offset, params_[p].numel()));
      }
    }
  }
  ++generation_;
}

const std::vector<at::Tensor>& FusedOptimizer::state_buffers(size_t index, const Bucket& bucket) {
  size_t buffers = 0;
  for (int64_t p : bucket.params) {
    buffers = std::max(buffers, num_buffers(group_of_[static_cast<size_t>(p)]));
  }
  ensure_state(index, bucket, buffers);
  return flats_[index];
}

std::vector<std::pair<std::string, at::Tensor>> FusedOptimizer::state(size_t p, size_t index,
                                                                      const Bucket& bucket,
                                                                      size_t slot) const {
  if (sharded() || index >= flats_.size()) return {};
  if (kind_ == OptimKind::kAdam8bit) {
    if (index >= layouts8_.size() || flats_[index].empty()) return {};  // (no state yet)
    return state8(p, slot, flats_[index], layouts8_[index]);
  }
  return entries(p, flats_[index], bucket.offsets[slot]);
}

std::vector<std::string> FusedOptimizer::buffer_keys(size_t p) const {
  return buffer_names(kind_, groups_[static_cast<size_t>(group_of_[p])].momentum != 0.0);
}

void FusedOptimizer::set_steps(size_t p, int64_t step) {
  TORCH_CHECK(step >= 0, "FusedOptimizer: negative step count");
  ++generation_;
  steps_[p] = step;
  step_tensors_[p] = at::Tensor();
  if (counted() && step > 0) {
    step_tensors_[p] = at::scalar_tensor(static_cast<double>(step),
                                         at::TensorOptions(at::kFloat).device(step_device_));
  }
}

std::vector<std::pair<std::string, at::Tensor>> FusedOptimizer::entries(
    size_t p, const std::vector<at::Tensor>& full, int64_t offset) const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  const bool momentum = groups_[static_cast<size_t>(group_of_[p])].momentum != 0.0;
  const StateSpec rule = state_spec(kind_, params_[p], on_host_, momentum, quant_.block);
  if (steps_[p] == 0 || full.size() < rule.buffers.size()) return out;
  if (rule.counted) out.emplace_back("step", step_tensors_[p]);
  for (size_t k = 0; k < rule.buffers.size(); ++k) {
    out.emplace_back(rule.buffers[k], slice_like(full[k], offset, params_[p]));
  }
  return out;
}

std::vector<std::vector<std::pair<std::string, at::Tensor>>> FusedOptimizer::state_from(
    const Bucket& bucket, const std::vector<at::Tensor>& full) const {
  std::vector<std::vector<std::pair<std::string, at::Tensor>>> out;
  const bool eight = kind_ == OptimKind::kAdam8bit;
  const Layout8 layout = eight ? whole_layout8(bucket) : Layout8{};
  for (size_t s = 0; s < bucket.params.size(); ++s) {
    const auto p = static_cast<size_t>(bucket.params[s]);
    if (!can_step(p)) {
      out.emplace_back();
    } else {
      out.push_back(eight ? state8(p, s, full, layout) : entries(p, full, bucket.offsets[s]));
    }
  }
  return out;
}

std::vector<at::Tensor> FusedOptimizer::whole_state(size_t index, const Bucket& bucket,
                                                    std::vector<at::Tensor> gathered) const {
  if (kind_ != OptimKind::kAdam8bit) return gathered;  // (the padded bucket, shard by shard)
  TORCH_CHECK(sharded() && gathered.size() == kBuffers8,
              "FusedOptimizer: whole_state takes the 8-bit buffers of every rank's shard");
  const ShardLayout& mine = shards_.at(index);
  const int64_t world = mine.world();
  const Layout8 whole = whole_layout8(bucket);
  const int64_t lengths[kBuffers8] = {whole.codes,  whole.codes, whole.scales,
                                      whole.scales, whole.plain, whole.plain};
  std::vector<at::Tensor> out;
  for (size_t k = 0; k < kBuffers8; ++k)
    out.push_back(at::zeros({lengths[k]}, gathered[k].options()));
  for (int64_t r = 0; r < world; ++r) {
    const Layout8 theirs = layout8(bucket, recut(bucket, params_, mine, r).pieces);
    std::vector<at::Tensor> chunks;
    for (const at::Tensor& all : gathered) {
      const int64_t length = all.numel() / world;
      chunks.push_back(all.narrow(0, r * length, length));
    }
    for (size_t m = 0; m < theirs.members.size(); ++m) {
      if (theirs.at[m] < 0) continue;
      const ShardPiece& piece = theirs.members[m];
      const std::vector<at::Tensor> from = pieces8(chunks, theirs, m);
      const std::vector<at::Tensor> to = narrow8(pieces8(out, whole, piece.slot), piece);
      for (size_t k = 0; k < to.size(); ++k) to[k].copy_(from[k]);
    }
  }
  return out;
}

std::vector<std::tuple<int64_t, std::string, at::Tensor>> FusedOptimizer::shard_state(
    size_t index, const Bucket& bucket) {
  TORCH_CHECK(sharded(), "FusedOptimizer: shard_state needs shard_optimizer_state");
  const std::vector<at::Tensor>& buffers = state_buffers(index, bucket);
  std::vector<std::tuple<int64_t, std::string, at::Tensor>> out;
  if (kind_ == OptimKind::kAdam8bit) {
    const Layout8& layout = layouts8_[index];
    for (size_t m = 0; m < layout.members.size(); ++m) {
      if (layout.at[m] < 0) continue;
      const int64_t p = bucket.params[layout.members[m].slot];
      const std::vector<at::Tensor> pieces = pieces8(buffers, layout, m);
      for (size_t k = 0; k < pieces.size(); ++k) out.emplace_back(p, kKeys8[k], pieces[k]);
    }
    return out;
  }
  for (const ShardPiece& piece : shards_.at(index).pieces) {
    const int64_t p = bucket.params[piece.slot];
    const std::vector<std::string> keys = buffer_keys(static_cast<size_t>(p));
    for (size_t k = 0; k < keys.size(); ++k) {
      out.emplace_back(p, keys[k], buffers[k].narrow(0, piece.shard_offset, piece.numel));
    }
  }
  return out;
}

void FusedOptimizer::load_state(size_t p, size_t index, const Bucket& bucket, size_t slot,
                                int64_t step, const std::vector<at::Tensor>& values) {
  const size_t nbuf = num_buffers(group_of_[p]);
  set_steps(p, step);
  if (step == 0) {
    // Sharded, the state is never handed out, so a fresh start zeroes it here (the first step
    // reads the moments as zeros; 8-bit: zero codes with zero scales).
    if (sharded() && kind_ == OptimKind::kAdam8bit && index < flats_.size() &&
        !flats_[index].empty()) {
      const Layout8& layout = layouts8_[index];
      for (size_t m = 0; m < layout.members.size(); ++m) {
        if (layout.members[m].slot != slot || layout.at[m] < 0) continue;
        for (const at::Tensor& t : pieces8(flats_[index], layout, m)) t.zero_();
      }
    } else if (sharded() && index < flats_.size()) {
      for (size_t k = 0; k < flats_[index].size(); ++k) {
        copy_in(index, bucket, slot, k,
                at::zeros({params_[p].numel()}, flats_[index][k].options()));
      }
    }
    return;
  }
  ensure_state(index, bucket, nbuf);
  if (kind_ == OptimKind::kAdam8bit) {
    // codes and scales (quantized) or the two moments, in pieces8()'s order
    copy_in8(index, bucket, slot, values);
    return;
  }
  TORCH_CHECK(values.size() == nbuf, "FusedOptimizer: expected ", nbuf, " state tensors, got ",
              values.size());
  for (size_t k = 0; k < nbuf; ++k) {
    // The value in the parameter's memory order, as the state holds it.
    copy_in(index, bucket, slot, k, in_memory_order_of(values[k], params_[p]).reshape({-1}));
  }
}

int64_t FusedOptimizer::state_bytes() const {
  int64_t total = 0;
  for (const auto& flats : flats_) {
    for (const auto& f : flats) total += static_cast<int64_t>(f.nbytes());
  }
  return total;
}

}  // namespace leanddp
