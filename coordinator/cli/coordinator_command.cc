// `hetpar coordinator`: run the coordinator of one run until it is done or failed.
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <filesystem>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/config/config.h"
#include "common/control/security.h"
#include "common/logging.h"
#include "common/run_directory.h"
#include "common/trace/recorder.h"
#include "coordinator/cli/commands.h"
#include "coordinator/cli/step_metrics.h"
#include "coordinator/membership.h"
#include "coordinator/metrics_exporter.h"
#include "coordinator/run_controller.h"
#include "coordinator/server.h"
#include "coordinator/step_planner.h"
#include "nlohmann/json.hpp"

namespace hetpar::cli {
namespace {

struct CoordinatorFlags {
  std::string config;
  std::vector<std::string> overrides;
  std::string listen;
  std::string token_file;
  coordinator::ServerTlsOptions tls;
  double step_timeout_s = 600;
  double stop_timeout_s = 10;
  bool synthetic_batches = false;
  std::string out;
  bool linger = false;
  std::string metrics_listen;
  int eval_threads = 0;
};

// Who-expects-what line: "4 workers (2 encoder, 2 llm)".
std::string ExpectedWorkers(const v1::RunSpec& spec) {
  absl::StatusOr<coordinator::Membership> membership = coordinator::Membership::Create(spec);
  if (!membership.ok()) return "?";
  if (membership->placement() == v1::PLACEMENT_COLOCATED) {
    return absl::StrCat(membership->expected_workers(), " colocated workers");
  }
  return absl::StrCat(membership->expected_workers(), " workers (",
                      membership->encoder_grid().size(), " encoder, ",
                      membership->llm_grid().size(), " llm)");
}

int RunCoordinator(const CoordinatorFlags& flags) {
  SetLogTag("coordinator");
  // absl's lock-order graph is a debugging aid that costs the coordinator a few percent of a
  // core at 1024 workers; the tests keep it on.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  config::LoadOptions load;
  load.overrides = flags.overrides;
  if (!flags.out.empty()) load.overrides.push_back(absl::StrCat("run.out_dir=", flags.out));
  if (!flags.metrics_listen.empty()) {
    load.overrides.push_back(absl::StrCat("coordinator.metrics_listen=", flags.metrics_listen));
  }
  absl::StatusOr<config::LoadedRunSpec> loaded = config::LoadRunSpecFile(flags.config, load);
  if (!loaded.ok()) {
    std::cerr << "hetpar: invalid config " << flags.config << ":\n"
              << loaded.status().message() << "\n";
    return kExitInvalidInput;
  }
  const v1::RunSpec& spec = loaded->spec;

  // The run directory: the normalised config and one metrics.jsonl line per committed step, and
  // at the end the workers' outputs, the final parameter line and the evaluation.
  absl::StatusOr<std::unique_ptr<RunDirectory>> run_dir =
      RunDirectory::Create(spec.run().out_dir(), spec);
  if (!run_dir.ok()) {
    std::cerr << "hetpar: " << run_dir.status().message() << "\n";
    return kExitFailure;
  }
  ClearRunOutputs(spec.run().out_dir());

  coordinator::ServerOptions options;
  options.listen_address = flags.listen.empty() ? spec.coordinator().listen() : flags.listen;
  options.tls = flags.tls;
  options.controller.step_timeout = absl::Seconds(flags.step_timeout_s);
  options.controller.stop_timeout = absl::Seconds(flags.stop_timeout_s);
  bool generated_token = false;
  absl::StatusOr<coordinator::RunToken> token =
      coordinator::ResolveToken(flags.token_file, spec.coordinator().token_file());
  if (!token.ok() && absl::IsNotFound(token.status())) {
    absl::StatusOr<std::string> fresh = coordinator::GenerateToken();
    if (!fresh.ok()) {
      std::cerr << "hetpar: " << fresh.status().message() << "\n";
      return kExitFailure;
    }
    token = coordinator::RunToken{*fresh, "generated"};
    generated_token = true;
  }
  if (!token.ok()) {
    std::cerr << "hetpar: " << token.status().message() << "\n";
    return kExitInvalidInput;
  }
  options.token = token->value;

  absl::StatusOr<std::unique_ptr<coordinator::StepPlanner>> planner =
      coordinator::MakeStepPlanner(spec, flags.synthetic_batches);
  if (!planner.ok()) {
    std::cerr << "hetpar: cannot plan steps for " << flags.config << ": "
              << planner.status().message() << "\n";
    return kExitInvalidInput;
  }

  // Signals are taken by one thread with sigwait; block them before gRPC starts its threads.
  // SIGUSR1 only wakes that thread when the run is over.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGUSR1);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  absl::StatusOr<std::unique_ptr<coordinator::CoordinatorServer>> server =
      coordinator::CoordinatorServer::Create(spec, options, *std::move(planner));
  if (!server.ok()) {
    std::cerr << "hetpar: cannot start the coordinator: " << server.status().message() << "\n";
    return kExitFailure;
  }
  std::string token_path;
  if (generated_token) {
    token_path = coordinator::LocalTokenPath((*server)->port());
    if (absl::Status s = coordinator::WriteLocalTokenFile(token_path, options.token); !s.ok()) {
      std::cerr << "hetpar: " << s.message()
                << " (set a run token with --token-file or HETPAR_TOKEN instead)\n";
      return kExitFailure;
    }
    HETPAR_LOG(INFO) << "run token: generated, in " << token_path
                     << " (readable by this user only)";
  } else {
    HETPAR_LOG(INFO) << "run token from " << token->origin;
  }
  std::cout << "hetpar coordinator: run " << spec.run().name() << " listening on "
            << (*server)->address() << (options.tls.enabled() ? " (TLS)" : "") << "; waiting for "
            << ExpectedWorkers(spec) << std::endl;

  coordinator::CoordinatorServer* raw = server->get();
  std::unique_ptr<coordinator::MetricsExporter> exporter;
  if (const std::string& listen = spec.coordinator().metrics_listen(); !listen.empty()) {
    absl::StatusOr<std::unique_ptr<coordinator::MetricsExporter>> started =
        coordinator::MetricsExporter::Start(listen, [raw] { return raw->Status(); });
    if (!started.ok()) {
      std::cerr << "hetpar: coordinator.metrics_listen: " << started.status().message() << "\n";
      raw->Shutdown(absl::Seconds(2));
      return kExitFailure;
    }
    exporter = *std::move(started);
    std::cout << "hetpar coordinator: Prometheus metrics at " << exporter->url() << std::endl;
  }
  std::thread signal_thread([raw, signals] {
    int signal = 0;
    if (sigwait(&signals, &signal) != 0) return;
    if (signal == SIGUSR1) return;  // woken to exit
    HETPAR_LOG(WARNING) << "received " << (signal == SIGINT ? "SIGINT" : "SIGTERM")
                        << ": stopping the run";
    // SIGTERM (a scheduler ending the job): the step in flight commits with a checkpoint first
    // when the run writes checkpoints.
    raw->Stop(signal == SIGINT ? "interrupted" : "terminated", /*checkpoint=*/signal == SIGTERM);
  });

  StepMetricsWriter metrics(run_dir->get(), spec.run().peak_tflops());
  std::string outputs_failure;
  v1::RunState state = v1::RUN_STATE_WAITING;
  bool metrics_failed = false;
  while (state != v1::RUN_STATE_DONE && state != v1::RUN_STATE_FAILED) {
    state = (*server)->WaitForEnd(absl::Milliseconds(200));
    if (absl::Status s = metrics.Follow((*server)->Status()); !s.ok() && !metrics_failed) {
      HETPAR_LOG(ERROR) << "metrics.jsonl: " << s.message();
      metrics_failed = true;
    }
  }
  const v1::StatusResponse final_status = (*server)->Status();
  // The workers sent their parameter sums and model files before closing their sessions.
  if (state == v1::RUN_STATE_DONE) {
    if (absl::Status s = FinishRunDirectory(**run_dir, spec, flags.eval_threads, nullptr);
        absl::IsNotFound(s)) {
      // Workers that send no outputs (e.g. simulated ones): the run itself is done.
      HETPAR_LOG(WARNING) << "no final outputs: " << s.message();
    } else if (!s.ok()) {
      HETPAR_LOG(ERROR) << "the run's outputs are incomplete: " << s.message();
      state = v1::RUN_STATE_FAILED;
      outputs_failure = std::string(s.message());
    }
  }
  if (flags.linger) {
    // Under a Deployment an exit would restart the coordinator into a new run: keep answering
    // `hetpar status` with the final state until the pod is deleted.
    std::cout << "hetpar coordinator: run " << spec.run().name() << " "
              << (state == v1::RUN_STATE_DONE ? "done" : "failed")
              << "; serving its status until terminated (SIGTERM)" << std::endl;
    signal_thread.join();
  } else {
    // Let a `hetpar stop --wait` or `hetpar status` see the final state before the port closes.
    absl::SleepFor(absl::Milliseconds(500));
  }
  exporter.reset();
  (*server)->Shutdown(absl::Seconds(2));
  if (!token_path.empty()) ::unlink(token_path.c_str());
  if (!flags.linger) {
    pthread_kill(signal_thread.native_handle(), SIGUSR1);
    signal_thread.join();
  }

  if (state == v1::RUN_STATE_FAILED) {
    std::cerr << "hetpar: run " << spec.run().name() << " failed: "
              << (outputs_failure.empty() ? final_status.state_message() : outputs_failure) << "\n";
    return kExitFailure;
  }
  std::cout << "hetpar coordinator: run " << spec.run().name()
            << " done: " << final_status.state_message() << " (" << final_status.committed_steps()
            << "/" << final_status.total_steps() << " steps committed); metrics in "
            << spec.run().out_dir() << "/metrics.jsonl" << std::endl;
  return kExitOk;
}

void AddCoordinatorCommand(CLI::App& app, int* exit_code) {
  auto flags = std::make_shared<CoordinatorFlags>();
  CLI::App* command = app.add_subcommand(
      "coordinator",
      "Run the coordinator of a run: admit workers into the ranks of the config's layouts, host "
      "the rendezvous store, plan and commit steps; exit 0 when the run is done, 1 when it fails");
  command->add_option("-c,--config", flags->config, "RunSpec YAML file")
      ->envname("HETPAR_CONFIG")
      ->required();
  command->add_option(
      "--set", flags->overrides,
      "Override a field, e.g. --set coordinator.heartbeat_timeout_s=5 (repeatable)");
  command
      ->add_option("--metrics-listen", flags->metrics_listen,
                   "host:port to serve Prometheus metrics on at /metrics (default: "
                   "coordinator.metrics_listen; port 0 picks one)")
      ->envname("HETPAR_METRICS_LISTEN");
  command
      ->add_option("--listen", flags->listen,
                   "host:port to listen on (default: coordinator.listen; port 0 picks one)")
      ->envname("HETPAR_LISTEN");
  command
      ->add_option("--token-file", flags->token_file,
                   "File with the run token (default: $HETPAR_TOKEN, coordinator.token_file, "
                   "else a generated token kept in the per-user runtime directory)")
      ->envname(coordinator::kTokenFileEnvVar);
  command->add_option("--tls-cert", flags->tls.cert_file, "PEM server certificate; enables TLS")
      ->envname("HETPAR_TLS_CERT");
  command->add_option("--tls-key", flags->tls.key_file, "PEM key of --tls-cert")
      ->envname("HETPAR_TLS_KEY");
  command
      ->add_option("--tls-client-ca", flags->tls.client_ca_file,
                   "PEM CA; clients must present a certificate it signed (mutual TLS)")
      ->envname("HETPAR_TLS_CLIENT_CA");
  command
      ->add_option("--step-timeout", flags->step_timeout_s,
                   "Seconds a step may take before it is aborted")
      ->check(CLI::PositiveNumber);
  command
      ->add_option("--stop-timeout", flags->stop_timeout_s,
                   "Seconds to wait for workers to close their sessions after stop")
      ->check(CLI::PositiveNumber);
  command
      ->add_option("--out", flags->out,
                   "Run directory: config.yaml, metrics.jsonl, the workers' outputs (model/, their "
                   "parameter sums) and the evaluation (default: run.out_dir)")
      ->envname("HETPAR_OUT");
  command
      ->add_flag("--linger", flags->linger,
                 "When the run ends, keep serving its status until terminated instead of exiting "
                 "(for a Kubernetes Deployment, which would restart it)")
      ->envname("HETPAR_LINGER");
  command
      ->add_option("--eval-threads", flags->eval_threads,
                   "Intra-op threads of the evaluation at the end of the run (default: the "
                   "machine's cores)")
      ->envname("HETPAR_EVAL_THREADS")
      ->check(CLI::NonNegativeNumber);
  command->add_flag("--synthetic-batches", flags->synthetic_batches,
                    "Plan steps over seeded synthetic samples instead of the data index");
  command->callback([flags, exit_code] { *exit_code = RunCoordinator(*flags); });
}

}  // namespace

HETPAR_REGISTER_COMMAND(20, AddCoordinatorCommand);

}  // namespace hetpar::cli
