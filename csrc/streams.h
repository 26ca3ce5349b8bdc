// Device-generic streams and events: how leanddp orders work on a GPU instead of polling it.
//
// Everything here goes through c10's virtual device guard, so it compiles in CPU-only builds and
// works for any device type with streams (CUDA). None of it is called for CPU tensors: on the
// CPU, work runs on the host in program order.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

namespace leanddp {

// Whether work on `device` is queued on streams that run apart from the host (a GPU): progress
// there is ordered on streams and events, never by asking the host whether work is done.
bool runs_apart(const c10::Device& device);

// The calling thread's current stream on `device`.
c10::Stream current_stream(const c10::Device& device);

// `device`'s default stream.
c10::Stream default_stream(const c10::Device& device);

// A stream of `device`'s global pool (c10 hands them out round-robin; they live for the process).
c10::Stream pool_stream(const c10::Device& device);

// Records that `tensor`'s memory is used by the work queued so far on `stream`: the caching
// allocator hands it out again only after that work, even if the tensor is dropped now.
void record_on_stream(const at::Tensor& tensor, const c10::Stream& stream);

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
    void operator()(c10::Event* event) const;
  };
  using Handle = std::unique_ptr<c10::Event, Returner>;

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
