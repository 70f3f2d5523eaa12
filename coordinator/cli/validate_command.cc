#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/config/config.h"
#include "common/data/synth.h"
#include "common/data/tokenizer.h"
#include "coordinator/cli/commands.h"

namespace hetpar::cli {
namespace {

// What a run checks of the tokenizer when it opens the data set, checked here so that a config
// that validates is one that runs: it loads, fits llm.model.vocab and has the image token.
std::vector<std::string> TokenizerProblems(const config::LoadedRunSpec& loaded) {
  const v1::RunSpec& spec = loaded.spec;
  const std::string where = loaded.source.Where("data.tokenizer");
  auto tokenizer = data::Tokenizer::Load(spec.data().tokenizer());
  if (!tokenizer.ok()) {
    return {absl::StrCat("data.tokenizer: ", tokenizer.status().message(), " (", where, ")")};
  }
  std::vector<std::string> problems;
  if ((*tokenizer)->vocab_size() > spec.llm().model().vocab()) {
    problems.push_back(absl::StrCat(
        "llm.model.vocab: =", spec.llm().model().vocab(), " is smaller than the tokenizer's ",
        (*tokenizer)->vocab_size(), " pieces (", spec.data().tokenizer(), ") (",
        loaded.source.Where("llm.model.vocab"), ")"));
  }
  if (!(*tokenizer)->PieceId(spec.data().image_token()).has_value()) {
    problems.push_back(absl::StrCat("data.image_token: '", spec.data().image_token(),
                                    "' is not a piece of the tokenizer ", spec.data().tokenizer(),
                                    " (", loaded.source.Where("data.image_token"), ")"));
  }
  return problems;
}

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
    // A synthetic data set's tokenizer is made for the config before a run, unless the data set
    // is already there: then the run uses it as it is, and so is it checked.
    const absl::StatusOr<bool> present = data::SyntheticDatasetPresent(loaded->spec);
    const bool generated_for_the_run =
        loaded->spec.data().synth().samples() > 0 && !(present.ok() && *present);
    if (load.check_files && !generated_for_the_run) {
      if (std::vector<std::string> problems = TokenizerProblems(*loaded); !problems.empty()) {
        std::cerr << "hetpar: invalid config " << options->config << ":\n";
        for (const std::string& problem : problems) std::cerr << problem << "\n";
        *exit_code = kExitInvalidInput;
        return;
      }
    }
    std::cout << config::RunSpecToYaml(loaded->spec);
    *exit_code = kExitOk;
  });
}

}  // namespace

HETPAR_REGISTER_COMMAND(10, AddValidateCommand);

}  // namespace hetpar::cli
