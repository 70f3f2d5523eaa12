// Subcommands of the `hetpar` CLI. Each Add*Command registers one subcommand on the app and, when
// it is the one chosen, runs it and stores the process exit code in *exit_code.
//
// Exit codes: 0 success; 1 the command failed at run time; 2 invalid input (a bad config, a bad
// flag value), with a message naming what to fix.
#ifndef HETPAR_COORDINATOR_CLI_COMMANDS_H_
#define HETPAR_COORDINATOR_CLI_COMMANDS_H_

#include "CLI/CLI.hpp"

namespace hetpar::cli {

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;
inline constexpr int kExitInvalidInput = 2;

// `hetpar validate --config FILE [--set KEY=VALUE]...`
void AddValidateCommand(CLI::App& app, int* exit_code);

}  // namespace hetpar::cli

#endif  // HETPAR_COORDINATOR_CLI_COMMANDS_H_
