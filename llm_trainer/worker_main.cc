// `hetpar-worker`: one process of a hetpar run. The role says which:
//   encoder     one rank of the encoder pool, driven by the coordinator
//   llm         one rank of the LLM cluster, driven by the coordinator
//   colocated   one rank of both modules (placement: colocated), driven by the coordinator
//   reference   both modules in one process at tp = 1, dp = 1 (the parity baseline)
//   evaluate    validation metrics of a run's saved model (<out>/model), written to <out>/eval.json
#include <ATen/Parallel.h>

#include <fstream>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "common/config/config.h"
#include "common/logging.h"
#include "common/version.h"
#include "coordinator/security.h"
#include "llm_trainer/reference_trainer.h"
#include "llm_trainer/worker.h"

namespace {

constexpr int kExitFailure = 1;
constexpr int kExitInvalidInput = 2;

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"hetpar-worker: one process of a hetpar run (normally started by `hetpar run`)."};
  app.name("hetpar-worker");
  app.set_version_flag("--version", std::string("hetpar-worker ") + HETPAR_VERSION);
  std::string role;
  std::string config_path;
  std::vector<std::string> overrides;
  std::string out_dir;
  int64_t steps = 0;
  int threads = 0;
  bool progress = false;
  std::string coordinator_address = "127.0.0.1:50051";
  std::string token_file;
  int64_t rank = -1;
  std::string host = "127.0.0.1";
  double timeout_s = 300;
  app.add_option("--role", role,
                 "What this process runs: encoder, llm, colocated, reference or evaluate")
      ->required()
      ->check(CLI::IsMember({"encoder", "llm", "colocated", "reference", "evaluate"}));
  app.add_option("-c,--config", config_path, "RunSpec YAML file (reference role)");
  app.add_option("--coordinator", coordinator_address,
                 "Coordinator address (encoder and llm roles)")
      ->capture_default_str();
  app.add_option("--token-file", token_file,
                 "File holding the run token (default: the HETPAR_TOKEN environment variable)");
  app.add_option("--rank", rank, "Rank to take in the role's module (default: the next free one)");
  app.add_option("--host", host, "Address this worker's data plane and process groups use")
      ->capture_default_str();
  app.add_option("--timeout", timeout_s,
                 "Seconds any wait for peers or the coordinator may last before the worker fails")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--set", overrides, "Override a RunSpec field, e.g. --set run.steps=5");
  app.add_option("--out", out_dir, "Run directory (default: run.out_dir of the config)");
  app.add_option("--steps", steps, "Steps to train (default: run.steps)")
      ->check(CLI::PositiveNumber);
  app.add_option("--threads", threads,
                 "Intra-op threads (default: the machine's cores divided among local workers)")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--progress", progress, "Log one progress line per step");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : kExitInvalidInput;
  }

  at::set_num_threads(
      threads > 0 ? threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  if (role == "encoder" || role == "llm" || role == "colocated") {
    hetpar::SetLogTag(role);
    auto token = hetpar::coordinator::ResolveToken(token_file, "");
    if (!token.ok()) {
      std::cerr << "hetpar-worker: " << token.status().message() << "\n";
      return kExitInvalidInput;
    }
    hetpar::worker::WorkerOptions options;
    options.role = role == "encoder" ? hetpar::worker::Role::kEncoder
                   : role == "llm"   ? hetpar::worker::Role::kLlm
                                     : hetpar::worker::Role::kColocated;
    options.coordinator = coordinator_address;
    options.token = token->value;
    options.requested_rank = rank;
    options.out_dir = out_dir;
    options.host = host;
    options.timeout = absl::Seconds(timeout_s);
    absl::Status status = hetpar::worker::RunWorker(options);
    if (!status.ok()) {
      HETPAR_LOG(ERROR) << role << " worker failed: " << status;
      return kExitFailure;
    }
    return 0;
  }
  if (config_path.empty()) {
    std::cerr << "hetpar-worker: --role " << role << " needs --config FILE\n";
    return kExitInvalidInput;
  }
  if (steps > 0) overrides.push_back("run.steps=" + std::to_string(steps));
  auto loaded = hetpar::config::LoadRunSpecFile(config_path, {overrides, true});
  if (!loaded.ok()) {
    std::cerr << "hetpar-worker: invalid config " << config_path << ":\n"
              << loaded.status().message() << "\n";
    return kExitInvalidInput;
  }
  const hetpar::v1::RunSpec& spec = loaded->spec;
  at::set_num_threads(
      threads > 0 ? threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  hetpar::SetLogTag(role);

  if (role == "evaluate") {
    if (out_dir.empty()) {
      std::cerr << "hetpar-worker: --role evaluate needs --out RUN_DIR (with model/ inside)\n";
      return kExitInvalidInput;
    }
    auto line = hetpar::llm::EvaluateSavedModel(spec, out_dir + "/model", spec.run().steps());
    if (!line.ok()) {
      HETPAR_LOG(ERROR) << "evaluation failed: " << line.status();
      return kExitFailure;
    }
    std::ofstream(out_dir + "/eval.json") << *line << "\n";
    HETPAR_LOG(INFO) << "validation: " << *line;
    return 0;
  }
  hetpar::llm::ReferenceOptions options;
  options.out_dir = out_dir.empty() ? spec.run().out_dir() : out_dir;
  options.progress = progress;
  absl::Status status = hetpar::llm::RunReference(spec, options);
  if (!status.ok()) {
    HETPAR_LOG(ERROR) << "reference run failed: " << status;
    return kExitFailure;
  }
  HETPAR_LOG(INFO) << "run directory: " << options.out_dir;
  return 0;
}
