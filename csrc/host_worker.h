// HostWorker: the host side of offload_to_cpu as an executor. One thread runs jobs in the order
// they are posted; two copy streams carry data each way across PCIe (separate, so both
// directions run at once), an event pool marks the copies, and host memory that crosses PCIe is
// allocated with staging_options() (pinned on a GPU).
//
// Its clients: HostOffload (host_offload.h), the optimizer's side, which copies reduced buckets
// to the host, steps them on this thread and copies the weights back; and HostAccumulator
// (host_accumulator.h), the Reducer's side, which copies no_sync() micro-batches' gradients to
// the host and sums them here, before reduction. Both post into one queue, so a bucket's
// additions always run before its step. The worker knows neither: a job is a closure, run once
// the event it names (if any) is done.
//
// Errors: a job that raises stops nothing; the error is kept for a client to take
// (take_error()), and the jobs queued at that moment are dropped (each told so through its
// `dropped`, with the lock held, then destroyed without it). Jobs posted later run, except those
// posted `drop_if_failed` while the error is held.
//
// Threading: every method may be called from any thread. The worker's lock (lock()) guards its
// queue and status, and also the state its clients' jobs publish (which bucket was stepped, what
// was added): a client reads and writes that state with lock() held, waits on it with wait(),
// and wakes waiters with notify() after changing it. The worker holds the lock only between
// jobs, never while one runs.
//
// Lifetime: co-owned (std::shared_ptr) by its clients. shutdown() (or the destructor) runs the
// jobs already queued, then stops the thread; a client whose jobs refer to it calls shutdown()
// before it goes, so that no job outlives what it refers to. The last reference may be dropped by
// a job on the worker thread itself: then the thread is detached instead of joined (see
// shutdown()).
#pragma once

#include "streams.h"

#include <ATen/ATen.h>
#include <c10/core/Device.h>
#include <c10/core/Stream.h>

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

namespace leanddp {

class HostWorker {
 public:
  struct Job {
    std::function<void()> run;
    EventPool::Handle after;  // GPU: run once this event is done (the copies to the host)
    // Called, with the lock held, if the job fails or is dropped unrun after another's error.
    // It must not own what `run` refers to (it outlives `run`, which is destroyed first).
    std::function<void()> dropped;
    // >= 0: post(..., sort_tail) may move it among the keyed jobs queued at the tail.
    int64_t key = -1;
    // Not queued (post() returns false) while the worker holds an error not taken yet.
    bool drop_if_failed = false;
  };
  // What a client waits on, besides its own state (with the lock held).
  struct Status {
    bool idle = true;      // no job queued or running
    bool failed = false;   // an error is held (take_error())
    bool stopped = false;  // shutdown() was called: no job runs any more
  };

  // The parameters' `device` (the CPU, or a GPU: copies then run apart from the host on the
  // streams); `threads`: the OpenMP team of the worker's kernels. Starts the thread.
  HostWorker(c10::Device device, int threads);
  ~HostWorker();
  HostWorker(const HostWorker&) = delete;
  HostWorker& operator=(const HostWorker&) = delete;

  c10::Device device() const { return device_; }
  // Whether the parameters live on a device that runs apart (the copies are asynchronous).
  bool on_gpu() const { return on_gpu_; }
  // GPU: the stream of the copies to the host, and of the copies back to the device.
  c10::Stream d2h_stream() const { return *d2h_stream_; }
  c10::Stream h2d_stream() const { return *h2d_stream_; }
  // GPU: the events that mark the copies (shared by the clients; thread-safe).
  EventPool& events() { return *events_; }
  int64_t events_created() const { return events_ ? events_->created() : 0; }
  // Host memory that crosses PCIe: pinned on a GPU.
  const at::TensorOptions& staging_options() const { return staging_options_; }

  // Queues `job` after the jobs queued before it; returns whether it was queued (not when
  // stopped, nor when it is `drop_if_failed` and an error is held). With `sort_tail`, the keyed
  // jobs queued last and not started (up to the last unkeyed job) are first reordered, highest
  // key first (stably), so that `job` follows them in that order.
  bool post(Job job, bool sort_tail = false);
  // Queues `job` only if the worker is busy or has jobs queued (then it runs after them);
  // returns false, queuing nothing, if it is idle or stopped: the caller may do the work itself.
  bool post_if_busy(Job job);

