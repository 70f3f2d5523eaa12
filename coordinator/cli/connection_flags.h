// Flags shared by the CLI commands that talk to a running coordinator (status, stop, scale):
// where it is, the run token and TLS.
//
// Address: --coordinator, else $HETPAR_COORDINATOR, else coordinator.listen of --config, else
// 127.0.0.1:50051. Token: --token-file, else $HETPAR_TOKEN_FILE, else $HETPAR_TOKEN, else
// coordinator.token_file of --config, else the token a local coordinator generated (security.h,
// LocalTokenPath).
#ifndef HETPAR_COORDINATOR_CLI_CONNECTION_FLAGS_H_
#define HETPAR_COORDINATOR_CLI_CONNECTION_FLAGS_H_

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>

#include "CLI/CLI.hpp"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/cli_checks.h"
#include "common/config/config.h"
#include "common/control/client.h"
#include "common/control/security.h"

namespace hetpar::cli {

inline constexpr char kDefaultCoordinatorAddress[] = "127.0.0.1:50051";
inline constexpr char kCoordinatorEnvVar[] = "HETPAR_COORDINATOR";

struct ConnectionFlags {
  std::string coordinator;
  std::string config;
  std::string token_file;
  coordinator::ClientTlsOptions tls;
  double timeout_s = 10;
};

inline void AddConnectionFlags(CLI::App* command, ConnectionFlags* flags) {
  command->add_option("--coordinator", flags->coordinator,
                      "Coordinator address host:port (default: $HETPAR_COORDINATOR, the config's "
                      "coordinator.listen, or 127.0.0.1:50051)");
  command->add_option("-c,--config", flags->config,
                      "RunSpec YAML: its coordinator.listen and coordinator.token_file are used");
  command->add_option("--token-file", flags->token_file,
                      "File with the run token (default: $HETPAR_TOKEN_FILE, then the token in "
                      "$HETPAR_TOKEN, the config's "
                      "coordinator.token_file, or the token a local coordinator generated)");
  command->add_option("--tls-ca", flags->tls.ca_file,
                      "PEM CA of the coordinator's certificate; enables TLS");
  command->add_option("--tls-cert", flags->tls.cert_file, "PEM client certificate (mutual TLS)");
  command->add_option("--tls-key", flags->tls.key_file, "PEM key of --tls-cert");
  command->add_option("--tls-server-name", flags->tls.server_name,
                      "Name to check the coordinator's certificate against (default: its host)");
  command->add_option("--timeout", flags->timeout_s, "Seconds to wait for each call")
      ->check(hetpar::kPositiveNumber);
}

// The address and connection the flags describe; errors name the flag or file to fix.
inline absl::StatusOr<std::shared_ptr<coordinator::CoordinatorConnection>> ConnectFromFlags(
    const ConnectionFlags& flags) {
  std::string address = flags.coordinator;
  std::string config_token_file;
  if (!flags.config.empty()) {
    config::LoadOptions load;
    load.check_files = false;
    absl::StatusOr<config::LoadedRunSpec> loaded = config::LoadRunSpecFile(flags.config, load);
    if (!loaded.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("invalid config ", flags.config, ":\n",
                                                     std::string(loaded.status().message())));
    }
    if (address.empty() && std::getenv(kCoordinatorEnvVar) == nullptr) {
      address = loaded->spec.coordinator().listen();
    }
    config_token_file = loaded->spec.coordinator().token_file();
  }
  if (address.empty()) {
    const char* env = std::getenv(kCoordinatorEnvVar);
    address = env != nullptr && env[0] != '\0' ? env : kDefaultCoordinatorAddress;
  }
  absl::StatusOr<coordinator::RunToken> token =
      coordinator::ResolveToken(flags.token_file, config_token_file);
  if (!token.ok() && absl::IsNotFound(token.status()) && flags.token_file.empty() &&
      config_token_file.empty()) {
    const std::string local = coordinator::LocalTokenPath(coordinator::PortOf(address));
    if (std::filesystem::exists(local)) {
      token = coordinator::ReadTokenFile(local);
    } else {
      return absl::NotFoundError(
          absl::StrCat("no run token for coordinator ", address, ": pass --token-file, set ",
                       coordinator::kTokenEnvVar,
                       ", pass --config with coordinator.token_file, or run on "
                       "the coordinator's machine (it keeps a generated token in ",
                       local, ")"));
    }
  }
  if (!token.ok()) return token.status();
  coordinator::ClientOptions options;
  options.address = address;
  options.token = token->value;
  options.tls = flags.tls;
  options.rpc_timeout = absl::Seconds(flags.timeout_s);
  return coordinator::CoordinatorConnection::Create(options);
}

}  // namespace hetpar::cli

#endif  // HETPAR_COORDINATOR_CLI_CONNECTION_FLAGS_H_
