#include "streams.h"

#include <ATen/core/grad_mode.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <thread>
#include <unordered_map>
#include <utility>

namespace leanddp {

// Host ordering's lagging stream (set_stream_lag): a thread that runs the work queued on the
// stream in order, each piece `lag` seconds after it was queued. Pieces are numbered as they are
// queued; an event recorded on the stream is reached once the piece queued before it ran.
class Lane {
 public:
  explicit Lane(double lag) : lag_(lag) {
    std::thread([this] { run(); }).detach();  // (lanes live for the process: never joined)
  }
  void set_lag(double lag) {
    std::lock_guard<std::mutex> lock(mu_);
    lag_ = lag;
  }
  void submit(std::function<void()> work) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      const auto due = std::chrono::steady_clock::now() +
                       std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                           std::chrono::duration<double>(lag_));
      queue_.emplace_back(due, std::move(work));
      ++queued_;
    }
    cv_.notify_all();
  }
  // The number of pieces queued so far (an event's ticket).
  int64_t queued() const {
    std::lock_guard<std::mutex> lock(mu_);
    return queued_;
  }
  bool reached(int64_t ticket) const {
    std::lock_guard<std::mutex> lock(mu_);
    return done_ >= ticket;
  }
  // Blocks until the pieces up to `ticket` ran; rethrows an error one of them raised, once (the
  // first wait that covers it reports it).
  void wait(int64_t ticket) const {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return done_ >= ticket; });
    if (error_ && error_piece_ <= ticket) std::rethrow_exception(std::exchange(error_, nullptr));
  }

 private:
  void run() {
    at::NoGradGuard no_grad;  // (device work writes parameters in place)
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [&] { return !queue_.empty(); });
      auto [due, work] = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      std::this_thread::sleep_until(due);
      std::exception_ptr error;
      try {
        work();
      } catch (...) {
        error = std::current_exception();
      }
      work = nullptr;  // (what it owned goes before it counts as done)
      lock.lock();
      ++done_;
      if (error && !error_) {
        error_ = error;
        error_piece_ = done_;
      }
      cv_.notify_all();
    }
  }

  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  std::deque<std::pair<std::chrono::steady_clock::time_point, std::function<void()>>> queue_;
  int64_t queued_ = 0;
  int64_t done_ = 0;
  double lag_;
  mutable std::exception_ptr error_;  // a piece that raised (not reported yet), and its number
  int64_t error_piece_ = 0;
};

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

// Host ordering, per CPU stream: how many events were recorded on it, the latest of those the
// host waited for, and its lane if it lags. The host's own stream (the default) is always known.
struct HostStream {
  int64_t marks = 0;
  int64_t known = 0;
  std::shared_ptr<Lane> lane;
};
struct HostStreams {
  std::mutex mu;
  std::unordered_map<c10::StreamId, HostStream> streams;
};
HostStreams& host_streams() {
  static auto* streams = new HostStreams();  // (leaked: lanes may still run at exit)
  return *streams;
}
std::shared_ptr<Lane> lane_of(const c10::Stream& stream) {
  if (!on_host(stream.device_type())) return nullptr;
  HostStreams& all = host_streams();
  std::lock_guard<std::mutex> lock(all.mu);
  const auto it = all.streams.find(stream.id());
  return it == all.streams.end() ? nullptr : it->second.lane;
}

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

void set_stream_lag(const c10::Stream& stream, double seconds) {
  // (a CPU side stream exists only if host ordering was on when its owner was built)
  TORCH_CHECK(on_host(stream.device_type()),
              "leanddp: a stream lags only under host ordering (a test seam)");
  TORCH_CHECK(stream.id() != default_stream(stream.device()).id(),
              "leanddp: the host's own stream cannot lag");
  TORCH_CHECK(seconds >= 0, "leanddp: a stream's lag must not be negative");
  HostStreams& all = host_streams();
  std::lock_guard<std::mutex> lock(all.mu);
  HostStream& host = all.streams[stream.id()];
  if (host.lane) {
    host.lane->set_lag(seconds);
  } else {
    host.lane = std::make_shared<Lane>(seconds);
  }
}

void run_on(const c10::Stream& stream, std::function<void()> work) {
  if (const std::shared_ptr<Lane> lane = lane_of(stream)) return lane->submit(std::move(work));
  StreamScope scope(stream);
  work();
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
    return;
  }
  ++counters().records;
  HostStreams& all = host_streams();
  std::lock_guard<std::mutex> lock(all.mu);
  HostStream& host = all.streams[stream.id()];
  stream_id_ = stream.id();
  mark_ = ++host.marks;
  lane_ = host.lane;
  ticket_ = lane_ ? lane_->queued() : 0;
}

void PooledEvent::block(const c10::Stream& stream) const {
  if (event_) {
    event_->block(stream);
    return;
  }
  ++counters().blocks;
  if (!lane_) return;  // (the host ran it already)
  const std::shared_ptr<Lane> waiter = lane_of(stream);
  if (waiter && waiter != lane_) {  // one lagging stream after another: on the waiter's thread
    waiter->submit([lane = lane_, ticket = ticket_] { lane->wait(ticket); });
  } else if (!waiter) {  // the host is every other stream
    lane_->wait(ticket_);
  }
}

void PooledEvent::synchronize() const {
  if (event_) {
    event_->synchronize();
    return;
  }
  ++counters().synchronizes;
  if (lane_) lane_->wait(ticket_);
  HostStreams& all = host_streams();
  std::lock_guard<std::mutex> lock(all.mu);
  HostStream& host = all.streams[stream_id_];
  host.known = std::max(host.known, mark_);
}

bool PooledEvent::query() const {
  if (event_) return event_->query();
  if (lane_) return lane_->reached(ticket_);
  if (stream_id_ == default_stream(c10::Device(c10::kCPU)).id()) return true;  // the host's
  HostStreams& all = host_streams();
  std::lock_guard<std::mutex> lock(all.mu);
  return all.streams[stream_id_].known >= mark_;
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
