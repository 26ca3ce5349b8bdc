#include "host_offload.h"

#include "op_calls.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <thread>
#include <utility>

namespace leanddp {

HostOffload::HostOffload(std::vector<at::Tensor> params, std::unique_ptr<FusedOptimizer> optimizer,
                         OffloadOptions options)
    : params_(std::move(params)), optimizer_(std::move(optimizer)), options_(options) {
  TORCH_CHECK(!params_.empty() && optimizer_, "HostOffload: no parameters or no optimizer");
  TORCH_CHECK(options_.threads > 0, "HostOffload: threads must be positive");
  worker_ = std::make_shared<HostWorker>(params_[0].device(), options_.threads);
  on_gpu_ = worker_->on_gpu();
  const size_t n = params_.size();
  masters_.resize(n);
  versions_.assign(n, 0);
  made_.assign(n, 0);
  location_.assign(n, {SIZE_MAX, 0});
}

// (The worker may outlive this object, co-owned by the accumulator: no job referring to this
// object may run after it.)
HostOffload::~HostOffload() { worker_->shutdown(); }

void HostOffload::set_layout(const std::vector<Bucket>& buckets, std::vector<ShardLayout> shards) {
  TORCH_CHECK(shards.empty() || shards.size() == buckets.size(),
              "HostOffload: one shard per bucket");
  layout_.clear();
  for (const Bucket& bucket : buckets) {
    Bucket plain;
    plain.params = bucket.params;
    plain.offsets = bucket.offsets;
    plain.numel = bucket.numel;
    layout_.push_back(std::move(plain));
  }
  std::fill(location_.begin(), location_.end(), std::make_pair(SIZE_MAX, size_t{0}));
  for (size_t b = 0; b < layout_.size(); ++b) {
    for (size_t s = 0; s < layout_[b].params.size(); ++s) {
      location_[static_cast<size_t>(layout_[b].params[s])] = {b, s};
    }
  }
  host_.assign(layout_.size(), HostBucket{});
  last_submit_.assign(layout_.size(), 0);
  {
    const std::unique_lock<std::mutex> lock = worker_->lock();
    stepped_.assign(layout_.size(), 0);
    copied_back_.clear();
    copied_back_.resize(layout_.size());
  }
  piece_of_.assign(params_.size(), -1);
  for (size_t b = 0; b < shards.size(); ++b) {
    for (size_t k = 0; k < shards[b].pieces.size(); ++k) {
      piece_of_[static_cast<size_t>(layout_[b].params[shards[b].pieces[k].slot])] =
          static_cast<int64_t>(k);
    }
  }
  shards_ = std::move(shards);
  optimizer_->set_shards(shards_);
}

void HostOffload::submit(size_t index, const Bucket& bucket, const std::vector<char>& mask) {
  {
    const std::unique_lock<std::mutex> lock = worker_->lock();
    const HostWorker::Status status = worker_->status();
    if (status.stopped || status.failed) return;  // dropped: the error surfaces at the next wait()
  }
  TORCH_CHECK(index < layout_.size() && layout_[index].numel == bucket.numel,
              "HostOffload: bucket ", index, " does not match the layout it was given");
  at::Tensor& grads = host_[index].grads;
  if (!grads.defined()) {
    grads = at::empty({extent(index)}, worker_->staging_options().dtype(bucket.flat.scalar_type()));
  }
  Step step;
  step.index = index;
  step.layout = layout_[index];
  step.mask = mask;
  step.refresh.assign(bucket.params.size(), 0);
  step.grads = grads;
  HostWorker::Job job;
  std::optional<StreamScope> guard;
  if (on_gpu_) guard.emplace(worker_->d2h_stream());
  // Sharded: the shard, reduced there (the rest of the padded bucket is not).
  grads.copy_(
      shards_.empty() ? bucket.flat : bucket.padded.narrow(0, shards_[index].begin, extent(index)),
      /*non_blocking=*/on_gpu_);
  // Masters of parameters someone else changed since our last write (or not made yet) are
  // read from the parameters through their pinned `weights` slots, in the same stream order as
  // the gradients (a float32 master is that slot; a low-precision one is upcast by the worker).
  for (size_t s = 0; s < bucket.params.size(); ++s) {
    const auto p = static_cast<size_t>(bucket.params[s]);
    const at::Tensor& param = params_[p];
    if (masters_[p].defined() && param._version() == versions_[p]) continue;
    const at::Tensor host = weights_slot(p);
    if (host.defined()) host.copy_(part(p, param), /*non_blocking=*/on_gpu_);
    step.refresh[s] = low_precision(p);
    if (!low_precision(p)) ensure_master(p);  // a view of that slot
    versions_[p] = param._version();
  }
  if (on_gpu_) job.after = worker_->events().record(worker_->d2h_stream());
  int64_t sequence = 0;
  {
    const std::unique_lock<std::mutex> lock = worker_->lock();
    sequence = step.sequence = last_submit_[index] = ++submitted_;
  }
  // (captures nothing `run` owns: see HostWorker::Job)
  job.dropped = [this, index, sequence] { settle(index, sequence); };
  job.run = [this, step = std::move(step)]() mutable { process(step); };
  job.key = static_cast<int64_t>(index);
  job.drop_if_failed = true;
  if (!worker_->post(std::move(job))) {  // (an error met meanwhile, or stopped)
    const std::unique_lock<std::mutex> lock = worker_->lock();
    settle(index, sequence);
  }
}

void HostOffload::end_iteration(bool completed, std::optional<double> sum_squares) {
  HostWorker::Job marker;
  marker.run = [this, completed, sum_squares] { finish_iteration(completed, sum_squares); };
  marker.drop_if_failed = true;
  // The steps queued last and not started (no other job among them): highest index first.
  worker_->post(std::move(marker), /*sort_tail=*/options_.last_bucket_first);
}

std::vector<int64_t> HostOffload::pending() const {
  std::vector<int64_t> out;
  const std::unique_lock<std::mutex> lock = worker_->lock();
  // (idle: what was not stepped was dropped, by an abandoned iteration or an error)
  const HostWorker::Status status = worker_->status();
  if (status.failed || status.stopped || status.idle) return out;
  for (size_t b = 0; b < last_submit_.size(); ++b) {
    if (stepped_[b] < last_submit_[b]) out.push_back(static_cast<int64_t>(b));
  }
  return out;
}

void HostOffload::set_groups(std::vector<OptimHyper> groups) {
  optimizer_->check_groups(groups);
  auto shared = std::make_shared<std::vector<OptimHyper>>(std::move(groups));
  HostWorker::Job job;
  job.run = [this, shared] { optimizer_->set_groups(std::move(*shared)); };
  if (worker_->post_if_busy(std::move(job))) return;
  // (no step is queued or running; the accumulator's additions never touch the optimizer)
  optimizer_->set_groups(std::move(*shared));
}

void HostOffload::block_until(std::unique_lock<std::mutex>& lock,
                              const std::function<bool(const HostWorker::Status&)>& ready) {
  if (ready(worker_->status())) return;
  const auto start = std::chrono::steady_clock::now();
  worker_->wait(lock, ready);
  stats_.wait_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void HostOffload::wait_stepped(size_t index) {
  std::shared_ptr<const PooledEvent> copied;
  bool failed = false;
  {
    std::unique_lock<std::mutex> lock = worker_->lock();
    // (a failed or stopped worker dropped its jobs: the queue is empty then)
    block_until(lock, [&](const HostWorker::Status& status) {
      return stepped_[index] >= last_submit_[index] || status.failed || status.stopped ||
             status.idle;
    });
    const HostWorker::Status status = worker_->status();
    failed = status.failed || status.stopped;
    copied = copied_back_[index];
  }
  // (outside the lock: the worker goes on publishing steps; `copied` stays alive here if it
  // records a newer copy back meanwhile) After an error the bucket's last step may have failed
  // part-way, its copy back queued but not its event: follow every copy back queued so far.
  if (failed) return order_after_copies();
  if (on_gpu_ && copied) copied->block(current_stream(params_[0].device()));
}

void HostOffload::wait(bool host_too) {
  wait_keeping_error(host_too);
  if (std::exception_ptr error = take_error()) std::rethrow_exception(error);
}

void HostOffload::wait_keeping_error(bool host_too) {
  {
    std::unique_lock<std::mutex> lock = worker_->lock();
    block_until(lock,
                [](const HostWorker::Status& status) { return status.idle || status.stopped; });
  }
  // (the worker is idle; the only other client, the accumulator, queues additions inside
  // backward, never while its owner waits here)
  order_after_copies(host_too);
}

void HostOffload::follow_copies(bool host_too) {
  order_after_copies(host_too);  // (first: if it raises, the worker's error stays for the next)
  if (std::exception_ptr error = take_error()) std::rethrow_exception(error);
}

std::exception_ptr HostOffload::take_error() {
  // (no step ran since the error: none is queued while it is held, and the queue was dropped)
  return worker_->take_error([this] {
    for (const Step& dropped : held_) settle(dropped.index, dropped.sequence);
    held_.clear();
    sum_squares_ = 0;
  });
}

void HostOffload::order_after_copies(bool host_too) {
  if (!on_gpu_) return;
  // (recorded after the caller read pending(): every bucket stepped by then had its copy back
  // queued before its step was published, so this event follows it)
  const EventPool::Handle copied = worker_->events().record(worker_->h2d_stream());
  copied->block(current_stream(params_[0].device()));
  if (host_too) copied->synchronize();
}

void HostOffload::process(Step& step) {
  if (!holds()) {
    step_job(step, std::nullopt);
    return;
  }
  if (options_.max_grad_norm) {
    // Unused parameters' slots hold zeros: the sum is over the gradients torch would clip.
    const double norm =
        at::linalg_vector_norm(step.grads, 2, std::nullopt, false, at::kDouble).item<double>();
    sum_squares_ += norm * norm;
  }
  held_.push_back(std::move(step));
}

void HostOffload::adopt_masters() {
  for (size_t p = 0; p < params_.size(); ++p) {
    if (!low_precision(p)) continue;
    made_[p] = 1;
    if (!ensure_master(p).defined()) continue;  // (sharded: no piece here)
    versions_[p] = params_[p]._version();
    ++generation_;
  }
}

void HostOffload::adopt_versions() {
  for (size_t p = 0; p < params_.size(); ++p) versions_[p] = params_[p]._version();
}

double HostOffload::held_sum_squares() const {
  const std::unique_lock<std::mutex> lock = worker_->lock();
  return sum_squares_;
}

void HostOffload::settle(size_t index, int64_t sequence) {
  stepped_[index] = std::max(stepped_[index], sequence);
}

void HostOffload::finish_iteration(bool completed, std::optional<double> total) {
  std::vector<Step> held = std::exchange(held_, {});
  const double sum_squares = std::exchange(sum_squares_, 0.0);
  if (!completed) {  // held buckets are dropped unstepped: not pending any more
    {
      const std::unique_lock<std::mutex> lock = worker_->lock();
      for (const Step& dropped : held) settle(dropped.index, dropped.sequence);
    }
    worker_->notify();
    return;
  }
  double grad_norm = -1;
  std::optional<double> coef;
  if (options_.max_grad_norm) {
    grad_norm = std::sqrt(total.value_or(sum_squares));
    coef = clip_coefficient(grad_norm, *options_.max_grad_norm);
  }
  std::vector<Step*> order;
  for (Step& step : held) order.push_back(&step);
  if (options_.last_bucket_first) {
    std::stable_sort(order.begin(), order.end(),
                     [](const Step* a, const Step* b) { return a->index > b->index; });
  }
  size_t done = 0;
  try {
    for (; done < order.size(); ++done) step_job(*order[done], coef);
  } catch (...) {
    // The failing step and those after it are dropped: back to held_, which take_error() settles
    // (not pending any more; wait_stepped() and pending() see the error until then).
    for (size_t k = done; k < order.size(); ++k) held_.push_back(std::move(*order[k]));
    throw;
  }
  const std::unique_lock<std::mutex> lock = worker_->lock();
  ++stats_.iterations;
  stats_.grad_norm = grad_norm;
}

void HostOffload::step_job(const Step& job, std::optional<double> grad_scale) {
  if (const double delay = worker_->delay(); delay > 0) {
    std::this_thread::sleep_for(std::chrono::duration<double>(delay));
  }
  worker_->check_fault(HostWorker::Fault::kStep, static_cast<int64_t>(job.index));
  const Bucket& layout = job.layout;
  const at::Tensor& weights = ensure_weights(job.index);
  for (size_t s = 0; s < layout.params.size(); ++s) {
    const auto p = static_cast<size_t>(layout.params[s]);
    if (!job.refresh[s]) continue;
    made_[p] = 1;
    const at::Tensor& master = ensure_master(p);
    if (master.defined()) master.copy_(weights_slot(p));  // (sharded: p may have no piece here)
  }
  StepTargets targets;
  targets.grad_scale = grad_scale;
  targets.cut = !shards_.empty();  // (the host buffers hold the shard's pieces)
  for (size_t s = 0; s < layout.params.size(); ++s) {
    const auto p = static_cast<size_t>(layout.params[s]);
    targets.params.push_back(masters_[p]);
    targets.grads.push_back(slot(p, job.grads));
    if (low_precision(p)) {  // the kernel writes the rounded weights straight into `weights`
      targets.copies.push_back(slot(p, weights));
    }
  }
  optimizer_->step(job.index, layout, job.mask, targets);
  copy_back(job, weights);
  {
    // (recorded first: a bucket is published stepped together with the event of its copy)
    std::shared_ptr<const PooledEvent> copied;
    if (on_gpu_) copied = worker_->events().record(worker_->h2d_stream());  // (a pooled event)
    const std::unique_lock<std::mutex> lock = worker_->lock();
    ++stats_.buckets;
    stepped_[job.index] = job.sequence;
    if (copied) copied_back_[job.index] = std::move(copied);
  }
  worker_->notify();  // (wait_stepped: also within an iteration's held steps)
}

void HostOffload::copy_back(const Step& job, const at::Tensor& weights) {
  const Bucket& layout = job.layout;
  // What this rank stepped of each member: the parameter, or sharded its piece, and where it
  // lies in the bucket's host buffers (their regions are consecutive from the start, in slot
  // order, either way). Members not stepped (unused) keep their values.
  struct Stepped {
    at::Tensor target;
    int64_t offset;  // in `weights`
    size_t param;
  };
  std::vector<at::Tensor> present;
  std::vector<Stepped> stepped;
  bool all = true;
  for (size_t s = 0; s < layout.params.size(); ++s) {
    const auto p = static_cast<size_t>(layout.params[s]);
    at::Tensor target = part(p, params_[p]);
    if (!target.defined()) continue;
    present.push_back(target);
    all = all && job.mask[s];
    if (!job.mask[s]) continue;
    const int64_t offset =
        shards_.empty() ? layout.offsets[s]
                        : shards_[job.index].pieces[static_cast<size_t>(piece_of_[p])].shard_offset;
    stepped.push_back({std::move(target), offset, p});
  }
  // The device's part, in the host-to-device stream's order: one flat copy over PCIe, then one
  // launch scatters it into the parameters. It owns what it reads (a lagging stream of the
  // host-ordering seam runs it later, on its own thread: streams.h).
  const at::Tensor& member = params_[static_cast<size_t>(layout.params.front())];
  const int64_t numel = extent(job.index);
  const at::TensorOptions options = member.options().requires_grad(false);  // the bucket's dtype
  auto write = [on_gpu = on_gpu_, weights, numel, options, all, present, stepped] {
    // (the version counters were bumped when the copy was queued, as a GPU's would be: a
    // lagging stream of the seam runs this later)
    at::AutoDispatchBelowADInplaceOrView no_version_bump;
    at::Tensor source = weights;
    if (on_gpu) {
      source = at::empty({numel}, options);
      source.copy_(weights, /*non_blocking=*/true);
    }
    if (all) {
      unflatten_from(source, present);
      return;
    }
    for (const Stepped& member : stepped) {
      const at::Tensor& target = member.target;
      target.copy_(source.narrow(0, member.offset, target.numel()).view(target.sizes()));
    }
  };
  for (const Stepped& member : stepped) {
    // As an in-place op does: autograd then knows tensors it saved from the parameter are stale
    // (before the write: a write that fails part-way has bumped them all).
    torch::autograd::impl::bump_version(member.target);
    versions_[member.param] = member.target._version();  // (shared with the parameter)
  }
  if (on_gpu_) {
    run_on(worker_->h2d_stream(), std::move(write));
  } else {
    write();
  }
}

void HostOffload::relayout(const std::vector<Bucket>& old_buckets,
                           const std::vector<Bucket>& new_buckets) {
  TORCH_CHECK(shards_.empty(), "HostOffload: a sharded layout is fixed");
  optimizer_->relayout(old_buckets, new_buckets);
  // Masters are views into the old buckets' blocks (kept alive by these views): copy them into
  // the new layout.
  const std::vector<at::Tensor> old_masters = masters_;
  set_layout(new_buckets);
  for (size_t p = 0; p < params_.size(); ++p) {
    if (!old_masters[p].defined()) continue;
    masters_[p] = at::Tensor();
    ensure_master(p).copy_(old_masters[p]);
  }
}

at::Tensor HostOffload::master(size_t p) const {
  return low_precision(p) ? masters_[p] : at::Tensor();
}

void HostOffload::load_master(size_t p, const at::Tensor& value) {
  const at::Tensor& param = params_[p];
  TORCH_CHECK(value.numel() == param.numel(), "offload_to_cpu: a master weight of ", value.numel(),
              " elements for a parameter of ", param.numel());
  const at::Tensor master = ensure_master(p);
  if (master.defined()) master.copy_(part(p, value.reshape(param.sizes())).view(master.sizes()));
  versions_[p] = param._version();
  made_[p] = 1;
  ++generation_;
}

at::Tensor& HostOffload::ensure_master(size_t p) {
  if (!masters_[p].defined()) {
    if (low_precision(p)) {
      masters_[p] = slot(p, masters_block(bucket_of(p)));
    } else {
      masters_[p] = weights_slot(p);
    }
    if (masters_[p].defined()) ++generation_;
  }
  return masters_[p];
}

at::Tensor HostOffload::weights_slot(size_t p) { return slot(p, ensure_weights(bucket_of(p))); }

size_t HostOffload::bucket_of(size_t p) const {
  const size_t b = location_[p].first;
  TORCH_CHECK(b < layout_.size(), "HostOffload: parameter ", p, " is in no bucket");
  return b;
}

at::Tensor HostOffload::masters_block(size_t b) {
  at::Tensor& masters = host_[b].masters;
  if (!masters.defined()) {  // ordinary memory: never crosses PCIe
    masters = at::empty({extent(b)}, at::TensorOptions(at::kFloat));
  }
  return masters;
}

at::Tensor HostOffload::slot(size_t p, const at::Tensor& block) const {
  const auto [b, s] = location_[p];
  const at::Tensor& param = params_[p];
  if (shards_.empty()) {
    return block.narrow(0, layout_[b].offsets[s], param.numel()).view(param.sizes());
  }
  if (piece_of_[p] < 0) return at::Tensor();
  const ShardPiece& piece = shards_[b].pieces[static_cast<size_t>(piece_of_[p])];
  return block.narrow(0, piece.shard_offset, piece.numel);
}

at::Tensor HostOffload::part(size_t p, const at::Tensor& t) const {
  if (shards_.empty()) return t;
  if (piece_of_[p] < 0) return at::Tensor();
  const ShardPiece& piece = shards_[bucket_of(p)].pieces[static_cast<size_t>(piece_of_[p])];
  return t.reshape({-1}).narrow(0, piece.slot_offset, piece.numel);
}

at::Tensor& HostOffload::ensure_weights(size_t b) {
  at::Tensor& weights = host_[b].weights;
  if (!weights.defined()) {
    const at::Tensor& first = params_[static_cast<size_t>(layout_[b].params.front())];
    weights = at::empty({extent(b)}, worker_->staging_options().dtype(first.scalar_type()));
  }
  return weights;
}

OffloadStats HostOffload::stats() const {
  OffloadStats out;
  {
    const std::unique_lock<std::mutex> lock = worker_->lock();
    out = stats_;
  }
  out.step_seconds = worker_->busy_seconds();
  const auto count = [&](const at::Tensor& t, int64_t& category) {
    if (!t.defined()) return;
    category += static_cast<int64_t>(t.nbytes());
    if (on_gpu_ && t.is_pinned()) out.pinned_bytes += static_cast<int64_t>(t.nbytes());
  };
  for (size_t b = 0; b < host_.size(); ++b) {
    const HostBucket& host = host_[b];
    // A float32 bucket's weights are its masters; a low-precision one's are a buffer.
    const bool masters = !low_precision(static_cast<size_t>(layout_[b].params.front()));
    count(host.grads, out.host_buffer_bytes);
    count(host.weights, masters ? out.master_bytes : out.host_buffer_bytes);
    count(host.masters, out.master_bytes);
  }
  return out;
}

}  // namespace leanddp
