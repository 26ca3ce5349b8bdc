// The Python module leanddp._C: the only file that knows pybind11. Importing it registers the
// custom ops (torch.ops.leanddp.*) through the static registrations of the other files, and
// binds the Reducer (whose methods release the GIL) and the Python side of communication hooks.
#include "bindings.h"
#include "fused_optim.h"
#include "ops/cpu_kernels.h"
#include "reducer.h"
#include "shard.h"

#include <ATen/Parallel.h>
#include <pybind11/functional.h>
#include <torch/extension.h>
#include <torch/version.h>
#include <torch/csrc/distributed/c10d/comm.hpp>

#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <set>

namespace py = pybind11;

namespace {

// A communication hook written in Python: `launch(index, bucket_count, buffer, params, offsets,
// lengths)` returns
// an object with `wait()` (a torch.futures.Future) whose value is the reduced tensor, or a list
// holding it.
class PyCommHook final : public leanddp::CommHook {
 public:
  explicit PyCommHook(py::object launch) : launch_(std::move(launch)) {}
  ~PyCommHook() override {
    py::gil_scoped_acquire gil;
    futures_.clear();
    launch_ = py::object();
  }
  void launch(size_t index, size_t bucket_count, const at::Tensor& buffer,
              const std::vector<int64_t>& params, const std::vector<int64_t>& offsets,
              const std::vector<int64_t>& lengths) override {
    py::gil_scoped_acquire gil;
    py::object future = launch_(index, bucket_count, buffer, params, offsets, lengths);
    if (futures_.size() <= index) futures_.resize(index + 1);
    futures_[index] = std::move(future);
  }
  at::Tensor wait(size_t index) override {
    py::gil_scoped_acquire gil;
    TORCH_CHECK(index < futures_.size() && futures_[index],
                "leanddp: no communication hook result for bucket ", index);
    // Dropped once read: the future holds the reduced tensor, which the Reducer releases.
    py::object future = std::move(futures_[index]);
    py::object value = future.attr("wait")();
    if (py::isinstance<py::list>(value) || py::isinstance<py::tuple>(value)) {
      value = value[py::int_(0)];
    }
    TORCH_CHECK(THPVariable_Check(value.ptr()),
                "leanddp: a communication hook's future must hold a tensor (or a list with one)");
    return THPVariable_Unpack(value.ptr());
  }
  void settle(size_t index) override {
    py::gil_scoped_acquire gil;
    if (index < futures_.size() && futures_[index]) futures_[index].attr("wait")();
  }
  bool done(size_t index) override {
    py::gil_scoped_acquire gil;
    return index < futures_.size() && futures_[index] &&
           futures_[index].attr("done")().cast<bool>();
  }
  void reset() override {
    py::gil_scoped_acquire gil;
    futures_.clear();
  }

