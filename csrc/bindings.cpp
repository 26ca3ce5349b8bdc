// The Python module leanddp._C: the only files that know pybind11 are bindings*.cpp (see
// bindings.h). Importing it registers the custom ops (torch.ops.leanddp.*) through the static
// registrations of the other files, and binds the Reducer, the in-backward optimizer, the
// layout functions and, in leanddp._C._testing, the test seams.
#include "bindings.h"
#include "bucket.h"
#include "fused_optimizer.h"
#include "ops/cpu_kernels.h"
#include "ops/optim8_math.h"
#include "shard.h"
#include "step_window.h"

#include <torch/csrc/utils/pybind.h>
#include <torch/version.h>

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "leanddp's C++/CUDA extension";
  leanddp::bind_reducer(m);
  leanddp::bind_optimizer(m);
  leanddp::bind_modes(m);  // (after bind_reducer: Modes holds its NanCheck)
  leanddp::bind_testing(m);
  m.attr("BUCKETS_IN_FLIGHT") = leanddp::kBucketsInFlight;
  // torchao's 8-bit rule as the kernels follow it: the fewest elements of a quantized tensor,
  // and the largest block the kernels quantize.
  m.attr("MIN_QUANTIZED_8BIT") = leanddp::kMinQuantized8;
  m.attr("MAX_QUANT_BLOCK") = leanddp::ops::kMaxQuantBlock;
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
}
