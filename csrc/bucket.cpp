#include "bucket.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <map>
#include <tuple>

namespace leanddp {

std::vector<std::vector<int64_t>> assign_buckets(const std::vector<at::Tensor>& params,
                                                 const std::vector<int64_t>& order,
                                                 const std::vector<int64_t>& caps_bytes,
                                                 const std::vector<bool>& sparse) {
  TORCH_CHECK(!caps_bytes.empty(), "assign_buckets: no bucket cap given");
  TORCH_CHECK(sparse.empty() || sparse.size() == params.size(),
              "assign_buckets: one sparse flag per parameter");
  using Key = std::tuple<int, int, int>;  // device type, device index, dtype
  struct Open {
    std::vector<int64_t> indices;
    int64_t bytes = 0;
    size_t closed = 0;  // buckets of this key closed so far: picks the next cap
  };
  std::map<Key, Open> open;
  std::vector<Key> first_seen;
  std::vector<std::vector<int64_t>> buckets;
  for (int64_t i : order) {
    const at::Tensor& p = params.at(static_cast<size_t>(i));
    if (!sparse.empty() && sparse[static_cast<size_t>(i)]) {
      buckets.push_back({i});
      continue;
    }
    Key key{static_cast<int>(p.device().type()), p.device().index(),
            static_cast<int>(p.scalar_type())};
    auto [it, inserted] = open.try_emplace(key);
    if (inserted) first_seen.push_back(key);
    Open& b = it->second;
    b.indices.push_back(i);
    b.bytes += p.numel() * static_cast<int64_t>(p.element_size());
    const int64_t cap = caps_bytes[std::min(b.closed, caps_bytes.size() - 1)];
    if (b.bytes >= cap) {
      buckets.push_back(std::move(b.indices));
      b.indices.clear();
      b.bytes = 0;
      ++b.closed;
    }
  }
  // The buckets left open follow, as in torch's compute_bucket_assignment_by_size (which emits
  // them in the iteration order of its hash map): the (device, dtype) seen last first.
  for (auto key = first_seen.rbegin(); key != first_seen.rend(); ++key) {
    Open& b = open[*key];
    if (!b.indices.empty()) buckets.push_back(std::move(b.indices));
  }
  return buckets;
}

Bucket make_bucket(const std::vector<at::Tensor>& params, const std::vector<int64_t>& indices,
                   bool allocate, bool sparse) {
  TORCH_CHECK(!indices.empty(), "make_bucket: empty bucket");
  TORCH_CHECK(!sparse || indices.size() == 1, "make_bucket: a sparse bucket holds one parameter");
  Bucket b;
  b.params = indices;
  b.sparse = sparse;
  for (int64_t i : indices) {
    b.offsets.push_back(b.numel);
    b.numel += params.at(static_cast<size_t>(i)).numel();
  }
  if (allocate && !sparse) allocate_bucket(b, params);
  return b;
}

void allocate_bucket(Bucket& b, const std::vector<at::Tensor>& params, bool zeroed,
                     const at::Tensor& storage) {
  TORCH_CHECK(!b.sparse, "allocate_bucket: a sparse bucket has no flat storage");
  const at::Tensor& first = params.at(static_cast<size_t>(b.params.at(0)));
  const auto options = first.options().requires_grad(false);
  const auto make = [&](int64_t n) {
    if (!storage.defined()) return zeroed ? at::zeros({n}, options) : at::empty({n}, options);
    TORCH_CHECK(storage.dim() == 1 && storage.numel() >= n &&
                    storage.scalar_type() == first.scalar_type() &&
                    storage.device() == first.device(),
                "allocate_bucket: the storage given does not fit the bucket");
    at::Tensor out = storage.narrow(0, 0, n);
    if (zeroed) out.zero_();
    return out;
  };
  if (b.padded_numel > b.numel) {
    b.padded = make(b.padded_numel);
    if (!zeroed) b.padded.narrow(0, b.numel, b.padded_numel - b.numel).zero_();
    b.flat = b.padded.narrow(0, 0, b.numel);
  } else {
    b.flat = make(b.numel);
    b.padded = b.padded_numel > 0 ? b.flat : at::Tensor();  // (padded_numel == numel)
  }
  b.views.clear();
  for (size_t k = 0; k < b.params.size(); ++k) {
    b.views.push_back(slice_like(b.flat, b.offsets[k], params[static_cast<size_t>(b.params[k])]));
  }
}

at::Tensor slice_like(const at::Tensor& flat, int64_t offset, const at::Tensor& like) {
  if (like.is_non_overlapping_and_dense()) {
    return flat.as_strided(like.sizes(), like.strides(), flat.storage_offset() + offset);
  }
  return flat.narrow(0, offset, like.numel()).view(like.sizes());
}

at::Tensor memory_1d(const at::Tensor& t) {
  TORCH_CHECK(t.is_non_overlapping_and_dense(), "memory_1d: the tensor of sizes ", t.sizes(),
              " and strides ", t.strides(), " has gaps or overlaps");
  return t.as_strided({t.numel()}, {1}, t.storage_offset());
}

at::Tensor in_memory_order_of(const at::Tensor& t, const at::Tensor& view) {
  if (view.is_contiguous()) return t;
  // Dims by decreasing stride (ties, possible only between size-1 dims, in dim order): the
  // permutation that makes the dense `view` contiguous.
  std::vector<int64_t> dims(static_cast<size_t>(view.dim()));
  for (size_t d = 0; d < dims.size(); ++d) dims[d] = static_cast<int64_t>(d);
  std::stable_sort(dims.begin(), dims.end(),
                   [&](int64_t a, int64_t b) { return view.stride(a) > view.stride(b); });
  return t.permute(dims);
}

void release_bucket(Bucket& b) {
  b.flat = at::Tensor();
  b.padded = at::Tensor();
  b.views.clear();
}

}  // namespace leanddp
