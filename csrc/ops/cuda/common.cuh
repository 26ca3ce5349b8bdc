// Pieces shared by leanddp's CUDA kernels: the per-launch metadata (a by-value kernel argument,
// uploaded only when too large), vector loads and stores, and compile-time dtype tags.
#pragma once

#include "../chunks.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace leanddp::ops::cuda {

constexpr int kThreads = 256;  // threads per block for every kernel

template <typename T>
struct Tag {
  using type = T;
};

// Per-launch metadata (per-tensor records, chunk table) as one kernel argument.
//
// A launch whose arrays fit in kMetaArgBytes passes them by value, inside the kernel's parameter
// buffer (as torch's multi_tensor_apply does; the whole parameter list stays under the 4 KiB
// that every CUDA version and GPU accepts): no copy, no allocation, and the launch may be
// captured in a CUDA graph. Larger ones are uploaded to the device first and the argument
// carries their address instead. Kernels take a `const __grid_constant__ MetaArg` (read in
// place, never copied to local memory) and reach array k with array<T>(k) either way.
constexpr size_t kMetaArgBytes = 3552;  // with the header, 3.5 KiB: 512 B left for other args
constexpr int kMetaArrays = 4;          // arrays one launch may add

struct alignas(16) MetaArg {
  const uint8_t* uploaded;        // the arrays in device memory, or nullptr: in `bytes`
  uint32_t offsets[kMetaArrays];  // byte offset of array k
  alignas(16) uint8_t bytes[kMetaArgBytes];

  // Array k (in the order LaunchMeta::add added them), where this launch keeps it.
  template <typename T>
  __device__ __forceinline__ const T* array(int k) const {
    return reinterpret_cast<const T*>((uploaded != nullptr ? uploaded : bytes) + offsets[k]);
  }
};
static_assert(sizeof(MetaArg) + 512 <= 4096, "kernel parameters must stay within 4 KiB");

// Bytes that add() takes for `count` records of type T (each array starts 16-byte aligned).
template <typename T>
constexpr size_t meta_bytes(size_t count) {
  return (count * sizeof(T) + 15) / 16 * 16;
}

// Collects a launch's arrays in host memory and finishes them into a MetaArg. Only past
// kMetaArgBytes does finish() copy them to the device, in one asynchronous copy on the current
// stream: the staging buffer comes from torch's caching pinned allocator, which keeps it until
// that copy has finished, and the device buffer from the caching device allocator, which frees
// it in stream order, so the object may be destroyed right after the kernel launch.
class LaunchMeta {
 public:
  // Appends `items` (trivially copyable records) as the next array; returns its index.
  template <typename T>
  int add(const std::vector<T>& items) {
    TORCH_CHECK(count_ < kMetaArrays, "LaunchMeta: more than ", kMetaArrays, " arrays");
    const size_t offset = (host_.size() + 15) / 16 * 16;
    host_.resize(offset + meta_bytes<T>(items.size()), 0);
    if (!items.empty()) std::memcpy(host_.data() + offset, items.data(), items.size() * sizeof(T));
    arg_.offsets[count_] = static_cast<uint32_t>(offset);
    return count_++;
  }

  // Whether the arrays added so far travel by value.
  bool by_value() const { return host_.size() <= kMetaArgBytes; }

