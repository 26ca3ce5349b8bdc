// NonFiniteCheck: check_for_nan_in_grad's state and checks, for the Reducer.
//
// Two ways to find a reduced gradient holding NaN or infinity:
//   * on the host (check()): each reduced bucket is tested before it is stepped or handed back,
//     several buckets with one device synchronization; the first bad bucket and its offending
//     parameters are remembered;
//   * on the device (flag(); optimizer_in_backward with NanCheck::kOn): a float flag per
//     parameter is set where its gradient holds NaN/inf and folded into a running maximum
//     (seen()), which the fused kernels take as found_inf: the bad bucket and every one stepped
//     after it are skipped on the device. read_flags() reads the flags once at the end of
//     backward (the check's one host synchronization), finds the first bucket flagged and lists
//     the members whose kernels skipped (gate() listed them), whose step counts go back.
// Every rank holds the same reduced values, so every rank finds the same bucket, and raise()
// gives every rank the same error.
//
// Owned by the Reducer and called only by it, with the Reducer's lock held, on the thread that
// holds it (autograd's threads in backward, the caller's at a forward). reset() starts each
// synchronized backward afresh; the device flags' memory is kept across backwards.
#pragma once

#include "bucket.h"
#include "modes.h"  // NanCheck

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

namespace leanddp {

class NonFiniteCheck {
 public:
  NonFiniteCheck(NanCheck mode, bool optimizer_in_backward)
      : mode_(mode), optimizer_in_backward_(optimizer_in_backward) {}

  bool enabled() const { return mode_ != NanCheck::kOff; }
  bool strict() const { return mode_ == NanCheck::kStrict; }
  // The check runs on the device (check_for_nan_in_grad=True with in-backward steps; with
  // offload_to_cpu too, whose host steps are held until the end of backward, where the flags
  // are read and a NaN drops every held step).
  bool on_device() const { return mode_ == NanCheck::kOn && optimizer_in_backward_; }

  // At the start of each synchronized backward (and when one is abandoned): nothing found,
  // no bucket checked, the device flags not armed; `num_buckets` buckets.
  void reset(size_t num_buckets);
  // A bucket holding NaN/inf was found (its index; -1 if none).
  bool found() const { return bucket_ >= 0; }
  int64_t bucket() const { return bucket_; }

  // On the host: checks the reduced buckets `indices` not checked yet (one device
  // synchronization for all) and remembers the first holding NaN/inf, with its parameters.
  // Nothing more is checked once one is found.
  void check(const std::vector<Bucket>& buckets, const std::vector<size_t>& indices);

  // On the device: queues, on the current stream, the flags of bucket `index`'s parameters
  // (`num_params` parameters in all) and folds them into seen().
  void flag(const std::vector<Bucket>& buckets, size_t index, size_t num_params);
  // The device flags were set this backward and not read yet.
  bool armed() const { return armed_; }
  // found_inf for the fused kernels: nonzero once a bucket flagged so far holds NaN/inf.
  const at::Tensor& seen() const { return seen_; }
  // Parameter `p` of bucket `index` is stepped by the fused kernels under seen().
  void gate(size_t index, int64_t p) { gated_[index].push_back(p); }
  // Reads the flags (if armed): the first bucket flagged; returns the members gated in it and
  // after it (their kernels skipped: the optimizer takes their step counts back).
  std::vector<int64_t> read_flags(const std::vector<Bucket>& buckets);

  // Raises the check's error, naming what holds NaN/inf (`names`: the parameters' names) and,
  // with in-backward steps, which parameters were stepped: the `used` members of the buckets
  // before the bad one if `earlier_stepped` (the steps did not wait for the end of backward).
  [[noreturn]] void raise(const std::vector<std::string>& names, const std::vector<Bucket>& buckets,
                          const std::vector<int32_t>& used, bool earlier_stepped) const;

 private:
  NanCheck mode_;
  bool optimizer_in_backward_;
  int64_t bucket_ = -1;          // the first bucket with NaN/inf
  std::vector<int64_t> params_;  // its parameters holding NaN/inf
  std::vector<char> checked_;    // per bucket: found finite on the host
  // The device check: a flag per parameter (1: NaN/inf), bucket by bucket in slot order; their
  // running max (found_inf of the kernels); whether this backward set them; per bucket, the
  // parameters the fused kernels were asked to step under seen_.
  at::Tensor flags_, seen_;
  bool armed_ = false;
  std::vector<std::vector<int64_t>> gated_;
};

}  // namespace leanddp
