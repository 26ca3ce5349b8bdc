#pragma once

// The error helpers every layer shares: how parameters are named in a message, and how a failed
// collective is reported. A leaf header: it includes nothing of leanddp's, so that the classes
// under the Reducer (NonFiniteCheck, ShardGather, the step strategies) need not include
// reducer.h for them.

#include <cstdint>
#include <string>
#include <vector>

namespace leanddp {

// "a, b, c" for the parameters `idx` (at most 8 named, then the count), for error messages.
std::string join_names(const std::vector<std::string>& names, const std::vector<int64_t>& idx);

// Inside a catch block: rethrows the exception being handled as an error of rank `rank` saying
// that `what` failed, and what that usually means (another rank died or diverged).
[[noreturn]] void rethrow_collective_error(int rank, const std::string& what);

}  // namespace leanddp