  // The kernel argument: the arrays by value, or, beyond kMetaArgBytes, after their upload to
  // `device` (refused during CUDA graph capture: the copy would replay from a staging buffer
  // that later calls reuse; the ops refuse such a capture up front, refuse_graph_capture()).
  const MetaArg& finish(const at::Device& device) {
    if (by_value()) {
      arg_.uploaded = nullptr;
      if (!host_.empty()) std::memcpy(arg_.bytes, host_.data(), host_.size());
      return arg_;
    }
    TORCH_CHECK(c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None,
                "leanddp ops cannot upload their metadata during CUDA graph capture");
    auto staging = at::empty({static_cast<int64_t>(host_.size())},
                             at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    std::memcpy(staging.data_ptr(), host_.data(), host_.size());
    device_ = staging.to(device, /*non_blocking=*/true);
    arg_.uploaded = device_.const_data_ptr<uint8_t>();
    return arg_;
  }

 private:
  std::vector<uint8_t> host_;
  MetaArg arg_{};
  int count_ = 0;
  at::Tensor device_;
};

// Called first by every CUDA op, with an upper bound of the metadata bytes it will add: a launch
// whose metadata travels by value may be captured in a CUDA graph; a larger one would replay
// its metadata copy from a staging buffer that later calls reuse, so its capture is refused
// before the op does anything.
inline void refuse_graph_capture(const char* op, size_t meta_bytes_bound) {
  if (meta_bytes_bound <= kMetaArgBytes) return;
  TORCH_CHECK(c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None,
              op, " cannot be captured in a CUDA graph with this list: its metadata (up to ",
              meta_bytes_bound, " bytes) exceeds the ", kMetaArgBytes,
              " bytes passed by value; split the list into smaller calls");
}

// An upper bound of the chunks plan_chunks() makes for `tensors`.
inline size_t chunk_bound(at::TensorList tensors, int64_t chunk_elems) {
  size_t total = 0;
  for (const auto& t : tensors)
    total += static_cast<size_t>((t.numel() + chunk_elems - 1) / chunk_elems);
  return total;
}

// Calls launch(Tag<P>{}, Tag<G>{}, Tag<C>{}, has_copy) for the dtypes of an optimizer op's lists
// (checks.h's rules): bf16/fp16 params take grads of their dtype and no copy (C is then unused);
// float32 params take float32, bf16 or fp16 grads and an optional bf16/fp16 param_copy.
template <typename Launch>
void dispatch_optim_dtypes(at::TensorList params, at::TensorList grads, at::TensorList param_copy,
                           const Launch& launch) {
  switch (params[0].scalar_type()) {
    case at::kBFloat16:
      return launch(Tag<c10::BFloat16>{}, Tag<c10::BFloat16>{}, Tag<c10::BFloat16>{},
                    std::false_type{});
    case at::kHalf:
      return launch(Tag<c10::Half>{}, Tag<c10::Half>{}, Tag<c10::BFloat16>{}, std::false_type{});
    default:
      break;
  }
  auto with_copy = [&](auto grad_tag) {
    if (param_copy.empty()) {
      launch(Tag<float>{}, grad_tag, Tag<c10::BFloat16>{}, std::false_type{});
    } else if (param_copy[0].scalar_type() == at::kBFloat16) {
      launch(Tag<float>{}, grad_tag, Tag<c10::BFloat16>{}, std::true_type{});
    } else {
      launch(Tag<float>{}, grad_tag, Tag<c10::Half>{}, std::true_type{});
    }
  };
  switch (grads[0].scalar_type()) {
    case at::kFloat:
      return with_copy(Tag<float>{});
    case at::kBFloat16:
      return with_copy(Tag<c10::BFloat16>{});
    case at::kHalf:
      return with_copy(Tag<c10::Half>{});
    default:
      TORCH_CHECK(false, "unreachable: grad dtype was checked");
  }
}

__device__ __forceinline__ bool aligned_to(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// Four consecutive elements moved as one 4 * sizeof(T)-byte access (16 B for float).
template <typename T>
struct alignas(4 * sizeof(T)) Pack4 {
  T v[4];
};

template <typename T>
__device__ __forceinline__ void load4(const T* ptr, float (&out)[4]) {
  const Pack4<T> pk = *reinterpret_cast<const Pack4<T>*>(ptr);
#pragma unroll
  for (int k = 0; k < 4; ++k) out[k] = static_cast<float>(pk.v[k]);
}

template <typename T>
__device__ __forceinline__ void store4(T* ptr, const float (&in)[4]) {
  Pack4<T> pk;
#pragma unroll
  for (int k = 0; k < 4; ++k) pk.v[k] = static_cast<T>(in[k]);
  *reinterpret_cast<Pack4<T>*>(ptr) = pk;
}

}  // namespace leanddp::ops::cuda
