// CUDA kernels of flatten_into and unflatten_from: the whole list in one launch.
//
// Every tensor is cut into chunks (chunks.h) of kChunkBytes; block b copies chunk b. Contiguous
// tensors are stored in 16-byte accesses, and loaded in them too when source and destination
// share their alignment within 16 bytes (always, for slices that start on 16-byte boundaries),
// with a scalar head and tail. A tensor that is its own slice of the flat buffer (a bucket view
// in any dense layout: channels_last, transposed, ...) is such a contiguous range too: the numel
// elements from its lowest address, scaled in place. Other non-contiguous tensors are indexed
// through their collapsed sizes and strides (up to kMaxDims of them; beyond, through a contiguous
// stand-in, flat_common.h), with precomputed 32-bit divisors (multiply and shift, no division)
// when their numel fits. Without a scale the copy only depends on the element size, so any dtype
// works; with one, the element is multiplied in its math type (float for half/bfloat16). The
// per-launch tables travel as a by-value kernel argument when small (common.cuh, MetaArg).
#include "../checks.h"
#include "../flat_common.h"
#include "common.cuh"

#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <torch/library.h>
#include <ATen/cuda/detail/IntegerDivider.cuh>

namespace leanddp::ops::cuda {
namespace {

constexpr int64_t kChunkBytes = 32 << 10;  // one block's share of a tensor
constexpr int kMaxDims = 6;                // dims of a non-contiguous tensor after collapsing

struct TensorDesc {
  char* data;           // the tensor side: source when flattening, destination otherwise
  int64_t numel;        // elements the kernel copies (0: nothing to do here)
  int64_t flat_offset;  // element offset of this tensor's slice in the flat buffer
  int32_t strided;      // index into the StridedDesc table, -1 when contiguous
};

struct StridedDesc {
  int32_t ndim;
  int32_t fast;  // numel <= INT32_MAX: 32-bit indices divided through `div`
  at::cuda::detail::IntDivider<uint32_t> div[kMaxDims];  // sizes[d] as fast divisors (if fast)
  int64_t sizes[kMaxDims];
  int64_t strides[kMaxDims];  // in elements
};

// Collapses t's dims into the fewest (size, stride) pairs that keep row-major element order.
bool collapse_dims(const at::Tensor& t, StridedDesc& out) {
  int32_t n = 0;
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) == 1) continue;
    if (n > 0 && out.strides[n - 1] == t.stride(d) * t.size(d)) {
      out.sizes[n - 1] *= t.size(d);
      out.strides[n - 1] = t.stride(d);
      continue;
    }
    if (n == kMaxDims) return false;
    out.sizes[n] = t.size(d);
    out.strides[n] = t.stride(d);
    ++n;
  }
  out.ndim = n;
  out.fast = t.numel() <= std::numeric_limits<int32_t>::max();
  for (int32_t d = 0; d < n && out.fast; ++d) {
    out.div[d] = at::cuda::detail::IntDivider<uint32_t>(static_cast<uint32_t>(out.sizes[d]));
  }
  return true;
}

// Element offset of row-major element `linear` of a strided tensor. The outermost dim needs no
// division: what is left of `linear` there is its index.
__device__ __forceinline__ int64_t strided_offset(const StridedDesc& s, int64_t linear) {
  if (s.ndim == 0) return 0;
  int64_t off = 0;
  if (s.fast) {
    auto rest = static_cast<uint32_t>(linear);
    for (int d = s.ndim - 1; d > 0; --d) {
      const auto qr = s.div[d].divmod(rest);
      off += static_cast<int64_t>(qr.mod) * s.strides[d];
      rest = qr.div;
    }
    return off + static_cast<int64_t>(rest) * s.strides[0];
  }
  for (int d = s.ndim - 1; d > 0; --d) {
    off += (linear % s.sizes[d]) * s.strides[d];
    linear /= s.sizes[d];
  }
  return off + linear * s.strides[0];
}

template <typename T>
struct Identity {
  __device__ __forceinline__ T operator()(T x) const { return x; }
};

template <typename T>
struct Scale {
  using opmath_t = at::opmath_type<T>;
  opmath_t s;
  __device__ __forceinline__ T operator()(T x) const {
    return static_cast<T>(static_cast<opmath_t>(x) * s);
  }
};

