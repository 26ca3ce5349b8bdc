// FusedOptimizer: torch.optim.SGD / Adam / AdamW stepped bucket by bucket inside backward
// (optimizer_in_backward), with leanddp's fused kernels over the bucket's flat gradient memory.
//
// It owns the optimizer state in torch's format but laid out like the buckets: one flat
// buffer per state kind per bucket, in the parameters' dtype (float32, or bfloat16/float16
// stepped in float32 math: torch's fused optimizers keep such state in the parameter's dtype)
// (exp_avg and exp_avg_sq for Adam, momentum_buffer for SGD), allocated at the bucket's first step,
// so a bucket's step is one kernel launch per parameter group. Per parameter it keeps torch's
// `step` tensor (Adam). Python exposes the per-parameter views as the `state` of the user's torch
// optimizer, so checkpoints have torch's format.
//
// With shard_optimizer_state (set_shards) each bucket's state covers only this rank's shard of
// the bucket (shard.h): one flat buffer of shard_numel elements per state kind, and a step
// steps only the pieces of its members inside the shard (the reduced gradient is valid there).
// Step counts are kept for every member on every rank, so they agree everywhere. state() is
// then empty; the optimizer gathers the shards (state_buffers, whole_state, state_from) for
// torch's format. kAdam8bit: the cut falls on block boundaries inside every quantized member
// (shard.h's `block`), so a rank steps whole blocks, torchao's own.
//
// With offload_to_cpu (`on_host`) the same code steps the fp32 master weights in host memory:
// the state lives in ordinary host memory (it never crosses PCIe), float32 whatever
// the parameters' dtype (kAdam8bit: 8-bit codes and scales, float32 plain moments), and the
// caller says what is stepped (StepTargets).
//
// Not thread-safe: one thread at a time (InBackwardOptimizer with its lock held, or the host
// worker running HostOffload's steps while the optimizer waits for it before touching this).
#pragma once

#include "bucket.h"
#include "shard.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace leanddp {

// kAdam8bit: torchao's AdamW8bit / Adam8bit (block-wise 8-bit moments, adam8bit_step_).
enum class OptimKind { kSgd, kAdam, kAdam8bit };

// kAdam8bit: torchao quantizes the moments of parameters of at least this many elements (and a
// multiple of the block); a bucket keeps this many state buffers (Layout8).
constexpr int64_t kMinQuantized8 = 4096;
constexpr size_t kBuffers8 = 6;
// kAdam8bit: torch's keys of a quantized parameter's state tensors, in the order the kernels
// take them (a plain one has the first two).
inline constexpr const char* kKeys8[] = {"exp_avg", "exp_avg_sq", "exp_avg.scale",
                                         "exp_avg_sq.scale"};

// torchao's 8-bit state settings (kAdam8bit): the optimizer's block size and its two maps (256
// float32 entries each, where the state lives: the parameters' device, or the host with
// offload_to_cpu), shared by every parameter's state.
struct Quant8 {
  int64_t block = 0;
  at::Tensor qmap_signed;
  at::Tensor qmap_unsigned;
};

// The one rule for one parameter's fused state: whether the kernels step it and, if they do,
// what state they keep for it. FusedOptimizer follows it (can_step, buffer_keys, state_dtype)
// and Python asks it (leanddp._C.state_spec: the checks before wrapping, optimizer.state's
// checks and loads, sharded checkpoints), so a new kind or state buffer changes this only.
struct StateSpec {
  // Whether the kernels can step the parameter: float32, bfloat16 or float16 and, on the device,
  // dense in any layout (contiguous, channels_last, transposed: its state is laid out like it),
  // or, on the host (offload_to_cpu, float32 masters in flat host buffers), contiguous. Fixed
  // for a parameter, so its state never moves between the kernels and the fallback.
  bool stepped = false;
  // When not stepped, what fails: "dtype" or "layout" (else empty); and what the kernels need
  // instead, in words: "float32, bfloat16 and float16", or "contiguous" / "dense".
  std::string unfit;
  std::string needs;
  // Whether the state holds torch's `step` entry (Adam: a float32 scalar tensor).
  bool counted = false;
  // torch's names of the state buffers, in the order the kernels take them (Adam: exp_avg,
  // exp_avg_sq; SGD with momentum: momentum_buffer; else none). Empty when not stepped.
  std::vector<std::string> buffers;
  // offload_to_cpu with a bfloat16/float16 parameter: the float32 `master_weight` on the host.
  bool master = false;
  // kAdam8bit: whether the moments are 8-bit codes (uint8, one per element) with one float32
  // scale per `block` elements, torchao's rule: at least 4096 elements and a multiple of the
  // block; else they are plain tensors of `dtype`, as torchao keeps small parameters' moments.
  bool quantized = false;
  int64_t block = 0;
  // Where the buffers (and the master weight) live: float32 on the host with offload_to_cpu,
  // else the parameter's dtype on its device (as torch's fused optimizers keep it).
  at::ScalarType dtype = at::kFloat;
  c10::Device device = c10::Device(c10::kCPU);
  // torch's keys of the parameter's state entry, in FusedOptimizer::state()'s order (`step`,
  // the buffers, `master_weight`).
  std::vector<std::string> keys() const;
};

