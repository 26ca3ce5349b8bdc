// leanddp._C._testing: the seams tests drive directly (the step window, the shard collectives,
// host ordering, the offload worker's end on its own thread, the kinds of host job a test makes
// fail, the OpenMP build check). Nothing in leanddp itself calls them (see bindings.h).
#include "bindings.h"
#include "fused_optimizer.h"
#include "host_offload.h"
#include "ops/cpu_kernels.h"
#include "shard.h"
#include "step_window.h"
#include "streams.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <pybind11/functional.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <chrono>
#include <future>
#include <map>
#include <mutex>
#include <set>
#include <thread>

namespace py = pybind11;

namespace leanddp {
namespace {

// An 8-bit Adam map for the CPU kernels' testing entries.
void check_qmap(const at::Tensor& qmap, const char* entry) {
  TORCH_CHECK(qmap.scalar_type() == at::kFloat && qmap.numel() == ops::kQmapSize &&
                  qmap.is_contiguous() && qmap.is_cpu(),
              entry, ": qmap must be 256 contiguous float32 entries on the CPU");
}

// The step window's decision unit (step_window.h), for the tests that drive it directly.
void bind_step_window(py::module_& m) {
  using leanddp::StepWindow;
  py::class_<StepWindow>(m, "StepWindow")
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
            TORCH_CHECK(it != phases.end(), "StepWindow.next: unknown phase ", phase);
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
}

// For tests: a HostOffload over one CPU parameter whose worker thread drops the last reference to
// it, so that its destructor (and shutdown()) run on the worker itself: as a finished job, or,
// `after_error`, as a job the worker drops because the one before it raised. Returns whether the
// destructor ran on another thread than the caller's, after it completed (false if it had not
// within 20 seconds).
bool offload_released_on_worker(bool after_error) {
  at::Tensor param = at::zeros({4});
  std::vector<at::Tensor> params{param};
  auto fused = std::make_unique<leanddp::FusedOptimizer>(
      leanddp::OptimKind::kSgd, params, std::vector<int64_t>{0},
      std::vector<leanddp::OptimHyper>(1), c10::Device(c10::kCPU), /*on_host=*/true);
  auto destroyed = std::make_shared<std::promise<std::thread::id>>();
  std::future<std::thread::id> destroyed_on = destroyed->get_future();
  std::shared_ptr<leanddp::HostOffload> owner(
      new leanddp::HostOffload(params, std::move(fused), leanddp::OffloadOptions{}),
      [destroyed](leanddp::HostOffload* offload) {
        delete offload;
        destroyed->set_value(std::this_thread::get_id());
      });
  std::promise<void> released;
  std::shared_future<void> caller_released = released.get_future().share();
  const std::shared_ptr<leanddp::HostWorker> worker = owner->worker();
  leanddp::HostWorker::Job first;
  if (after_error) {  // raises once ours is gone: the worker drops the job queued behind it
    first.run = [caller_released] {
      caller_released.wait();
      TORCH_CHECK(false, "offload_released_on_worker: the job that raises");
    };
  } else {  // holds a reference until the worker drops the finished job, after ours is gone
    first.run = [keep = owner, caller_released] { caller_released.wait(); };
  }
  worker->post(std::move(first));
  if (after_error) {
    leanddp::HostWorker::Job second;
    second.run = [keep = owner] {};
    worker->post(std::move(second));
  }
  owner.reset();
  released.set_value();
  if (destroyed_on.wait_for(std::chrono::seconds(20)) != std::future_status::ready) return false;
  return destroyed_on.get() != std::this_thread::get_id();
}

}  // namespace

void bind_testing(py::module_& m) {
  py::module_ t = m.def_submodule("_testing", "Test seams of leanddp's extension.");
  bind_step_window(t);
  // The host jobs InBackwardOptimizer._inject_host_faults makes fail (HostWorker::Fault).
  py::enum_<leanddp::HostWorker::Fault>(t, "HostFault")
      .value("addition", leanddp::HostWorker::Fault::kAddition)
      .value("step", leanddp::HostWorker::Fault::kStep);
  t.def(
      "reduce_to_shard",
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
      "reduce_to_shard (csrc/shard.h) of the padded bucket `flat` over the group, "
      "waited for.");
  t.def("set_host_ordering", &leanddp::set_host_ordering, py::arg("on"),
        "(csrc/streams.h) CPU tensors are ordered as if on a device that runs apart, "
        "so wrappers built afterwards take their device-ordered branches on the CPU.");
  t.def(
      "host_ordering_counts",
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
  t.def(
      "reduces_scattered",
      [](const py::object& process_group, const std::string& device) {
        auto group = process_group.cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
        return leanddp::reduces_scattered(group, c10::Device(device));
      },
      py::arg("process_group"), py::arg("device"),
      "whether shard_optimizer_state reduce-scatters buckets on `device` over the "
      "group (csrc/shard.h), else allreduces them.");
  t.def(
      "pack_and_gather_shards",
      [](const py::object& process_group, at::Tensor flat, const std::vector<int64_t>& offsets,
         const std::vector<int64_t>& numels, int64_t bucket_numel, int64_t align,
         const std::vector<at::Tensor>& sources) {
        auto group = process_group.cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
        const leanddp::ShardLayout layout = leanddp::shard_layout(
            offsets, numels, bucket_numel, align, group->getSize(), group->getRank());
        py::gil_scoped_release no_gil;  // (see reduce_to_shard)
        leanddp::pack_shard(flat, layout, sources);
        leanddp::gather_shards(group, flat, layout)->wait();
      },
      py::arg("process_group"), py::arg("flat"), py::arg("offsets"), py::arg("numels"),
      py::arg("bucket_numel"), py::arg("align"), py::arg("sources"),
      "pack_shard then gather_shards (csrc/shard.h) of the padded bucket `flat`, "
      "waited for.");
  t.def("offload_released_on_worker", &offload_released_on_worker, py::arg("after_error") = false,
        py::call_guard<py::gil_scoped_release>(),
        "an offload worker that drops the last reference to its owner (its "
        "destructor runs on the worker thread), in a finished job or, after_error, in one it "
        "drops after an error; True once it completed there.");
  t.def(
      "quantize8",
      [](const at::Tensor& x, const at::Tensor& qmap, bool table, bool bounded) {
        TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.is_cpu(),
                    "quantize8: x must be a contiguous float32 CPU tensor");
        check_qmap(qmap, "quantize8");
        TORCH_CHECK(!bounded || x.abs().le(1).all().item<bool>(),
                    "quantize8: bounded needs every x in [-1, 1] (no NaN)");
        at::Tensor scratch = x.clone();
        at::Tensor codes = at::empty_like(x, x.options().dtype(at::kByte));
        const float* q = qmap.const_data_ptr<float>();
        const leanddp::ops::QuantTable* t = table ? &leanddp::ops::quant_table(q) : nullptr;
        TORCH_CHECK(!table || t->exact, "quantize8: this map has no exact tables");
        leanddp::ops::cpu_loops().quant8(scratch.data_ptr<float>(), 1.0f, bounded, q, t,
                                         codes.data_ptr<uint8_t>(), x.numel());
        return codes;
      },
      py::arg("x"), py::arg("qmap"), py::arg("table"), py::arg("bounded") = false,
      "8-bit Adam's codes of x against qmap (csrc/ops/cpu_loops_8bit.h, this CPU's "
      "instruction set), through quant_table's look-ups (`table`) or torchao's binary search; "
      "`bounded`: the path for x known to lie in [-1, 1].");
  t.def(
      "dequantize8",
      [](const at::Tensor& codes, const at::Tensor& qmap, double scale, bool table) {
        TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.is_cpu(),
                    "dequantize8: codes must be a contiguous uint8 CPU tensor");
        check_qmap(qmap, "dequantize8");
        at::Tensor out = at::empty(codes.sizes(), codes.options().dtype(at::kFloat));
        const float* q = qmap.const_data_ptr<float>();
        leanddp::ops::cpu_loops().dequant8(
            codes.const_data_ptr<uint8_t>(), q, table ? &leanddp::ops::quant_table(q) : nullptr,
            static_cast<float>(scale), out.data_ptr<float>(), codes.numel());
        return out;
      },
      py::arg("codes"), py::arg("qmap"), py::arg("scale"), py::arg("table") = true,
      "qmap[codes] * scale as 8-bit Adam dequantizes (csrc/ops/cpu_loops_8bit.h, this CPU's "
      "instruction set); `table`: with qmap's quant_table (byte shuffles where the CPU has "
      "AVX-512 VBMI), else gathers.");
  t.def(
      "parallel_threads",
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

}  // namespace leanddp
