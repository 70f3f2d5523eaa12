// `hetpar scale`: ask the coordinator for a different number of encoder replicas. Resizing the
// encoder pool of a running run is not supported yet: the coordinator refuses every request
// (UNIMPLEMENTED, naming the requested and the current size) and this command prints that error
// and exits 1.
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
      "Ask a running coordinator to resize the encoder pool. Not supported yet: the coordinator "
      "refuses every request, the pool keeps encoder.layout.dp replicas, and this command prints "
      "the refusal and exits 1 (2 for an invalid request)");
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
