#include "common/control/grpc_status.h"

#include <string>

namespace hetpar::coordinator {

absl::Status FromGrpcStatus(const grpc::Status& status, std::string_view context) {
  if (status.ok()) return absl::OkStatus();
  // Both enumerations use the canonical gRPC code numbers.
  const auto code = static_cast<absl::StatusCode>(status.error_code());
  std::string message = status.error_message();
  if (!context.empty()) message = std::string(context) + ": " + message;
  return absl::Status(code, message);
}

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

}  // namespace hetpar::coordinator
