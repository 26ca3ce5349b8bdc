// Pieces shared by leanddp's CUDA kernels: the per-launch metadata upload, vector loads and
// stores, and compile-time dtype tags.
#pragma once

#include "../chunks.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace leanddp::ops::cuda {

constexpr int kThreads = 256;  // threads per block for every kernel

template <typename T>
struct Tag {
  using type = T;
};

// Collects a launch's metadata arrays (per-tensor records, chunk table) in host memory and
// copies them to the device in one asynchronous copy on the current stream. The staging buffer
// comes from torch's caching pinned allocator, which keeps it until that copy has finished, and
// the device buffer from the caching device allocator, which frees it in stream order: the
// object may be destroyed right after the kernel launch.
class LaunchMeta {
 public:
  // Appends `items` (trivially copyable records); returns their byte offset.
  template <typename T>
  size_t add(const std::vector<T>& items) {
    const size_t offset = (host_.size() + 15) / 16 * 16;
    host_.resize(offset + items.size() * sizeof(T));
    if (!items.empty()) std::memcpy(host_.data() + offset, items.data(), items.size() * sizeof(T));
    return offset;
  }

  // Copies everything to `device`. Refused during CUDA graph capture: the copy would replay from
  // a staging buffer that later calls reuse.
  void upload(const at::Device& device) {
    TORCH_CHECK(c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None,
                "leanddp ops cannot be captured in a CUDA graph");
    auto staging = at::empty({static_cast<int64_t>(host_.size())},
                             at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    std::memcpy(staging.data_ptr(), host_.data(), host_.size());
    device_ = staging.to(device, /*non_blocking=*/true);
  }

  // Device address of the array added at `offset` (after upload).
  template <typename T>
  const T* at(size_t offset) const {
    return reinterpret_cast<const T*>(device_.const_data_ptr<uint8_t>() + offset);
  }

 private:
  std::vector<uint8_t> host_;
  at::Tensor device_;
};

// Called first by every CUDA op: a captured graph would replay the metadata copy from a staging
// buffer that later calls reuse, so capture is refused before the op does anything.
inline void refuse_graph_capture(const char* op) {
  TORCH_CHECK(c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None,
              op, " cannot be captured in a CUDA graph");
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
