#include "common/worker/worker_main.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <iostream>
#include <thread>

#include "CLI/CLI.hpp"
#include "common/control/security.h"
#include "common/logging.h"
#include "common/status.h"
#include "common/version.h"
#include "common/worker/outputs.h"
#include "common/worker/step_driver.h"

namespace hetpar::worker {
namespace {

constexpr int kExitFailure = 1;
constexpr int kExitInvalidInput = 2;

absl::Status Serve(const WorkerOptions& options, const ModuleFactory& factory) {
  HETPAR_ASSIGN_OR_RETURN(std::unique_ptr<WorkerContext> context,
                          WorkerContext::Bootstrap(options));
  HETPAR_ASSIGN_OR_RETURN(std::unique_ptr<ModuleRuntime> modules, factory(*context));
  SessionChannel channel(&context->session());
  StepDriverOptions driver_options;
  driver_options.timeout = options.timeout;
  const int64_t world_rank = context->world_rank();
  driver_options.on_applied = [&](int64_t step, const std::vector<ModuleTimings>& timings) {
    for (const ModuleTimings& t : timings) {
      if (absl::Status s = AppendStepTimings(options.out_dir, world_rank, step, t); !s.ok()) {
        HETPAR_LOG(WARNING) << "step timings not written: " << s;
      }
    }
  };
  StepDriver driver(&channel, modules.get(), driver_options);
  HETPAR_RETURN_IF_ERROR(driver.Run());
  HETPAR_LOG(INFO) << driver.steps_applied() << " steps applied, " << driver.steps_discarded()
                   << " discarded";
  HETPAR_RETURN_IF_ERROR(modules->WriteOutputs(options.out_dir, world_rank));
  return context->Close(absl::Seconds(10));
}

}  // namespace

int WorkerMain(int argc, char** argv, const WorkerBinary& binary, const ModuleFactory& factory) {
  CLI::App app{binary.description};
  app.name(binary.name);
  app.set_version_flag("--version", binary.name + " " + HETPAR_VERSION);
  WorkerOptions options;
  options.role = binary.role;
  std::string token_file;
  int threads = 0;
  double timeout_s = absl::ToDoubleSeconds(options.timeout);
  bool colocated = false;
  app.add_option("--coordinator", options.coordinator, "Coordinator address (host:port)")
      ->capture_default_str();
  app.add_option("--token-file", token_file,
                 "File holding the run token (default: the HETPAR_TOKEN environment variable)");
  app.add_option("--rank", options.requested_rank,
                 "Rank to take in the module's grid (default: the next free one)");
  app.add_option("--host", options.host,
                 "Address this worker's data plane and process groups listen on and advertise")
      ->capture_default_str();
  app.add_option("--timeout", timeout_s,
                 "Seconds any wait for peers or the coordinator may last before the worker fails")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--out", options.out_dir,
                 "Run directory for step timings, parameter sums and model files (default: none)");
  app.add_option("--threads", threads, "Intra-op threads (default: the machine's cores)")
      ->check(CLI::NonNegativeNumber);
  if (binary.offers_colocated) {
    app.add_flag(
        "--colocated", colocated,
        "Also host the encoder's layout on this rank (the RunSpec's placement: colocated)");
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : kExitInvalidInput;
  }
  if (colocated) options.role = Role::kColocated;
  options.timeout = absl::Seconds(timeout_s);
  at::set_num_threads(
      threads > 0 ? threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  SetLogTag(RoleName(options.role));
  auto token = coordinator::ResolveToken(token_file, "");
  if (!token.ok()) {
    std::cerr << binary.name << ": " << token.status().message() << "\n";
    return kExitInvalidInput;
  }
  options.token = token->value;
  if (absl::Status status = Serve(options, factory); !status.ok()) {
    HETPAR_LOG(ERROR) << RoleName(options.role) << " worker failed: " << status;
    return kExitFailure;
  }
  return 0;
}

}  // namespace hetpar::worker
