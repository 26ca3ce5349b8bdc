#include "iteration_timer.h"

#include "streams.h"

#include <chrono>

namespace leanddp {

namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

void IterationTimer::start(bool sampled, const c10::Device& device) {
  active_ = sampled;
  if (!sampled) return;
  complete_ = false;
  marked_.fill(false);
  order_.clear();
  device_.reset();
  if (device.is_cuda()) device_ = device;  // (CUDA timing events; not under host ordering)
  mark(kForwardStart);
}

void IterationTimer::mark(Moment moment) {
  if (!active_ || marked_[moment]) return;
  marked_[moment] = true;
  host_ns_[moment] = now_ns();
  if (device_) {
    auto& event = events_[moment];
    // BACKEND_DEFAULT: timing enabled (pooled ordering events are created without timing).
    if (!event) event.emplace(device_->type(), c10::EventFlag::BACKEND_DEFAULT);
    event->record(current_stream(*device_));
  }
  if (moment == kBackwardCommEnd) {
    complete_ = true;
    active_ = false;
  }
}

IterationTimes IterationTimer::collect() {
  IterationTimes out;
  if (!complete_) return out;
  complete_ = false;
  out.valid = true;
  out.host_ns = host_ns_;
  out.grad_ready_order = std::move(order_);
  order_.clear();
  // A moment never reached (nothing was reduced) gives 0.
  auto span = [&](Moment from, Moment to) -> int64_t {
    if (!marked_[from] || !marked_[to]) return 0;
    int64_t ns = host_ns_[to] - host_ns_[from];
    if (device_) {
      events_[from]->synchronize();
      events_[to]->synchronize();
      ns = static_cast<int64_t>(events_[from]->elapsedTime(*events_[to]) * 1e6);
    }
    return ns > 0 ? ns : 0;  // (the moments' order may differ from run to run)
  };
  out.forward_compute = span(kForwardStart, kBackwardComputeStart);
  out.backward_compute = span(kBackwardComputeStart, kBackwardComputeEnd);
  out.backward_comm = span(kBackwardCommStart, kBackwardCommEnd);
  out.overlap = span(kBackwardCommStart, kBackwardComputeEnd);
  return out;
}

}  // namespace leanddp