  // The worker's lock (see the top of this file).
  std::unique_lock<std::mutex> lock() const { return std::unique_lock<std::mutex>(sync_->mu); }
  // With the lock held.
  Status status() const;
  // With `lock` held: blocks until `ready(status())` holds, asked whenever a job finished or a
  // client notified (and first).
  void wait(std::unique_lock<std::mutex>& lock, const std::function<bool(const Status&)>& ready);
  // Wakes the waiters of wait(), after a client changed the state it publishes (lock released).
  void notify() { sync_->cv.notify_all(); }
  // The error a job raised, taken (null if none); the jobs queued then were dropped. `then`, if
  // given, runs with the lock held when an error is taken (a client dropping what the error
  // left), and the waiters are woken after it.
  std::exception_ptr take_error(const std::function<void()>& then = {});
  // Seconds the worker spent running jobs (including waiting for their events).
  double busy_seconds() const;

  // Runs the jobs queued, then stops the thread for good; later posts are dropped. Idempotent.
  // Called on the worker thread itself (by a job dropping the last reference to a client, or to
  // this object) it cannot wait or join: it drops the queue, stops, and detaches the thread.
  // Detaching is safe because after a job the worker touches nothing of this object until it
  // has re-taken the lock co-owned with the thread and seen `stop`; it then returns.
  void shutdown();

  // How many errors take_error() has handed out so far (any thread). A client whose data a
  // failed or dropped job may have left partial (the accumulator's host sums) drops that data
  // once this has moved since the data was begun.
  int64_t errors_taken() const { return errors_taken_.load(); }

  // Tests: clients sleep `seconds` before each step or addition they run here (0: not).
  void delay_jobs(double seconds) { delay_ = seconds; }
  double delay() const { return delay_; }
  // The client jobs a test can make fail (inject_faults()).
  enum class Fault : uint8_t { kAddition = 0, kStep = 1 };
  // Tests, any thread: the next `count` jobs of `kind` that reach check_fault() (only those of
  // bucket `bucket`, if it is >= 0) raise a c10::Error instead of running ("leanddp injected
  // fault: host addition of bucket B"); count 0 disarms. Replaces what was armed for `kind`.
  void inject_faults(Fault kind, int64_t count, int64_t bucket = -1);
  // On the worker thread, by a client's job of `kind` on `bucket`, after its delay and before
  // it touches anything: raises if inject_faults() made it fail. Costs one relaxed atomic load
  // when nothing is armed (the hot path).
  void check_fault(Fault kind, int64_t bucket) {
    if (faults_[static_cast<size_t>(kind)].count.load(std::memory_order_relaxed) > 0) {
      fail_if_due(kind, bucket);
    }
  }
  // Tests, under host ordering (streams.h): the copies back run `seconds` after they were
  // queued, on the host-to-device stream's own thread, as a GPU's may.
  void delay_copies_back(double seconds);

 private:
  // Shared with the thread, so it outlives this object when the thread destroys it.
  struct Sync {
    std::mutex mu;
    std::condition_variable cv;
    bool busy = false;
    bool stop = false;
  };
  void run(const std::shared_ptr<Sync>& sync, int threads);
  // check_fault()'s slow path: an injection is armed for `kind`.
  void fail_if_due(Fault kind, int64_t bucket);

  // What inject_faults() armed, per Fault: jobs left to fail, and the bucket (-1: any).
  struct FaultPlan {
    std::atomic<int64_t> count{0};
    std::atomic<int64_t> bucket{-1};
  };

  c10::Device device_;
  bool on_gpu_ = false;
  std::optional<c10::Stream> d2h_stream_;
  std::optional<c10::Stream> h2d_stream_;
  std::unique_ptr<EventPool> events_;
  at::TensorOptions staging_options_;
  std::atomic<double> delay_{0};
  std::array<FaultPlan, 2> faults_;
  std::atomic<int64_t> errors_taken_{0};  // take_error()'s count of errors handed out

  std::shared_ptr<Sync> sync_ = std::make_shared<Sync>();
  // Guarded by sync_->mu.
  std::deque<Job> queue_;
  std::exception_ptr error_;
  double busy_seconds_ = 0;
  std::thread thread_;
};

}  // namespace leanddp
