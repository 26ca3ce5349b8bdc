#include "recycler.h"

#include <c10/util/Exception.h>

namespace leanddp {

BucketRecycler::BucketRecycler(size_t capacity) : capacity_(capacity) {
  TORCH_CHECK(capacity_ >= 1, "BucketRecycler: the capacity must be at least one buffer");
}

void BucketRecycler::give(at::Tensor storage, EventPool::Handle ready) {
  TORCH_CHECK(storage.dim() == 1 && storage.storage_offset() == 0,
              "BucketRecycler: a buffer is a whole 1-D storage");
  if (entries_.size() == capacity_) {
    bytes_ -= static_cast<int64_t>(entries_.front().storage.nbytes());
    entries_.pop_front();
  }
  bytes_ += static_cast<int64_t>(storage.nbytes());
  entries_.push_back(Entry{std::move(storage), std::move(ready)});
}

at::Tensor BucketRecycler::take(int64_t numel, const at::Tensor& like, const c10::Stream& stream) {
  auto best = entries_.end();
  for (auto it = entries_.begin(); it != entries_.end(); ++it) {
    const at::Tensor& s = it->storage;
    if (s.scalar_type() != like.scalar_type() || s.device() != like.device() || s.numel() < numel) {
      continue;
    }
    if (best == entries_.end() || s.numel() < best->storage.numel()) best = it;
  }
  if (best == entries_.end()) return at::Tensor();
  best->ready->block(stream);
  at::Tensor storage = std::move(best->storage);
  bytes_ -= static_cast<int64_t>(storage.nbytes());
  entries_.erase(best);
  return storage;
}

void BucketRecycler::clear() {
  entries_.clear();
  bytes_ = 0;
}

}  // namespace leanddp
