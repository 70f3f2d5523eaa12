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

// How the message starts of the status (ABORTED) a coordinator ends a worker's session with when
// it declared the worker dead (no heartbeat, or stuck in a step). The worker restarts itself to
// register again, as after losing its coordinator, which also ends a process whose step hangs.
inline constexpr char kDeclaredDeadPrefix[] = "declared dead by the coordinator: ";

}  // namespace hetpar::coordinator

#endif  // HETPAR_COMMON_CONTROL_GRPC_STATUS_H_
