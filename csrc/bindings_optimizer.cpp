// leanddp._C's InBackwardOptimizer (its methods release the GIL), the typed values that cross
// into it (OptimKind, OptimHyper, InBackwardOptions) and what it reports (see bindings.h).
#include "bindings.h"
#include "in_backward_optimizer.h"

#include <torch/csrc/utils/pybind.h>

namespace py = pybind11;

namespace leanddp {
namespace {

// The in-backward step of buckets the fused kernels do not cover, written in Python:
// `step(index, params, grads)` (see leanddp.optim).
class PyStepper final : public BucketStepper {
 public:
  explicit PyStepper(py::object step) : step_(std::move(step)) {}
  ~PyStepper() override {
    py::gil_scoped_acquire gil;
    step_ = py::object();
  }
  void step(size_t index, const std::vector<int64_t>& params,
            const std::vector<at::Tensor>& grads) override {
    py::gil_scoped_acquire gil;
    step_(index, params, grads);
  }

 private:
  py::object step_;
};

void bind_values(py::module_& m) {
  py::enum_<OptimKind>(m, "OptimKind", "The optimizers the fused kernels step (fused_optimizer.h).")
      .value("sgd", OptimKind::kSgd)
      .value("adam", OptimKind::kAdam)
      .value("adam8bit", OptimKind::kAdam8bit);
  py::class_<OptimHyper>(m, "OptimHyper",
                         "One parameter group's hyper-parameters for the fused kernels.")
      .def(py::init([](double lr, std::optional<at::Tensor> lr_tensor, double beta1, double beta2,
                       double eps, double weight_decay, double momentum, double dampening,
                       bool nesterov, bool maximize, bool decoupled) {
             OptimHyper h;
             h.lr = lr;
             h.lr_tensor = lr_tensor.value_or(at::Tensor());
             h.beta1 = beta1;
             h.beta2 = beta2;
             h.eps = eps;
             h.weight_decay = weight_decay;
             h.momentum = momentum;
             h.dampening = dampening;
             h.nesterov = nesterov;
             h.maximize = maximize;
             h.decoupled = decoupled;
             return h;
           }),
           py::kw_only(), py::arg("lr"), py::arg("lr_tensor") = std::nullopt,
           py::arg("beta1") = 0.9, py::arg("beta2") = 0.999, py::arg("eps") = 1e-8,
           py::arg("weight_decay") = 0.0, py::arg("momentum") = 0.0, py::arg("dampening") = 0.0,
           py::arg("nesterov") = false, py::arg("maximize") = false, py::arg("decoupled") = false)
      .def_readonly("lr", &OptimHyper::lr)
      .def_property_readonly("lr_tensor",
                             [](const OptimHyper& h) -> std::optional<at::Tensor> {
                               if (!h.lr_tensor.defined()) return std::nullopt;
                               return h.lr_tensor;
                             })
      .def_readonly("beta1", &OptimHyper::beta1)
      .def_readonly("beta2", &OptimHyper::beta2)
      .def_readonly("eps", &OptimHyper::eps)
      .def_readonly("weight_decay", &OptimHyper::weight_decay)
      .def_readonly("momentum", &OptimHyper::momentum)
      .def_readonly("dampening", &OptimHyper::dampening)
      .def_readonly("nesterov", &OptimHyper::nesterov)
      .def_readonly("maximize", &OptimHyper::maximize)
      .def_readonly("decoupled", &OptimHyper::decoupled);
  py::class_<InBackwardOptions>(m, "InBackwardOptions",
                                "How the in-backward optimizer steps (in_backward_optimizer.h).")
      .def(py::init<>())
      .def_readwrite("kind", &InBackwardOptions::kind)
      .def_readwrite("group_of", &InBackwardOptions::group_of)
      .def_readwrite("groups", &InBackwardOptions::groups)
      .def_property(
          "step_device", [](const InBackwardOptions& o) { return o.step_device.str(); },
          [](InBackwardOptions& o, const std::string& device) {
            o.step_device = c10::Device(device);
          })
      .def_readwrite("offload_to_cpu", &InBackwardOptions::offload_to_cpu)
      .def_readwrite("offload_threads", &InBackwardOptions::offload_threads)
      .def_readwrite("sharded", &InBackwardOptions::sharded)
      .def_readwrite("max_grad_norm", &InBackwardOptions::max_grad_norm)
      .def_property(
          "block_size", [](const InBackwardOptions& o) { return o.quant.block; },
          [](InBackwardOptions& o, int64_t block) { o.quant.block = block; })
      .def_property(
          "qmaps",
          [](const InBackwardOptions& o) {
            return std::make_pair(o.quant.qmap_signed, o.quant.qmap_unsigned);
          },
          [](InBackwardOptions& o, std::pair<at::Tensor, at::Tensor> maps) {
            o.quant.qmap_signed = std::move(maps.first);
            o.quant.qmap_unsigned = std::move(maps.second);
          });
  py::class_<OffloadStats>(m, "OffloadStats")
      .def_readonly("iterations", &OffloadStats::iterations)
      .def_readonly("buckets", &OffloadStats::buckets)
      .def_readonly("step_seconds", &OffloadStats::step_seconds)
      .def_readonly("wait_seconds", &OffloadStats::wait_seconds)
      .def_readonly("grad_norm", &OffloadStats::grad_norm)
      .def_readonly("master_bytes", &OffloadStats::master_bytes)
      .def_readonly("host_buffer_bytes", &OffloadStats::host_buffer_bytes)
      .def_readonly("pinned_bytes", &OffloadStats::pinned_bytes);
  py::class_<OptimizerMemory>(m, "OptimizerMemory")
      .def_readonly("state_bytes", &OptimizerMemory::state_bytes)
      .def_readonly("host_master_bytes", &OptimizerMemory::host_master_bytes)
      .def_readonly("host_buffer_bytes", &OptimizerMemory::host_buffer_bytes)
      .def_readonly("host_pinned_bytes", &OptimizerMemory::host_pinned_bytes);
  py::class_<StateSpec>(m, "StateSpec",
                        "What the fused kernels keep for one parameter, and whether they step it "
                        "(fused_optimizer.h).")
      .def_readonly("stepped", &StateSpec::stepped)
      .def_readonly("unfit", &StateSpec::unfit)
      .def_readonly("needs", &StateSpec::needs)
      .def_readonly("counted", &StateSpec::counted)
      .def_readonly("buffers", &StateSpec::buffers)
      .def_readonly("master", &StateSpec::master)
      .def_readonly("quantized", &StateSpec::quantized)
      .def_readonly("block", &StateSpec::block)
      .def_readonly("dtype", &StateSpec::dtype)
      .def_readonly("device", &StateSpec::device)
      .def_property_readonly("keys", &StateSpec::keys);
  m.def("state_spec", &state_spec, py::arg("kind"), py::arg("param"), py::arg("on_host"),
        py::arg("momentum"), py::arg("block") = 0,
        "The fused optimizer's rule for `param` stepped by `kind` on the host (offload_to_cpu) "
        "or its device, `momentum` its group's momentum is nonzero, `block` the 8-bit kind's "
        "block size: whether the kernels step it, and its state's keys, dtype and device "
        "(csrc/fused_optimizer.h).");
}

}  // namespace

void bind_optimizer(py::module_& m) {
  bind_values(m);
  using Opt = InBackwardOptimizer;
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  py::class_<Opt, std::shared_ptr<Opt>>(
      m, "InBackwardOptimizer",
      "optimizer_in_backward's optimizer: the state, the steps the Reducer hands over, and the "
      "forward's waits (csrc/in_backward_optimizer.h).")
      .def(py::init([](std::vector<at::Tensor> params, std::vector<std::string> names,
                       const py::object& process_group, InBackwardOptions options,
                       py::object fallback) {
             auto group = process_group.cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
             // (offload_to_cpu steps every bucket on the host: no Python step to hold)
             std::unique_ptr<BucketStepper> stepper;
             if (!options.offload_to_cpu) stepper = std::make_unique<PyStepper>(fallback);
             py::gil_scoped_release no_gil;
             return std::make_shared<Opt>(std::move(params), std::move(names), std::move(group),
                                          std::move(options), std::move(stepper));
           }),
           py::arg("params"), py::arg("names"), py::arg("process_group"), py::arg("options"),
           py::arg("fallback"))
      .def("wait_for_steps", &Opt::wait_for_steps, py::arg("host_too") = false, no_gil)
      .def("pending_steps", &Opt::pending_steps, py::arg("follow_copies") = false, no_gil)
      .def("follow_steps", &Opt::follow_steps, no_gil)
      .def("wait_for_bucket", &Opt::wait_for_bucket, py::arg("index"), no_gil)
      .def("set_groups", &Opt::set_groups, py::arg("groups"), no_gil)
      .def(
          "set_grad_scaler",
          [](Opt& self, std::optional<at::Tensor> scale, std::optional<at::Tensor> found_inf) {
            py::gil_scoped_release no_gil;
            self.set_grad_scaler(scale.value_or(at::Tensor()), found_inf.value_or(at::Tensor()));
          },
          py::arg("scale"), py::arg("found_inf"))
      .def("state", &Opt::state, py::arg("param"), no_gil)
      .def("load_state", &Opt::load_state, py::arg("param"), py::arg("step"), py::arg("values"),
           no_gil)
      .def("load_master_weight", &Opt::load_master_weight, py::arg("param"), py::arg("value"),
           no_gil)
      .def("adopt_master_weights", &Opt::adopt_master_weights, no_gil)
      .def("generation", &Opt::generation, no_gil)
      .def("gathered_state", &Opt::gathered_state, no_gil)
      .def("shard_placement", &Opt::shard_placement, no_gil)
      .def("local_state", &Opt::local_state, no_gil)
      .def("steps", &Opt::steps, no_gil)
      .def("set_steps", &Opt::set_steps, py::arg("steps"), no_gil)
      .def("stats", &Opt::stats, no_gil)
      .def("memory_stats", &Opt::memory_stats, no_gil)
      .def("events_created", &Opt::events_created, no_gil)
      .def("attached", &Opt::attached, no_gil)
      .def("_delay_host_steps", &Opt::delay_host_steps, py::arg("seconds"), no_gil)
      .def("_inject_host_faults", &Opt::inject_host_faults, py::arg("kind"), py::arg("count"),
           py::arg("bucket") = -1, no_gil)
      .def("_delay_copies_back", &Opt::delay_copies_back, py::arg("seconds"), no_gil)
      .def("_copy_back_stream", &Opt::copy_back_stream, no_gil);
}

}  // namespace leanddp
