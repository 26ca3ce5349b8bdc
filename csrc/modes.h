// Which of DistributedDataParallel's modes combine: the one source of the rules.
//
// Modes describes a combination a user asked for (optimizer_in_backward, offload_to_cpu,
// shard_optimizer_state, their companions, the NaN check, a GradScaler, a communication hook,
// sparse gradients); check_modes() returns the first rule it breaks, with the user-facing
// message. The Python side (leanddp._C.Modes / check_modes) asks it once at construction, before
// any collective or state change, and again when a communication hook is registered; the docs'
// table of which modes combine is held to it by the tests. Each argument's own type and range
// (a bool, a positive number) are checked in Python before, and are no concern here.
//
// A leaf: it includes nothing of leanddp's and no torch header, so that anything may ask it.
#pragma once

#include <optional>
#include <string>

namespace leanddp {

// check_for_nan_in_grad: off; on (raise at the end of backward; with optimizer_in_backward on the
// device, buckets stepped before the bad one keep their update); strict (also defers the device's
// in-backward steps to the end of backward, so a NaN changes no weight).
enum class NanCheck { kOff = 0, kOn = 1, kStrict = 2 };

// A requested combination of modes. Every field says whether the user asked for the knob it is
// named after; all default to "not asked", which combines with anything. A plain record: it is
// filled in by the caller and only read by check_modes().
struct Modes {
  // optimizer_in_backward=<factory> was given: buckets are stepped inside backward.
  bool optimizer_in_backward = false;
  // offload_to_cpu=True: optimizer state and masters on the host, stepped there.
  bool offload_to_cpu = false;
  // shard_optimizer_state=True: each rank keeps and steps 1/N of every bucket's state.
  bool shard_optimizer_state = false;
  // accumulate_on_host=True was given explicitly (its default, None, follows offload_to_cpu
  // and breaks no rule).
  bool accumulate_on_host = false;
  // max_grad_norm was given (not None).
  bool max_grad_norm = false;
  // offload_threads was given (not None).
  bool offload_threads = false;
  // check_for_nan_in_grad: False, True or "strict".
  NanCheck check_for_nan_in_grad = NanCheck::kOff;
  // grad_scaler=<GradScaler> was given, and whether that scaler is enabled (a disabled scaler
  // scales nothing, so only the rules about the host steps reading its scale let it pass).
  bool grad_scaler = false;
  bool grad_scaler_enabled = true;
  // A communication hook is (being) registered (register_comm_hook).
  bool comm_hook = false;
  // The first trainable parameter that gets sparse gradients (a module with sparse=True), by
  // name; empty if none does.
  std::string sparse_parameter;
};

// A broken rule: the argument it names (as the constructor spells it, or "register_comm_hook")
// and the message for the user, without the "leanddp.DistributedDataParallel: " prefix the
// caller adds.
struct ModeError {
  std::string argument;
  std::string message;
};

// The first rule `modes` breaks, or nullopt if they combine. Called by the constructor's
// argument check (after each argument's own checks, before any collective) and by
// register_comm_hook (with comm_hook set, before the hook is attached); pure, cheap, and it
// assumes nothing of the process group or the module. The rules are tried in a fixed order, so
// that a combination breaking several gets the same message every time.
std::optional<ModeError> check_modes(const Modes& modes);

}  // namespace leanddp
