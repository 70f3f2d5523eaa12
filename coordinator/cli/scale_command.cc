// `hetpar scale`: resize the encoder pool of a running run. The coordinator takes the new target
// (failure.min_encoder_replicas to encoder.layout.dp): a smaller pool leaves at the next step
// boundary; a larger one admits workers into its vacant replicas, each joining at a step boundary
// with the state of a live replica (`hetpar run` starts their workers itself; in a cluster, add
// pods or tasks). Prints the coordinator's answer; exits 2 for a size out of range.
#include <iostream>
#include <memory>

#include "common/cli_checks.h"
#include "coordinator/cli/commands.h"
#include "coordinator/cli/connection_flags.h"

namespace hetpar::cli {
namespace {

void AddScaleCommand(CLI::App& app, int* exit_code) {
  struct Flags {
    ConnectionFlags connection;
    int64_t encoders = 0;
  };
  auto flags = std::make_shared<Flags>();
  CLI::App* command = app.add_subcommand(
      "scale",
      "Resize the encoder pool of a running run: fewer replicas leave at the next step "
      "boundary; more replicas admit workers (hetpar run starts them; in a cluster add pods), "
      "each joining at a step boundary with a live replica's parameters and optimizer state. "
      "Between failure.min_encoder_replicas and encoder.layout.dp (exit 2 otherwise)");
  AddConnectionFlags(command, &flags->connection);
  command->add_option("--encoders,--encoder-dp", flags->encoders, "Encoder replicas wanted")
      ->required()
      ->check(hetpar::kPositiveNumber);
  command->callback([flags, exit_code] {
    auto connection = ConnectFromFlags(flags->connection);
    if (!connection.ok()) {
      std::cerr << "hetpar: " << connection.status().message() << "\n";
      *exit_code = absl::IsInvalidArgument(connection.status()) ? kExitInvalidInput : kExitFailure;
      return;
    }
    auto scaled = coordinator::AdminClient(*connection).Scale(flags->encoders);
    if (!scaled.ok()) {
      std::cerr << "hetpar: " << scaled.status().message() << "\n";
      *exit_code =
          absl::IsInvalidArgument(scaled.status()) || absl::IsFailedPrecondition(scaled.status())
              ? kExitInvalidInput
              : kExitFailure;
      return;
    }
    std::cout << scaled->message() << std::endl;
    *exit_code = kExitOk;
  });
}

}  // namespace

HETPAR_REGISTER_COMMAND(23, AddScaleCommand);

}  // namespace hetpar::cli
