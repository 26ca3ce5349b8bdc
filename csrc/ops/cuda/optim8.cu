// CUDA kernel of block-wise 8-bit Adam(W) (adam8bit_step_; the arithmetic: optim8_math.h, the
// same as the CPU kernel's), the whole list in one launch.
//
// Each CUDA block takes a chunk of consecutive units of one tensor: quantization blocks of a
// tensor with 8-bit state (up to kChunkElems elements per chunk), or kPlainElems elements of one
// with plain state. For a quantization block the threads dequantize and update their elements,
// keep the new moments in shared memory, agree on the block's new scales (an integer maximum
// over abs_bits), then requantize; the maps live in shared memory. found_inf is read by every
// CUDA block, so nothing is copied to the host.
#include "../checks.h"
#include "../optim8_math.h"
#include "common.cuh"

#include <c10/cuda/CUDAException.h>
#include <torch/library.h>

#include <algorithm>

namespace leanddp::ops::cuda {
namespace {

constexpr int64_t kChunkElems = 16 << 10;  // one CUDA block's share of a tensor
constexpr int64_t kPlainElems = 1024;      // a unit of a tensor with plain state
static_assert(kThreads == kQmapSize, "each thread loads one entry of each map");

struct Adam8Tensor {
  void* param;
  const void* grad;
  void* m;  // uint8 codes, or plain state in the param's dtype
  void* v;
  float* sm;  // one scale per quantization block, or nullptr: plain state
  float* sv;
  void* copy;  // bf16/fp16 copy of the updated parameter, or nullptr
  int64_t numel;
  int64_t unit;       // elements per unit
  int64_t per_chunk;  // units per chunk
};

template <typename P, typename G, typename C, bool kCopy, bool kDecoupled>
__global__ void __launch_bounds__(kThreads)
    adam8_kernel(const __grid_constant__ MetaArg meta, Adam8Consts c, const float* qmap_s,
                 const float* qmap_u, const float* found_inf) {
  if (found_inf != nullptr && *found_inf != 0.0f) return;  // as torch's fused kernels
  __shared__ float qs[kQmapSize], qu[kQmapSize];
  __shared__ float mbuf[kMaxQuantBlock], vbuf[kMaxQuantBlock];
  __shared__ uint32_t max_m, max_v;
  qs[threadIdx.x] = qmap_s[threadIdx.x];
  qu[threadIdx.x] = qmap_u[threadIdx.x];
  __syncthreads();
  const Adam8Tensor* tensors = meta.array<Adam8Tensor>(0);
  const Chunk ch = meta.array<Chunk>(1)[blockIdx.x];
  const Adam8Tensor t = tensors[ch.tensor];
  P* p = static_cast<P*>(t.param);
  const G* g = static_cast<const G*>(t.grad);
  C* copy = static_cast<C*>(t.copy);
  const int64_t units = (t.numel + t.unit - 1) / t.unit;
  const int64_t u_end = std::min<int64_t>(units, (ch.index + int64_t{1}) * t.per_chunk);
  for (int64_t u = ch.index * t.per_chunk; u < u_end; ++u) {
    const int64_t first = u * t.unit;
    const int64_t len = std::min(t.unit, t.numel - first);
    if (t.sm == nullptr) {  // plain state (uniform per tensor: no divergence)
      P* m = static_cast<P*>(t.m) + first;
      P* v = static_cast<P*>(t.v) + first;
      for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
        float pv = static_cast<float>(p[first + i]);
        float m_new, v_new;
        adam8_update<kDecoupled>(pv, static_cast<float>(g[first + i]), static_cast<float>(m[i]),
                                 static_cast<float>(v[i]), m_new, v_new, c);
        p[first + i] = static_cast<P>(pv);
        m[i] = static_cast<P>(m_new);
        v[i] = static_cast<P>(v_new);
        if constexpr (kCopy) copy[first + i] = static_cast<C>(pv);
      }
      continue;
    }
    uint8_t* cm = static_cast<uint8_t*>(t.m) + first;
    uint8_t* cv = static_cast<uint8_t*>(t.v) + first;
    if (threadIdx.x == 0) max_m = max_v = 0;
    const float old_sm = t.sm[u], old_sv = t.sv[u];
    __syncthreads();  // (the maxima reset before any thread folds into them)
    uint32_t bm = 0, bv = 0;
    for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
      float pv = static_cast<float>(p[first + i]);
      float m_new, v_new;
      adam8_update<kDecoupled>(pv, static_cast<float>(g[first + i]), qs[cm[i]] * old_sm,
                               qu[cv[i]] * old_sv, m_new, v_new, c);
      p[first + i] = static_cast<P>(pv);
      if constexpr (kCopy) copy[first + i] = static_cast<C>(pv);
      mbuf[i] = m_new;
      vbuf[i] = v_new;
      bm = max(bm, abs_bits(m_new));
      bv = max(bv, abs_bits(v_new));
    }
    atomicMax(&max_m, bm);
    atomicMax(&max_v, bv);
    __syncthreads();  // (every element's new moments and the block's maxima are in)
    const float new_sm = quant_scale(from_bits(max_m)), new_sv = quant_scale(from_bits(max_v));
    for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
      cm[i] = static_cast<uint8_t>(quantize_code(mbuf[i] / new_sm, qs));
      cv[i] = static_cast<uint8_t>(quantize_code(vbuf[i] / new_sv, qu));
    }
    if (threadIdx.x == 0) {
      t.sm[u] = new_sm;
      t.sv[u] = new_sv;
    }
    __syncthreads();  // (before the next unit reuses the buffers and maxima)
  }
}

