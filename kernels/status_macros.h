#ifndef FLCE_KERNELS_STATUS_MACROS_H_
#define FLCE_KERNELS_STATUS_MACROS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

// Returns from the enclosing function if `expr` (an absl::Status) is not OK.
#define FLCE_RETURN_IF_ERROR(expr)                 \
  do {                                             \
    ::absl::Status flce_status_ = (expr);          \
    if (!flce_status_.ok()) return flce_status_;   \
  } while (false)

#define FLCE_STATUS_CONCAT_INNER_(a, b) a##b
#define FLCE_STATUS_CONCAT_(a, b) FLCE_STATUS_CONCAT_INNER_(a, b)

// `FLCE_ASSIGN_OR_RETURN(auto x, MakeX());` assigns the value of an
// absl::StatusOr or returns its error from the enclosing function.
#define FLCE_ASSIGN_OR_RETURN(lhs, expr)                                  \
  FLCE_ASSIGN_OR_RETURN_IMPL_(FLCE_STATUS_CONCAT_(flce_or_, __LINE__), lhs, \
                              expr)
#define FLCE_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                \
  if (!tmp.ok()) return std::move(tmp).status();    \
  lhs = std::move(tmp).value()

#endif  // FLCE_KERNELS_STATUS_MACROS_H_
