// StepWindow: when may a launched bucket be stepped (optimizer_in_backward)? The decision lives
// here, apart from the Reducer that carries it out, so that the tests drive it directly.
//
// Buckets are launched 0, 1, 2, ... and stepped in that same order, so every rank steps the same
// buckets in the same order. A bucket is *in flight* from its launch until its step is known to be
// finished:
//   * host progress (CPU buckets): a bucket is ready when its reduction reports done; its step
//     runs on the host, so a stepped bucket is finished;
//   * device order (GPU buckets): a bucket is ready when its reduction can be ordered on a stream
//     now (the work's future is complete on the host: at once for NCCL, whose futures carry CUDA
//     events); stepping enqueues the step on a side stream behind the reduction, and the step is
//     known to be finished only once the host waited for its event, which it does only when the
//     window is full.
// At most `capacity` buckets are in flight: before another launch the oldest is stepped and
// finished first, waiting for it if need be. Device steps still unfinished when a backward ends
// stay in flight into the next one (reset(carried)): a host that reaches the next backward
// before the device finished the last one's steps finishes those first, so the bound holds
// across iterations, not only within one. So the memory of released buckets stays bounded
// even when a backend reports completion late or the device runs far behind the host; when the
// device keeps up, nothing ever waits.
//
// Not thread-safe: the Reducer calls it with its lock held.
#pragma once

#include <cstddef>
#include <functional>
#include <optional>

namespace leanddp {

// Buckets launched but not yet stepped and finished, at most (optimizer_in_backward).
constexpr size_t kBucketsInFlight = 2;

class StepWindow {
 public:
  // What to do next with bucket `bucket`.
  enum class Action {
    kStep,         // step it now: its reduction is ready, nothing blocks
    kStepWaiting,  // step it now, waiting for its reduction if it is not ready
    kFinish,       // wait until its (device) step has finished (the oldest unfinished step:
                   // a carried one, whose `bucket` is then kCarried)
  };
  static constexpr size_t kCarried = static_cast<size_t>(-1);
  struct Decision {
    Action action;
    size_t bucket;
  };
  // Where the Reducer asks: after a hook's launches (step what is ready, never wait); before
  // launching another bucket (make room in the window); at the end of backward (step everything
  // launched; device steps are then ordered before the caller's stream, not waited for).
  enum class Phase { kAfterHook, kBeforeLaunch, kEnd };

  StepWindow(size_t capacity, bool device_ordered);

  // A new synchronized backward: nothing launched; `carried` device steps of earlier backwards
  // are still unfinished (the oldest first), and count as in flight until finished_one().
  void reset(size_t carried = 0);
  // The next action, or none when nothing is to be done in `phase`. `ready(b)` tells whether
  // bucket b's reduction is ready (asked only for the oldest launched bucket not yet stepped).
  std::optional<Decision> next(Phase phase, const std::function<bool(size_t)>& ready) const;
  // Records what was done: a launch (of bucket launched()), a step (of bucket stepped()), the
  // finish of a device step (a carried one first, else of bucket finished()).
  void launched_one();
  void stepped_one();
  void finished_one();

  size_t capacity() const { return capacity_; }
  bool device_ordered() const { return device_ordered_; }
  size_t launched() const { return launched_; }
  size_t stepped() const { return stepped_; }
  size_t finished() const { return finished_; }
  size_t carried() const { return carried_; }
  size_t in_flight() const { return carried_ + launched_ - finished_; }

 private:
  size_t capacity_;
  bool device_ordered_;
  size_t launched_ = 0;
  size_t stepped_ = 0;   // stepped (host) or enqueued (device): always <= launched_
  size_t finished_ = 0;  // always <= stepped_; equal to it with host progress
  size_t carried_ = 0;   // device steps of earlier backwards not yet finished (device order)
};

}  // namespace leanddp
