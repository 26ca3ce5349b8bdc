// The Python module leanddp._C: the only file that knows pybind11. Importing it registers the
// custom ops (torch.ops.leanddp.*) through the static registrations of the other files.
#include "ops/cpu_kernels.h"

#include <ATen/Parallel.h>
#include <torch/extension.h>
#include <torch/version.h>

#include <mutex>
#include <set>

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "leanddp's C++/CUDA extension";
  m.def(
      "build_info",
      [] {
        py::dict info;
        info["torch_version"] = TORCH_VERSION;  // the torch this extension was compiled against
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
