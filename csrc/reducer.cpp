// The Reducer's life and hot path (see reducer.h): construction and close, arming a backward,
// the autograd hooks, launching each bucket's reduction, and the end-of-backward callback.
#include "reducer.h"

#include "op_calls.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>

#include <algorithm>
#include <optional>
#include <unordered_set>
#include <utility>

namespace leanddp {
namespace {

using torch::autograd::variable_list;

// Per parameter (named `all`): whether `names`, the ReducerOptions list `what`, names it; raises
// on a name of no trained parameter.
std::vector<bool> named_in(const std::vector<std::string>& all,
                           const std::vector<std::string>& names, const char* what) {
  std::vector<bool> out(all.size(), false);
  for (const std::string& name : names) {
    const auto it = std::find(all.begin(), all.end(), name);
    TORCH_CHECK(it != all.end(), "Reducer: ", what, " names no trained parameter: ", name);
    out[static_cast<size_t>(it - all.begin())] = true;
  }
  return out;
}

}  // namespace

Reducer::Reducer(std::vector<at::Tensor> params, std::vector<std::string> names,
                 c10::intrusive_ptr<c10d::ProcessGroup> process_group, ReducerOptions options)
    : params_(std::move(params)),
      names_(std::move(names)),
      process_group_(std::move(process_group)),
      rank_(process_group_ ? process_group_->getRank() : -1),
      options_(std::move(options)),
      shard_(params_, names_, rank_),
      window_(options_.buckets_in_flight, !params_.empty() && runs_apart(params_.front().device())),
      nan_(options_.nan_check, options_.optimizer_in_backward) {
  TORCH_CHECK(!params_.empty(), "Reducer: no parameters");
  TORCH_CHECK(names_.size() == params_.size(), "Reducer: one name per parameter");
  TORCH_CHECK(process_group_, "Reducer: no process group");
  div_factor_ = static_cast<double>(process_group_->getSize());
  sparse_ = named_in(names_, options_.sparse_names, "sparse_names");
  TORCH_CHECK(options_.shard_block >= 1, "Reducer: shard_block must be at least 1, got ",
              options_.shard_block);
  blocked_ = named_in(names_, options_.shard_block_names, "shard_block_names");
  for (size_t p = 0; p < params_.size(); ++p) {
    TORCH_CHECK(!blocked_[p] || params_[p].numel() % options_.shard_block == 0,
                "Reducer: parameter ", names_[p], " (", params_[p].numel(),
                " elements) is not made of blocks of ", options_.shard_block);
  }
  if (window_.device_ordered()) {
    const c10::Device device = params_.front().device();
    events_ = std::make_unique<EventPool>(device.type());
  }
  const size_t n = params_.size();
  grad_was_view_.assign(n, 0);
  view_since_sync_.assign(n, 0);
  // The layout before the first rebuild is torch's DDP's, for the same bits on any world size
  // (gloo's ring sums each element in an order set by its position in its bucket): buckets
  // filled in registration order (each one's parameters in that order), launched from the one
  // holding the last-registered parameters, whose gradients come first.
  std::vector<int64_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = static_cast<int64_t>(i);
  auto assignment = assign_buckets(
      params_, order,
      options_.initial_caps_bytes.empty() ? options_.caps_bytes : options_.initial_caps_bytes,
      sparse_);
  std::sort(assignment.begin(), assignment.end(),
            [](const auto& a, const auto& b) { return a.front() > b.front(); });
  build_buckets(assignment);
  reset_iteration_state();
  local_used_.assign(n, 0);
  for (size_t i = 0; i < n; ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(params_[i]);
    TORCH_CHECK(acc, "Reducer: parameter ", names_[i], " has no gradient accumulator");
    accumulator_index_[acc.get()] = i;
    hook_keys_.push_back(
        acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
            [this, i](const variable_list& outputs, const variable_list&) {
              autograd_hook(i);
              return outputs;
            })));
    grad_accumulators_.push_back(std::move(acc));
  }
}

Reducer::~Reducer() {
  for (size_t i = 0; i < grad_accumulators_.size(); ++i) {
    grad_accumulators_[i]->del_post_hook(hook_keys_[i]);
  }
}

