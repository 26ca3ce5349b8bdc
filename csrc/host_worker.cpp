#include "host_worker.h"

#include <ATen/Parallel.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <chrono>
#include <iterator>
#include <utility>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace leanddp {

HostWorker::HostWorker(c10::Device device, int threads) : device_(device) {
  TORCH_CHECK(threads > 0, "HostWorker: threads must be positive");
  TORCH_CHECK(device.is_cpu() || device.is_cuda(),
              "offload_to_cpu supports parameters on the CPU or a CUDA GPU, not ", device);
  on_gpu_ = runs_apart(device);
  if (on_gpu_) {
    d2h_stream_ = pool_stream(device);
    h2d_stream_ = pool_stream(device);
    TORCH_INTERNAL_ASSERT(*d2h_stream_ != *h2d_stream_, "offload_to_cpu: one stream for both ways");
    events_ = std::make_unique<EventPool>(device.type());
  }
  // Pinned where the copies cross PCIe (not under host ordering, on a CPU).
  staging_options_ = at::TensorOptions().device(at::kCPU).pinned_memory(device.is_cuda());
  thread_ = std::thread([this, sync = sync_, threads] { run(sync, threads); });
}

HostWorker::~HostWorker() { shutdown(); }

void HostWorker::shutdown() {
  const bool on_worker = thread_.get_id() == std::this_thread::get_id();
  // Destroyed last, unlocked: a job may own the last reference to a client, or to this object
  // (on the worker, after the thread is detached; nothing of this object is touched then).
  std::deque<Job> gone;
  {
    std::unique_lock<std::mutex> lock(sync_->mu);
    // The wrapper may be collected right after a backward (a framework's teardown): its queued
    // host steps still land in the parameters. (On the worker, nothing else can run them.)
    if (!on_worker) {
      sync_->cv.wait(lock, [&] { return sync_->stop || (queue_.empty() && !sync_->busy); });
    }
    sync_->stop = true;
    gone.swap(queue_);
  }
  sync_->cv.notify_all();
  if (!thread_.joinable()) return;
  if (on_worker) {
    thread_.detach();  // (see the header) destroying a joinable std::thread would terminate
  } else {
    thread_.join();
  }
}

bool HostWorker::post(Job job, bool sort_tail) {
  {
    std::lock_guard<std::mutex> lock(sync_->mu);
    if (sync_->stop || (job.drop_if_failed && error_)) return false;
    if (sort_tail) {
      auto first = queue_.end();
      while (first != queue_.begin() && std::prev(first)->key >= 0) --first;
      std::stable_sort(first, queue_.end(),
                       [](const Job& a, const Job& b) { return a.key > b.key; });
    }
    queue_.push_back(std::move(job));
  }
  sync_->cv.notify_all();
  return true;
}

bool HostWorker::post_if_busy(Job job) {
  {
    std::lock_guard<std::mutex> lock(sync_->mu);
    if (sync_->stop || (queue_.empty() && !sync_->busy)) return false;
    queue_.push_back(std::move(job));
  }
  sync_->cv.notify_all();
  return true;
}

HostWorker::Status HostWorker::status() const {
  Status out;
  out.idle = queue_.empty() && !sync_->busy;
  out.failed = error_ != nullptr;
  out.stopped = sync_->stop;
  return out;
}

void HostWorker::wait(std::unique_lock<std::mutex>& lock,
                      const std::function<bool(const Status&)>& ready) {
  sync_->cv.wait(lock, [&] { return ready(status()); });
}

std::exception_ptr HostWorker::take_error(const std::function<void()>& then) {
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lock(sync_->mu);
    error = std::exchange(error_, nullptr);
    if (error) ++errors_taken_;
    if (error && then) then();
  }
  if (error) sync_->cv.notify_all();
  return error;
}

double HostWorker::busy_seconds() const {
  std::lock_guard<std::mutex> lock(sync_->mu);
  return busy_seconds_;
}

void HostWorker::delay_copies_back(double seconds) {
  TORCH_CHECK(on_gpu_ && h2d_stream_->device_type() == c10::DeviceType::CPU,
              "HostWorker::delay_copies_back: only under host ordering (a test seam)");
  set_stream_lag(*h2d_stream_, seconds);
}

void HostWorker::inject_faults(Fault kind, int64_t count, int64_t bucket) {
  TORCH_CHECK(count >= 0, "HostWorker::inject_faults: count must not be negative");
  FaultPlan& plan = faults_[static_cast<size_t>(kind)];
  plan.count.store(0);  // (disarmed while the bucket changes)
  plan.bucket.store(bucket);
  plan.count.store(count);
}

void HostWorker::fail_if_due(Fault kind, int64_t bucket) {
  FaultPlan& plan = faults_[static_cast<size_t>(kind)];
  const int64_t only = plan.bucket.load();
  if (only >= 0 && only != bucket) return;
  int64_t left = plan.count.load();
  while (left > 0 && !plan.count.compare_exchange_weak(left, left - 1)) {
  }
  if (left <= 0) return;
  TORCH_CHECK(false, "leanddp injected fault: host ",
              kind == Fault::kAddition ? "addition" : "step", " of bucket ", bucket);
}

void HostWorker::run(const std::shared_ptr<Sync>& sync, int threads) {
  // A new thread's current device is the first GPU: this rank's device instead, before the first
  // CUDA call (an event synchronize does not set it), or every rank opens a context on GPU 0.
  if (device_.is_cuda()) c10::impl::VirtualGuardImpl(device_.type()).setDevice(device_);
  // The step kernels use at::parallel_for, an OpenMP team sized by this thread's own setting.
  at::internal::lazy_init_num_threads();
#ifdef _OPENMP
  omp_set_num_threads(threads);
#else
  (void)threads;
#endif
  at::NoGradGuard no_grad;
  std::unique_lock<std::mutex> lock(sync->mu);
  while (true) {
    sync->cv.wait(lock, [&] { return sync->stop || !queue_.empty(); });
    if (sync->stop) return;
    Job job = std::move(queue_.front());
    queue_.pop_front();
    sync->busy = true;
    lock.unlock();
    const auto start = std::chrono::steady_clock::now();
    std::exception_ptr error;
    try {
      if (job.after) job.after->synchronize();
      job.run();
    } catch (c10::Error& e) {
      e.add_context(
          "in leanddp offload_to_cpu's host step (the weights of this iteration may be "
          "partly updated)");
      error = std::current_exception();
    } catch (...) {
      error = std::current_exception();
    }
    // Drops the job's references before publishing. The last reference to this object may go
    // with them (shutdown() then ran on this thread): from here on only `sync` is touched until
    // `stop` is known to be unset. (`dropped` owns nothing the job refers to.)
    std::function<void()> dropped = std::move(job.dropped);
    job = Job();
    lock.lock();
    if (sync->stop) return;
    if (error) {
      error_ = error;
      if (dropped) dropped();
      for (const Job& queued : queue_) {
        if (queued.dropped) queued.dropped();
      }
      std::deque<Job> gone;
      gone.swap(queue_);
      // Destroyed unlocked, as `job` above: a dropped job may own the last reference to a client
      // or to this object, whose shutdown() takes the lock.
      lock.unlock();
      gone.clear();
      lock.lock();
      if (sync->stop) return;
    }
    sync->busy = false;
    busy_seconds_ +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    sync->cv.notify_all();
  }
}

}  // namespace leanddp
