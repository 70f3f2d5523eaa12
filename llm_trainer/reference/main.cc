// `hetpar-reference`: the tools that run both models in one process (normally started by `hetpar
// run`):
//   train     the single-process reference trainer at tp = 1, dp = 1 (the parity baseline)
//   evaluate  validation metrics of a run's saved model (<out>/model), written to <out>/eval.json
//   export    a checkpoint's full parameters as two .hpar files
//   convert   Hugging Face checkpoints in (from-hf) and out (to-hf)   (`hetpar convert` runs it)
//   score     log-probabilities of token sequences under a model      (`hetpar score` runs it)
#include <ATen/Parallel.h>

#include <algorithm>
#include <fstream>
#include <iostream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/numbers.h"
#include "common/cli_checks.h"
#include "common/config/config.h"
#include "common/logging.h"
#include "common/status.h"
#include "common/version.h"
#include "llm_trainer/hf/hf_convert.h"
#include "llm_trainer/hf/score.h"
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
      ->check(hetpar::kNonNegativeNumber);
}

// Exit code of a failed tool: 2 for input the user must fix, 1 otherwise.
int ExitCodeOf(const absl::Status& status) {
  return absl::IsInvalidArgument(status) || absl::IsNotFound(status) ? kExitInvalidInput
                                                                     : kExitFailure;
}