Reducer::Detached Reducer::close() {
  std::lock_guard<std::mutex> lock(mu_);
  Detached detached;
  if (optimizer_) detached.optimizer = optimizer_->close();  // (idempotent)
  if (!process_group_) return detached;                      // closed already
  armed_ = false;
  tell_iteration();
  detached.process_group = std::move(process_group_);
  detached.works = std::move(works_);
  detached.futures = std::move(futures_);
  if (local_used_work_) detached.works.push_back(std::move(local_used_work_));
  for (auto& gather : shard_.take_gathers()) {  // (sharded: a backward that never finished)
    detached.works.push_back(std::move(gather));
  }
  detached.comm_hook = std::move(comm_hook_);
  works_.assign(buckets_.size(), {});
  futures_.assign(buckets_.size(), {});
  return detached;
}

bool Reducer::closed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return !process_group_;
}

void Reducer::check_open(const char* what) const {
  TORCH_CHECK(process_group_, "leanddp.DistributedDataParallel: ", what,
              " after the wrapper was closed (at interpreter exit, or when it was collected): "
              "it no longer holds its process group");
}

bool Reducer::tracks_unused() const {
  return options_.static_graph ? iterations_ == 0 : options_.find_unused_parameters;
}

bool Reducer::should_rebuild() const {
  // (offload_to_cpu with shard_optimizer_state keeps its first layout: see host_offload.h)
  return !has_rebuilt_ && (options_.static_graph || !options_.find_unused_parameters) &&
         !(options_.shard_optimizer_state && steps_on_host());
}

void Reducer::settle_finished_steps() {
  // (one side stream: its steps finish in the order they were queued)
  const bool drop_all = !steps_in_hooks();
  while (!finish_events_.empty() && (drop_all || finish_events_.front().first->query())) {
    unfinished_bytes_ -= finish_events_.front().second;
    finish_events_.pop_front();
  }
}

void Reducer::reset_iteration_state() {
  const size_t n = params_.size();
  armed_ = false;
  callback_queued_ = false;  // a backward that raised never ran its callback
  unused_marked_ = false;
  recording_order_ = false;
  next_bucket_ = 0;
  // Device steps still queued count against the next backward's window (their bytes too).
  settle_finished_steps();
  window_.reset(finish_events_.size());
  ready_.assign(n, 0);
  sources_.assign(n, at::Tensor());
  unused_.clear();
  works_.assign(buckets_.size(), {});
  futures_.assign(buckets_.size(), {});
  launched_events_.clear();
  launched_events_.resize(buckets_.size());
  collected_.assign(buckets_.size(), 0);
  nan_.reset(buckets_.size());
  local_used_reduced_ = at::Tensor();
  local_used_work_.reset();
  shard_.reset(buckets_.size());
  for (Bucket& b : buckets_) {
    b.pending = b.params.size();
    b.sparse_grad = at::Tensor();
  }
  tell_iteration();
}

std::vector<std::string> Reducer::prepare_for_forward() {
  std::lock_guard<std::mutex> lock(mu_);
  recover_unfinished();
  if (std::exchange(local_callback_queued_, false)) {
    // A no_sync() backward raised before its end: what it accumulated goes to the host now.
    for (size_t b = 0; b < buckets_.size(); ++b) flush_local(b);
  }
  reduced_since_forward_ = false;
  std::vector<std::string> replaced;
  if (!options_.gradient_as_bucket_view) return replaced;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!grad_was_view_[i]) continue;
    const at::Tensor& grad = params_[i].grad();
    if (!grad.defined()) continue;  // zero_grad(set_to_none=True): the view comes back
    const auto [b, s] = location_[i];
    if (!buckets_[b].allocated() || !is_view(grad, buckets_[b].views[s])) {
      replaced.push_back(names_[i]);
      grad_was_view_[i] = 0;
      view_since_sync_[i] = 0;
    }
  }
  return replaced;
}

