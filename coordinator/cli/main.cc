// `hetpar`: the command line of a hetpar run (coordinator, planning, data, validation).
#include <algorithm>
#include <iostream>

#include "CLI/CLI.hpp"
#include "common/version.h"
#include "coordinator/cli/commands.h"

namespace hetpar::cli {

std::vector<CommandEntry>& CommandRegistry() {
  static std::vector<CommandEntry> registry;
  return registry;
}

}  // namespace hetpar::cli

int main(int argc, char** argv) {
  CLI::App app{
      "hetpar: train multimodal LLMs with heterogeneous parallelism. The image encoder and the\n"
      "LLM each run their own layout (TP/DP, and CP/PP for the LLM), on separate machines or\n"
      "on the same ranks. Every run is described by one RunSpec YAML file (see configs/)."};
  app.name("hetpar");
  app.set_version_flag("--version",
                       std::string("hetpar ") + HETPAR_VERSION + " (" + HETPAR_GIT_REVISION + ")");
  app.require_subcommand(1);
  int exit_code = hetpar::cli::kExitOk;
  auto commands = hetpar::cli::CommandRegistry();
  std::stable_sort(commands.begin(), commands.end(),
                   [](const auto& a, const auto& b) { return a.order < b.order; });
  for (const auto& command : commands) command.add(app, &exit_code);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    // --help and --version are successes; any usage error is invalid input.
    return code == 0 ? 0 : hetpar::cli::kExitInvalidInput;
  }
  return exit_code;
}
