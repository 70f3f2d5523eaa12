// `hetpar coordinator`: run the coordinator of one run until it is done or failed.
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <iostream>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/checkpoint_pin.h"
#include "common/cli_checks.h"
#include "common/config/config.h"
#include "common/control/security.h"
#include "common/logging.h"
#include "common/run_directory.h"
#include "common/trace/recorder.h"
#include "coordinator/cli/commands.h"
#include "coordinator/cli/step_metrics.h"
#include "coordinator/journal.h"
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
  double step_timeout_s = 0;  // 0: failure.step_timeout_s
  double stop_timeout_s = 10;
  bool synthetic_batches = false;
  std::string out;
  bool linger = false;
  std::string metrics_listen;
  int eval_threads = 0;
  double log_every_s = 0;  // also a progress line once this many seconds passed
};

// A coordinator restarted on a run directory continues the run journaled there only with the
// same config (the coordinator's own section aside: its addresses may change).
absl::Status SameRun(const coordinator::Journal& lost, const v1::RunSpec& spec,
                     const std::string& out_dir) {
  const std::string restart_hint =
      absl::StrCat("use another --out, or remove ", coordinator::JournalPath(out_dir),
                   " to start a new run there");
  if (lost.run != spec.run().name()) {
    return absl::FailedPreconditionError(
        absl::StrCat("run directory ", out_dir, " holds the journal of the unfinished run '",
                     lost.run, "'; this config trains '", spec.run().name(), "': ", restart_hint));
  }
  config::LoadOptions recorded_options;
  recorded_options.resume = false;
  recorded_options.check_files = false;  // compared only: files the run started from may be gone
  absl::StatusOr<config::LoadedRunSpec> recorded =
      config::LoadRunSpecFile(out_dir + "/config.yaml", recorded_options);
  if (!recorded.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot continue run '", lost.run, "': its recorded config ", out_dir,
                     "/config.yaml does not load: ", recorded.status().message()));
  }
  v1::RunSpec a = recorded->spec;
  v1::RunSpec b = spec;
  a.clear_coordinator();
  b.clear_coordinator();
  b.mutable_checkpoint()->clear_resume_from();
  if (config::RunSpecToYaml(a) != config::RunSpecToYaml(b)) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot continue run '", lost.run,
                     "': this config differs from the one it was started with (", out_dir,
                     "/config.yaml) outside the coordinator section; ", restart_hint));
  }
  return absl::OkStatus();
}

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
  // Errors about these name the flag the user gave, not a --set.
  if (!flags.out.empty()) {
    load.AddFlagOverride(absl::StrCat("run.out_dir=", flags.out), "--out " + flags.out);
  }
  if (!flags.metrics_listen.empty()) {
    load.AddFlagOverride(absl::StrCat("coordinator.metrics_listen=", flags.metrics_listen),
                         "--metrics-listen " + flags.metrics_listen);
  }
  absl::StatusOr<config::LoadedRunSpec> loaded = config::LoadRunSpecFile(flags.config, load);
  // A run continued from its journal needs not the checkpoint it was first resumed from, which
  // checkpoint.keep may have pruned since: the journal says where the run started. Nor the
  // init_from files it started from, when a checkpoint of its own is left (checked below).
  std::optional<int64_t> journaled_start;
  std::string new_run_error;  // why the config does not load as a new run, when it does not
  if (!loaded.ok()) {
    new_run_error = std::string(loaded.status().message());
    config::LoadOptions without = load;
    without.resume = false;
    without.check_init_from = false;
    absl::StatusOr<config::LoadedRunSpec> bare = config::LoadRunSpecFile(flags.config, without);
    if (bare.ok()) {
      absl::StatusOr<std::optional<coordinator::Journal>> lost =
          coordinator::ReadJournal(bare->spec.run().out_dir());
      if (lost.ok() && lost->has_value() && (*lost)->Unfinished() && (*lost)->first_step >= 0) {
        HETPAR_LOG(WARNING) << "continuing run " << bare->spec.run().name()
                            << " from its journal, which says it started at step "
                            << (*lost)->first_step << "; its config does not load as a new run ("
                            << loaded.status().message() << ")";
        journaled_start = (*lost)->first_step;
        loaded = std::move(bare);
      }
    }
  }
  if (!loaded.ok()) {
    std::cerr << "hetpar: invalid config " << flags.config << ":\n"
              << loaded.status().message() << "\n";
    return kExitInvalidInput;
  }
  const v1::RunSpec& spec = loaded->spec;
  const std::string out_dir = spec.run().out_dir();

  // A journal of an unfinished run in the run directory: its coordinator was lost; continue the
  // run from the newest complete checkpoint (coordinator/journal.h).
  absl::StatusOr<std::optional<coordinator::Journal>> previous = coordinator::ReadJournal(out_dir);
  if (!previous.ok()) {
    std::cerr << "hetpar: " << previous.status().message()
              << " (remove it to start the run over)\n";
    return kExitFailure;
  }
  coordinator::Journal journal;
  journal.run = spec.run().name();
  journal.total_steps = spec.run().steps();
  journal.checkpoint_dir = spec.checkpoint().dir();
  v1::RunSpec run_spec = spec;  // what the coordinator trains: `spec`, or its continuation
  int64_t first_step = journaled_start.value_or(0);
  if (!spec.checkpoint().resume_from().empty()) {
    absl::StatusOr<config::CheckpointSummary> resume =
        config::ReadCheckpointSummary(spec.checkpoint().resume_from());
    if (resume.ok()) first_step = resume->step;
  }
  journal.first_step = first_step;
  const bool restarted = previous->has_value() && (*previous)->Unfinished();
  // Held until this coordinator ends, before anything reads checkpoint.dir: no other live run
  // writes there (a coordinator lost mid-run no longer holds it). A continued run's directory is
  // not created: one out of reach now is refused below.
  absl::StatusOr<std::unique_ptr<DirectoryLock>> checkpoint_claim =
      coordinator::ClaimCheckpointDir(spec, /*create=*/!restarted);
  if (!checkpoint_claim.ok()) {
    std::cerr << "hetpar: " << checkpoint_claim.status().message() << "\n";
    return absl::IsFailedPrecondition(checkpoint_claim.status()) ? kExitInvalidInput : kExitFailure;
  }
  const int64_t run_first_step = first_step;  // where the run itself started
  if (restarted) {
    const coordinator::Journal& lost = **previous;
    if (absl::Status same = SameRun(lost, spec, out_dir); !same.ok()) {
      std::cerr << "hetpar: " << same.message() << "\n";
      return kExitInvalidInput;
    }
    journal.generation = lost.generation + 1;
    journal.restarts = lost.restarts + 1;
    journal.foreign_checkpoints = lost.foreign_checkpoints;
    // Kept until a commit finds a newer one: a restart lost before its first commit still knows
    // the checkpoint the run had (the refusal below relies on it).
    journal.last_checkpoint = lost.last_checkpoint;
    journal.last_checkpoint_step = lost.last_checkpoint_step;
    // The lost coordinator wrote metrics.jsonl a little behind the commits, and the workers
    // complete a step's checkpoint right after its commit: the newest checkpoint can be past the
    // last line written. Resume from the newest checkpoint that the lines reach, so that the
    // steps without a line are trained again and get theirs. That may be the checkpoint of the
    // run's last step (the coordinator was lost while it gathered the outputs, every line
    // written): nothing is left to train, and the workers write the outputs from it.
    const int64_t recorded_to = RunDirectory::StepAfterLastLine(out_dir, first_step);
    // Only this run's own checkpoints: the directory may also hold those of a run it resumed
    // from, at steps this run does not write again.
    // Nor those of a run of the same name that this one resumed from, which went further.
    std::optional<coordinator::FoundCheckpoint> newest = coordinator::NewestCompleteCheckpoint(
        spec.checkpoint().dir(), recorded_to, spec.run().name(), lost.foreign_checkpoints);
    const std::optional<coordinator::FoundCheckpoint> newer = coordinator::NewestCompleteCheckpoint(
        spec.checkpoint().dir(), spec.run().steps(), spec.run().name(), lost.foreign_checkpoints);
    if (newer.has_value() && newer->step > recorded_to) {
      if (newest.has_value() && newest->step >= first_step) {
        HETPAR_LOG(INFO) << "resuming at step " << newest->step << " rather than from the newer "
                         << newer->path << ": " << out_dir << "/metrics.jsonl has no line for "
                         << "step " << recorded_to << ", so steps " << newest->step << " to "
                         << newer->step - 1 << " are trained again";
      } else {
        // No checkpoint from the run's first step to the end of its lines is left
        // (checkpoint.keep): resuming from the newest one leaves the gap.
        HETPAR_LOG(WARNING) << out_dir << "/metrics.jsonl has no lines for steps " << recorded_to
                            << " to " << newer->step - 1 << " and no checkpoint of a step from "
                            << first_step << " to " << recorded_to << " is left; resuming from "
                            << newer->path << ", so those steps' lines stay missing";
        newest = newer;
      }
    }
    if ((!newer.has_value() || newer->step <= first_step) &&
        lost.last_checkpoint_step > first_step) {
      // The lost coordinator saw a checkpoint past the run's start complete, and none can be
      // read now (a file system not mounted or not answering, checkpoints removed): going on
      // would train the run again from its start and drop metrics.jsonl's lines after it.
      std::cerr << "hetpar: cannot continue run " << spec.run().name() << ": its journal ("
                << coordinator::JournalPath(out_dir) << ") records the complete checkpoint "
                << lost.last_checkpoint << " (step " << lost.last_checkpoint_step
                << "), but no complete checkpoint of this run from step " << first_step + 1
                << " on can be read in checkpoint.dir '" << spec.checkpoint().dir()
                << "' now; check that it is mounted and readable, then start the coordinator "
                   "again (going on would train the run again from step "
                << first_step << ")\n";
      return kExitFailure;
    }
    if (journaled_start.has_value() && first_step == 0 &&
        (!newest.has_value() || newest->step <= 0)) {
      // No checkpoint of the run is left, and it would start over: from its config, which must
      // then load as that of a new run (init_from's files among others).
      std::cerr << "hetpar: cannot continue run " << spec.run().name() << ": no complete "
                << "checkpoint of it is in checkpoint.dir '" << spec.checkpoint().dir()
                << "', so it would start over, and its config does not load as a new run:\n"
                << new_run_error << "\n";
      return kExitInvalidInput;
    }
    if (journaled_start.has_value() && (!newest.has_value() || newest->step <= first_step)) {
      // The checkpoint the run started from is gone, and no later one of its own is left.
      std::cerr << "hetpar: cannot continue run " << spec.run().name() << ": it started at step "
                << first_step << " from a checkpoint that cannot be read now, and no later "
                << "complete checkpoint of it is in checkpoint.dir '" << spec.checkpoint().dir()
                << "'\n";
      return kExitFailure;
    }
    if (newest.has_value() && newest->step > first_step) {
      config::LoadOptions resume = load;
      resume.AddFlagOverride(
          absl::StrCat("checkpoint.resume_from=", newest->path),
          absl::StrCat("the newest checkpoint of checkpoint.dir, ", newest->path));
      resume.resume_at_end = true;  // a checkpoint of the last step: only the outputs are left
      absl::StatusOr<config::LoadedRunSpec> continued =
          config::LoadRunSpecFile(flags.config, resume);
      if (!continued.ok()) {
        std::cerr << "hetpar: cannot continue run " << spec.run().name() << " from " << newest->path
                  << ":\n"
                  << continued.status().message() << "\n";
        return kExitInvalidInput;
      }
      run_spec = continued->spec;
      first_step = newest->step;
    }
    // How the recorded run ended: its coordinator lost mid-run, the run failed, or stopped.
    const char* ended = lost.state == v1::RUN_STATE_FAILED ? "when it failed"
                        : lost.state == v1::RUN_STATE_DONE ? "when it was stopped"
                                                           : "when its coordinator was lost";
    std::cout << "hetpar coordinator: continuing run " << spec.run().name() << " from its journal ("
              << lost.committed_steps << " of " << lost.total_steps << " steps were committed "
              << ended << ", generation " << lost.generation << "): "
              << (first_step > 0 ? absl::StrCat("resuming at step ", first_step, " from ",
                                                run_spec.checkpoint().resume_from())
                                 : std::string("no checkpoint to resume from; starting over"))
              << std::endl;
  }
  if (!restarted) {
    if (absl::Status s = coordinator::CheckCheckpointDirForNewRun(run_spec); !s.ok()) {
      std::cerr << "hetpar: " << s.message() << "\n";
      return kExitInvalidInput;
    }
    // Resumed in a directory whose run went further (the same run.name, from an earlier
    // checkpoint): those later checkpoints are not this run's, should its coordinator be lost
    // before it writes its own.
    journal.foreign_checkpoints =
        coordinator::CompleteCheckpointsAfter(spec.checkpoint().dir(), first_step);
  }
  journal.committed_steps = first_step;
  // A restart holds the checkpoint it resumes from against the pruning of the workers of the
  // coordinator it replaces, which may still be completing a later checkpoint
  // (common/checkpoint_pin.h), until its first commit; the pins an earlier coordinator of this
  // checkpoint.dir left go.
  bool pinned = false;
  const auto unpin = [&] {
    if (!pinned) return;
    pinned = false;
    if (absl::Status s = UnpinCheckpoints(spec.checkpoint().dir()); !s.ok()) {
      HETPAR_LOG(WARNING) << s.message() << " (a pinned checkpoint is not pruned)";
    }
  };
  // A start that fails after the pin (the checkpoint gone, a token, the server) lets go too.
  absl::Cleanup unpin_at_exit = unpin;
  if (!spec.checkpoint().dir().empty()) {
    const std::string& from = run_spec.checkpoint().resume_from();
    // The step directory's parent, however either path is written (a trailing slash, a link).
    std::error_code error;
    const std::filesystem::path step = std::filesystem::weakly_canonical(from, error);
    const bool in_dir =
        !from.empty() && !error &&
        std::filesystem::equivalent(step.parent_path(), spec.checkpoint().dir(), error) && !error;
    const std::string pin = restarted && in_dir ? from : "";
    if (!pin.empty()) {
      absl::Status s = PinCheckpoint(
          pin, absl::StrCat("hetpar coordinator of run ", spec.run().name(), ", generation ",
                            journal.generation, ", pid ", ::getpid()));
      pinned = true;  // a pin written in part, too, goes at the first commit
      if (s.ok()) {
        s = config::ReadCheckpointSummary(pin).status();
        // Pinned, and then taken out of sight by a pruner before this read: the pruner puts it
        // back on seeing the pin; this puts it back first, or in its place if it was killed.
        if (absl::IsNotFound(s)) {
          absl::StatusOr<bool> back = PutBackPinnedCheckpoint(step.string());
          if (back.ok() && *back) {
            HETPAR_LOG(INFO) << pin << " was being pruned as it was pinned; it is back";
            s = config::ReadCheckpointSummary(pin).status();
          } else if (!back.ok()) {
            HETPAR_LOG(WARNING) << back.status().message();
          }
        }
      }
      // Pruned between the pick and the pin by a worker of the lost coordinator, which completed
      // a later checkpoint meanwhile: that one is there now for the next start to pick.
      if (!s.ok() && (absl::IsNotFound(s) || absl::IsDataLoss(s))) {
        std::cerr << "hetpar: cannot continue run " << spec.run().name() << " from " << pin
                  << ": it was removed as this coordinator picked it (a worker of the lost "
                  << "coordinator completed a later checkpoint and pruned the older ones, "
                  << "checkpoint.keep): start the coordinator again, and it continues from the "
                  << "newest (" << s.message() << ")\n";
        return kExitFailure;
      }
      if (!s.ok()) {
        HETPAR_LOG(WARNING) << "pinning " << pin << ": " << s.message()
                            << "; a worker of the lost coordinator that completes a later "
                            << "checkpoint may prune it before this run has read it";
      }
    }
    // The pin kept is the step directory's, named as it is (not as a link to it may be).
    if (absl::Status s =
            UnpinCheckpoints(spec.checkpoint().dir(), pin.empty() ? "" : step.string());
        !s.ok()) {
      HETPAR_LOG(WARNING) << s.message();
    }
  }

  coordinator::ServerOptions options;
  options.listen_address = flags.listen.empty() ? spec.coordinator().listen() : flags.listen;
  options.tls = flags.tls;
  options.controller.step_timeout = absl::Seconds(flags.step_timeout_s);
  options.controller.keep_committed_steps = true;  // metrics.jsonl has a line for every step
  options.controller.stop_timeout = absl::Seconds(flags.stop_timeout_s);
  options.controller.initial_generation = journal.generation;
  options.controller.continues_lost_run = restarted;
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
      coordinator::MakeStepPlanner(run_spec, flags.synthetic_batches, /*opened=*/nullptr,
                                   // The lost coordinator's committed steps are this run's.
                                   restarted ? run_first_step : -1);
  if (!planner.ok()) {
    std::cerr << "hetpar: cannot plan steps for " << flags.config << ": "
              << planner.status().message() << "\n";
    return kExitInvalidInput;
  }

  // The run directory, once the checks above passed (a start refused for a bad token or config
  // leaves no journal to continue): the normalised config and one metrics.jsonl line per
  // committed step, and at the end the workers' outputs, the final parameter line and the
  // evaluation.
  absl::StatusOr<std::unique_ptr<RunDirectory>> run_dir =
      restarted ? RunDirectory::Continue(out_dir, spec, first_step)
                : RunDirectory::Create(out_dir, spec);
  if (!run_dir.ok()) {
    std::cerr << "hetpar: " << run_dir.status().message() << "\n";
    return kExitFailure;
  }
  ClearRunOutputs(out_dir);
  if (absl::Status s = coordinator::WriteJournal(out_dir, journal); !s.ok()) {
    std::cerr << "hetpar: " << s.message() << "\n";
    return kExitFailure;
  }

  // A fresh run whose coordinator cannot start leaves no journal either: there is no run to
  // continue, and a journal would hold the next start to this config.
  const auto forget_fresh_run = [&] {
    if (!restarted) ::unlink(coordinator::JournalPath(out_dir).c_str());
  };

  // Signals are taken by one thread with sigwait; block them before gRPC starts its threads.
  // SIGUSR1 only wakes that thread when the run is over.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGUSR1);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  absl::StatusOr<std::unique_ptr<coordinator::CoordinatorServer>> server =
      coordinator::CoordinatorServer::Create(run_spec, options, *std::move(planner));
  if (!server.ok()) {
    std::cerr << "hetpar: cannot start the coordinator: " << server.status().message() << "\n";
    forget_fresh_run();
    return kExitFailure;
  }
  std::string token_path;
  if (generated_token) {
    token_path = coordinator::LocalTokenPath((*server)->port());
    if (absl::Status s = coordinator::WriteLocalTokenFile(token_path, options.token); !s.ok()) {
      std::cerr << "hetpar: " << s.message()
                << " (set a run token with --token-file or HETPAR_TOKEN instead)\n";
      (*server)->Shutdown(absl::Seconds(2));
      forget_fresh_run();
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
      forget_fresh_run();
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

  // A progress line in the log every run.log_every steps: on a cluster, the coordinator's log is
  // where the run's progress is read (kubectl logs, the Slurm job's output).
  ProgressLine progress(spec.run().steps(), first_step, spec.run().log_every(), flags.log_every_s,
                        /*tty=*/false, absl::Now(), stderr);
  StepMetricsWriter metrics(
      run_dir->get(), spec.run().peak_tflops(),
      [&progress](const v1::StepTiming& t) { progress.Committed(t, absl::Now()); }, first_step);
  std::string outputs_failure;
  v1::RunState state = v1::RUN_STATE_WAITING;
  bool metrics_failed = false;
  bool journal_failed = false;
  // The journal follows the run: rewritten when a step commits or the generation or state
  // changes.
  auto follow_journal = [&](const v1::StatusResponse& status, v1::RunState run_state) {
    coordinator::Journal next = journal;
    next.state = run_state;
    next.generation = status.generation();
    next.committed_steps = status.committed_steps();
    // Every worker has read the resumed checkpoint once a step of this run commits.
    if (status.committed_steps() > first_step) unpin();
    if (next.committed_steps != journal.committed_steps || run_state != journal.state) {
      if (std::optional<coordinator::FoundCheckpoint> newest =
              coordinator::NewestCompleteCheckpoint(
                  spec.checkpoint().dir(), std::numeric_limits<int64_t>::max(), spec.run().name(),
                  journal.foreign_checkpoints)) {
        next.last_checkpoint = newest->path;
        next.last_checkpoint_step = newest->step;
      }
    }
    if (next == journal) return;
    if (absl::Status s = coordinator::WriteJournal(out_dir, next); !s.ok()) {
      if (!journal_failed) HETPAR_LOG(ERROR) << "journal: " << s.message();
      journal_failed = true;
      return;
    }
    journal = next;
  };
  while (state != v1::RUN_STATE_DONE && state != v1::RUN_STATE_FAILED) {
    state = (*server)->WaitForEnd(absl::Milliseconds(200));
    // In this order: a pool change the status shows as recovered has its step among those taken.
    const v1::StatusResponse status = (*server)->Status();
    const std::vector<v1::StepTiming> committed = (*server)->TakeCommittedSteps();
    if (absl::Status s = metrics.Follow(status, committed); !s.ok() && !metrics_failed) {
      HETPAR_LOG(ERROR) << "metrics.jsonl: " << s.message();
      metrics_failed = true;
    }
    // Done only once the run directory is complete (below): a coordinator lost before then
    // continues the run.
    follow_journal(status, state == v1::RUN_STATE_DONE ? v1::RUN_STATE_STOPPING : status.state());
  }
  const v1::StatusResponse final_status = (*server)->Status();
  const std::vector<v1::StepTiming> last_committed = (*server)->TakeCommittedSteps();
  if (absl::Status s = metrics.Follow(final_status, last_committed); !s.ok() && !metrics_failed) {
    HETPAR_LOG(ERROR) << "metrics.jsonl: " << s.message();
  }
  if (absl::Status s = metrics.WriteLedger(final_status); !s.ok()) {
    HETPAR_LOG(ERROR) << "metrics.jsonl: " << s.message();
  }
  // The workers sent their parameter sums and model files before closing their sessions.
  if (state == v1::RUN_STATE_DONE) {
    const std::vector<std::string> cut = (*server)->CutAtStop();
    // A coordinator's machine may lack what the model computes on (a CPU-only pod of a GPU
    // run): an evaluation that fails there leaves the trained run done, and says how to
    // evaluate it elsewhere.
    std::string evaluation_error;
    if (absl::Status s =
            FinishRunDirectory(**run_dir, spec, flags.eval_threads, nullptr, &evaluation_error);
        absl::IsNotFound(s) && cut.empty()) {
      // Workers that send no outputs (e.g. simulated ones): the run itself is done.
      HETPAR_LOG(WARNING) << "no final outputs: " << s.message();
    } else if (!s.ok()) {
      if (!cut.empty()) {
        s = absl::Status(s.code(), absl::StrCat(s.message(), " (the stop's deadline ended the "
                                                "sessions of ", absl::StrJoin(cut, ", "),
                                                " before they had sent them)"));
      }
      HETPAR_LOG(ERROR) << "the run's outputs are incomplete: " << s.message();
      state = v1::RUN_STATE_FAILED;
      outputs_failure = std::string(s.message());
    } else if (!evaluation_error.empty()) {
      HETPAR_LOG(ERROR) << "the run is done, but " << evaluation_error;
    }
  }
  // The workers wrote the outputs (from the pinned checkpoint itself, when it was of the last
  // step), or are gone.
  unpin();
  // Done with every step committed and the run directory complete: a coordinator started on it
  // later starts a new run. Stopped early or failed: it continues this one.
  follow_journal(final_status, state);
  if (flags.linger) {
    // Under a Deployment an exit would restart the coordinator into a new run: keep answering
    // `hetpar status` with the final state until the pod is deleted.
    const bool stopped_early = final_status.committed_steps() < final_status.total_steps();
    std::cout << "hetpar coordinator: run " << spec.run().name() << " "
              << (state != v1::RUN_STATE_DONE ? "failed"
                  : stopped_early
                      ? absl::StrCat("stopped after ", final_status.committed_steps(), " of ",
                                     final_status.total_steps(), " steps")
                      : std::string("done"))
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
  if (final_status.committed_steps() < final_status.total_steps()) {
    // Stopped before its last step (hetpar stop, a signal): not done, and said so.
    std::cout << "hetpar coordinator: run " << spec.run().name() << " stopped after "
              << final_status.committed_steps() << " of " << final_status.total_steps()
              << " steps (" << final_status.state_message() << "); "
              << (spec.checkpoint().dir().empty()
                      ? "without checkpoint.dir, a coordinator started again on it starts over"
                      : absl::StrCat("start the coordinator again on ", out_dir,
                                     " to continue it from its newest checkpoint"))
              << "; metrics in " << spec.run().out_dir() << "/metrics.jsonl" << std::endl;
    return kExitOk;
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
                   "File with the run token (default: $HETPAR_TOKEN_FILE, then the token in "
                   "$HETPAR_TOKEN, coordinator.token_file, "
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
                   "Seconds a step attempt may take before it is aborted (default: "
                   "failure.step_timeout_s)")
      ->check(hetpar::kPositiveNumber);
  command
      ->add_option("--stop-timeout", flags->stop_timeout_s,
                   "Seconds to wait for workers to close their sessions after stop")
      ->check(hetpar::kPositiveNumber);
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
      ->check(hetpar::kNonNegativeNumber);
  command
      ->add_option("--log-every-seconds", flags->log_every_s,
                   "Also print a progress line once this many seconds have passed since the last "
                   "(besides every run.log_every steps and the last step)")
      ->envname("HETPAR_LOG_EVERY_SECONDS")
      ->check(hetpar::kNonNegativeNumber);
  command->add_flag("--synthetic-batches", flags->synthetic_batches,
                    "Plan steps over seeded synthetic samples instead of the data index");
  command->callback([flags, exit_code] { *exit_code = RunCoordinator(*flags); });
}

}  // namespace

HETPAR_REGISTER_COMMAND(20, AddCoordinatorCommand);

}  // namespace hetpar::cli
