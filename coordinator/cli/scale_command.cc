// `hetpar scale`: ask the coordinator for a different number of encoder replicas.
#include <iostream>
#include <memory>

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
      "Request a number of encoder replicas for a non-colocated run; the coordinator records "
      "the request and shows it in status");
  AddConnectionFlags(command, &flags->connection);
  command->add_option("--encoders", flags->encoders, "Encoder replicas wanted")
      ->required()
      ->check(CLI::PositiveNumber);
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
