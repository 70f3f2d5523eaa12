// The run token and TLS for the coordinator's gRPC endpoints (server and clients).
//
// Every RPC carries the run token as `authorization: Bearer <token>` metadata. The token comes
// from, in order: a --token-file flag, the HETPAR_TOKEN environment variable, the RunSpec's
// coordinator.token_file, and, for a local coordinator, the token file the coordinator wrote in
// the per-user runtime directory when it generated a token itself. The token is never logged or
// printed; messages name only where it came from.
//
// TLS is optional: a server certificate and key enable it; a client CA on the server requires
// and verifies client certificates (mutual TLS). Clients verify the server with a CA file and
// may present a certificate of their own.
#ifndef HETPAR_COMMON_CONTROL_SECURITY_H_
#define HETPAR_COMMON_CONTROL_SECURITY_H_

#include <memory>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"

namespace hetpar::coordinator {

inline constexpr char kTokenEnvVar[] = "HETPAR_TOKEN";
// A file holding the token (a mounted Secret); read before HETPAR_TOKEN.
inline constexpr char kTokenFileEnvVar[] = "HETPAR_TOKEN_FILE";
inline constexpr char kAuthMetadataKey[] = "authorization";
inline constexpr char kBearerPrefix[] = "Bearer ";

struct RunToken {
  std::string value;
  std::string origin;  // "HETPAR_TOKEN", "file /path", "generated": safe to log
};

// Checks a token's shape (8..4096 printable ASCII characters, no spaces) without echoing it.
absl::Status ValidateToken(std::string_view token, std::string_view origin);

// Reads a token file (surrounding whitespace trimmed). NotFound / PermissionDenied name the path.
absl::StatusOr<RunToken> ReadTokenFile(const std::string& path);

// The first token found among: `flag_file`, the file $HETPAR_TOKEN_FILE names, $HETPAR_TOKEN,
// `config_file` (each may be empty).
// NotFound when none is set.
absl::StatusOr<RunToken> ResolveToken(const std::string& flag_file, const std::string& config_file);

// 32 random bytes from the OS, as 64 hex characters.
absl::StatusOr<std::string> GenerateToken();

// Where a coordinator listening on `port` keeps a token it generated:
// $XDG_RUNTIME_DIR/hetpar/coordinator-<port>.token, else
// /tmp/hetpar-<uid>/coordinator-<port>.token.
std::string LocalTokenPath(int port);
// Writes `token` to `path` readable by the owner only (the directory is created 0700).
absl::Status WriteLocalTokenFile(const std::string& path, const std::string& token);

// Equality that takes the same time wherever the first difference is.
bool TokenMatches(std::string_view expected, std::string_view presented);

// The port of "host:port", "[v6]:port" or "dns:///host:port"; -1 when there is none.
int PortOf(std::string_view address);

struct ServerTlsOptions {
  std::string cert_file;       // PEM server certificate chain; empty: no TLS
  std::string key_file;        // PEM private key
  std::string client_ca_file;  // PEM CA; set: clients must present a certificate it signed
  bool enabled() const { return !cert_file.empty(); }
};

struct ClientTlsOptions {
  std::string ca_file;      // PEM CA that signed the server certificate; set: use TLS
  std::string cert_file;    // PEM client certificate (mutual TLS), optional
  std::string key_file;     // its private key
  std::string server_name;  // name to verify the server certificate against; default: the host
  bool enabled() const { return !ca_file.empty(); }
};

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const ServerTlsOptions& tls);
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const ClientTlsOptions& tls);

// Whole-file read for PEM files and tokens; NotFound / PermissionDenied name the path and `what`.
absl::StatusOr<std::string> ReadSmallFile(const std::string& path, std::string_view what);

}  // namespace hetpar::coordinator

#endif  // HETPAR_COMMON_CONTROL_SECURITY_H_
