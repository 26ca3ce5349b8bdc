// leanddp._C.Modes, ModeError and check_modes: the rules of which modes combine (modes.h), for
// the constructor's argument check, register_comm_hook and the tests that hold the docs' table
// to them.
#include "bindings.h"
#include "modes.h"

#include <pybind11/pybind11.h>

#include <iterator>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace py = pybind11;

namespace {

using leanddp::Modes;
using leanddp::NanCheck;

// Modes' yes/no fields, in declaration order: the constructor's keywords, the pickled state
// and the repr follow it.
constexpr std::pair<const char*, bool Modes::*> kFlags[] = {
    {"optimizer_in_backward", &Modes::optimizer_in_backward},
    {"offload_to_cpu", &Modes::offload_to_cpu},
    {"shard_optimizer_state", &Modes::shard_optimizer_state},
    {"accumulate_on_host", &Modes::accumulate_on_host},
    {"max_grad_norm", &Modes::max_grad_norm},
    {"offload_threads", &Modes::offload_threads},
    {"grad_scaler", &Modes::grad_scaler},
    {"grad_scaler_enabled", &Modes::grad_scaler_enabled},
    {"comm_hook", &Modes::comm_hook},
};

const char* nan_check_name(NanCheck value) {
  switch (value) {
    case NanCheck::kOff:
      return "off";
    case NanCheck::kOn:
      return "on";
    case NanCheck::kStrict:
      return "strict";
  }
  return "?";
}

py::tuple state_of(const Modes& modes) {
  py::tuple state(std::size(kFlags) + 2);
  size_t i = 0;
  for (const auto& flag : kFlags) state[i++] = py::bool_(modes.*flag.second);
  state[i++] = py::cast(modes.check_for_nan_in_grad);
  state[i] = py::str(modes.sparse_parameter);
  return state;
}

Modes from_state(const py::tuple& state) {
  if (state.size() != std::size(kFlags) + 2) throw std::runtime_error("Modes: invalid state");
  Modes modes;
  size_t i = 0;
  for (const auto& flag : kFlags) modes.*flag.second = state[i++].cast<bool>();
  modes.check_for_nan_in_grad = state[i++].cast<NanCheck>();
  modes.sparse_parameter = state[i].cast<std::string>();
  return modes;
}

}  // namespace

namespace leanddp {

void bind_modes(py::module_& m) {
  py::class_<leanddp::ModeError>(
      m, "ModeError", "A rule of which modes combine that a Modes breaks (csrc/modes.h).")
      .def_readonly("argument", &leanddp::ModeError::argument,
                    "The argument the rule names, as the constructor spells it "
                    "(or 'register_comm_hook').")
      .def_readonly("message", &leanddp::ModeError::message,
                    "The message for the user, without the 'leanddp.DistributedDataParallel: ' "
                    "prefix.")
      .def("__repr__", [](const leanddp::ModeError& e) {
        return "ModeError(argument=" + py::repr(py::str(e.argument)).cast<std::string>() +
               ", message=" + py::repr(py::str(e.message)).cast<std::string>() + ")";
      });

  py::class_<Modes>(m, "Modes",
                    "A requested combination of modes (csrc/modes.h); every field defaults to "
                    "'not asked for'.")
      .def(py::init([](bool optimizer_in_backward, bool offload_to_cpu, bool shard_optimizer_state,
                       bool accumulate_on_host, bool max_grad_norm, bool offload_threads,
                       bool grad_scaler, bool grad_scaler_enabled, bool comm_hook,
                       NanCheck check_for_nan_in_grad, std::string sparse_parameter) {
             Modes modes;
             modes.optimizer_in_backward = optimizer_in_backward;
             modes.offload_to_cpu = offload_to_cpu;
             modes.shard_optimizer_state = shard_optimizer_state;
             modes.accumulate_on_host = accumulate_on_host;
             modes.max_grad_norm = max_grad_norm;
             modes.offload_threads = offload_threads;
             modes.grad_scaler = grad_scaler;
             modes.grad_scaler_enabled = grad_scaler_enabled;
             modes.comm_hook = comm_hook;
             modes.check_for_nan_in_grad = check_for_nan_in_grad;
             modes.sparse_parameter = std::move(sparse_parameter);
             return modes;
           }),
           py::kw_only(), py::arg("optimizer_in_backward") = false,
           py::arg("offload_to_cpu") = false, py::arg("shard_optimizer_state") = false,
           py::arg("accumulate_on_host") = false, py::arg("max_grad_norm") = false,
           py::arg("offload_threads") = false, py::arg("grad_scaler") = false,
           py::arg("grad_scaler_enabled") = true, py::arg("comm_hook") = false,
           py::arg("check_for_nan_in_grad") = NanCheck::kOff, py::arg("sparse_parameter") = "")
      .def_readwrite("optimizer_in_backward", &Modes::optimizer_in_backward)
      .def_readwrite("offload_to_cpu", &Modes::offload_to_cpu)
      .def_readwrite("shard_optimizer_state", &Modes::shard_optimizer_state)
      .def_readwrite("accumulate_on_host", &Modes::accumulate_on_host)
      .def_readwrite("max_grad_norm", &Modes::max_grad_norm)
      .def_readwrite("offload_threads", &Modes::offload_threads)
      .def_readwrite("grad_scaler", &Modes::grad_scaler)
      .def_readwrite("grad_scaler_enabled", &Modes::grad_scaler_enabled)
      .def_readwrite("comm_hook", &Modes::comm_hook)
      .def_readwrite("check_for_nan_in_grad", &Modes::check_for_nan_in_grad)
      .def_readwrite("sparse_parameter", &Modes::sparse_parameter)
      .def("__copy__", [](const Modes& modes) { return modes; })
      .def("__deepcopy__", [](const Modes& modes, py::dict) { return modes; })
      .def(
          "__eq__", [](const Modes& a, const Modes& b) { return state_of(a).equal(state_of(b)); },
          py::is_operator())
      .def("__repr__",
           [](const Modes& modes) {
             std::ostringstream out;
             out << "Modes(";
             for (const auto& flag : kFlags) {
               out << flag.first << "=" << (modes.*flag.second ? "True" : "False") << ", ";
             }
             out << "check_for_nan_in_grad=NanCheck." << nan_check_name(modes.check_for_nan_in_grad)
                 << ", sparse_parameter="
                 << py::repr(py::str(modes.sparse_parameter)).cast<std::string>() << ")";
             return out.str();
           })
      .def(py::pickle(&state_of, &from_state));

  m.def(
      "check_modes",
      [](const Modes& modes) -> py::object {
        std::optional<leanddp::ModeError> error = leanddp::check_modes(modes);
        if (!error) return py::none();
        return py::cast(std::move(*error));
      },
      py::arg("modes"),
      "The first rule of which modes combine that `modes` breaks (a ModeError), or None if "
      "they combine (csrc/modes.h).");
}

}  // namespace leanddp
