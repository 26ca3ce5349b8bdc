// leanddp._C's Reducer (its methods release the GIL), its options and statistics, and the
// Python side of communication hooks (see bindings.h).
#include "bindings.h"
#include "reducer.h"

#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/distributed/c10d/comm.hpp>

namespace py = pybind11;

namespace leanddp {
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

}  // namespace

void bind_reducer(py::module_& m) {
  using leanddp::Reducer;
  py::class_<leanddp::MemoryStats>(m, "MemoryStats")
      .def_readonly("bucket_bytes", &leanddp::MemoryStats::bucket_bytes)
      .def_readonly("grad_bytes", &leanddp::MemoryStats::grad_bytes)
      .def_readonly("grads_as_views", &leanddp::MemoryStats::grads_as_views)
      .def_readonly("grads_outside", &leanddp::MemoryStats::grads_outside)
      .def_readonly("num_buckets", &leanddp::MemoryStats::num_buckets)
      .def_readonly("peak_bucket_bytes", &leanddp::MemoryStats::peak_bucket_bytes)
      .def_readonly("max_buckets_in_flight", &leanddp::MemoryStats::max_buckets_in_flight)
      .def_readonly("recycled_bucket_bytes", &leanddp::MemoryStats::recycled_bucket_bytes)
      .def_readonly("host_accumulation_bytes", &leanddp::MemoryStats::host_accumulation_bytes)
      .def_readonly("host_pinned_bytes", &leanddp::MemoryStats::host_pinned_bytes);
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
      .def_readwrite("optimizer_in_backward", &ReducerOptions::optimizer_in_backward)
      .def_readwrite("sparse_names", &ReducerOptions::sparse_names)
      .def_readwrite("buckets_in_flight", &ReducerOptions::buckets_in_flight)
      .def_readwrite("nan_check", &ReducerOptions::nan_check)
      .def_readwrite("shard_optimizer_state", &ReducerOptions::shard_optimizer_state)
      .def_readwrite("shard_block", &ReducerOptions::shard_block)
      .def_readwrite("shard_block_names", &ReducerOptions::shard_block_names)
      .def_readwrite("accumulate_on_host", &ReducerOptions::accumulate_on_host)
      .def_readwrite("max_grad_norm", &ReducerOptions::max_grad_norm);
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
      .def("set_optimizer", &Reducer::set_optimizer, py::arg("optimizer"),
           py::call_guard<py::gil_scoped_release>())
      .def("_delay_additions", &Reducer::delay_additions, py::arg("seconds"),
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
               detached.optimizer.group.reset();
             }
             // The hook and the stepper hold Python objects: released here, with the GIL.
           })
      .def("closed", &Reducer::closed, py::call_guard<py::gil_scoped_release>())
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
  m.def("make_grad_bucket", &make_grad_bucket, py::arg("index"), py::arg("bucket_count"),
        py::arg("buffer"), py::arg("offsets"), py::arg("lengths"), py::arg("params"),
        "torch's dist.GradBucket over a bucket's buffer (what communication hooks receive).");
}

}  // namespace leanddp
