// An absl::Status for a failed system call: the code follows errno (a missing file is NotFound,
// no permission PermissionDenied, a full disk ResourceExhausted, anything else Unavailable), the
// message is "<what>: <strerror>", and the errno itself rides along as a payload (ErrnoOf), for
// a caller that must tell a full disk from an out-of-memory error of the same code.
#ifndef HETPAR_COMMON_ERRNO_STATUS_H_
#define HETPAR_COMMON_ERRNO_STATUS_H_

#include <cerrno>
#include <cstring>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace hetpar {

inline constexpr char kErrnoPayload[] = "type.hetpar/errno";

inline absl::Status ErrnoStatus(int err, const std::string& what) {
  const std::string message = absl::StrCat(what, ": ", std::strerror(err));
  absl::Status status;
  switch (err) {
    case ENOENT:
      status = absl::NotFoundError(message);
      break;
    case EACCES:
    case EPERM:
    case EROFS:
      status = absl::PermissionDeniedError(message);
      break;
    case ENOSPC:
    case EDQUOT:
      status = absl::ResourceExhaustedError(message);
      break;
    default:
      status = absl::UnavailableError(message);
  }
  status.SetPayload(kErrnoPayload, absl::Cord(std::to_string(err)));
  return status;
}

// The errno of an ErrnoStatus (kept through Annotate), or nullopt for any other status.
inline std::optional<int> ErrnoOf(const absl::Status& status) {
  const auto payload = status.GetPayload(kErrnoPayload);
  int err = 0;
  if (!payload.has_value() || !absl::SimpleAtoi(std::string(*payload), &err)) return std::nullopt;
  return err;
}

}  // namespace hetpar

#endif  // HETPAR_COMMON_ERRNO_STATUS_H_
