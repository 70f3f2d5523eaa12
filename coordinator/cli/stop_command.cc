// `hetpar stop`: stop a run; optionally wait until it is done.
#include <iostream>
#include <memory>
#include <string>

#include "absl/time/clock.h"
#include "common/cli_checks.h"
#include "coordinator/cli/commands.h"
#include "coordinator/cli/connection_flags.h"
#include "coordinator/run_controller.h"

namespace hetpar::cli {
namespace {

void AddStopCommand(CLI::App& app, int* exit_code) {
  struct Flags {
    ConnectionFlags connection;
    std::string reason;
    double wait_s = 0;
    bool checkpoint = false;
  };
  auto flags = std::make_shared<Flags>();
  CLI::App* command = app.add_subcommand(
      "stop",
      "Stop a run: the coordinator aborts the step in flight, tells every worker to stop and "
      "ends when their sessions have closed");
  AddConnectionFlags(command, &flags->connection);
  command->add_option("--reason", flags->reason, "Why (shown to the workers and in status)");
  command->add_flag("--checkpoint", flags->checkpoint,
                    "Let the step in flight commit and write a checkpoint of it before stopping; "
                    "refused (exit 2, the run goes on) when the run has no checkpoint.dir");
  command
      ->add_option("--wait", flags->wait_s,
                   "Seconds to wait for the run to be done (exit 1 if it is not by then)")
      ->check(hetpar::kNonNegativeNumber);
  command->callback([flags, exit_code] {
    auto connection = ConnectFromFlags(flags->connection);
    if (!connection.ok()) {
      std::cerr << "hetpar: " << connection.status().message() << "\n";
      *exit_code = absl::IsInvalidArgument(connection.status()) ? kExitInvalidInput : kExitFailure;
      return;
    }
    coordinator::AdminClient admin(*connection);
    auto stopped = admin.Stop(flags->reason, flags->checkpoint);
    if (!stopped.ok()) {
      std::cerr << "hetpar: " << stopped.status().message() << "\n";
      *exit_code =
          absl::IsFailedPrecondition(stopped.status()) ? kExitInvalidInput : kExitFailure;
      return;
    }
    std::cout << "stop requested; the run is " << coordinator::RunStateName(stopped->state())
              << std::endl;
    if (!stopped->checkpoint().empty()) std::cout << stopped->checkpoint() << std::endl;
    v1::RunState state = stopped->state();
    const absl::Time deadline = absl::Now() + absl::Seconds(flags->wait_s);
    while (flags->wait_s > 0 && state != v1::RUN_STATE_DONE && state != v1::RUN_STATE_FAILED) {
      if (absl::Now() >= deadline) {
        std::cerr << "hetpar: the run is still " << coordinator::RunStateName(state) << " after "
                  << flags->wait_s << "s\n";
        *exit_code = kExitFailure;
        return;
      }
      absl::SleepFor(absl::Milliseconds(100));
      auto status = admin.Status();
      if (!status.ok()) {
        // The coordinator exits once the run is over.
        if (absl::IsUnavailable(status.status())) break;
        std::cerr << "hetpar: " << status.status().message() << "\n";
        *exit_code = kExitFailure;
        return;
      }
      state = status->state();
    }
    if (flags->wait_s > 0) std::cout << "the run has ended" << std::endl;
    *exit_code = kExitOk;
  });
}

}  // namespace

HETPAR_REGISTER_COMMAND(22, AddStopCommand);

}  // namespace hetpar::cli