void Reducer::prepare_for_backward(const std::vector<at::Tensor>& outputs) {
  std::lock_guard<std::mutex> lock(mu_);
  check_open("a forward that prepares a synchronized backward");
  recover_unfinished();  // (prepare_for_forward did this already, unless the forward ran no_grad)
  reset_iteration_state();
  armed_ = true;
  tell_iteration();
  peak_bucket_bytes_ = allocated_bytes_;
  max_in_flight_ = 0;
  reuses_.clear();
  // As torch's DDP: a static graph's buckets are rebuilt from the order of its second iteration
  // (the first one's gradients are reduced together at its end), so both keep the first layout
  // for two iterations, for the same bits.
  recording_order_ =
      should_rebuild() && ready_order_.empty() && !(options_.static_graph && iterations_ == 0);
  timer_.mark(IterationTimer::kBackwardComputeStart);
  if (options_.static_graph) {
    if (iterations_ > 0) unused_ = static_unused_;
    return;
  }
  if (!options_.find_unused_parameters) return;
  std::unordered_set<const torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack;
  for (const at::Tensor& out : outputs) {
    if (!out.defined() || !out.requires_grad()) continue;
    auto fn = torch::autograd::impl::gradient_edge(out).function;
    if (fn && seen.insert(fn.get()).second) stack.push_back(fn.get());
  }
  while (!stack.empty()) {
    torch::autograd::Node* node = stack.back();
    stack.pop_back();
    for (const auto& edge : node->next_edges()) {
      if (edge.function && seen.insert(edge.function.get()).second) {
        stack.push_back(edge.function.get());
      }
    }
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!seen.count(grad_accumulators_[i].get())) unused_.push_back(static_cast<int64_t>(i));
  }
  found_unused_ = unused_;
}

void Reducer::autograd_hook(size_t index) {
  at::NoGradGuard no_grad;
  std::lock_guard<std::mutex> lock(mu_);
  if (!armed_) {
    LEANDDP_USAGE_CHECK(
        !reduced_since_forward_, "leanddp.DistributedDataParallel: parameter ", names_[index],
        " received a gradient in a second backward through the outputs of one forward "
        "(its gradients were already reduced). Each backward that reduces needs a "
        "forward through the wrapper of its own; to accumulate gradients without "
        "reducing, run that forward inside no_sync().");
    // no_sync() or a backward not prepared by a forward: accumulate locally, in the views. A
    // parameter used here is used in the next synchronized step, as in torch's DDP.
    if (params_[index].grad().defined()) local_used_[index] = 1;
    if (accumulator()) return accumulate_locally(index);  // summed on the host, bucket by bucket
    // (a sparse gradient accumulates in param.grad, by autograd)
    if (!options_.gradient_as_bucket_view || expects_sparse(index)) return;
    at::Tensor& grad = params_[index].mutable_grad();
    const auto [b, s] = location_[index];
    ensure_allocated(b);
    const at::Tensor& view = buckets_[b].views[s];
    if (grad.defined() && !is_view(grad, view)) {
      check_dense_grad(index, grad);
      view.copy_(grad);
      grad = view;
      grad_was_view_[index] = 1;
      view_since_sync_[index] = 0;  // torch's gradient would be this copy, not its bucket
    }
    return;
  }
  if (!callback_queued_) {
    callback_queued_ = true;
    torch::autograd::Engine::get_default_engine().queue_callback([this] { finalize(); });
  }
  if (!unused_marked_) {
    unused_marked_ = true;
    for (int64_t u : unused_) {
      if (!ready_[static_cast<size_t>(u)]) mark_ready(static_cast<size_t>(u));
    }
  }
  LEANDDP_USAGE_CHECK(
      !ready_[index], "leanddp.DistributedDataParallel: parameter ", names_[index],
      " received a gradient twice in one backward (it had already been ",
      (local_used_[index] ? "reduced" : "found unreachable from the forward's outputs"),
      "). Reentrant activation checkpointing does this: use "
      "torch.utils.checkpoint.checkpoint(..., use_reentrant=False).");
  local_used_[index] = 1;
  timer_.ready(static_cast<int64_t>(index));  // (hooks only, as torch's order: not the unused)
  // The order of gradients that arrived (not of parameters marked ready without one), as
  // torch's DDP records it for the rebuild.
  if (recording_order_) ready_order_.push_back(static_cast<int64_t>(index));
  mark_ready(index);
}