// dst[i] = op(src[i]) for i < n by the threads of one block; src == dst is allowed. Stores are
// 16-byte vectors from dst's first 16-byte boundary on; loads are too when src has the same
// alignment within 16 bytes, else element-wise (coalesced, so still full memory transactions).
template <typename T, typename Op>
__device__ void copy_contiguous(const T* src, T* dst, int64_t n, const Op& op) {
  constexpr int kVec = sizeof(T) >= 16 ? 1 : 16 / static_cast<int>(sizeof(T));
  int64_t done = 0;
  if constexpr (kVec > 1) {
    const auto to_boundary =
        static_cast<int64_t>((16 - reinterpret_cast<uintptr_t>(dst) % 16) % 16 / sizeof(T));
    const int64_t head = to_boundary < n ? to_boundary : n;
    for (int64_t i = threadIdx.x; i < head; i += blockDim.x) dst[i] = op(src[i]);
    const T* s = src + head;
    const bool vector_loads = aligned_to(s, 16);
    const int64_t nvec = (n - head) / kVec;
    auto* vdst = reinterpret_cast<uint4*>(dst + head);
    for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) {
      alignas(16) T vals[kVec];
      if (vector_loads) {
        *reinterpret_cast<uint4*>(vals) = reinterpret_cast<const uint4*>(s)[v];
      } else {
#pragma unroll
        for (int k = 0; k < kVec; ++k) vals[k] = s[v * kVec + k];
      }
#pragma unroll
      for (int k = 0; k < kVec; ++k) vals[k] = op(vals[k]);
      vdst[v] = *reinterpret_cast<const uint4*>(vals);
    }
    done = head + nvec * kVec;
  }
  for (int64_t i = done + threadIdx.x; i < n; i += blockDim.x) dst[i] = op(src[i]);
}

template <typename T, bool kToFlat, typename Op>
__global__ void __launch_bounds__(kThreads)
    flat_copy_kernel(const __grid_constant__ MetaArg meta, T* flat, int64_t chunk_elems, Op op) {
  const TensorDesc* tensors = meta.array<TensorDesc>(0);
  const StridedDesc* strided = meta.array<StridedDesc>(1);
  const Chunk c = meta.array<Chunk>(2)[blockIdx.x];
  const TensorDesc d = tensors[c.tensor];
  const int64_t begin = chunk_begin(c, chunk_elems);
  const int64_t len = chunk_len(c, chunk_elems, d.numel);
  T* flat_ptr = flat + d.flat_offset + begin;
  T* t_base = reinterpret_cast<T*>(d.data);
  if (d.strided < 0) {
    T* t_ptr = t_base + begin;
    copy_contiguous<T>(kToFlat ? t_ptr : flat_ptr, kToFlat ? flat_ptr : t_ptr, len, op);
    return;
  }
  const StridedDesc& s = strided[d.strided];
  for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
    T* t_ptr = t_base + strided_offset(s, begin + i);
    if (kToFlat) {
      flat_ptr[i] = op(*t_ptr);
    } else {
      *t_ptr = op(flat_ptr[i]);
    }
  }
}

// Storage type for an unscaled copy of `itemsize`-byte elements.
struct alignas(16) Bytes16 {
  uint64_t lo, hi;
};

template <typename Fn>
void dispatch_itemsize(int64_t itemsize, const Fn& fn) {
  switch (itemsize) {
    case 1:
      return fn(Tag<uint8_t>{});
    case 2:
      return fn(Tag<uint16_t>{});
    case 4:
      return fn(Tag<uint32_t>{});
    case 8:
      return fn(Tag<uint64_t>{});
    case 16:
      return fn(Tag<Bytes16>{});
    default:
      TORCH_CHECK(false, "leanddp: unsupported element size ", itemsize);
  }
}

template <typename Fn>
void dispatch_scaled(at::ScalarType dtype, const Fn& fn) {
  switch (dtype) {
    case at::kFloat:
      return fn(Tag<float>{});
    case at::kDouble:
      return fn(Tag<double>{});
    case at::kHalf:
      return fn(Tag<c10::Half>{});
    case at::kBFloat16:
      return fn(Tag<c10::BFloat16>{});
    default:
      TORCH_CHECK_TYPE(false, "leanddp: scale is not supported for dtype ", dtype);
  }
}

