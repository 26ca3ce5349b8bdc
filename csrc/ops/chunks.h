// How the list ops split their work.
//
// CUDA: each tensor of a list is cut into chunks of at most `chunk_elems` elements, one CUDA block
// per chunk, so large tensors spread over many blocks and small ones cost one block each. Chunk
// {tensor, index} covers elements [index * chunk_elems, min((index + 1) * chunk_elems, numel)).
// CPU: ConcatRange below splits the concatenated elements evenly over threads.
#pragma once

#include <c10/macros/Macros.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace leanddp::ops {

struct Chunk {
  int32_t tensor;  // index into the op's tensor list
  int32_t index;   // which chunk of that tensor
};

// Chunks of all non-empty tensors, in list order (so consecutive workers read consecutive memory).
inline std::vector<Chunk> plan_chunks(const std::vector<int64_t>& numels, int64_t chunk_elems) {
  TORCH_CHECK(chunk_elems > 0 && numels.size() < std::numeric_limits<int32_t>::max());
  int64_t total = 0;
  for (auto n : numels) total += (n + chunk_elems - 1) / chunk_elems;
  TORCH_CHECK(total < std::numeric_limits<int32_t>::max(), "too many chunks: ", total);
  std::vector<Chunk> chunks;
  chunks.reserve(total);
  for (size_t t = 0; t < numels.size(); ++t) {
    const int64_t count = (numels[t] + chunk_elems - 1) / chunk_elems;
    for (int64_t c = 0; c < count; ++c) {
      chunks.push_back({static_cast<int32_t>(t), static_cast<int32_t>(c)});
    }
  }
  return chunks;
}

// First element and length of a chunk of a tensor with `numel` elements.
C10_HOST_DEVICE inline int64_t chunk_begin(Chunk c, int64_t chunk_elems) {
  return static_cast<int64_t>(c.index) * chunk_elems;
}
C10_HOST_DEVICE inline int64_t chunk_len(Chunk c, int64_t chunk_elems, int64_t numel) {
  const int64_t begin = chunk_begin(c, chunk_elems);
  return numel - begin < chunk_elems ? numel - begin : chunk_elems;
}

// CPU work split: the concatenation of a list's tensors as one element range. A worker given
// [first, last) of it visits the pieces of every tensor that fall inside, in order, so threads
// get equal numbers of elements whatever the tensor sizes.
class ConcatRange {
 public:
  explicit ConcatRange(const std::vector<int64_t>& numels) : offsets_(numels.size() + 1, 0) {
    for (size_t i = 0; i < numels.size(); ++i) offsets_[i + 1] = offsets_[i] + numels[i];
  }
  int64_t total() const { return offsets_.back(); }

  // Calls fn(tensor, begin, len) for each piece of [first, last), in order.
  template <typename Fn>
  void for_each_piece(int64_t first, int64_t last, const Fn& fn) const {
    auto it = std::upper_bound(offsets_.begin(), offsets_.end(), first);
    for (size_t t = static_cast<size_t>(it - offsets_.begin()) - 1;
         t + 1 < offsets_.size() && offsets_[t] < last; ++t) {
      const int64_t begin = std::max(first, offsets_[t]);
      const int64_t end = std::min(last, offsets_[t + 1]);
      if (end > begin) fn(static_cast<int32_t>(t), begin - offsets_[t], end - begin);
    }
  }

 private:
  std::vector<int64_t> offsets_;  // offsets_[i]: first element of tensor i; back(): total
};

}  // namespace leanddp::ops
