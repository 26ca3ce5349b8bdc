// shard_optimizer_state: how a bucket is cut among the ranks of its process group.
//
// The bucket's `numel` elements are padded to `padded`, the smallest multiple of `world * align`
// not below `numel` (`align`: elements per 16 bytes, so that every shard starts aligned for the
// vector kernels and for NCCL; with 8-bit optimizer state, a multiple of its block too, so that
// cuts fall on block boundaries), and cut into `world` shards of `shard_numel`: rank r owns the
// elements [r * shard_numel, (r + 1) * shard_numel). A reduce-scatter of the padded buffer
// leaves each rank its shard reduced; an all-gather of the shards puts the stepped weights back.
// A rank steps, and keeps optimizer state for, only the pieces of parameters inside its shard.
#pragma once

#include "bucket.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace leanddp {

// The part of one bucket slot inside a shard. A slot cut by a shard boundary has a piece on
// each rank it spans; the padding belongs to no slot.
struct ShardPiece {
  size_t slot = 0;           // the bucket slot (its index in Bucket::params)
  int64_t slot_offset = 0;   // the piece's first element within the slot
  int64_t shard_offset = 0;  // the piece's first element within the shard
  int64_t numel = 0;
};

// One rank's shard of a bucket. Pieces are in layout order and tile the shard's unpadded part.
struct ShardLayout {
  int64_t padded = 0;       // the bucket's elements with the padding: world * shard_numel
  int64_t shard_numel = 0;  // elements per shard (a multiple of align)
  int64_t begin = 0;        // this rank's first element in the padded bucket
  int64_t align = 1;        // shard_numel and begin are multiples of it (the cut's alignment)
  std::vector<ShardPiece> pieces;
  int64_t world() const { return shard_numel > 0 ? padded / shard_numel : 1; }
};

// `t` (one slot's tensor, dense and non-overlapping) cut to `piece` of the slot: its elements
// [slot_offset, slot_offset + numel) in memory order, 1-D.
inline at::Tensor piece_of(const at::Tensor& t, const ShardPiece& piece) {
  return memory_1d(t).narrow(0, piece.slot_offset, piece.numel);
}

// Rank `rank` of `world`'s shard of a bucket of `bucket_numel` elements whose slots start at
// `offsets` and hold `numels` elements (in layout order, not overlapping, inside the bucket).
// Raises, naming the argument, on a world size below 1, a rank outside [0, world), an align
// below 1, or slots that do not fit the bucket.
ShardLayout shard_layout(const std::vector<int64_t>& offsets, const std::vector<int64_t>& numels,
                         int64_t bucket_numel, int64_t align, int64_t world, int64_t rank);

// Rank `rank`'s shard of `bucket` (of `params`) among `world` ranks: shard_layout() with shards
// at least 16 bytes apart (aligned for the vector kernels and for NCCL) and a multiple of
// `block` elements (8-bit optimizer state: a slot that starts on a multiple of `block` is cut
// only on its block boundaries).
ShardLayout cut_bucket(const Bucket& bucket, const std::vector<at::Tensor>& params, int64_t world,
                       int64_t rank, int64_t block = 1);

// Rank `rank`'s shard of the cut `like` (any rank's shard of `bucket`, of `params`): its pieces
// for a rank that is not this one (gathered state, checkpoint placement).
ShardLayout recut(const Bucket& bucket, const std::vector<at::Tensor>& params,
                  const ShardLayout& like, int64_t rank);

// Starts reducing (summing) `flat`, the padded bucket (1-D, contiguous, `layout.padded`
// elements), over `group`, so that this rank's shard, `flat`'s elements [begin, begin +
// shard_numel), holds the sum once the work completes. NCCL: a reduce-scatter in place into that
// slice (the rest of `flat` is left as it was). Other backends (gloo, whose reduce-scatter does
// not take every dtype): an allreduce of the whole buffer, which reduces every shard; the caller
// uses its own. Either way the result in the shard is the same sum.
c10::intrusive_ptr<c10d::Work> reduce_to_shard(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                               at::Tensor flat, const ShardLayout& layout);

// Whether reduce_to_shard reduce-scatters tensors on `device` over `group`: whether the backend
// that serves that device type is NCCL (a group of "cpu:gloo,cuda:nccl" too).
bool reduces_scattered(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                       const c10::Device& device);

// Writes this rank's pieces of the stepped weights into its shard of `flat` (the padded bucket):
// the piece of slot s comes from `sources[s]`, the slot's parameter (or its float32 master, when
// `flat` is float32) seen as 1-D in the slot's memory order, of `flat`'s dtype. The padding and
// the other shards are left as they are.
void pack_shard(const at::Tensor& flat, const ShardLayout& layout,
                const std::vector<at::Tensor>& sources);

// Starts gathering every rank's shard of `flat` into `flat` in place (an all-gather whose input
// is this rank's shard of its output): once the work completes, every rank's `flat` holds rank
// r's shard at [r * shard_numel, (r + 1) * shard_numel).
c10::intrusive_ptr<c10d::Work> gather_shards(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                             at::Tensor flat, const ShardLayout& layout);

// Starts gathering every rank's `local` (1-D, contiguous, equally long on every rank) into
// `out` (world times as long): rank r's at [r * local.numel(), (r + 1) * local.numel()).
c10::intrusive_ptr<c10d::Work> gather_equal(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                            at::Tensor out, at::Tensor local);

}  // namespace leanddp
