// `hetpar-reference`: the tools that run both models in one process (normally started by `hetpar
// run`):
//   train     the single-process reference trainer at tp = 1, dp = 1 (the parity baseline)
//   evaluate  validation metrics of a run's saved model (<out>/model), written to <out>/eval.json
#include <ATen/Parallel.h>

#include <algorithm>
#include <fstream>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "common/config/config.h"
#include "common/logging.h"
#include "common/version.h"
#include "llm_trainer/reference/reference_trainer.h"

namespace {

constexpr int kExitFailure = 1;
constexpr int kExitInvalidInput = 2;

struct Flags {
  std::string config_path;
  std::vector<std::string> overrides;
  std::string out_dir;
  int64_t steps = 0;
  int threads = 0;
  bool progress = false;
};

void AddCommonFlags(CLI::App* command, Flags* flags) {
  command->add_option("-c,--config", flags->config_path, "RunSpec YAML file")->required();
  command->add_option("--set", flags->overrides,
                      "Override a RunSpec field, e.g. --set run.steps=5 (repeatable)");
  command
      ->add_option("--threads", flags->threads, "Intra-op threads (default: the machine's cores)")
      ->check(CLI::NonNegativeNumber);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"hetpar-reference: both modules in one process (normally started by `hetpar run`)"};
  app.name("hetpar-reference");
  app.set_version_flag("--version", std::string("hetpar-reference ") + HETPAR_VERSION);
  app.require_subcommand(1);
  Flags flags;
  CLI::App* train = app.add_subcommand(
      "train", "Train the RunSpec at tp = 1, dp = 1 in this process (the parity baseline)");
  AddCommonFlags(train, &flags);
  train->add_option("--out", flags.out_dir, "Run directory (default: run.out_dir of the config)");
  train->add_option("--steps", flags.steps, "Steps to train (default: run.steps)")
      ->check(CLI::PositiveNumber);
  train->add_flag("--progress", flags.progress, "Log one progress line per step");
  CLI::App* evaluate = app.add_subcommand(
      "evaluate", "Evaluate a run's saved model (<out>/model) on the validation split");
  AddCommonFlags(evaluate, &flags);
  evaluate->add_option("--out", flags.out_dir, "Run directory holding model/")->required();
  std::string checkpoint;
  CLI::App* export_command = app.add_subcommand(
      "export",
      "Write a checkpoint's full parameters as <out>/encoder.hpar and llm.hpar (the files "
      "encoder.init_from and llm.init_from start a run from)");
  AddCommonFlags(export_command, &flags);
  export_command
      ->add_option("--checkpoint", checkpoint, "A complete checkpoint (a step-NNNNNN directory)")
      ->required();
  export_command->add_option("--out", flags.out_dir, "Directory to write the two files to")
      ->required();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : kExitInvalidInput;
  }

  if (flags.steps > 0) flags.overrides.push_back("run.steps=" + std::to_string(flags.steps));
  hetpar::config::LoadOptions load;
  load.overrides = flags.overrides;
  // The evaluation of a finished run needs no checkpoint it may have started from.
  load.resume = !evaluate->parsed();
  auto loaded = hetpar::config::LoadRunSpecFile(flags.config_path, load);
  if (!loaded.ok()) {
    std::cerr << "hetpar-reference: invalid config " << flags.config_path << ":\n"
              << loaded.status().message() << "\n";
    return kExitInvalidInput;
  }
  const hetpar::v1::RunSpec& spec = loaded->spec;
  at::set_num_threads(flags.threads > 0
                          ? flags.threads
                          : static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));

  if (export_command->parsed()) {
    hetpar::SetLogTag("export");
    if (absl::Status status = hetpar::llm::ExportCheckpoint(spec, checkpoint, flags.out_dir);
        !status.ok()) {
      HETPAR_LOG(ERROR) << "export failed: " << status;
      return kExitFailure;
    }
    HETPAR_LOG(INFO) << "wrote " << flags.out_dir << "/encoder.hpar and " << flags.out_dir
                     << "/llm.hpar from " << checkpoint;
    return 0;
  }
  if (evaluate->parsed()) {
    hetpar::SetLogTag("evaluate");
    auto line = hetpar::llm::EvaluateSavedModel(spec, flags.out_dir + "/model", spec.run().steps());
    if (!line.ok()) {
      HETPAR_LOG(ERROR) << "evaluation failed: " << line.status();
      return kExitFailure;
    }
    std::ofstream(flags.out_dir + "/eval.json") << *line << "\n";
    HETPAR_LOG(INFO) << "validation: " << *line;
    return 0;
  }
  hetpar::SetLogTag("reference");
  hetpar::llm::ReferenceOptions options;
  options.out_dir = flags.out_dir.empty() ? spec.run().out_dir() : flags.out_dir;
  options.progress = flags.progress;
  if (absl::Status status = hetpar::llm::RunReference(spec, options); !status.ok()) {
    HETPAR_LOG(ERROR) << "reference run failed: " << status;
    return kExitFailure;
  }
  HETPAR_LOG(INFO) << "run directory: " << options.out_dir;
  return 0;
}
