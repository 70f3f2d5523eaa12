// The one place where UCX status codes become absl::Status.
#ifndef HETPAR_COMMON_TRANSPORT_UCX_UCX_STATUS_H_
#define HETPAR_COMMON_TRANSPORT_UCX_UCX_STATUS_H_

#include <ucs/type/status.h>

#include <string_view>

#include "absl/status/status.h"

namespace hetpar::transport::ucx {

// Maps `status` to an absl code and a message "<context>: <UCX text> (UCX status <n>)".
// UCS_OK maps to OK. Codes:
//   UCS_ERR_CANCELED                                  -> kCancelled
//   UCS_ERR_MESSAGE_TRUNCATED                         -> kOutOfRange
//   UCS_ERR_TIMED_OUT                                 -> kDeadlineExceeded
//   UCS_ERR_NO_MEMORY, NO_RESOURCE, EXCEEDS_LIMIT     -> kResourceExhausted
//   UCS_ERR_INVALID_PARAM, INVALID_ADDR, BUFFER_TOO_SMALL -> kInvalidArgument
//   UCS_ERR_UNSUPPORTED, NOT_IMPLEMENTED              -> kUnimplemented
//   UCS_ERR_NO_DEVICE                                 -> kFailedPrecondition
//   UCS_ERR_ALREADY_EXISTS                            -> kAlreadyExists
//   UCS_ERR_OUT_OF_RANGE                              -> kOutOfRange
//   UCS_ERR_UNREACHABLE, IO_ERROR, REJECTED, NOT_CONNECTED, CONNECTION_RESET, link and
//   endpoint failures (-40..-89)                      -> kUnavailable
//   anything else                                     -> kInternal
absl::Status UcsToStatus(ucs_status_t status, std::string_view context);

// True for the codes that mean the remote side is gone (kUnavailable above).
bool IsPeerFailure(ucs_status_t status);

}  // namespace hetpar::transport::ucx

#endif  // HETPAR_COMMON_TRANSPORT_UCX_UCX_STATUS_H_
