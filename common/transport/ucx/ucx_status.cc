#include "common/transport/ucx/ucx_status.h"

#include "absl/strings/str_cat.h"

namespace hetpar::transport::ucx {

bool IsPeerFailure(ucs_status_t status) {
  switch (status) {
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_IO_ERROR:
    case UCS_ERR_REJECTED:
    case UCS_ERR_NOT_CONNECTED:
    case UCS_ERR_CONNECTION_RESET:
      return true;
    default:
      return UCS_IS_LINK_ERROR(status) || UCS_IS_ENDPOINT_ERROR(status);
  }
}

absl::Status UcsToStatus(ucs_status_t status, std::string_view context) {
  if (status == UCS_OK) return absl::OkStatus();
  const std::string message = absl::StrCat(std::string(context), ": ", ucs_status_string(status),
                                           " (UCX status ", static_cast<int>(status), ")");
  if (IsPeerFailure(status)) return absl::UnavailableError(message);
  switch (status) {
    case UCS_ERR_CANCELED:
      return absl::CancelledError(message);
    case UCS_ERR_MESSAGE_TRUNCATED:
    case UCS_ERR_OUT_OF_RANGE:
      return absl::OutOfRangeError(message);
    case UCS_ERR_TIMED_OUT:
      return absl::DeadlineExceededError(message);
    case UCS_ERR_NO_MEMORY:
    case UCS_ERR_NO_RESOURCE:
    case UCS_ERR_EXCEEDS_LIMIT:
      return absl::ResourceExhaustedError(message);
    case UCS_ERR_INVALID_PARAM:
    case UCS_ERR_INVALID_ADDR:
    case UCS_ERR_BUFFER_TOO_SMALL:
      return absl::InvalidArgumentError(message);
    case UCS_ERR_UNSUPPORTED:
    case UCS_ERR_NOT_IMPLEMENTED:
      return absl::UnimplementedError(message);
    case UCS_ERR_NO_DEVICE:
      return absl::FailedPreconditionError(message);
    case UCS_ERR_ALREADY_EXISTS:
      return absl::AlreadyExistsError(message);
    default:
      return absl::InternalError(message);
  }
}

}  // namespace hetpar::transport::ucx
