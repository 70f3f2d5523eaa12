// An absl::Status for a failed system call: the code follows errno (a missing file is NotFound,
// no permission PermissionDenied, a full disk ResourceExhausted, anything else Unavailable) and
// the message is "<what>: <strerror>".
#ifndef HETPAR_COMMON_ERRNO_STATUS_H_
#define HETPAR_COMMON_ERRNO_STATUS_H_

#include <cerrno>
#include <cstring>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace hetpar {

inline absl::Status ErrnoStatus(int err, const std::string& what) {
  const std::string message = absl::StrCat(what, ": ", std::strerror(err));
  switch (err) {
    case ENOENT:
      return absl::NotFoundError(message);
    case EACCES:
    case EPERM:
    case EROFS:
      return absl::PermissionDeniedError(message);
    case ENOSPC:
    case EDQUOT:
      return absl::ResourceExhaustedError(message);
    default:
      return absl::UnavailableError(message);
  }
}

}  // namespace hetpar

#endif  // HETPAR_COMMON_ERRNO_STATUS_H_
