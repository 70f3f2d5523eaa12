#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "common/config/config.h"
#include "coordinator/cli/commands.h"

namespace hetpar::cli {
namespace {

void AddValidateCommand(CLI::App& app, int* exit_code) {
  struct Options {
    std::string config;
    std::vector<std::string> overrides;
    bool skip_file_checks = false;
  };
  auto options = std::make_shared<Options>();
  CLI::App* command =
      app.add_subcommand("validate",
                         "Check a RunSpec config and print it normalised (defaults filled, paths "
                         "absolute) as YAML; exit 2 with every problem listed when it is invalid");
  command->add_option("-c,--config", options->config, "RunSpec YAML file")->required();
  command->add_option("--set", options->overrides,
                      "Override a field, e.g. --set llm.layout.tp=2 (repeatable)");
  command->add_flag("--skip-file-checks", options->skip_file_checks,
                    "Do not check that data and token files exist");
  command->callback([options, exit_code] {
    config::LoadOptions load;
    load.overrides = options->overrides;
    load.check_files = !options->skip_file_checks;
    auto loaded = config::LoadRunSpecFile(options->config, load);
    if (!loaded.ok()) {
      std::cerr << "hetpar: invalid config " << options->config << ":\n"
                << loaded.status().message() << "\n";
      *exit_code = kExitInvalidInput;
      return;
    }
    std::cout << config::RunSpecToYaml(loaded->spec);
    *exit_code = kExitOk;
  });
}

}  // namespace

HETPAR_REGISTER_COMMAND(10, AddValidateCommand);

}  // namespace hetpar::cli