void Reducer::mark_ready(size_t index) {
  ready_[index] = 1;
  const auto [b, s] = location_[index];
  Bucket& bucket = buckets_[b];
  const at::Tensor& grad = params_[index].grad();
  if (bucket.sparse) {
    // taken from param.grad at launch (launch_sparse)
  } else if (!grad.defined()) {
    ensure_allocated(b);
    bucket.views[s].zero_();  // no gradient on this rank: contribute zeros
  } else if (!bucket.allocated() || !is_view(grad, bucket.views[s])) {
    check_dense_grad(index, grad);
    sources_[index] = grad;  // copied (and scaled) into the slice at launch
  }
  --bucket.pending;
  // Step what is reduced already, unless this iteration is still learning which parameters
  // are used (then everything is stepped at the end of backward).
  const bool in_hooks = steps_in_hooks();
  const std::vector<int32_t>* used = options_.static_graph ? &static_used_ : nullptr;
  while (next_bucket_ < buckets_.size() && buckets_[next_bucket_].pending == 0) {
    if (in_hooks) advance_steps(StepWindow::Phase::kBeforeLaunch, used);
    launch(next_bucket_++);
    window_.launched_one();
    max_in_flight_ = std::max(max_in_flight_, static_cast<int64_t>(window_.in_flight()));
  }
  if (next_bucket_ == buckets_.size()) timer_.mark(IterationTimer::kBackwardComputeEnd);
  if (next_bucket_ == buckets_.size() && tracks_unused() && !local_used_work_) {
    // Through a fresh pinned buffer, without blocking the host (as torch's DDP does): the
    // caching host allocator keeps it until the copy has run, and the next iteration's marks
    // go to local_used_, not to memory the copy may still read.
    const at::Device device = params_[0].device();
    at::Tensor staged = at::empty({static_cast<int64_t>(local_used_.size())},
                                  at::TensorOptions(at::kInt).pinned_memory(device.is_cuda()));
    std::copy(local_used_.begin(), local_used_.end(), staged.data_ptr<int32_t>());
    local_used_reduced_ = staged.to(device, /*non_blocking=*/true, /*copy=*/true);
    std::vector<at::Tensor> tensors{local_used_reduced_};
    try {
      local_used_work_ = process_group_->allreduce(tensors);
    } catch (...) {
      rethrow_collective_error("the reduction of which parameters are used");
    }
  }
  // Sharded steps issue collectives (the all-gathers): they run only where the window forces
  // them, the same on every rank, never when a reduction happens to be done.
  if (in_hooks && !options_.shard_optimizer_state) {
    advance_steps(StepWindow::Phase::kAfterHook, used);
  }
}

void Reducer::average_into(size_t bucket_index, std::optional<double> scale) {
  Bucket& bucket = buckets_[bucket_index];
  std::vector<at::Tensor> sources;
  bool copies = false;
  for (size_t s = 0; s < bucket.params.size(); ++s) {
    const at::Tensor& src = sources_[static_cast<size_t>(bucket.params[s])];
    copies = copies || src.defined();
    // A gradient of its own goes into the slice in the view's memory order (a linear copy when
    // it has the view's strides, e.g. channels_last).
    sources.push_back(src.defined() ? in_memory_order_of(src, bucket.views[s]) : bucket.views[s]);
  }
  // Average as torch's reducer does, for the same bits: a gradient copied in is multiplied by
  // 1/world (at::mul_out in the copy), one a synchronized backward left in place is divided by
  // the world size (div_). In one pass unless a slot divides.
  bool divides = false;
  bool all_divide = true;
  for (size_t s = 0; s < bucket.params.size() && scale; ++s) {
    const auto p = static_cast<size_t>(bucket.params[s]);
    const bool d = !sources_[p].defined() && view_since_sync_[p];
    divides = divides || d;
    all_divide = all_divide && d;
  }
  if (!divides) {
    if (copies || scale) flatten_into(sources, bucket.flat, scale);
  } else {
    if (copies) flatten_into(sources, bucket.flat, std::nullopt);
    if (all_divide) {
      bucket.flat.div_(div_factor_);  // the views tile the flat buffer
    } else {
      for (size_t s = 0; s < bucket.params.size(); ++s) {
        const at::Tensor& view = bucket.views[s];
        if (!sources_[static_cast<size_t>(bucket.params[s])].defined() &&
            view_since_sync_[static_cast<size_t>(bucket.params[s])]) {
          view.div_(div_factor_);
        } else {
          view.mul_(*scale);
        }
      }
    }
  }
}