// The spec of `param` stepped by `kind`, on the host (`on_host`) or its device; `momentum`: its
// group's momentum is nonzero (SGD keeps a buffer then); `block`: kAdam8bit's block size.
StateSpec state_spec(OptimKind kind, const at::Tensor& param, bool on_host, bool momentum,
                     int64_t block = 0);

// The live hyper-parameters of one parameter group (torch's param_groups[i]).
struct OptimHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  double momentum = 0.0;
  double dampening = 0.0;
  bool nesterov = false;
  bool maximize = false;
  bool decoupled = false;  // AdamW's decoupled weight decay (else Adam's L2 term)
  // torch's tensor lr (a one-element tensor on the parameters' device): read by the kernels
  // when they run, so it is never copied to the host; undefined: `lr`.
  at::Tensor lr_tensor;
};

// What one bucket's step updates, per slot of the bucket: the float32 weights stepped in place
// (`params`), their averaged gradients (`grads`, float32/bfloat16/float16, shaped like the
// weights), and, if not empty, low-precision tensors that receive the updated weights
// (`copies`; an undefined entry: none for that slot). `grad_scale` multiplies every gradient
// (global-norm clipping). With torch.amp.GradScaler (`amp_scale` defined, on the parameters'
// device), the gradients are divided by the scale, and a nonzero `found_inf` makes the step do
// nothing, read by the kernels themselves as torch's fused optimizers do: Adam's step counts
// then live on the device and are not advanced by a skipped step.
// Sharded (set_shards), the per-slot tensors are whole slots, cut into this rank's pieces by the
// step; or, with `cut`, already this rank's piece of each slot as 1-D tensors (undefined for a
// slot without one): HostOffload's host buffers hold the shard only.
struct StepTargets {
  std::vector<at::Tensor> params;
  std::vector<at::Tensor> grads;
  std::vector<at::Tensor> copies;
  bool cut = false;
  std::optional<double> grad_scale;
  at::Tensor amp_scale;
  at::Tensor found_inf;
};

// torch.nn.utils.clip_grad_norm_'s coefficient, in its float32 arithmetic:
// clamp(max_norm / (total_norm + 1e-6), max=1), where float / tensor is reciprocal() * float.
// It becomes StepTargets::grad_scale (max_grad_norm).
double clip_coefficient(double total_norm, double max_norm);

class FusedOptimizer {
 public:
  // `params`: the Reducer's parameters; `group_of[p]`: the parameter group of parameter p.
  // `step_device`: where Adam's per-parameter `step` tensors live (torch keeps them on the
  // parameter's device for fused or capturable Adam, on the CPU otherwise). `on_host`: the state
  // lives in host memory (offload_to_cpu). `quant`: kAdam8bit's settings.
  FusedOptimizer(OptimKind kind, std::vector<at::Tensor> params, std::vector<int64_t> group_of,
                 std::vector<OptimHyper> groups, c10::Device step_device, bool on_host = false,
                 Quant8 quant = {});