void adam8bit_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avg,
                        at::TensorList exp_avg_sq, at::TensorList exp_avg_scale,
                        at::TensorList exp_avg_sq_scale, at::TensorList param_copy,
                        const at::Tensor& qmap_signed, const at::Tensor& qmap_unsigned, double lr,
                        double beta1, double beta2, double eps, double weight_decay, int64_t step,
                        bool decoupled_weight_decay, std::optional<double> grad_scale,
                        const std::optional<at::Tensor>& found_inf) {
  const Adam8Args args{params,           grads,      exp_avg,     exp_avg_sq,   exp_avg_scale,
                       exp_avg_sq_scale, param_copy, qmap_signed, qmap_unsigned};
  check_adam8_args(args, lr, beta1, beta2, eps, weight_decay, step, grad_scale, found_inf);
  if (params.empty()) return;
  const c10::cuda::CUDAGuard guard(params[0].device());
  // The step count and the learning rate are arguments of the launch: a captured call would
  // replay this step's forever.
  TORCH_CHECK(
      c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None,
      "leanddp::adam8bit_step_ cannot be captured in a CUDA graph: its step count and learning "
      "rate are arguments of the launch, which a replay would repeat");
  std::vector<Adam8Tensor> tensors(params.size());
  std::vector<Chunk> chunks;
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t numel = params[i].numel();
    const bool quantized = exp_avg[i].scalar_type() == at::kByte;
    const int64_t unit = quantized ? numel / exp_avg_scale[i].numel() : kPlainElems;
    const int64_t per_chunk = std::max<int64_t>(1, kChunkElems / unit);
    tensors[i] = {params[i].data_ptr(),
                  grads[i].const_data_ptr(),
                  exp_avg[i].data_ptr(),
                  exp_avg_sq[i].data_ptr(),
                  quantized ? exp_avg_scale[i].data_ptr<float>() : nullptr,
                  quantized ? exp_avg_sq_scale[i].data_ptr<float>() : nullptr,
                  param_copy.empty() ? nullptr : param_copy[i].data_ptr(),
                  numel,
                  unit,
                  per_chunk};
    const int64_t units = (numel + unit - 1) / unit;
    for (int64_t k = 0; k * per_chunk < units; ++k) {
      chunks.push_back({static_cast<int32_t>(i), static_cast<int32_t>(k)});
    }
  }
  if (chunks.empty()) return;
  LaunchMeta meta;
  meta.add(tensors);  // array 0
  meta.add(chunks);   // array 1
  const MetaArg& meta_arg = meta.finish(params[0].device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const Adam8Consts consts = make_adam8_consts(lr, beta1, beta2, eps, weight_decay, step,
                                               decoupled_weight_decay, grad_scale);
  const float* inf = found_inf.has_value() ? found_inf->const_data_ptr<float>() : nullptr;
  auto launch = [&](auto param_tag, auto grad_tag, auto copy_tag, auto has_copy) {
    using P = typename decltype(param_tag)::type;
    using G = typename decltype(grad_tag)::type;
    using C = typename decltype(copy_tag)::type;
    constexpr bool kCopy = decltype(has_copy)::value;
    const auto grid = static_cast<unsigned>(chunks.size());
    if (decoupled_weight_decay) {
      adam8_kernel<P, G, C, kCopy, true>
          <<<grid, kThreads, 0, stream>>>(meta_arg, consts, qmap_signed.const_data_ptr<float>(),
                                          qmap_unsigned.const_data_ptr<float>(), inf);
    } else {
      adam8_kernel<P, G, C, kCopy, false>
          <<<grid, kThreads, 0, stream>>>(meta_arg, consts, qmap_signed.const_data_ptr<float>(),
                                          qmap_unsigned.const_data_ptr<float>(), inf);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  dispatch_optim_dtypes(params, grads, param_copy, launch);
}

}  // namespace

TORCH_LIBRARY_IMPL(leanddp, CUDA, m) { m.impl("adam8bit_step_", &adam8bit_step_cuda); }

}  // namespace leanddp::ops::cuda
