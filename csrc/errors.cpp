#include "errors.h"

#include <c10/util/Exception.h>

#include <exception>
#include <sstream>

namespace leanddp {

std::string join_names(const std::vector<std::string>& names, const std::vector<int64_t>& idx) {
  std::ostringstream out;
  for (size_t k = 0; k < idx.size(); ++k) {
    if (k == 8) {
      out << ", ... (" << idx.size() << " in all)";
      break;
    }
    out << (k ? ", " : "") << names[static_cast<size_t>(idx[k])];
  }
  return out.str();
}

void rethrow_collective_error(int rank, const std::string& what) {
  std::ostringstream context;
  context << "leanddp.DistributedDataParallel: rank " << rank << ": " << what
          << " failed. Another rank has probably died, raised an exception, or run a different "
             "sequence of forwards and backwards (every rank must run the same ones); this "
             "process group cannot be used for training any more. The error: ";
  try {
    throw;
  } catch (const c10::DistBackendError& e) {
    C10_THROW_ERROR(DistBackendError, context.str() + e.what_without_backtrace());
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, context.str(), e.what_without_backtrace());
  } catch (const std::exception& e) {
    TORCH_CHECK(false, context.str(), e.what());
  }
}

}  // namespace leanddp
