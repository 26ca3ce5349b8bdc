#include "streams.h"

#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <atomic>

namespace leanddp {
namespace {

std::atomic<bool> g_host_ordering{false};

// Host ordering's counts (relaxed: read by tests after the work they count).
struct Counters {
  std::atomic<int64_t> streams{0}, records{0}, blocks{0}, synchronizes{0}, records_on_stream{0};
};
Counters& counters() {
  static Counters c;
  return c;
}

// Whether `type`'s streams and events are host ordering's synchronous stand-ins.
bool on_host(c10::DeviceType type) { return type == c10::DeviceType::CPU; }

}  // namespace

struct EventPoolState {
  explicit EventPoolState(c10::DeviceType t) : type(t) {}
  const c10::DeviceType type;
  std::mutex mu;
  std::vector<std::unique_ptr<PooledEvent>> free;
  int64_t created = 0;
};

bool runs_apart(const c10::Device& device) {
  return device.is_cuda() || (device.is_cpu() && host_ordering());
}

void set_host_ordering(bool on) { g_host_ordering = on; }

bool host_ordering() { return g_host_ordering.load(); }

HostOrderingCounts host_ordering_counts() {
  const Counters& c = counters();
  return {c.streams.load(), c.records.load(), c.blocks.load(), c.synchronizes.load(),
          c.records_on_stream.load()};
}

c10::Stream current_stream(const c10::Device& device) {
  if (on_host(device.type())) return c10::Stream(c10::Stream::DEFAULT, device);
  return c10::impl::VirtualGuardImpl(device.type()).getStream(device);
}

c10::Stream default_stream(const c10::Device& device) {
  if (on_host(device.type())) return c10::Stream(c10::Stream::DEFAULT, device);
  return c10::impl::VirtualGuardImpl(device.type()).getDefaultStream(device);
}

c10::Stream pool_stream(const c10::Device& device) {
  if (on_host(device.type())) {
    TORCH_CHECK(host_ordering(), "leanddp: a side stream for the CPU outside host ordering");
    return c10::Stream(c10::Stream::UNSAFE, device, ++counters().streams);
  }
  return c10::impl::VirtualGuardImpl(device.type())
      .getStreamFromGlobalPool(device, /*isHighPriority=*/false);
}

void record_on_stream(const at::Tensor& tensor, const c10::Stream& stream) {
  if (!tensor.defined() || !tensor.has_storage()) return;
  if (on_host(stream.device_type())) {
    ++counters().records_on_stream;  // the host's work on it is done already
    return;
  }
  c10::impl::VirtualGuardImpl(stream.device_type())
      .recordDataPtrOnStream(tensor.storage().data_ptr(), stream);
}

PooledEvent::PooledEvent(c10::DeviceType type) {
  if (!on_host(type)) event_.emplace(type);
}

void PooledEvent::record(const c10::Stream& stream) {
  if (event_) {
    event_->record(stream);
  } else {
    ++counters().records;
  }
}

void PooledEvent::block(const c10::Stream& stream) const {
  if (event_) {
    event_->block(stream);
  } else {
    ++counters().blocks;
  }
}

void PooledEvent::synchronize() const {
  if (event_) {
    event_->synchronize();
  } else {
    ++counters().synchronizes;
  }
}

EventPool::EventPool(c10::DeviceType type) : state_(std::make_shared<EventPoolState>(type)) {}

void EventPool::Returner::operator()(PooledEvent* event) const {
  std::unique_ptr<PooledEvent> owned(event);
  std::lock_guard<std::mutex> lock(state->mu);
  state->free.push_back(std::move(owned));
}

EventPool::Handle EventPool::record(const c10::Stream& stream) {
  TORCH_CHECK(stream.device_type() == state_->type, "EventPool: a stream of ", stream.device_type(),
              " for events of ", state_->type);
  std::unique_ptr<PooledEvent> event;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (!state_->free.empty()) {
      event = std::move(state_->free.back());
      state_->free.pop_back();
    } else {
      ++state_->created;
    }
  }
  if (!event) event = std::make_unique<PooledEvent>(state_->type);
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
