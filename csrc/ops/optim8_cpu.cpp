// CPU kernel of block-wise 8-bit Adam(W) (adam8bit_step_; the arithmetic: optim8_math.h).
//
// The work is cut into units: one quantization block of a parameter with 8-bit state (its moments
// are dequantized, updated, and requantized against the block's new scale, all while the block
// is in cache), or kPlainElems elements of a parameter with plain state. at::parallel_for splits
// the concatenated units evenly over threads (ConcatRange), so a block never straddles two
// threads. bf16/fp16 parameters, gradients and plain state are upcast into per-thread float
// buffers and rounded back from them; the optional param_copy is written from the updated block.
// Every tensor is read and written once.
#include "checks.h"
#include "chunks.h"  // ConcatRange
#include "cpu_common.h"
#include "cpu_kernels.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <memory>
#include <utility>

namespace leanddp::ops {
namespace {

constexpr int64_t kPlainElems = 1024;  // elements per unit of a parameter with plain state
// Fewer elements than this per thread cost more in threading than they save.
constexpr int64_t kGrainElems = 32 << 10;

// Asks for the cache lines of [at, at + bytes) (a hint).
inline void prefetch(const char* at, int64_t bytes) {
  for (int64_t offset = 0; offset < bytes; offset += 64) prefetch_line(at, offset);
}

// Quantization blocks stepped by one call where parameters and gradients are float32 (the AVX-512
// loops overlap one block's update with the previous block's quantization).
constexpr int64_t kRunBlocks = 8;

// Per-thread scratch: a unit's parameters and gradients as floats, and the moments of two.
struct Scratch {
  static constexpr int64_t kElems = std::max(kMaxQuantBlock, kPlainElems);
  alignas(64) float p[kElems];
  alignas(64) float g[kElems];
  alignas(64) float m[2 * kElems];
  alignas(64) float v[2 * kElems];
};

void adam8bit_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avg,
                       at::TensorList exp_avg_sq, at::TensorList exp_avg_scale,
                       at::TensorList exp_avg_sq_scale, at::TensorList param_copy,
                       const at::Tensor& qmap_signed, const at::Tensor& qmap_unsigned, double lr,
                       double beta1, double beta2, double eps, double weight_decay, int64_t step,
                       bool decoupled_weight_decay, std::optional<double> grad_scale,
                       const std::optional<at::Tensor>& found_inf) {
  const Adam8Args args{params,           grads,      exp_avg,     exp_avg_sq,   exp_avg_scale,
                       exp_avg_sq_scale, param_copy, qmap_signed, qmap_unsigned};
  check_adam8_args(args, lr, beta1, beta2, eps, weight_decay, step, grad_scale, found_inf);
  if (skipped(found_inf) || params.empty()) return;
  const Adam8Consts consts = make_adam8_consts(lr, beta1, beta2, eps, weight_decay, step,
                                               decoupled_weight_decay, grad_scale);
  const auto& loops = cpu_loops();
  const size_t n = params.size();
  const auto param_dtype = params[0].scalar_type();
  const auto grad_dtype = grads[0].scalar_type();
  const bool low = param_dtype != at::kFloat;
  const bool has_copy = !param_copy.empty();
  const bool prefetch_blocks = !loops.adam8_prefetches || low || grad_dtype != at::kFloat;
  const auto copy_dtype = has_copy ? param_copy[0].scalar_type() : at::kBFloat16;
  QuantMaps maps{qmap_signed.const_data_ptr<float>(), qmap_unsigned.const_data_ptr<float>()};
  maps.ts = &quant_table(maps.qs);
  maps.tu = &quant_table(maps.qu);

  // Per tensor: elements per unit, and units.
  std::vector<int64_t> unit(n), units(n);
  std::vector<char> quantized(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t numel = params[i].numel();
    quantized[i] = exp_avg[i].scalar_type() == at::kByte;
    unit[i] = quantized[i] ? numel / exp_avg_scale[i].numel() : kPlainElems;
    units[i] = (numel + unit[i] - 1) / unit[i];
  }
  const ConcatRange range(units);
  int64_t total_elems = 0;
  for (const auto& p : params) total_elems += p.numel();
  const int64_t mean_unit = std::max<int64_t>(1, total_elems / std::max<int64_t>(1, range.total()));
  const int64_t grain = std::max<int64_t>(1, kGrainElems / mean_unit);

  // Addresses, taken once (written tensors through data_ptr(), read ones through const_data_ptr()).
  const auto addresses = [](at::TensorList list, bool written) {
    std::vector<char*> out;
    for (const auto& t : list) {
      out.push_back(written ? static_cast<char*>(t.data_ptr())
                            : const_cast<char*>(static_cast<const char*>(t.const_data_ptr())));
    }
    return out;
  };
  const auto p_at = addresses(params, true), g_at = addresses(grads, false);
  const auto m_at = addresses(exp_avg, true), v_at = addresses(exp_avg_sq, true);
  const auto sm_at = addresses(exp_avg_scale, true), sv_at = addresses(exp_avg_sq_scale, true);
  const auto copy_at = addresses(param_copy, true);

  // Unit u of tensor t: its first element and its length.
  const auto span_of = [&](size_t t, int64_t u) {
    const int64_t first = u * unit[t];
    return std::pair<int64_t, int64_t>{first, std::min(unit[t], params[t].numel() - first)};
  };
  // Units [u, u + count) of tensor t; count > 1 only for quantized blocks of float32
  // parameters and gradients, which are all of one length.
  const auto step_units = [&](size_t t, int64_t u, int64_t count, Scratch& s) {
    const auto [first, one] = span_of(t, u);
    const int64_t len = one * count;
    float* p = as_float(param_dtype, p_at[t], first, len, s.p);
    const float* g = as_float(grad_dtype, g_at[t], first, len, s.g);
    if (quantized[t]) {
      loops.adam8_quant(p, g, reinterpret_cast<uint8_t*>(m_at[t]) + first,
                        reinterpret_cast<uint8_t*>(v_at[t]) + first,
                        reinterpret_cast<float*>(sm_at[t]) + u,
                        reinterpret_cast<float*>(sv_at[t]) + u, maps, one, count, consts, s.m, s.v);
    } else {
      float* m = as_float(param_dtype, m_at[t], first, len, s.m);
      float* v = as_float(param_dtype, v_at[t], first, len, s.v);
      loops.adam8_plain(p, g, m, v, len, consts);
      if (low) {
        store_low(param_dtype, m, m_at[t], first, len);
        store_low(param_dtype, v, v_at[t], first, len);
      }
    }
    if (low) store_low(param_dtype, p, p_at[t], first, len);
    if (has_copy) store_low(copy_dtype, p, copy_at[t], first, len);
  };
  // A quantized block's memory, requested while the block before it is stepped, where the
  // kernel's loops do not ask for it themselves. With AVX-512 they do, two blocks ahead of the
  // pointers they are given (cpu_loops_8bit.h's prefetch_line), which are the tensors' own unless
  // parameters or gradients are upcast into scratch.
  const auto prefetch_block = [&](size_t t, int64_t u) {
    const auto [first, len] = span_of(t, u);
    prefetch(p_at[t] + first * params[t].element_size(), len * params[t].element_size());
    prefetch(g_at[t] + first * grads[t].element_size(), len * grads[t].element_size());
    prefetch(m_at[t] + first, len);
    prefetch(v_at[t] + first, len);
  };
  at::parallel_for(0, range.total(), grain, [&](int64_t first, int64_t last) {
    const std::unique_ptr<Scratch> scratch(new Scratch);  // (default-initialized: not zeroed)
    range.for_each_piece(first, last, [&](int32_t t, int64_t begin, int64_t len) {
      const auto i = static_cast<size_t>(t);
      const int64_t run = quantized[i] && !prefetch_blocks ? kRunBlocks : 1;
      for (int64_t u = begin; u < begin + len; u += run) {
        if (prefetch_blocks && quantized[i] && u + 1 < begin + len) prefetch_block(i, u + 1);
        step_units(i, u, std::min(run, begin + len - u), *scratch);
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(leanddp, CPU, m) { m.impl("adam8bit_step_", &adam8bit_step_cpu); }

}  // namespace leanddp::ops