void Reducer::launch(size_t bucket_index) {
  timer_.mark(IterationTimer::kBackwardCommStart);
  if (buckets_[bucket_index].sparse) return launch_sparse(bucket_index);
  ensure_allocated(bucket_index);
  Bucket& bucket = buckets_[bucket_index];
  const std::optional<double> scale =
      comm_hook_ ? std::nullopt : std::optional<double>(1.0 / div_factor_);
  // accumulate_on_host: the no_sync() micro-batches' sum is added in, on its stream (GPU), and
  // the reduction starts there.
  HostAccumulator* acc = accumulator();
  const bool summed = acc && acc->holds(bucket_index);
  std::optional<StreamScope> on_sum_stream;
  if (summed && window_.device_ordered()) {
    on_sum_stream.emplace(sum_stream(bucket_index));
  }
  if (summed) {
    add_host_sum(bucket_index, scale);
  } else {
    average_into(bucket_index, scale);
  }
  for (size_t s = 0; s < bucket.params.size(); ++s) {
    const auto p = static_cast<size_t>(bucket.params[s]);
    if (sources_[p].defined() && options_.optimizer_in_backward) {
      params_[p].mutable_grad().reset();  // its value is in the bucket now
    } else if (sources_[p].defined() && options_.gradient_as_bucket_view) {
      params_[p].mutable_grad() = bucket.views[s];
      grad_was_view_[p] = 1;
    }
    if (options_.gradient_as_bucket_view && !options_.optimizer_in_backward)
      view_since_sync_[p] = 1;
    sources_[p] = at::Tensor();
  }
  if (comm_hook_) {
    std::vector<int64_t> lengths;
    for (const at::Tensor& view : bucket.views) lengths.push_back(view.numel());
    comm_hook_->launch(bucket_index, buckets_.size(), bucket.flat, bucket.params, bucket.offsets,
                       lengths);
  } else {
    std::vector<at::Tensor> tensors{bucket.flat};
    try {
      works_[bucket_index] =
          options_.shard_optimizer_state
              ? reduce_to_shard(process_group_, bucket.padded, shard_.shards()[bucket_index])
              : process_group_->allreduce(tensors);
    } catch (...) {
      rethrow_collective_error("starting the reduction of bucket " + std::to_string(bucket_index));
    }
  }
  if (window_.device_ordered() && options_.optimizer_in_backward) {
    // What the side stream waits for before stepping this bucket: its gradients are final (and
    // whatever a communication hook queued on the compute stream is done).
    launched_events_[bucket_index] = events_->record(current_stream(bucket.flat.device()));
    if (!comm_hook_) {
      try {
        futures_[bucket_index] = works_[bucket_index]->getFuture();
      } catch (const c10::Error&) {  // a backend without futures: readiness from isCompleted()
      }
    }
  }
}

