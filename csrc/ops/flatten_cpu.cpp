// CPU kernels of flatten_into and unflatten_from.
//
// at::parallel_for splits the concatenation of the contiguous tensors into equal element ranges
// (ConcatRange in chunks.h), copied with memcpy (streaming stores for large lists), or with the
// vectorized scale loop when a scale is given. A tensor that is its own slice of the flat buffer
// (a bucket view, in any dense layout: channels_last, transposed, ...) is processed in place as
// the numel elements from its lowest address; any other non-contiguous tensor is moved by torch's
// strided copy_ and processed through a contiguous stand-in (flat_common.h).
#include "checks.h"
#include "chunks.h"  // ConcatRange
#include "cpu_kernels.h"
#include "flat_common.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define LEANDDP_STREAM_STORES 1
#endif

namespace leanddp::ops {
namespace {

// Fewer bytes than this per thread cost more in threading than they save.
constexpr int64_t kGrainBytes = 256 << 10;
constexpr int64_t kStreamBytes = 4 << 20;  // from this total on, copies bypass the caches

// memcpy with streaming (non-temporal) stores: a large destination would only evict useful
// cache lines, and streaming skips the read-for-ownership of every destination line, so the
// copy moves 2 bytes per byte instead of 3.
void stream_copy(const char* src, char* dst, int64_t n) {
#ifdef LEANDDP_STREAM_STORES
  const auto head = std::min<int64_t>(n, (16 - reinterpret_cast<uintptr_t>(dst) % 16) % 16);
  std::memcpy(dst, src, head);
  int64_t i = head;
  for (; i + 64 <= n; i += 64) {
    const auto* s = reinterpret_cast<const __m128i*>(src + i);
    auto* d = reinterpret_cast<__m128i*>(dst + i);
    const __m128i a = _mm_loadu_si128(s), b = _mm_loadu_si128(s + 1);
    const __m128i c = _mm_loadu_si128(s + 2), e = _mm_loadu_si128(s + 3);
    _mm_stream_si128(d, a);
    _mm_stream_si128(d + 1, b);
    _mm_stream_si128(d + 2, c);
    _mm_stream_si128(d + 3, e);
  }
  std::memcpy(dst + i, src + i, n - i);
  _mm_sfence();  // streaming stores are weakly ordered: publish them before the join
#else
  std::memcpy(dst, src, n);
#endif
}

// dst[i] = src[i] * scale for n elements of `dtype` (src may equal dst).
void scale_bytes(at::ScalarType dtype, const void* src, void* dst, int64_t n, double scale) {
  const auto& l = cpu_loops();
  switch (dtype) {
    case at::kFloat:
      return l.scale_float(static_cast<const float*>(src), static_cast<float*>(dst), n, scale);
    case at::kDouble:
      return l.scale_double(static_cast<const double*>(src), static_cast<double*>(dst), n, scale);
    case at::kBFloat16:
      return l.scale_bf16(static_cast<const c10::BFloat16*>(src), static_cast<c10::BFloat16*>(dst),
                          n, scale);
    case at::kHalf:
      return l.scale_half(static_cast<const c10::Half*>(src), static_cast<c10::Half*>(dst), n,
                          scale);
    default:
      TORCH_CHECK_TYPE(false, "leanddp: scale is not supported for dtype ", dtype);
  }
}

// Copies between `tensors` and consecutive slices of `flat`: into flat when `to_flat`, out of it
// otherwise; each element multiplied by `scale` when given.
void flat_copy_cpu(const char* op, at::TensorList tensors, const at::Tensor& flat,
                   std::optional<double> scale, bool to_flat) {
  const auto offsets =
      check_flat_args(op, tensors, flat, to_flat ? "out" : "flat", !to_flat, scale);
  const auto dtype = flat.scalar_type();
  const int64_t itemsize = flat.element_size();
  char* flat_base = raw_data(flat, /*written=*/to_flat);

  // Per tensor: the contiguous memory the parallel loop processes on its side, and how many
  // elements (0 = nothing to do: empty, already in place, or fully handled by its stand-in).
  std::vector<char*> data(tensors.size());
  std::vector<int64_t> numels(tensors.size(), 0);
  PendingCopies pending;  // also keeps unflatten's staging tensors alive through the loop
  for (size_t i = 0; i < tensors.size(); ++i) {
    at::Tensor t = tensors[i];
    if (t.numel() == 0) continue;
    if (is_flat_slice(t, flat, offsets[i])) {
      // Its own slice, in whatever dense layout: numel elements from data_ptr() on, in place.
      if (!scale) continue;
    } else if (!t.is_contiguous()) {
      t = contiguous_stand_in(t, flat, offsets[i], to_flat, scale.has_value(), pending);
      if (!t.defined()) continue;
    }
    data[i] = raw_data(t, /*written=*/!to_flat);
    numels[i] = t.numel();
  }

  const ConcatRange range(numels);
  const bool streaming = range.total() * itemsize >= kStreamBytes;
  at::parallel_for(0, range.total(), kGrainBytes / itemsize, [&](int64_t first, int64_t last) {
    range.for_each_piece(first, last, [&](int32_t t, int64_t begin, int64_t len) {
      char* t_ptr = data[t] + begin * itemsize;
      char* f_ptr = flat_base + (offsets[t] + begin) * itemsize;
      char* dst = to_flat ? f_ptr : t_ptr;
      const char* src = to_flat ? t_ptr : f_ptr;
      if (scale) {
        scale_bytes(dtype, src, dst, len, *scale);
      } else if (streaming) {
        stream_copy(src, dst, len * itemsize);
      } else {
        std::memcpy(dst, src, len * itemsize);
      }
    });
  });
  for (auto& [dst, staging] : pending) dst.copy_(staging);
}

void flatten_into_cpu(at::TensorList tensors, const at::Tensor& out, std::optional<double> scale) {
  flat_copy_cpu("leanddp::flatten_into", tensors, out, scale, /*to_flat=*/true);
}

void unflatten_from_cpu(const at::Tensor& flat, at::TensorList tensors,
                        std::optional<double> scale) {
  flat_copy_cpu("leanddp::unflatten_from", tensors, flat, scale, /*to_flat=*/false);
}

}  // namespace

TORCH_LIBRARY_IMPL(leanddp, CPU, m) {
  m.impl("flatten_into", &flatten_into_cpu);
  m.impl("unflatten_from", &unflatten_from_cpu);
}

}  // namespace leanddp::ops
