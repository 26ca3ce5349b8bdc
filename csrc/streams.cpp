#include "streams.h"

#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

namespace leanddp {

struct EventPoolState {
  explicit EventPoolState(c10::DeviceType t) : type(t) {}
  const c10::DeviceType type;
  std::mutex mu;
  std::vector<std::unique_ptr<c10::Event>> free;
  int64_t created = 0;
};

bool runs_apart(const c10::Device& device) { return device.is_cuda(); }

c10::Stream current_stream(const c10::Device& device) {
  return c10::impl::VirtualGuardImpl(device.type()).getStream(device);
}

c10::Stream default_stream(const c10::Device& device) {
  return c10::impl::VirtualGuardImpl(device.type()).getDefaultStream(device);
}

c10::Stream pool_stream(const c10::Device& device) {
  return c10::impl::VirtualGuardImpl(device.type())
      .getStreamFromGlobalPool(device, /*isHighPriority=*/false);
}

void record_on_stream(const at::Tensor& tensor, const c10::Stream& stream) {
  if (!tensor.defined() || !tensor.has_storage()) return;
  c10::impl::VirtualGuardImpl(stream.device_type())
      .recordDataPtrOnStream(tensor.storage().data_ptr(), stream);
}

EventPool::EventPool(c10::DeviceType type) : state_(std::make_shared<EventPoolState>(type)) {}

void EventPool::Returner::operator()(c10::Event* event) const {
  std::unique_ptr<c10::Event> owned(event);
  std::lock_guard<std::mutex> lock(state->mu);
  state->free.push_back(std::move(owned));
}

EventPool::Handle EventPool::record(const c10::Stream& stream) {
  TORCH_CHECK(stream.device_type() == state_->type, "EventPool: a stream of ", stream.device_type(),
              " for events of ", state_->type);
  std::unique_ptr<c10::Event> event;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (!state_->free.empty()) {
      event = std::move(state_->free.back());
      state_->free.pop_back();
    } else {
      ++state_->created;
    }
  }
  if (!event) event = std::make_unique<c10::Event>(state_->type);
  event->record(stream);
  return Handle(event.release(), Returner{state_});
}

int64_t EventPool::created() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->created;
}

void stream_wait(const c10::Stream& waiter, const c10::Stream& stream, EventPool& pool) {
  if (waiter == stream) return;
  pool.record(stream)->block(waiter);
}

}  // namespace leanddp
