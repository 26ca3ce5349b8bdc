// Device-generic streams and events: how leanddp orders work on a GPU instead of polling it.
//
// Everything here goes through c10's virtual device guard, so it compiles in CPU-only builds and
// works for any device type with streams (CUDA). None of it is called for CPU tensors in a real
// run: on the CPU, work runs on the host in program order.
//
// The one exception is a test seam, host ordering (set_host_ordering): CPU tensors are then
// treated as if they lived on a device that runs apart, so that the Reducer and HostOffload take
// their device-ordered branches (side streams, events, the window's finish path, staging copies)
// on the CPU, under gloo, against torch's DDP. Its operations are synchronous: a CPU "stream" is
// the host itself, where everything queued so far has already run, so recording, blocking and
// synchronizing complete at once (and are counted, so tests can tell the branches ran). Only
// tests turn it on. Two things make the seam ask a GPU's ordering questions on the CPU:
//   * what the host knows: an event of a side stream is known reached (query()) only once the
//     host waited for it or for a later event of that stream (synchronize()), as NCCL's works
//     report done only when waited for; so the branches that wait, or that must not wait, run;
//   * lagging streams (set_stream_lag): work queued through run_on() on such a stream runs later,
//     on a thread of its own, so a reader that is not ordered after it reads stale data, as it
//     would on a GPU. A stream waiting for such a stream's event is the host waiting.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

namespace leanddp {

// Whether work on `device` is queued on streams that run apart from the host (a GPU, or the CPU
// under host ordering): progress there is ordered on streams and events, never by asking the
// host whether work is done.
bool runs_apart(const c10::Device& device);

// The host-ordering test seam (see the top of this file). Read where objects decide how they
// order work (at construction): turn it on before building the wrapper.
void set_host_ordering(bool on);
bool host_ordering();
// What host ordering was asked to do in this process so far (counts only grow).
struct HostOrderingCounts {
  int64_t streams = 0;            // side streams handed out (pool_stream)
  int64_t records = 0;            // events recorded
  int64_t blocks = 0;             // stream waits on an event
  int64_t synchronizes = 0;       // host waits on an event
  int64_t records_on_stream = 0;  // tensors recorded as used by a stream (record_on_stream)
};
HostOrderingCounts host_ordering_counts();

// The calling thread's current stream on `device`.
c10::Stream current_stream(const c10::Device& device);

// `device`'s default stream.
c10::Stream default_stream(const c10::Device& device);

// A stream of `device`'s global pool (c10 hands them out round-robin; they live for the process).
// Under host ordering, a new CPU stream id each call (so two streams compare unequal).
c10::Stream pool_stream(const c10::Device& device);

// Host ordering only (a CPU side stream): work queued on `stream` through run_on() from now on
// runs `seconds` after it was queued, in order, on a thread of the stream's own (with gradients
// off), and events recorded on the stream are reached when that thread gets there (see the top
// of this file). The stream keeps its thread for the life of the process; a later call changes
// the lag (0: the work still runs on that thread, in order, at once). The thread writes what the
// host may read meanwhile: the data race a missing ordering has on a GPU (a race detector flags
// it; only tests lag a stream).
void set_stream_lag(const c10::Stream& stream, double seconds);

// Runs `work` in `stream`'s order: at once with `stream` current, so that the device work it
// issues is queued there; under host ordering on a lagging stream (set_stream_lag), later, on
// that stream's thread. `work` must own what it uses: it may run after the caller returned.
void run_on(const c10::Stream& stream, std::function<void()> work);

// Records that `tensor`'s memory is used by the work queued so far on `stream`: the caching
// allocator hands it out again only after that work, even if the tensor is dropped now.
void record_on_stream(const at::Tensor& tensor, const c10::Stream& stream);

// Makes `stream` the current stream of its device for the scope (c10::StreamGuard), except under
// host ordering, where the host is every CPU stream.
class StreamScope {
 public:
  explicit StreamScope(const c10::Stream& stream) {
    if (stream.device_type() != c10::DeviceType::CPU) guard_.emplace(stream);
  }

 private:
  std::optional<c10::StreamGuard> guard_;
};

class Lane;  // host ordering's lagging stream (streams.cpp)

// One event of an EventPool: a c10::Event on a device; under host ordering, a marker whose work
// is done when it is recorded. The same calls either way.
class PooledEvent {
 public:
  explicit PooledEvent(c10::DeviceType type);
  // Marks the point reached by the work queued so far on `stream`.
  void record(const c10::Stream& stream);
  // `stream` waits, on the device, for the recorded point (the host does not wait).
  void block(const c10::Stream& stream) const;
  // The host waits for the recorded point.
  void synchronize() const;
  // Whether the recorded point is known to be reached, without waiting (the device's answer;
  // under host ordering, see the top of this file: the host's stream always, a side stream's
  // once the host waited for this point or a later one, a lagging stream's once it got there).
  bool query() const;

 private:
  std::optional<c10::Event> event_;  // absent under host ordering
  // Host ordering: the stream recorded on, this record's number among that stream's records,
  // and on a lagging stream its lane and the work queued there before the record.
  c10::StreamId stream_id_ = 0;
  int64_t mark_ = 0;
  std::shared_ptr<Lane> lane_;
  int64_t ticket_ = 0;
};

// A pool of reusable events of one device type. Creating a CUDA event costs a driver call, so
// events are created on first need and returned to the pool when their handle is dropped (from
// any thread: the offload worker drops them too). Re-recording an event is safe once every
// `block` on its previous record has been issued: a stream waits for the record that was the
// latest when its wait was enqueued.
class EventPool {
 public:
  explicit EventPool(c10::DeviceType type);

  // Returns the event to the pool when destroyed. The pool's storage outlives every handle.
  struct Returner {
    std::shared_ptr<struct EventPoolState> state;
    void operator()(PooledEvent* event) const;
  };
  using Handle = std::unique_ptr<PooledEvent, Returner>;

  // An event, recorded on `stream` now.
  Handle record(const c10::Stream& stream);
  // Events created so far (the pool never shrinks): a test holds this bounded.
  int64_t created() const;

 private:
  std::shared_ptr<struct EventPoolState> state_;
};

// `waiter` waits, on the device, for the work queued so far on `stream` (the host does not wait).
void stream_wait(const c10::Stream& waiter, const c10::Stream& stream, EventPool& pool);

}  // namespace leanddp