int RunHfCommand(const hetpar::hf::ImportOptions* import_options,
                 const std::pair<std::string, std::string>& export_dirs,
                 const hetpar::hf::ScoreOptions* score_options) {
  if (import_options != nullptr) {
    hetpar::SetLogTag("from-hf");
    auto imported = hetpar::hf::ImportFromHf(*import_options);
    if (!imported.ok()) {
      HETPAR_LOG(ERROR) << "import failed (nothing written): "
                        << hetpar::StatusText(imported.status());
      return ExitCodeOf(imported.status());
    }
    for (const std::string& note : imported->notes) HETPAR_LOG(INFO) << "note: " << note;
    for (const std::string& file : imported->written) HETPAR_LOG(INFO) << "wrote " << file;
    return 0;
  }
  if (!export_dirs.first.empty()) {
    hetpar::SetLogTag("to-hf");
    auto exported = hetpar::hf::ExportToHf(export_dirs.first, export_dirs.second);
    if (!exported.ok()) {
      HETPAR_LOG(ERROR) << "export failed: " << hetpar::StatusText(exported.status());
      return ExitCodeOf(exported.status());
    }
    for (const std::string& note : exported->notes) HETPAR_LOG(INFO) << "note: " << note;
    for (const std::string& file : exported->written) HETPAR_LOG(INFO) << "wrote " << file;
    return 0;
  }
  hetpar::SetLogTag("score");
  if (absl::Status status = hetpar::hf::Score(*score_options); !status.ok()) {
    HETPAR_LOG(ERROR) << "score failed: " << hetpar::StatusText(status);
    return ExitCodeOf(status);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"hetpar-reference: both modules in one process (normally started by `hetpar run`)"};
  // `hetpar convert` and `hetpar score` run this binary with argv[0] "hetpar": its usage names
  // the command the user typed.
  app.name(argc > 0 && std::string(argv[0]) == "hetpar" ? "hetpar" : "hetpar-reference");
  app.set_version_flag("--version", std::string("hetpar-reference ") + HETPAR_VERSION);
  app.require_subcommand(1);
  Flags flags;
  CLI::App* train = app.add_subcommand(
      "train", "Train the RunSpec at tp = 1, dp = 1 in this process (the parity baseline)");
  AddCommonFlags(train, &flags);
  train->add_option("--out", flags.out_dir, "Run directory (default: run.out_dir of the config)");
  train->add_option("--steps", flags.steps, "Steps to train (default: run.steps)")
      ->check(hetpar::kPositiveNumber);
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
  hetpar::hf::ImportOptions import_options;
  std::string model_dir;
  std::string hf_out;
  CLI::App* convert = app.add_subcommand(
      "convert", "Convert Hugging Face checkpoints to hetpar parameter files and back");
  convert->require_subcommand(1);
  CLI::App* from_hf = convert->add_subcommand(
      "from-hf",
      "Import a Llama-architecture decoder (and a SigLIP vision tower) from Hugging Face "
      "directories (config.json + *.safetensors): writes llm.hpar, encoder.hpar and model.yaml");
  from_hf->add_option("--llm", import_options.llm_dir, "Hugging Face LLM directory")->required();
  from_hf->add_option("--encoder", import_options.encoder_dir,
                      "Hugging Face SigLIP vision model directory (optional)");
  from_hf->add_option("--projector", import_options.projector,
                      "safetensors file with the projector (multi_modal_projector.linear_{1,2}; "
                      "default: a fresh projector)");
  from_hf->add_option("--out", import_options.out_dir, "Directory to write")->required();
  from_hf
      ->add_option("--seq-len", import_options.seq_len,
                   "llm.model.seq_len to write (default: min(max_position_embeddings, 4096))")
      ->check(hetpar::kNonNegativeNumber);
  from_hf->add_option("--seed", import_options.seed, "Seed of a fresh projector (default 1234)");
  from_hf
      ->add_option(
          "--vision-feature-layer", import_options.vision_feature_layer,
          "With --encoder: LLaVA's vision_feature_layer, the tower's hidden state the projector "
          "reads "
          "(-2: the next-to-last layer's output; 1..L or -L..-1; without post_layernorm). The "
          "tower is "
          "imported up to it, with encoder.model.no_final_norm (default: the last layer after "
          "post_layernorm)")
      ->check(CLI::Validator(
          [](std::string& input) -> std::string {
            int64_t layer = 0;
            if (!absl::SimpleAtoi(input, &layer) || layer != 0) return "";
            // 0 is also the option's default (hetpar's own tower): given, it is refused.
            return input +
                   " names the embeddings, which feed no layer: give a layer, 1..L or -L..-1 "
                   "(LLaVA 1.5: -2)";
          },
          "a layer, not 0"));
  CLI::App* to_hf = convert->add_subcommand(
      "to-hf",
      "Export a model (from-hf's output or a run's model/ directory) as Hugging Face "
      "directories: <out>/llm (LlamaForCausalLM), <out>/vision (SiglipVisionModel), "
      "<out>/projector.safetensors");
  to_hf->add_option("--model", model_dir, "Model directory")->required();
  to_hf->add_option("--out", hf_out, "Directory to write")->required();
  hetpar::hf::ScoreOptions score_options;
  CLI::App* score =
      app.add_subcommand("score",
                         "Log-probability of each next token of each {\"tokens\": [...]} line (one "
                         "{\"logprobs\": [...]} line out per line in)");
  score->add_option("--model", score_options.model_dir, "Model directory")->required();
  score->add_option("--tokens", score_options.tokens_path, "Input JSONL file")->required();
  score->add_option("--out", score_options.out_path, "Output JSONL file (default: stdout)");
  score->add_option("--dtype", score_options.dtype, "float32 (default) or float64")
      ->check(CLI::IsMember({"float32", "float64"}));
  score->add_option("--tp", score_options.tp, "Tensor-parallel ranks (threads; default 1)")
      ->check(hetpar::kPositiveNumber);
  score->add_option("--micro-batch", score_options.micro_batch, "Sequences per forward (default 8)")
      ->check(hetpar::kPositiveNumber);
  score->add_option("--threads", flags.threads, "Intra-op threads (default: the machine's cores)")
      ->check(hetpar::kNonNegativeNumber);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : kExitInvalidInput;
  }

  if (convert->parsed() || score->parsed()) {
    at::set_num_threads(flags.threads > 0
                            ? flags.threads
                            : static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
    return RunHfCommand(
        from_hf->parsed() ? &import_options : nullptr,
        to_hf->parsed() ? std::make_pair(model_dir, hf_out) : std::pair<std::string, std::string>(),
        score->parsed() ? &score_options : nullptr);
  }
  hetpar::config::LoadOptions load;
  load.overrides = flags.overrides;
  if (flags.steps > 0) {
    // Errors about it name the flag the user gave.
    load.AddFlagOverride("run.steps=" + std::to_string(flags.steps),
                         "--steps " + std::to_string(flags.steps));
  }
  // The evaluation of a finished run needs no checkpoint it may have started from.
  load.resume = !evaluate->parsed();
  if (evaluate->parsed() || export_command->parsed()) {
    // Their parameters all come from the model files or the checkpoint: the files the run
    // started from (init_from) may be gone.
    for (const char* cleared : {"encoder.init_from=\"\"", "llm.init_from=\"\""}) {
      load.AddFlagOverride(cleared, "cleared: the model's files or checkpoint hold it");
    }
  }
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
      HETPAR_LOG(ERROR) << "export failed: " << hetpar::StatusText(status);
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
      HETPAR_LOG(ERROR) << "evaluation failed: " << hetpar::StatusText(line.status());
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
    HETPAR_LOG(ERROR) << "reference run failed: " << hetpar::StatusText(status);
    return kExitFailure;
  }
  HETPAR_LOG(INFO) << "run directory: " << options.out_dir;
  return 0;
}