void Reducer::finalize() {
  at::NoGradGuard no_grad;
  std::lock_guard<std::mutex> lock(mu_);
  callback_queued_ = false;
  if (!armed_) return;
  try {
    if (options_.static_graph && iterations_ == 0) {
      // The first iteration of a static graph: whatever did not fire is unused on this rank.
      for (size_t i = 0; i < params_.size(); ++i) {
        if (!ready_[i]) mark_ready(i);
      }
    }
    if (next_bucket_ < buckets_.size()) {
      std::vector<int64_t> missing;
      for (size_t i = 0; i < params_.size(); ++i) {
        if (!ready_[i]) missing.push_back(static_cast<int64_t>(i));
      }
      LEANDDP_USAGE_CHECK(
          false, "leanddp.DistributedDataParallel: rank ", rank_,
          ": these parameters received no gradient in this backward: ", join_names(names_, missing),
          ". Their reduction could not start. If the forward does not use every "
          "parameter, pass find_unused_parameters=True (or static_graph=True when the "
          "set of used parameters never changes); parameters that are never trained "
          "can be frozen (requires_grad=False) before wrapping.");
    }
    std::vector<int32_t> used(params_.size(), 1);
    if (tracks_unused()) {
      try {
        local_used_work_->wait();
      } catch (...) {
        rethrow_collective_error("the reduction of which parameters are used");
      }
      // A parameter this rank used is used: the reduced map is read (a device-to-host copy
      // the host waits for) only if some parameter was unused here, as in torch's DDP.
      if (std::find(local_used_.begin(), local_used_.end(), 0) != local_used_.end()) {
        const at::Tensor reduced = local_used_reduced_.cpu();
        const int32_t* data = reduced.data_ptr<int32_t>();
        std::copy(data, data + used.size(), used.begin());
      }
      if (options_.static_graph) static_used_ = used;  // a static graph keeps the first verdict
    } else if (options_.static_graph) {
      used = static_used_;
    }
    std::vector<size_t> unstepped;
    for (size_t b = window_.stepped(); b < buckets_.size(); ++b) unstepped.push_back(b);
    if (options_.optimizer_in_backward) {
      if (nan_.strict()) {
        for (size_t b : unstepped) collect_reduced(b);
        nan_.check(buckets_, unstepped);  // before any step: a NaN leaves every weight as it was
      }
      if (clips_on_device()) {  // the coefficient every step takes (sharded)
        for (size_t b = 0; b < buckets_.size(); ++b) collect_reduced(b);
        shard_.clip(*process_group_, buckets_, *options_.max_grad_norm);
        optimizer_->note_grad_norm(shard_.grad_norm());
      }
      advance_steps(StepWindow::Phase::kEnd, &used);  // (checks each bucket before its step)
      finish_gathers();  // (sharded on the CPU: the last buckets' gathers)
      // The caller's stream (where the loop goes on after backward) sees the stepped weights;
      // the host does not wait. offload_to_cpu: the next forward waits for the host steps.
      // (with offload only for the NaN check's flags, set on its device-to-host stream)
      if (optimizer_->caller_follows() || nan_.armed()) follow_side_stream();
      if (nan_.armed()) optimizer_->skipped(nan_.read_flags(buckets_));  // (after the wait)
      if (nan_.found()) raise_nonfinite(used);
      optimizer_->end_of_backward();
      if (options_.shard_optimizer_state && steps_on_host()) {
        // Each bucket's stepped pieces are gathered into the parameters as soon as its own host
        // step is done (GPU: the gather is ordered after that step's copy back, the host waits
        // only for the worker to have queued it), so the gathers overlap the other host steps.
        gather_back([this](size_t b) { optimizer_->wait_stepped(b); });
        optimizer_->gathered();
      }
    } else {
      for (size_t b : unstepped) collect_reduced(b);
      if (nan_.enabled()) nan_.check(buckets_, unstepped);
      for (size_t b : unstepped) write_reduced_grads(b, used);
      if (nan_.found()) raise_nonfinite(used);
    }
    if (options_.static_graph && iterations_ == 0) {
      static_unused_.clear();
      for (size_t i = 0; i < params_.size(); ++i) {
        if (!local_used_[i]) static_unused_.push_back(static_cast<int64_t>(i));
      }
      found_unused_ = static_unused_;
    }
    timer_.mark(IterationTimer::kBackwardCommEnd);
    ++iterations_;
    if (comm_hook_) comm_hook_->reset();
    reset_iteration_state();
    std::fill(local_used_.begin(), local_used_.end(), 0);
    reduced_since_forward_ = true;
  } catch (...) {
    abandon_iteration(/*step_launched=*/false);
    throw;
  }
}

void Reducer::check_before_first_backward(const char* what) const {
  TORCH_CHECK(iterations_ == 0 && !armed_, "leanddp.DistributedDataParallel: ", what,
              " only before the first backward");
}

void Reducer::set_static_graph() {
  std::lock_guard<std::mutex> lock(mu_);
  check_before_first_backward("the graph can be declared static");
  options_.static_graph = true;
}

void Reducer::register_comm_hook(std::unique_ptr<CommHook> hook) {
  std::lock_guard<std::mutex> lock(mu_);
  TORCH_CHECK(!comm_hook_,
              "leanddp.DistributedDataParallel: register_comm_hook may be called "
              "only once");
  check_before_first_backward("register_comm_hook may be called");
  comm_hook_ = std::move(hook);
  // A hook's collective keeps its bucket past its release on a GPU (bucket_recycler.h).
  if (window_.device_ordered() && options_.optimizer_in_backward) {
    recycler_ = std::make_unique<BucketRecycler>(options_.buckets_in_flight + 1);
  }
}

void Reducer::time_iteration(bool sampled) {
  std::lock_guard<std::mutex> lock(mu_);
  timer_.start(sampled, params_.front().device());
}

std::optional<std::string> Reducer::take_usage_error() {
  std::lock_guard<std::mutex> lock(mu_);
  return std::exchange(usage_error_, std::nullopt);
}

void Reducer::usage_error(const std::string& message) const {
  usage_error_ = message;
  TORCH_CHECK(false, message);
}

}  // namespace leanddp
