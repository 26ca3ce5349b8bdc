#include "bucket_recycler.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace leanddp {

BucketRecycler::BucketRecycler(size_t capacity) : capacity_(capacity) {
  TORCH_CHECK(capacity_ >= 1, "BucketRecycler: the capacity must be at least one buffer");
}

void BucketRecycler::give(at::Tensor storage, EventPool::Handle ready, size_t giver) {
  TORCH_CHECK(storage.dim() == 1 && storage.storage_offset() == 0,
              "BucketRecycler: a buffer is a whole 1-D storage");
  if (entries_.size() == capacity_) {
    bytes_ -= static_cast<int64_t>(entries_.front().storage.nbytes());
    entries_.pop_front();
  }
  bytes_ += static_cast<int64_t>(storage.nbytes());
  entries_.push_back(Entry{std::move(storage), std::move(ready), giver});
}

std::optional<BucketRecycler::Reused> BucketRecycler::take(int64_t numel, const at::Tensor& like,
                                                           const c10::Stream& stream, size_t held) {
  const auto fits = [&](const Entry& e) {
    const at::Tensor& s = e.storage;
    return s.scalar_type() == like.scalar_type() && s.device() == like.device() &&
           s.numel() >= numel;
  };
  // The smallest fitting buffer known free: no wait.
  auto best = entries_.end();
  for (auto it = entries_.begin(); it != entries_.end(); ++it) {
    if (!fits(*it) || !it->ready->query()) continue;
    if (best == entries_.end() || it->storage.numel() < best->storage.numel()) best = it;
  }
  const bool waits = best == entries_.end();
  if (waits) {
    if (held + entries_.size() < capacity_) return std::nullopt;  // grow first
    // The oldest fitting one: steps finish in the order they were queued, so it is the first
    // to be free (the most recent may be the bucket launched just before).
    best = std::find_if(entries_.begin(), entries_.end(), fits);
    if (best == entries_.end()) return std::nullopt;
  }
  best->ready->block(stream);
  Reused reused{std::move(best->storage), best->giver, waits};
  bytes_ -= static_cast<int64_t>(reused.storage.nbytes());
  entries_.erase(best);
  return reused;
}

void BucketRecycler::clear() {
  entries_.clear();
  bytes_ = 0;
}

}  // namespace leanddp