  // Replaces the hyper-parameters (one per group), read by the next steps.
  void set_groups(std::vector<OptimHyper> groups);
  // Raises unless `groups` has the hyper-parameters of every parameter's group (set_groups'
  // check, for a caller that sets them later).
  void check_groups(const std::vector<OptimHyper>& groups) const;
  // Whether the kernels can step parameter p (StateSpec::stepped, fixed at construction).
  bool can_step(size_t p) const { return stepped_[p] != 0; }
  // Whether Adam's step counts live on parameter p's device (so the kernels can read them).
  bool counts_beside(size_t p) const;
  // Steps the members of bucket `index` whose `mask[slot]` is set (all of which can_step):
  // `targets` per slot; allocates the bucket's state at its first step. Bumps the version
  // counters of the tensors stepped, as torch's in-place ops do. Sharded: only the pieces in
  // this rank's shard are stepped (no found_inf then), every masked member's count advances.
  void step(size_t index, const Bucket& bucket, const std::vector<char>& mask,
            const StepTargets& targets);
  // Takes back the count of one step of parameter p whose kernel the device skipped (its
  // found_inf was set): the step that comes next is counted as this one was.
  void unstep(size_t p);
  // The buckets were rebuilt: moves the state into the new layout. Sharded (set_shards was
  // given the new buckets' shards first): `old_full[b]` holds old bucket b's state buffers
  // gathered whole (every rank's shard, padded), from which this rank takes its new pieces.
  void relayout(const std::vector<Bucket>& old_buckets, const std::vector<Bucket>& new_buckets,
                const std::vector<std::vector<at::Tensor>>& old_full = {});
  // shard_optimizer_state: this rank's shard of each bucket (empty: the state is whole). Set
  // before the first step, and before relayout() with the new buckets' shards.
  void set_shards(std::vector<ShardLayout> shards) { shards_ = std::move(shards); }
  bool sharded() const { return !shards_.empty(); }
  // Bucket `index`'s state buffers (this rank's shard of them when sharded), created (zeroed)
  // if missing: as many as its members' groups need, the same number on every rank, each as
  // long on every rank (kAdam8bit: the six buffers of Layout8).
  const std::vector<at::Tensor>& state_buffers(size_t index, const Bucket& bucket);
  // Sharded: bucket `index`'s state whole, from `gathered`, every rank's state_buffers() of it
  // gathered in rank order (world times as long): shard_numel-long buffers put back in place
  // into padded ones (an all-gather of the shards already is that), kAdam8bit's pieces moved
  // into the whole bucket's Layout8. What state_from() and a sharded relayout() take.
  std::vector<at::Tensor> whole_state(size_t index, const Bucket& bucket,
                                      std::vector<at::Tensor> gathered) const;
  // Each slot's entries in torch's format (as state(); none for a slot the kernels do not
  // step) from `bucket`'s whole state buffers `full` (whole_state()).
  std::vector<std::vector<std::pair<std::string, at::Tensor>>> state_from(
      const Bucket& bucket, const std::vector<at::Tensor>& full) const;
  // Sharded: this rank's pieces of bucket `index`'s state, as (parameter, torch's key, 1-D
  // view of the piece) in piece order: a slot's elements [slot_offset, slot_offset + numel)
  // (kAdam8bit's scales: its blocks [slot_offset / block, (slot_offset + numel) / block)).
  std::vector<std::tuple<int64_t, std::string, at::Tensor>> shard_state(size_t index,
                                                                        const Bucket& bucket);

  // torch's state entries of parameter p (slot `slot` of bucket `index`), in torch's key order;
  // empty before its first step. kAdam8bit, a quantized parameter: `exp_avg` and `exp_avg_sq`
  // are its codes (uint8, shaped like it), followed by `exp_avg.scale` and `exp_avg_sq.scale`.
  std::vector<std::pair<std::string, at::Tensor>> state(size_t p, size_t index,
                                                        const Bucket& bucket, size_t slot) const;
  // Sets parameter p's state from a checkpoint: `step` updates taken (0: no state) and the
  // values of its state tensors in state()'s order (the step tensor excluded; kAdam8bit: codes
  // and scales of a quantized parameter, as state() gives them).
  void load_state(size_t p, size_t index, const Bucket& bucket, size_t slot, int64_t step,
                  const std::vector<at::Tensor>& values);
  // torch's names of parameter p's state buffers, in buffer order (StateSpec::buffers, with its
  // group's live momentum).
  std::vector<std::string> buffer_keys(size_t p) const;
  // Updates parameter p has taken; set_steps() sets it (and torch's `step`) leaving the state
  // buffers as they are (a sharded checkpoint loaded them in place).
  int64_t steps(size_t p) const { return steps_[p]; }
  void set_steps(size_t p, int64_t step);
  // Changes whenever state tensors are created, moved or loaded (Python then refreshes its view).
  int64_t generation() const { return generation_; }
  int64_t state_bytes() const;

