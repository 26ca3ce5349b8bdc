#include "modes.h"

#include <string>
#include <utility>

namespace leanddp {

namespace {

// The factory the messages suggest.
constexpr const char* kFactoryExample =
    "optimizer_in_backward=functools.partial(torch.optim.AdamW, lr=1e-3)";

ModeError error(std::string argument, std::string message) {
  return ModeError{std::move(argument), std::move(message)};
}

}  // namespace

std::optional<ModeError> check_modes(const Modes& m) {
  const bool nan_check = m.check_for_nan_in_grad != NanCheck::kOff;
  if (m.grad_scaler && !m.optimizer_in_backward) {
    return error("grad_scaler",
                 "grad_scaler is for optimizer_in_backward (the in-backward steps unscale); "
                 "without it use GradScaler as with torch's DDP");
  }
  if (nan_check && m.grad_scaler) {
    return error("check_for_nan_in_grad",
                 "check_for_nan_in_grad and grad_scaler go separately: with a GradScaler, "
                 "gradients holding inf/NaN are expected (the scale overflowed) and their step is "
                 "skipped, as torch's GradScaler does; pass check_for_nan_in_grad=False");
  }
  if (m.offload_to_cpu && !m.optimizer_in_backward) {
    return error("offload_to_cpu",
                 std::string("offload_to_cpu=True needs optimizer_in_backward=<optimizer factory>: "
                             "the optimizer state and master weights it moves to the host are "
                             "stepped there as each bucket is reduced, so the wrapper must own the "
                             "optimizer (e.g. ") +
                     kFactoryExample + ")");
  }
  if (m.max_grad_norm && !m.offload_to_cpu && !m.shard_optimizer_state) {
    return error("max_grad_norm",
                 "max_grad_norm needs optimizer_in_backward with offload_to_cpu=True or "
                 "shard_optimizer_state=True: stepping bucket by bucket on the device, a bucket "
                 "is stepped before the global gradient norm is known, so clipping could not be "
                 "exact. Without optimizer_in_backward, clip with "
                 "torch.nn.utils.clip_grad_norm_ before optimizer.step() as usual");
  }
  if (m.offload_threads && !m.offload_to_cpu) {
    return error("offload_threads", "offload_threads is meaningful only with offload_to_cpu=True");
  }
  if (m.accumulate_on_host && !m.offload_to_cpu) {
    return error("accumulate_on_host",
                 "accumulate_on_host=True needs offload_to_cpu=True: the no_sync() micro-batches' "
                 "gradients are summed in host memory beside the offloaded optimizer state");
  }
  if (m.shard_optimizer_state && !m.optimizer_in_backward) {
    return error("shard_optimizer_state",
                 std::string("shard_optimizer_state=True needs optimizer_in_backward=<optimizer "
                             "factory>: each rank steps its shard of every bucket inside "
                             "backward, so the wrapper must own the optimizer (e.g. ") +
                     kFactoryExample + ")");
  }
  if (m.shard_optimizer_state && nan_check) {
    return error("check_for_nan_in_grad",
                 "check_for_nan_in_grad is not supported with shard_optimizer_state=True (each "
                 "rank holds only its shard of the reduced gradients)");
  }
  if (m.shard_optimizer_state && m.grad_scaler) {
    return error("grad_scaler",
                 "grad_scaler is not supported with shard_optimizer_state=True (an overflow seen "
                 "in one rank's shard would skip the step on that rank only)");
  }
  if (!m.sparse_parameter.empty() && m.optimizer_in_backward) {
    return error("optimizer_in_backward",
                 "parameter '" + m.sparse_parameter +
                     "' gets sparse gradients (a module with sparse=True), which "
                     "optimizer_in_backward" +
                     (m.offload_to_cpu ? " with offload_to_cpu" : "") +
                     " cannot step: its fused and host optimizers take dense gradients. Build "
                     "the module with sparse=False, or train without optimizer_in_backward "
                     "(sparse gradients are then reduced as in torch's DDP)");
  }
  if (m.offload_to_cpu && m.grad_scaler && m.grad_scaler_enabled) {
    return error("grad_scaler",
                 "grad_scaler is not supported with offload_to_cpu (the host steps would have to "
                 "read the scale and found_inf from the device); use bfloat16, which needs no "
                 "scaler");
  }
  if (m.shard_optimizer_state && m.comm_hook) {
    return error("register_comm_hook",
                 "register_comm_hook is not supported with shard_optimizer_state (each bucket "
                 "is reduce-scattered, not handed to a hook)");
  }
  return std::nullopt;
}

}  // namespace leanddp
