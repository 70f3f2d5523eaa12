// The one place where gRPC statuses and absl statuses are translated into each other.
#ifndef HETPAR_COMMON_CONTROL_GRPC_STATUS_H_
#define HETPAR_COMMON_CONTROL_GRPC_STATUS_H_

#include <string_view>

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace hetpar::coordinator {

// The same code and message; `context` (e.g. "Status RPC to coordinator 10.0.0.1:50051") is
// prefixed to the message when given.
absl::Status FromGrpcStatus(const grpc::Status& status, std::string_view context = {});
grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace hetpar::coordinator

#endif  // HETPAR_COMMON_CONTROL_GRPC_STATUS_H_
