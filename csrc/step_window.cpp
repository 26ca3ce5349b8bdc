#include "step_window.h"

#include <c10/util/Exception.h>

namespace leanddp {

StepWindow::StepWindow(size_t capacity, bool device_ordered)
    : capacity_(capacity), device_ordered_(device_ordered) {
  TORCH_CHECK(capacity_ >= 1, "StepWindow: the window must hold at least one bucket");
}

void StepWindow::reset(size_t carried) {
  TORCH_CHECK(carried == 0 || device_ordered_,
              "StepWindow: only device steps can be unfinished when a backward ends");
  launched_ = stepped_ = finished_ = 0;
  carried_ = carried;
}

std::optional<StepWindow::Decision> StepWindow::next(
    Phase phase, const std::function<bool(size_t)>& ready) const {
  const bool unstepped = stepped_ < launched_;
  switch (phase) {
    case Phase::kAfterHook:
      if (unstepped && ready(stepped_)) return Decision{Action::kStep, stepped_};
      return std::nullopt;
    case Phase::kBeforeLaunch:
      if (in_flight() < capacity_) return std::nullopt;
      if (carried_ > 0) return Decision{Action::kFinish, kCarried};
      // The oldest bucket in flight is finished_: step it first if it is not stepped yet.
      if (finished_ == stepped_) return Decision{Action::kStepWaiting, stepped_};
      return Decision{Action::kFinish, finished_};
    case Phase::kEnd:
      if (unstepped) return Decision{Action::kStepWaiting, stepped_};
      return std::nullopt;
  }
  return std::nullopt;
}

void StepWindow::launched_one() { ++launched_; }

void StepWindow::stepped_one() {
  TORCH_CHECK(stepped_ < launched_, "StepWindow: a step of a bucket not launched");
  ++stepped_;
  if (!device_ordered_) finished_ = stepped_;
}

void StepWindow::finished_one() {
  if (carried_ > 0) {
    --carried_;
    return;
  }
  TORCH_CHECK(finished_ < stepped_, "StepWindow: the finish of a bucket not stepped");
  ++finished_;
}

}  // namespace leanddp