 private:
  size_t num_buffers(int64_t group) const;  // state buffers a parameter of this group needs
  // Parameter p's entries in torch's format from whole buffers `full` of SGD/Adam state, p's
  // slice starting at `offset`.
  std::vector<std::pair<std::string, at::Tensor>> entries(size_t p,
                                                          const std::vector<at::Tensor>& full,
                                                          int64_t offset) const;
  bool counted() const { return kind_ != OptimKind::kSgd; }  // keeps torch's `step` tensors
  // kAdam8bit (fused_optimizer_8bit.cpp). A bucket's state is six flat buffers: codes of both
  // moments of its quantized members (uint8), their scales (float32), plain moments of the
  // others (the state dtype), each packed in member order (Layout8). A member is a whole slot,
  // or, sharded, this rank's piece of one (whole blocks of a quantized slot: the cut, shard.h).
  struct Layout8 {
    std::vector<ShardPiece> members;  // in layout order (whole: one per slot, slot_offset 0)
    std::vector<char> quantized;      // per member
    std::vector<int64_t> at;          // per member: offset in the codes, or in the plain buffers
    std::vector<int64_t> scale_at;    // per member: offset in the scales (quantized)
    // The buffers' lengths: what the members need; sharded, the most any rank's shard needs,
    // so that every rank's buffers are equally long (gathered by one all-gather each).
    int64_t codes = 0, scales = 0, plain = 0;
  };
  // The layout of `members` of `bucket` (members the kernels do not step have no place in it:
  // the fallback keeps their state).
  Layout8 layout8(const Bucket& bucket, std::vector<ShardPiece> members) const;
  Layout8 whole_layout8(const Bucket& bucket) const;  // one member per slot: unsharded
  void ensure_state8(size_t index, const Bucket& bucket);
  // Member `m`'s state (a stepped member) as 1-D tensors of the buffers `flats` laid out as
  // `layout`: codes, codes, scale, scale (quantized), else the two moments.
  std::vector<at::Tensor> pieces8(const std::vector<at::Tensor>& flats, const Layout8& layout,
                                  size_t m) const;
  // `whole` (a whole slot's pieces8()) narrowed to `piece` of that slot.
  std::vector<at::Tensor> narrow8(const std::vector<at::Tensor>& whole,
                                  const ShardPiece& piece) const;
  // Writes `whole`, slot `slot`'s state as pieces8() gives it for the whole slot, into the
  // state (this rank's pieces of it when sharded).
  void copy_in8(size_t index, const Bucket& bucket, size_t slot,
                const std::vector<at::Tensor>& whole);
  void step8(size_t index, const Bucket& bucket, const std::vector<char>& mask,
             const StepTargets& targets);
  // Parameter p's entries in torch's format from the buffers `flats` of its bucket laid out as
  // `layout` (whole), slot `slot`.
  std::vector<std::pair<std::string, at::Tensor>> state8(size_t p, size_t slot,
                                                         const std::vector<at::Tensor>& flats,
                                                         const Layout8& layout) const;
  void relayout8(const std::vector<Bucket>& old_buckets, const std::vector<Bucket>& new_buckets,
                 const std::vector<std::vector<at::Tensor>>& old_full);
  // Every masked member of `bucket` counts the step (sharded: whether or not a piece of it is
  // here), its version counter bumped: those that `advanced` says were counted with the kernel
  // (Adam's counts on the device under found_inf) are only bumped. `take_back`: counts beside
  // found_inf are taken back where it is set (the 8-bit kind's CPU float32 counts).
  void count_steps(const Bucket& bucket, const std::vector<char>& mask, const StepTargets& targets,
                   const std::function<bool(size_t)>& advanced, bool take_back);
  void ensure_state(size_t index, const Bucket& bucket, size_t buffers);
  at::Tensor state_view(size_t index, const Bucket& bucket, size_t slot, size_t k) const;
  // Writes `values`, slot `slot`'s state of kind k as 1-D in the parameter's memory order, into
  // the state (only this rank's pieces of it when sharded).
  void copy_in(size_t index, const Bucket& bucket, size_t slot, size_t k, const at::Tensor& values);

  OptimKind kind_;
  std::vector<at::Tensor> params_;  // fixed
  std::vector<char> stepped_;       // per parameter, fixed: StateSpec::stepped
  std::vector<int64_t> group_of_;   // fixed
  std::vector<OptimHyper> groups_;
  c10::Device step_device_;
  at::TensorOptions state_options_;  // on the parameters' device or the host (dtype: state_dtype)
  at::ScalarType state_dtype(const Bucket& bucket) const;
  bool on_host_ = false;
  Quant8 quant_;                                // kAdam8bit
  std::vector<std::vector<at::Tensor>> flats_;  // per bucket: its state buffers (may be empty)
  std::vector<ShardLayout> shards_;             // per bucket, sharded (else empty)
  // kAdam8bit, per bucket: the layout of its state buffers (set with them, by ensure_state8;
  // sharded, of this rank's pieces)
  std::vector<Layout8> layouts8_;
  std::vector<int64_t> steps_;            // per parameter: updates taken
  std::vector<at::Tensor> step_tensors_;  // per parameter (Adam): torch's `step`
  int64_t generation_ = 0;
};

}  // namespace leanddp