void flat_copy_cuda(const char* op, at::TensorList tensors, const at::Tensor& flat,
                    std::optional<double> scale, bool to_flat) {
  const auto offsets =
      check_flat_args(op, tensors, flat, to_flat ? "out" : "flat", !to_flat, scale);
  const int64_t chunk_elems = kChunkBytes / flat.element_size();
  size_t non_contiguous = 0;
  for (const auto& t : tensors) non_contiguous += t.is_contiguous() ? 0 : 1;
  // (first: the capture check asks about the current stream of flat's device, not another's)
  const c10::cuda::CUDAGuard guard(flat.device());
  refuse_graph_capture(op, meta_bytes<TensorDesc>(tensors.size()) +
                               meta_bytes<StridedDesc>(non_contiguous) +
                               meta_bytes<Chunk>(chunk_bound(tensors, chunk_elems)));
  std::vector<TensorDesc> descs(tensors.size());
  std::vector<StridedDesc> strided;
  std::vector<int64_t> numels(tensors.size(), 0);
  PendingCopies pending;  // for tensors with too many dims to index in the kernel
  for (size_t i = 0; i < tensors.size(); ++i) {
    at::Tensor t = tensors[i];
    descs[i] = {nullptr, 0, offsets[i], -1};
    if (t.numel() == 0) continue;
    if (is_flat_slice(t, flat, offsets[i])) {
      // Its own slice, in whatever dense layout: numel elements from data_ptr() on, in place.
      if (!scale) continue;
    } else if (!t.is_contiguous()) {
      StridedDesc s{};
      if (collapse_dims(t, s)) {
        descs[i].strided = static_cast<int32_t>(strided.size());
        strided.push_back(s);
      } else {
        t = contiguous_stand_in(t, flat, offsets[i], to_flat, scale.has_value(), pending);
        if (!t.defined()) continue;
      }
    }
    descs[i].data = raw_data(t, /*written=*/!to_flat);
    descs[i].numel = numels[i] = t.numel();
  }
  const auto chunks = plan_chunks(numels, chunk_elems);
  if (chunks.empty()) return;  // nothing was staged either: staging implies a chunk

  LaunchMeta meta;
  meta.add(descs);    // array 0
  meta.add(strided);  // array 1
  meta.add(chunks);   // array 2
  const MetaArg& meta_arg = meta.finish(flat.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  auto launch = [&](auto tag, auto op_fn) {
    using T = typename decltype(tag)::type;
    auto kernel = to_flat ? flat_copy_kernel<T, true, decltype(op_fn)>
                          : flat_copy_kernel<T, false, decltype(op_fn)>;
    kernel<<<static_cast<unsigned>(chunks.size()), kThreads, 0, stream>>>(
        meta_arg, reinterpret_cast<T*>(raw_data(flat, to_flat)), chunk_elems, op_fn);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (scale) {
    dispatch_scaled(flat.scalar_type(), [&](auto tag) {
      using T = typename decltype(tag)::type;
      launch(tag, Scale<T>{static_cast<at::opmath_type<T>>(*scale)});
    });
  } else {
    dispatch_itemsize(flat.element_size(),
                      [&](auto tag) { launch(tag, Identity<typename decltype(tag)::type>{}); });
  }
  for (auto& [dst, staging] : pending) dst.copy_(staging);  // same stream: after the kernel
}

void flatten_into_cuda(at::TensorList tensors, const at::Tensor& out, std::optional<double> scale) {
  flat_copy_cuda("leanddp::flatten_into", tensors, out, scale, /*to_flat=*/true);
}

void unflatten_from_cuda(const at::Tensor& flat, at::TensorList tensors,
                         std::optional<double> scale) {
  flat_copy_cuda("leanddp::unflatten_from", tensors, flat, scale, /*to_flat=*/false);
}

}  // namespace

TORCH_LIBRARY_IMPL(leanddp, CUDA, m) {
  m.impl("flatten_into", &flatten_into_cuda);
  m.impl("unflatten_from", &unflatten_from_cuda);
}

}  // namespace leanddp::ops::cuda
