// Picks a data-plane backend by name, for callers that take it from configuration.
#ifndef HETPAR_COMMON_TRANSPORT_FACTORY_H_
#define HETPAR_COMMON_TRANSPORT_FACTORY_H_

#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "common/transport/transport.h"

namespace hetpar::transport {

enum class Backend { kInproc, kUcx, kNccl };

std::string_view BackendName(Backend backend);

// "ucx", "inproc" or "nccl"; anything else is kInvalidArgument listing the choices.
absl::StatusOr<Backend> ParseBackend(std::string_view name);

// Creates a transport of `backend` named `name` with that backend's default options. kNccl
// wraps a fresh UcxTransport with NcclTransport's defaults (CUDA device 0); a worker that picks
// its GPU wraps its own UcxTransport with nccl::NcclTransport::Wrap instead.
absl::StatusOr<std::unique_ptr<Transport>> CreateTransport(Backend backend,
                                                           const std::string& name);

}  // namespace hetpar::transport

#endif  // HETPAR_COMMON_TRANSPORT_FACTORY_H_
