// Subcommands of the `hetpar` CLI.
//
// Each subcommand lives in its own `cli/<name>_command.cc` and registers itself with
// HETPAR_REGISTER_COMMAND(order, AddFn): AddFn adds the subcommand to the app and, when it is the
// one chosen, runs it and stores the process exit code in *exit_code. `order` sorts `--help`.
//
// Exit codes: 0 success; 1 the command failed at run time; 2 invalid input (a bad config, a bad
// flag value), with a message naming what to fix.
#ifndef HETPAR_COORDINATOR_CLI_COMMANDS_H_
#define HETPAR_COORDINATOR_CLI_COMMANDS_H_

#include <string>
#include <vector>

#include "CLI/CLI.hpp"

namespace hetpar::cli {

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;
inline constexpr int kExitInvalidInput = 2;

using AddCommandFn = void (*)(CLI::App& app, int* exit_code);

struct CommandEntry {
  int order;
  AddCommandFn add;
};

// Every registered subcommand, in registration order (main sorts by `order`).
std::vector<CommandEntry>& CommandRegistry();

// Adds a subcommand `name` that replaces this process with `hetpar-reference name <arguments>`
// (local_process.cc): for work that needs libtorch, which `hetpar` never links. `--help` and exit
// codes are hetpar-reference's.
void AddForwardedCommand(CLI::App& app, int* exit_code, const std::string& name,
                         const std::string& description);

struct CommandRegistration {
  CommandRegistration(int order, AddCommandFn add) { CommandRegistry().push_back({order, add}); }
};

}  // namespace hetpar::cli

#define HETPAR_REGISTER_COMMAND(order, fn) \
  static ::hetpar::cli::CommandRegistration hetpar_command_registration_##fn(order, fn)

#endif  // HETPAR_COORDINATOR_CLI_COMMANDS_H_