 private:
  py::object launch_;
  std::vector<py::object> futures_;
};

// torch's own `dist.GradBucket` (c10d::GradBucket, bound by torch with a shared_ptr holder) over
// a bucket: `buffer` holds `params`' gradients at `offsets` with `lengths` (elements; both empty
// for a sparse bucket, whose buffer is the sparse gradient). GradBucket keeps its sizes as
// non-owning IntArrayRefs: they point into the parameters' own sizes, and the GradBucket holds
// the parameters, so they outlive it.
py::object make_grad_bucket(size_t index, size_t bucket_count, const at::Tensor& buffer,
                            std::vector<size_t> offsets, std::vector<size_t> lengths,
                            std::vector<at::Tensor> params) {
  TORCH_CHECK(
      offsets.size() == lengths.size() && (offsets.empty() || offsets.size() == params.size()),
      "leanddp: a GradBucket needs one offset and one length per parameter");
  std::vector<c10::IntArrayRef> sizes;
  if (!offsets.empty()) {
    for (const at::Tensor& p : params) sizes.push_back(p.sizes());
  }
  auto bucket = std::make_shared<c10d::GradBucket>(index, bucket_count, buffer, std::move(offsets),
                                                   std::move(lengths), std::move(sizes),
                                                   std::move(params), std::nullopt);
  return py::cast(bucket);
}

// The in-backward step of buckets the fused kernels do not cover, written in Python:
// `step(index, params, grads)` (see leanddp.optim).
class PyStepper final : public leanddp::BucketStepper {
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

// torch's param_group dict -> the fused optimizer's hyper-parameters (keys leanddp.optim sets).
leanddp::OptimHyper to_hyper(const py::dict& g) {
  leanddp::OptimHyper h;
  if (THPVariable_Check(g["lr"].ptr())) {
    h.lr_tensor = THPVariable_Unpack(g["lr"].ptr());  // read by the kernels, never by the host
    h.lr = 0.0;
  } else {
    h.lr = g["lr"].cast<double>();
  }
  h.beta1 = g["beta1"].cast<double>();
  h.beta2 = g["beta2"].cast<double>();
  h.eps = g["eps"].cast<double>();
  h.weight_decay = g["weight_decay"].cast<double>();
  h.momentum = g["momentum"].cast<double>();
  h.dampening = g["dampening"].cast<double>();
  h.nesterov = g["nesterov"].cast<bool>();
  h.maximize = g["maximize"].cast<bool>();
  h.decoupled = g["decoupled"].cast<bool>();
  return h;
}

std::vector<leanddp::OptimHyper> to_hypers(const std::vector<py::dict>& groups) {
  std::vector<leanddp::OptimHyper> out;
  for (const auto& g : groups) out.push_back(to_hyper(g));
  return out;
}

// What Reducer.set_optimizer takes from Python (_C.OptimizerSetup): the fused optimizer's kind
// ("sgd", "adam", or "" for none), each parameter's group, the groups as torch's param_group
// dicts (the keys leanddp.optim sets), the device of the step counts, and the Python step of
// the buckets the fused kernels do not cover.
struct OptimizerSetup {
  std::string kind;
  std::vector<int64_t> group_of;
  std::vector<py::dict> groups;
  std::string step_device = "cpu";
  py::object fallback = py::none();
};

// The Reducer's OptimizerSpec for `setup` (with the GIL: it wraps Python objects).
leanddp::OptimizerSpec to_spec(const leanddp::Reducer& reducer, const OptimizerSetup& setup) {
  leanddp::OptimizerSpec spec;
  if (!setup.kind.empty()) spec.kind = leanddp::optim_kind(setup.kind);
  spec.group_of = setup.group_of;
  spec.groups = to_hypers(setup.groups);
  spec.step_device = c10::Device(setup.step_device);
  // (offload_to_cpu steps every bucket on the host: no Python step to hold)
  if (!reducer.options().offload_to_cpu)
    spec.fallback = std::make_unique<PyStepper>(setup.fallback);
  return spec;
}

// The step window's decision unit (step_window.h), for the tests that drive it directly.
void bind_step_window(py::module_& m) {
  using leanddp::StepWindow;
  py::class_<StepWindow>(m, "_StepWindow")
      .def(py::init<size_t, bool>(), py::arg("capacity"), py::arg("device_ordered"))
      .def("reset", &StepWindow::reset, py::arg("carried") = 0)
      .def(
          "next",
          [](const StepWindow& self, const std::string& phase,
             const std::function<bool(size_t)>& ready) -> py::object {
            static const std::map<std::string, StepWindow::Phase> phases{
                {"after_hook", StepWindow::Phase::kAfterHook},
                {"before_launch", StepWindow::Phase::kBeforeLaunch},
                {"end", StepWindow::Phase::kEnd}};
            const auto it = phases.find(phase);
            TORCH_CHECK(it != phases.end(), "_StepWindow.next: unknown phase ", phase);
            const auto decision = self.next(it->second, ready);
            if (!decision) return py::none();
            static const char* names[] = {"step", "step_waiting", "finish"};
            // (a carried step's bucket belongs to an earlier backward: None)
            const py::object bucket =
                decision->bucket == StepWindow::kCarried ? py::none() : py::cast(decision->bucket);
            return py::make_tuple(names[static_cast<int>(decision->action)], bucket);
          },
          py::arg("phase"), py::arg("ready"))
      .def("launched_one", &StepWindow::launched_one)
      .def("stepped_one", &StepWindow::stepped_one)
      .def("finished_one", &StepWindow::finished_one)
      .def_property_readonly("launched", &StepWindow::launched)
      .def_property_readonly("stepped", &StepWindow::stepped)
      .def_property_readonly("finished", &StepWindow::finished)
      .def_property_readonly("carried", &StepWindow::carried)
      .def_property_readonly("in_flight", &StepWindow::in_flight);
  m.attr("BUCKETS_IN_FLIGHT") = leanddp::kBucketsInFlight;
}

void bind_reducer(py::module_& m) {
  using leanddp::Reducer;
  py::class_<leanddp::MemoryStats>(m, "MemoryStats")
      .def_readonly("bucket_bytes", &leanddp::MemoryStats::bucket_bytes)
      .def_readonly("grad_bytes", &leanddp::MemoryStats::grad_bytes)
      .def_readonly("grads_as_views", &leanddp::MemoryStats::grads_as_views)
      .def_readonly("grads_outside", &leanddp::MemoryStats::grads_outside)
      .def_readonly("num_buckets", &leanddp::MemoryStats::num_buckets)
      .def_readonly("optimizer_state_bytes", &leanddp::MemoryStats::optimizer_state_bytes)
      .def_readonly("peak_bucket_bytes", &leanddp::MemoryStats::peak_bucket_bytes)
      .def_readonly("max_buckets_in_flight", &leanddp::MemoryStats::max_buckets_in_flight)
      .def_readonly("recycled_bucket_bytes", &leanddp::MemoryStats::recycled_bucket_bytes)
      .def_readonly("host_master_bytes", &leanddp::MemoryStats::host_master_bytes)
      .def_readonly("host_buffer_bytes", &leanddp::MemoryStats::host_buffer_bytes)
      .def_readonly("host_pinned_bytes", &leanddp::MemoryStats::host_pinned_bytes)
      .def_readonly("host_accumulation_bytes", &leanddp::MemoryStats::host_accumulation_bytes);
  py::class_<leanddp::OffloadStats>(m, "OffloadStats")
      .def_readonly("iterations", &leanddp::OffloadStats::iterations)
      .def_readonly("buckets", &leanddp::OffloadStats::buckets)
      .def_readonly("step_seconds", &leanddp::OffloadStats::step_seconds)
      .def_readonly("wait_seconds", &leanddp::OffloadStats::wait_seconds)
      .def_readonly("grad_norm", &leanddp::OffloadStats::grad_norm)
      .def_readonly("master_bytes", &leanddp::OffloadStats::master_bytes)
      .def_readonly("host_buffer_bytes", &leanddp::OffloadStats::host_buffer_bytes)
      .def_readonly("pinned_bytes", &leanddp::OffloadStats::pinned_bytes);
  py::enum_<leanddp::NanCheck>(m, "NanCheck")
      .value("off", leanddp::NanCheck::kOff)
      .value("on", leanddp::NanCheck::kOn)
      .value("strict", leanddp::NanCheck::kStrict);
  using leanddp::ReducerOptions;
  py::class_<ReducerOptions>(m, "ReducerOptions", "The Reducer's settings (csrc/reducer.h).")
      .def(py::init<>())
      .def_readwrite("caps_bytes", &ReducerOptions::caps_bytes)
      .def_readwrite("initial_caps_bytes", &ReducerOptions::initial_caps_bytes)
      .def_readwrite("gradient_as_bucket_view", &ReducerOptions::gradient_as_bucket_view)
      .def_readwrite("find_unused_parameters", &ReducerOptions::find_unused_parameters)
      .def_readwrite("static_graph", &ReducerOptions::static_graph)
      .def_readwrite("step_in_backward", &ReducerOptions::step_in_backward)
      .def_readwrite("expect_sparse", &ReducerOptions::expect_sparse)
      .def_readwrite("buckets_in_flight", &ReducerOptions::buckets_in_flight)
      .def_readwrite("nan_check", &ReducerOptions::nan_check)
      .def_readwrite("shard_optimizer_state", &ReducerOptions::shard_optimizer_state)
      .def_readwrite("offload_to_cpu", &ReducerOptions::offload_to_cpu)
      .def_readwrite("offload_threads", &ReducerOptions::offload_threads)
      .def_readwrite("accumulate_on_host", &ReducerOptions::accumulate_on_host)
      .def_readwrite("max_grad_norm", &ReducerOptions::max_grad_norm);
  py::class_<OptimizerSetup>(m, "OptimizerSetup",
                             "What Reducer.set_optimizer needs (optimizer_in_backward).")
      .def(py::init<>())
      .def_readwrite("kind", &OptimizerSetup::kind)
      .def_readwrite("group_of", &OptimizerSetup::group_of)
      .def_readwrite("groups", &OptimizerSetup::groups)
      .def_readwrite("step_device", &OptimizerSetup::step_device)
      .def_readwrite("fallback", &OptimizerSetup::fallback);
  py::class_<Reducer>(m, "Reducer")
      .def(py::init([](std::vector<at::Tensor> params, std::vector<std::string> names,
                       const py::object& process_group, leanddp::ReducerOptions options) {
             auto pg = process_group.cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
             py::gil_scoped_release no_gil;
             return std::make_unique<Reducer>(std::move(params), std::move(names), std::move(pg),
                                              std::move(options));
           }),
           py::arg("params"), py::arg("names"), py::arg("process_group"), py::arg("options"))
      .def_property_readonly("options", &Reducer::options)
      .def("prepare_for_forward", &Reducer::prepare_for_forward,
           py::call_guard<py::gil_scoped_release>())
      .def("prepare_for_backward", &Reducer::prepare_for_backward, py::arg("outputs"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "prepare_for_backward",
          [](Reducer& self, const at::Tensor& output) { self.prepare_for_backward({output}); },
          py::arg("output"), py::call_guard<py::gil_scoped_release>())
      .def("rebuild_buckets", &Reducer::rebuild_buckets, py::call_guard<py::gil_scoped_release>())
      .def("set_static_graph", &Reducer::set_static_graph, py::call_guard<py::gil_scoped_release>())
      // The names torch's reducer uses, for code written against it.
      .def("_rebuild_buckets", &Reducer::rebuild_buckets, py::call_guard<py::gil_scoped_release>())
      .def("_set_static_graph", &Reducer::set_static_graph,
           py::call_guard<py::gil_scoped_release>())
      .def(
          "register_comm_hook",
          [](Reducer& self, py::object launch) {
            self.register_comm_hook(std::make_unique<PyCommHook>(std::move(launch)));
          },
          py::arg("launch"))
      .def(
          "set_optimizer",
          [](Reducer& self, const OptimizerSetup& setup) {
            leanddp::OptimizerSpec spec = to_spec(self, setup);
            py::gil_scoped_release no_gil;
            self.set_optimizer(std::move(spec));
          },
          py::arg("setup"))
      .def("wait_for_steps", &Reducer::wait_for_steps, py::arg("host_too") = false,
           py::call_guard<py::gil_scoped_release>())
      .def("pending_steps", &Reducer::pending_steps, py::arg("follow_copies") = false,
           py::call_guard<py::gil_scoped_release>())
      .def("follow_steps", &Reducer::follow_steps, py::call_guard<py::gil_scoped_release>())
      .def("wait_for_bucket", &Reducer::wait_for_bucket, py::arg("index"),
           py::call_guard<py::gil_scoped_release>())
      .def("_delay_host_steps", &Reducer::delay_host_steps, py::arg("seconds"),
           py::arg("additions") = std::nullopt, py::call_guard<py::gil_scoped_release>())
      .def("_delay_copies_back", &Reducer::delay_copies_back, py::arg("seconds"),
           py::call_guard<py::gil_scoped_release>())
      .def("_copy_back_stream", &Reducer::copy_back_stream,
           py::call_guard<py::gil_scoped_release>())
      .def("discard_host_gradients", &Reducer::discard_host_gradients,
           py::call_guard<py::gil_scoped_release>())
      .def("close",
           [](Reducer& self) {
             Reducer::Detached detached;
             {
               py::gil_scoped_release no_gil;
               detached = self.close();
               // A process group's destructor joins its threads, which may wait for the GIL.
               detached.works.clear();
               detached.futures.clear();
               detached.process_group.reset();
             }
             // The hook and the stepper hold Python objects: released here, with the GIL.
           })
      .def("closed", &Reducer::closed, py::call_guard<py::gil_scoped_release>())
      .def("offload_stats", &Reducer::offload_stats, py::call_guard<py::gil_scoped_release>())
      .def("load_master_weight", &Reducer::load_master_weight, py::arg("param"), py::arg("value"),
           py::call_guard<py::gil_scoped_release>())
      .def("adopt_master_weights", &Reducer::adopt_master_weights,
           py::call_guard<py::gil_scoped_release>())
      .def(
          "set_optimizer_groups",
          [](Reducer& self, const std::vector<py::dict>& groups) {
            auto hypers = to_hypers(groups);
            py::gil_scoped_release no_gil;
            self.set_optimizer_groups(std::move(hypers));
          },
          py::arg("groups"))
      .def(
          "set_grad_scaler",
          [](Reducer& self, std::optional<at::Tensor> scale, std::optional<at::Tensor> found_inf) {
            py::gil_scoped_release no_gil;
            self.set_grad_scaler(scale.value_or(at::Tensor()), found_inf.value_or(at::Tensor()));
          },
          py::arg("scale"), py::arg("found_inf"))
      .def("optimizer_state", &Reducer::optimizer_state, py::arg("param"),
           py::call_guard<py::gil_scoped_release>())
      .def("load_optimizer_state", &Reducer::load_optimizer_state, py::arg("param"),
           py::arg("step"), py::arg("values"), py::call_guard<py::gil_scoped_release>())
      .def("gathered_optimizer_state", &Reducer::gathered_optimizer_state,
           py::call_guard<py::gil_scoped_release>())
      .def("shard_placement", &Reducer::shard_placement, py::call_guard<py::gil_scoped_release>())
      .def("local_optimizer_state", &Reducer::local_optimizer_state,
           py::call_guard<py::gil_scoped_release>())
      .def("optimizer_steps", &Reducer::optimizer_steps, py::call_guard<py::gil_scoped_release>())
      .def("set_optimizer_steps", &Reducer::set_optimizer_steps, py::arg("steps"),
           py::call_guard<py::gil_scoped_release>())
      .def("optimizer_generation", &Reducer::optimizer_generation,
           py::call_guard<py::gil_scoped_release>())
      .def("memory_stats", &Reducer::memory_stats, py::call_guard<py::gil_scoped_release>())
      .def("events_created", &Reducer::events_created, py::call_guard<py::gil_scoped_release>())
      .def("_recycler_reuses", &Reducer::recycler_reuses, py::call_guard<py::gil_scoped_release>())
      .def("bucket_indices", &Reducer::bucket_indices, py::call_guard<py::gil_scoped_release>())
      .def("bucket_bytes", &Reducer::bucket_bytes, py::call_guard<py::gil_scoped_release>())
      .def("has_rebuilt_buckets", &Reducer::has_rebuilt_buckets,
           py::call_guard<py::gil_scoped_release>())
      .def("num_iterations", &Reducer::num_iterations, py::call_guard<py::gil_scoped_release>())
      .def("time_iteration", &Reducer::time_iteration, py::arg("sampled"),
           py::call_guard<py::gil_scoped_release>())
      .def("unused_parameters", &Reducer::unused_parameters,
           py::call_guard<py::gil_scoped_release>())
      .def("take_usage_error", &Reducer::take_usage_error, py::call_guard<py::gil_scoped_release>())
      .def("collect_times", [](Reducer& self) -> py::object {
        leanddp::IterationTimes t;
        {
          py::gil_scoped_release release;
          t = self.collect_times();
        }
        if (!t.valid) return py::none();
        py::dict d;
        d["host_ns"] = std::vector<int64_t>(t.host_ns.begin(), t.host_ns.end());
        d["forward_compute_time"] = t.forward_compute;
        d["backward_compute_time"] = t.backward_compute;
        d["backward_comm_time"] = t.backward_comm;
        d["backward_compute_comm_overlap_time"] = t.overlap;
        d["grad_ready_order"] = t.grad_ready_order;
        return d;
      });
}

// For tests: a HostOffload over one CPU parameter whose worker thread drops the last reference to
// it, so that its destructor (and shutdown()) run on the worker itself. Returns whether the
// destructor ran on another thread than the caller's, after it completed.
bool offload_released_on_worker() {
  at::Tensor param = at::zeros({4});
  std::vector<at::Tensor> params{param};
  auto fused = std::make_unique<leanddp::FusedOptimizer>(
      leanddp::OptimKind::kSgd, params, std::vector<int64_t>{0},
      std::vector<leanddp::OptimHyper>(1), c10::Device(c10::kCPU), /*on_host=*/true);
  std::promise<std::thread::id> destroyed;
  std::future<std::thread::id> destroyed_on = destroyed.get_future();
  std::shared_ptr<leanddp::HostOffload> owner(
      new leanddp::HostOffload(params, std::move(fused), leanddp::OffloadOptions{}),
      [&destroyed](leanddp::HostOffload* offload) {
        delete offload;
        destroyed.set_value(std::this_thread::get_id());
      });
  std::promise<void> released;
  std::shared_future<void> caller_released = released.get_future().share();
  // The task holds a reference until the worker drops the finished job, after ours is gone.
  owner->post([keep = owner, caller_released] { caller_released.wait(); });
  owner.reset();
  released.set_value();
  return destroyed_on.get() != std::this_thread::get_id();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "leanddp's C++/CUDA extension";
  bind_reducer(m);
  bind_step_window(m);
  bind_modes(m);
  m.def("make_grad_bucket", &make_grad_bucket, py::arg("index"), py::arg("bucket_count"),
        py::arg("buffer"), py::arg("offsets"), py::arg("lengths"), py::arg("params"),
        "torch's dist.GradBucket over a bucket's buffer (what communication hooks receive).");
  m.def(
      "assign_buckets",
      [](const std::vector<at::Tensor>& params, const std::vector<int64_t>& order,
         const std::vector<int64_t>& caps_bytes) {
        return leanddp::assign_buckets(params, order, caps_bytes, {});
      },
      py::arg("params"), py::arg("order"), py::arg("caps_bytes"),
      "The Reducer's grouping of dense parameters (visited in `order`) into buckets of at most "
      "`caps_bytes` (the last cap repeats): lists of parameter indices, per device and dtype. "
      "Reads only shapes and dtypes, so meta tensors plan a model too large to build.");
  m.def(
      "build_info",
      [] {
        py::dict info;
        info["torch_version"] = TORCH_VERSION;  // the torch this extension was compiled against
        info["version"] = LEANDDP_VERSION;      // leanddp's, from python/leanddp/_version.py
#ifdef LEANDDP_WITH_CUDA
        info["cuda"] = true;
#else
        info["cuda"] = false;
#endif
        info["cpu_isa"] = leanddp::ops::cpu_loops().name;
        return info;
      },
      "How this extension was built: torch version, CUDA kernels, CPU instruction set in use.");
  m.def(
      "shard_layout",
      [](const std::vector<int64_t>& offsets, const std::vector<int64_t>& numels,
         int64_t bucket_numel, int64_t align, int64_t world, int64_t rank) {
        const leanddp::ShardLayout layout =
            leanddp::shard_layout(offsets, numels, bucket_numel, align, world, rank);
        py::list pieces;
        for (const leanddp::ShardPiece& p : layout.pieces) {
          pieces.append(py::make_tuple(p.slot, p.slot_offset, p.shard_offset, p.numel));
        }
        py::dict out;
        out["padded"] = layout.padded;
        out["shard_numel"] = layout.shard_numel;
        out["begin"] = layout.begin;
        out["pieces"] = pieces;
        return out;
      },
      py::arg("offsets"), py::arg("numels"), py::arg("bucket_numel"), py::arg("align"),
      py::arg("world"), py::arg("rank"),
      "shard_optimizer_state's cut of a bucket (csrc/shard.h): padded and shard sizes, this "
      "rank's first element, and its pieces as (slot, slot_offset, shard_offset, numel).");
  py::class_<leanddp::StateSpec>(
      m, "StateSpec",
      "What the fused kernels keep for one parameter, and whether they step it (fused_optim.h).")
      .def_readonly("stepped", &leanddp::StateSpec::stepped)
      .def_readonly("unfit", &leanddp::StateSpec::unfit)
      .def_readonly("needs", &leanddp::StateSpec::needs)
      .def_readonly("counted", &leanddp::StateSpec::counted)
      .def_readonly("buffers", &leanddp::StateSpec::buffers)
      .def_readonly("master", &leanddp::StateSpec::master)
      .def_readonly("dtype", &leanddp::StateSpec::dtype)
      .def_readonly("device", &leanddp::StateSpec::device)
      .def_property_readonly("keys", &leanddp::StateSpec::keys);
  m.def(
      "state_spec",
      [](const std::string& kind, const at::Tensor& param, bool on_host, bool momentum) {
        return leanddp::state_spec(leanddp::optim_kind(kind), param, on_host, momentum);
      },
      py::arg("kind"), py::arg("param"), py::arg("on_host"), py::arg("momentum"),
      "The fused optimizer's rule for `param` stepped by `kind` (\"sgd\", \"adam\") on the host "
      "(offload_to_cpu) or its device, `momentum` its group's momentum is nonzero: whether the "
      "kernels step it, and its state's keys, dtype and device (csrc/fused_optim.h).");
  m.def(
      "_reduce_to_shard",
      [](const py::object& process_group, at::Tensor flat, const std::vector<int64_t>& offsets,
         const std::vector<int64_t>& numels, int64_t bucket_numel, int64_t align) {
        auto group = process_group.cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
        const leanddp::ShardLayout layout = leanddp::shard_layout(
            offsets, numels, bucket_numel, align, group->getSize(), group->getRank());
        // Without the GIL from the collective's start (as torch's bindings): gloo's worker may
        // drop an earlier work's Python-owned tensors, which takes the GIL, while holding the
        // lock the start needs.
        py::gil_scoped_release no_gil;
        leanddp::reduce_to_shard(group, flat, layout)->wait();
      },
      py::arg("process_group"), py::arg("flat"), py::arg("offsets"), py::arg("numels"),
      py::arg("bucket_numel"), py::arg("align"),
      "Test hook: reduce_to_shard (csrc/shard.h) of the padded bucket `flat` over the group, "
      "waited for.");
  m.def("_set_host_ordering", &leanddp::set_host_ordering, py::arg("on"),
        "Test seam (csrc/streams.h): CPU tensors are ordered as if on a device that runs apart, "
        "so wrappers built afterwards take their device-ordered branches on the CPU.");
  m.def(
      "_host_ordering_counts",
      [] {
        const auto c = leanddp::host_ordering_counts();
        py::dict d;
        d["streams"] = c.streams;
        d["records"] = c.records;
        d["blocks"] = c.blocks;
        d["synchronizes"] = c.synchronizes;
        d["records_on_stream"] = c.records_on_stream;
        return d;
      },
      "What host ordering was asked to do in this process so far (csrc/streams.h).");
  m.def(
      "_reduces_scattered",
      [](const py::object& process_group, const std::string& device) {
        auto group = process_group.cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
        return leanddp::reduces_scattered(group, c10::Device(device));
      },
      py::arg("process_group"), py::arg("device"),
      "Test hook: whether shard_optimizer_state reduce-scatters buckets on `device` over the "
      "group (csrc/shard.h), else allreduces them.");
  m.def(
      "_pack_and_gather_shards",
      [](const py::object& process_group, at::Tensor flat, const std::vector<int64_t>& offsets,
         const std::vector<int64_t>& numels, int64_t bucket_numel, int64_t align,
         const std::vector<at::Tensor>& sources) {
        auto group = process_group.cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
        const leanddp::ShardLayout layout = leanddp::shard_layout(
            offsets, numels, bucket_numel, align, group->getSize(), group->getRank());
        py::gil_scoped_release no_gil;  // (see _reduce_to_shard)
        leanddp::pack_shard(flat, layout, sources);
        leanddp::gather_shards(group, flat, layout)->wait();
      },
      py::arg("process_group"), py::arg("flat"), py::arg("offsets"), py::arg("numels"),
      py::arg("bucket_numel"), py::arg("align"), py::arg("sources"),
      "Test hook: pack_shard then gather_shards (csrc/shard.h) of the padded bucket `flat`, "
      "waited for.");
  m.def("_offload_released_on_worker", &offload_released_on_worker,
        py::call_guard<py::gil_scoped_release>(),
        "Test hook: an offload worker that drops the last reference to its owner (its "
        "destructor runs on the worker thread); True once it completed there.");
  m.def(
      "_parallel_threads",
      [] {
        std::mutex mu;
        std::set<int> ids;
        at::parallel_for(0, 1 << 20, 1, [&](int64_t, int64_t) {
          std::lock_guard<std::mutex> lock(mu);
          ids.insert(at::get_thread_num());
        });
        return ids.size();
      },
      "How many threads at::parallel_for uses from this extension (a build check: without "
      "OpenMP it silently uses one).");
}
