#include "shard.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <numeric>

namespace leanddp {
namespace {

// `flat` is the padded bucket of `layout`, cut for a group of `world` ranks.
void check_padded(const char* what, const at::Tensor& flat, const ShardLayout& layout,
                  int64_t world) {
  TORCH_CHECK(flat.dim() == 1 && flat.is_contiguous() && flat.numel() == layout.padded, what,
              ": the bucket must be a contiguous 1-D tensor of ", layout.padded,
              " elements (the padded bucket), got sizes ", flat.sizes());
  TORCH_CHECK(world * layout.shard_numel == layout.padded, what, ": the layout was cut for ",
              layout.padded / std::max<int64_t>(layout.shard_numel, 1),
              " ranks, the process group has ", world);
}

}  // namespace

ShardLayout shard_layout(const std::vector<int64_t>& offsets, const std::vector<int64_t>& numels,
                         int64_t bucket_numel, int64_t align, int64_t world, int64_t rank) {
  TORCH_CHECK(world >= 1, "shard_layout: world must be at least 1, got ", world);
  TORCH_CHECK(rank >= 0 && rank < world, "shard_layout: rank must be in [0, ", world, "), got ",
              rank);
  TORCH_CHECK(align >= 1, "shard_layout: align must be at least 1, got ", align);
  TORCH_CHECK(bucket_numel >= 0, "shard_layout: bucket_numel must not be negative, got ",
              bucket_numel);
  TORCH_CHECK(offsets.size() == numels.size(), "shard_layout: ", offsets.size(), " offsets for ",
              numels.size(), " slots");
  int64_t end_of_previous = 0;
  for (size_t s = 0; s < offsets.size(); ++s) {
    TORCH_CHECK(
        numels[s] >= 0 && offsets[s] >= end_of_previous && offsets[s] + numels[s] <= bucket_numel,
        "shard_layout: slot ", s, " (offset ", offsets[s], ", ", numels[s],
        " elements) does not follow the previous slot inside the bucket of ", bucket_numel,
        " elements");
    end_of_previous = offsets[s] + numels[s];
  }
  ShardLayout layout;
  const int64_t unit = world * align;
  layout.padded = (bucket_numel + unit - 1) / unit * unit;
  layout.shard_numel = layout.padded / world;
  layout.begin = rank * layout.shard_numel;
  layout.align = align;
  const int64_t end = layout.begin + layout.shard_numel;
  for (size_t s = 0; s < offsets.size(); ++s) {
    const int64_t first = std::max(offsets[s], layout.begin);
    const int64_t last = std::min(offsets[s] + numels[s], end);
    if (first >= last) continue;
    layout.pieces.push_back(ShardPiece{s, first - offsets[s], first - layout.begin, last - first});
  }
  return layout;
}

bool reduces_scattered(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                       const c10::Device& device) {
  // The backend that serves `device`: a default group "cpu:gloo,cuda:nccl" is named
  // "undefined" as a whole but reduces CUDA tensors with NCCL.
  std::string name = group->getBackendName();
  if (group->hasBackends()) {
    try {
      name = group->getBackend(device.type())->getBackendName();
    } catch (const c10::Error&) {
      // no backend registered for this device type: the group's name stands
    }
  }
  return name == "nccl";
}

c10::intrusive_ptr<c10d::Work> reduce_to_shard(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                               at::Tensor flat, const ShardLayout& layout) {
  check_padded("reduce_to_shard", flat, layout, group->getSize());
  if (reduces_scattered(group, flat.device())) {
    at::Tensor shard = flat.narrow(0, layout.begin, layout.shard_numel);
    // (deprecated for reduce_scatter_single in recent torch; the old name is in every version)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
    return group->_reduce_scatter_base(shard, flat);
#pragma GCC diagnostic pop
  }
  std::vector<at::Tensor> tensors{flat};
  return group->allreduce(tensors);
}

void pack_shard(const at::Tensor& flat, const ShardLayout& layout,
                const std::vector<at::Tensor>& sources) {
  TORCH_CHECK(flat.dim() == 1 && flat.numel() == layout.padded,
              "pack_shard: the bucket must be a 1-D tensor of ", layout.padded, " elements");
  for (const ShardPiece& piece : layout.pieces) {
    TORCH_CHECK(piece.slot < sources.size(), "pack_shard: no source for slot ", piece.slot);
    const at::Tensor& source = sources[piece.slot];
    TORCH_CHECK(source.dim() == 1 && source.scalar_type() == flat.scalar_type() &&
                    source.numel() >= piece.slot_offset + piece.numel,
                "pack_shard: the source of slot ", piece.slot, " must be a 1-D ",
                flat.scalar_type(), " tensor of at least ", piece.slot_offset + piece.numel,
                " elements, got ", source.scalar_type(), " ", source.sizes());
    flat.narrow(0, layout.begin + piece.shard_offset, piece.numel)
        .copy_(source.narrow(0, piece.slot_offset, piece.numel));
  }
}

c10::intrusive_ptr<c10d::Work> gather_shards(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                             at::Tensor flat, const ShardLayout& layout) {
  check_padded("gather_shards", flat, layout, group->getSize());
  return gather_equal(group, flat, flat.narrow(0, layout.begin, layout.shard_numel));
}

c10::intrusive_ptr<c10d::Work> gather_equal(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                            at::Tensor out, at::Tensor local) {
  TORCH_CHECK(local.dim() == 1 && out.dim() == 1 && out.is_contiguous() &&
                  out.numel() == group->getSize() * local.numel(),
              "gather_equal: gathering ", local.numel(), " elements from each of ",
              group->getSize(), " ranks into ", out.numel());
  // (deprecated for all_gather_single in recent torch; the old name is in every version)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
  return group->_allgather_base(out, local);
#pragma GCC diagnostic pop
}

namespace {

std::vector<int64_t> numels_of(const Bucket& bucket, const std::vector<at::Tensor>& params) {
  std::vector<int64_t> numels;
  for (int64_t p : bucket.params) numels.push_back(params[static_cast<size_t>(p)].numel());
  return numels;
}

}  // namespace

ShardLayout cut_bucket(const Bucket& bucket, const std::vector<at::Tensor>& params, int64_t world,
                       int64_t rank, int64_t block) {
  TORCH_CHECK(block >= 1, "cut_bucket: block must be at least 1, got ", block);
  const int64_t align = std::max<int64_t>(
      1, 16 / static_cast<int64_t>(params[static_cast<size_t>(bucket.params[0])].element_size()));
  return shard_layout(bucket.offsets, numels_of(bucket, params), bucket.numel,
                      std::lcm(align, block), world, rank);
}

ShardLayout recut(const Bucket& bucket, const std::vector<at::Tensor>& params,
                  const ShardLayout& like, int64_t rank) {
  return shard_layout(bucket.offsets, numels_of(bucket, params), bucket.numel, like.align,
                      like.world(), rank);
}

}  // namespace leanddp
