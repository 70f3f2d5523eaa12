// Bounds on what the coordinator accepts from the network, checked before anything is stored or
// logged (a token holder is not trusted to send sane sizes), and the one way peer-provided text
// enters a log line or a status message.
//
//   gRPC messages     a request up to kMaxRequestBytes (8 MiB), else RESOURCE_EXHAUSTED from
//                     gRPC itself; responses up to kMaxResponseBytes (64 MiB)
//   registration      host: a hostname or address, 1 to 253 characters of [A-Za-z0-9.:_%[]-];
//                     data_address: up to 64 KiB (a UCX worker address with every transport of a
//                     node is a few KiB); up to 32 capabilities of up to 64 characters
//   rendezvous        keys up to 1 KiB, values up to 1 MiB, up to 1024 keys per wait or check
//
// Each check returns INVALID_ARGUMENT naming the field, its size and the limit.
#ifndef HETPAR_COORDINATOR_LIMITS_H_
#define HETPAR_COORDINATOR_LIMITS_H_

#include <cstddef>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "hetpar/v1/coordinator.pb.h"

namespace hetpar::coordinator {

inline constexpr int kMaxRequestBytes = 8 << 20;
inline constexpr int kMaxResponseBytes = 64 << 20;
inline constexpr size_t kMaxHostBytes = 253;
inline constexpr size_t kMaxDataAddressBytes = 64 << 10;
inline constexpr size_t kMaxCapabilities = 32;
inline constexpr size_t kMaxCapabilityBytes = 64;
inline constexpr size_t kMaxKeyBytes = 1 << 10;
inline constexpr size_t kMaxValueBytes = 1 << 20;
inline constexpr size_t kMaxKeysPerCall = 1024;
// Peer-provided text in a log line or a status message keeps at most this many bytes.
inline constexpr size_t kMaxLoggedBytes = 256;
// A worker's own error (WorkerFailure, a failed StepReport) keeps more: it names files and
// causes.
inline constexpr size_t kMaxErrorBytes = 4096;

absl::Status CheckRegistration(const v1::RegisterRequest& request);
absl::Status CheckKey(absl::string_view key);
absl::Status CheckValue(absl::string_view field, absl::string_view value);
absl::Status CheckKeys(const std::vector<std::string>& keys);

// `text` as it may enter a log or a message: control and non-ASCII bytes escaped (\n, \x01), and
// cut to `max_bytes` with the full size noted ("...(1048576 bytes)").
std::string Printable(absl::string_view text, size_t max_bytes = kMaxLoggedBytes);

}  // namespace hetpar::coordinator

#endif  // HETPAR_COORDINATOR_LIMITS_H_
