// Bucket layout and storage: which parameter's gradient lives where in which flat buffer.
//
// A plain record (Bucket) plus two free functions: assign_buckets() decides the grouping,
// make_bucket() allocates the storage and the per-parameter views. The Reducer owns the buckets
// and is the only code that talks to the process group.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace leanddp {

// The first bucket is capped at 1 MiB so the first reduction starts early in backward.
constexpr int64_t kFirstBucketCapBytes = 1 << 20;

// Groups parameters into buckets. `order` lists parameter indices in the order their gradients
// are expected to become ready (reverse registration order at first, the observed order after
// the rebuild); buckets are filled in that order, one open bucket per (device, dtype), and a
// bucket is closed when it reaches its cap: `caps_bytes[k]` for the k-th bucket closed (the last
// cap repeats). A parameter larger than the cap gets a bucket of its own. Returns, per bucket,
// the parameter indices in layout order; buckets are ordered by when they closed, then the ones
// left open, the (device, dtype) that `order` reached last first: torch's DDP's order
// (compute_bucket_assignment_by_size with its tensor_indices, as its rebuild calls it). That is
// the order in which all ranks launch their reductions. Deterministic: the same inputs give the
// same layout on every rank. A parameter with `sparse[i]` set (it expects sparse gradients;
// `sparse` may be empty: none does) gets a bucket of its own where `order` reaches it, outside the
// caps, as in torch's DDP: sparse gradients are reduced one tensor at a time.
std::vector<std::vector<int64_t>> assign_buckets(const std::vector<at::Tensor>& params,
                                                 const std::vector<int64_t>& order,
                                                 const std::vector<int64_t>& caps_bytes,
                                                 const std::vector<bool>& sparse = {});

// One bucket: a flat buffer holding the gradients of `params`, densely packed in that order
// (the layout torch's DDP uses, so a comm hook sees the buffer it expects). `params`, `offsets`
// and `numel` are fixed once the bucket is made; the storage (`flat` and `views`) is held for
// the bucket's lifetime, except with optimizer_in_backward, where it exists only between a
// bucket's first gradient and its optimizer step (allocate_bucket / release_bucket).
// A sparse bucket holds one parameter whose gradient is a sparse tensor: no flat buffer and no
// views (its gradient is never a bucket view); `sparse_grad` holds the gradient being reduced.
struct Bucket {
  at::Tensor flat;                // 1-D, one dtype and device: the communication buffer
  std::vector<int64_t> params;    // parameter indices, in layout order
  std::vector<int64_t> offsets;   // element offset of each parameter's slice in `flat`
  std::vector<at::Tensor> views;  // `flat` seen with each parameter's sizes and strides
  int64_t numel = 0;              // elements of `flat`
  size_t pending = 0;             // parameters not yet ready in the current backward
  bool sparse = false;            // one parameter reduced as a sparse tensor (fixed)
  // Sparse bucket: this rank's gradient from its launch, the reduced one once collected;
  // dropped when the iteration's state is reset.
  at::Tensor sparse_grad;
  // shard_optimizer_state: `flat` rounded up to equal shards (shard.h), fixed like `numel`
  // (0: no padding). The storage then holds `padded_numel` elements: `padded` sees them all,
  // `flat` the first `numel`; the padding is zeroed at allocation and belongs to no parameter.
  int64_t padded_numel = 0;
  at::Tensor padded;

  bool allocated() const { return flat.defined(); }
  // Bytes of the storage while allocated (padding included; a recycled buffer may be larger than
  // the bucket: all of it).
  int64_t bytes() const {
    return flat.defined() ? static_cast<int64_t>(flat.storage().nbytes()) : 0;
  }
};

// Lays out a bucket for `indices` (all of one device and dtype) and, if `allocate`, gives it
// zeroed storage. A `sparse` bucket (one index) never gets storage.
Bucket make_bucket(const std::vector<at::Tensor>& params, const std::vector<int64_t>& indices,
                   bool allocate = true, bool sparse = false);

// Gives `bucket` storage, zeroed if `zeroed`, and its views. Views keep each parameter's strides
// when the parameter is dense and non-overlapping (channels_last stays channels_last), and are
// contiguous otherwise. Uninitialized storage is for a bucket whose every slot is written before
// it is read (the Reducer's re-allocation inside backward: each slot receives its gradient, or
// zeros when the parameter has none). `storage`, if defined (a 1-D buffer of the bucket's dtype
// and device, at least as long as the bucket with its padding), is used instead of a new one.
void allocate_bucket(Bucket& bucket, const std::vector<at::Tensor>& params, bool zeroed = true,
                     const at::Tensor& storage = {});

// Drops the bucket's storage (returned to the caching allocator once no tensor refers to it).
void release_bucket(Bucket& bucket);

// `flat`'s elements [offset, offset + like.numel()) seen with `like`'s sizes: with `like`'s
// strides when `like` is dense and non-overlapping (the slice then holds the elements in
// `like`'s memory order, as a bucket view does), contiguous otherwise. Optimizer state views use
// it too, so parameter, gradient and state share one memory order.
at::Tensor slice_like(const at::Tensor& flat, int64_t offset, const at::Tensor& like);

// `t` (dense and non-overlapping) as 1-D in its memory order: what a slice_like() view of it
// holds in its flat buffer, element for element.
at::Tensor memory_1d(const at::Tensor& t);

// `t` (with `view`'s sizes) with its dims permuted so that its row-major order is `view`'s
// memory order: flatten_into / unflatten_from of the result moves t's values into / out of the
// slice that `view` (a slice_like() view) sees, whatever t's own strides, as one linear copy when
// t has view's strides. `t` itself when `view` is contiguous.
at::Tensor in_memory_order_of(const at::Tensor& t, const at::Tensor& view);

// True when `grad` is exactly `view` (same storage, offset, sizes and strides).
inline bool is_view(const at::Tensor& grad, const at::Tensor& view) {
  return grad.defined() && !grad.is_sparse() && grad.is_alias_of(view) &&
         grad.storage_offset() == view.storage_offset() && grad.sizes() == view.sizes() &&
         grad.strides() == view.strides();
}

}  // namespace leanddp
