// BucketRecycler: released bucket storage kept for the next buckets, where giving it back to the
// caching allocator would not free it in time.
//
// The case: optimizer_in_backward on a GPU with a communication hook. A hook hands the Reducer
// only a future; the c10d work behind it is never waited for, and ProcessGroupNCCL keeps the
// tensors of an unwaited collective in the work's stash until its watchdog has seen the work
// finish (it polls every 100 ms) and a later collective is queued on the same group. A bucket
// released after its step then stays allocated for most of a backward, so the window of buckets
// in flight would not bound memory. Instead the Reducer gives each released bucket's storage to
// this recycler, with an event recorded after the side stream's last work on it, and carves its
// next buckets of that dtype out of it: the stream that writes the new bucket's gradients waits
// for that event (on the device; the host does not wait). What the stash still references is
// then memory the Reducer reuses, so the bytes held stay bounded by the recycler's capacity.
//
// Which buffer a new bucket gets decides how much communication overlaps backward: reusing the
// bucket released just before (stepped right after its launch, as NCCL's futures are complete
// at once) would make the compute stream wait for that bucket's collective and step, so that
// only one collective ever runs beside the backward computation. So a buffer known to be free
// already (its event reached) is taken first; else the buffers grow, up to the capacity (the
// window + 1: the buckets in use and those kept together), before one still in use on the
// device is reused, the oldest that fits, waited for on the device (the host never waits).
//
// Not thread-safe: the Reducer calls it with its lock held.
#pragma once

#include "streams.h"

#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>

namespace leanddp {

class BucketRecycler {
 public:
  // Keeps at most `capacity` buffers (the oldest beyond it goes back to the allocator), and
  // grows to `capacity` buffers in use and kept before it reuses one still in use (take()).
  explicit BucketRecycler(size_t capacity);

  // A kept buffer handed out again: its storage, the bucket it was given by, and whether its
  // last use was not known finished (the stream taking it waits for it on the device).
  struct Reused {
    at::Tensor storage;
    size_t giver;
    bool waits;
  };
  // Keeps `storage` (1-D, the whole storage of bucket `giver`, released) for reuse once `ready`,
  // an event recorded after the last work on it, has passed.
  void give(at::Tensor storage, EventPool::Handle ready, size_t giver);
  // A kept buffer of `like`'s dtype and device holding at least `numel` elements, with `stream`
  // ordered after its last use, for a new bucket while the caller has `held` other buffers in
  // use: the smallest known free (no wait); else none while `held` and the buffers kept are
  // fewer than the capacity (the caller allocates); else the oldest that fits (the stream
  // waits for it on the device). None if none fits. Removed from the recycler.
  std::optional<Reused> take(int64_t numel, const at::Tensor& like, const c10::Stream& stream,
                             size_t held);
  // Bytes of the buffers kept now.
  int64_t bytes() const { return bytes_; }
  void clear();

 private:
  struct Entry {
    at::Tensor storage;
    EventPool::Handle ready;
    size_t giver;
  };
  size_t capacity_;
  std::deque<Entry> entries_;  // oldest first
  int64_t bytes_ = 0;
};

}  // namespace leanddp
