// `hetpar run`: train a RunSpec on this machine. Starts the coordinator in this process, spawns
// the encoder pool as `hetpar-encoder` processes and the LLM ranks as `hetpar-llm` processes
// (colocated: `hetpar-llm --colocated`, each a rank of both modules), shows progress, writes the
// run directory, forwards Ctrl-C as a clean stop, and ends every process it started.
//
// `--reference` trains the same batches in one process at tp = 1, dp = 1 instead (the parity
// baseline; compare the two with `hetpar compare`).
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/checkpoint_pin.h"
#include "common/cli_checks.h"
#include "common/config/config.h"
#include "common/control/security.h"
#include "common/data/batch_source.h"
#include "common/logging.h"
#include "common/run_directory.h"
#include "common/status.h"
#include "common/trace/recorder.h"
#include "common/transport/nccl/loopback.h"
#include "coordinator/cli/commands.h"
#include "coordinator/cli/local_process.h"
#include "coordinator/cli/step_metrics.h"
#include "coordinator/journal.h"
#include "coordinator/membership.h"
#include "coordinator/metrics_exporter.h"
#include "coordinator/server.h"
#include "coordinator/step_planner.h"
#include "nlohmann/json.hpp"

namespace hetpar::cli {
namespace {

// The GPUs this machine shows its workers: CUDA_VISIBLE_DEVICES's entries when it is set, else
// the GPU device nodes this process can open (/dev/nvidia<N>: a container given some of the
// machine's GPUs has only theirs, or may open only theirs, and CUDA numbers those from 0), else
// the NVIDIA driver's list (/proc/driver/nvidia/gpus, every GPU of the machine), else 1.
int64_t VisibleGpus() {
  if (const char* visible = std::getenv("CUDA_VISIBLE_DEVICES")) {
    const std::vector<std::string> ids = absl::StrSplit(visible, ',', absl::SkipEmpty());
    return std::max<int64_t>(1, static_cast<int64_t>(ids.size()));
  }
  std::error_code error;
  int64_t nodes = 0;
  for (auto it = std::filesystem::directory_iterator("/dev", error);
       !error && it != std::filesystem::directory_iterator(); it.increment(error)) {
    const std::string name = it->path().filename().string();
    if (name.size() > 6 && name.rfind("nvidia", 0) == 0 &&
        name.find_first_not_of("0123456789", 6) == std::string::npos) {
      const int fd = ::open(it->path().c_str(), O_RDWR | O_CLOEXEC);
      if (fd >= 0) {
        ::close(fd);
        ++nodes;
      }
    }
  }
  if (nodes > 0) return nodes;
  int64_t gpus = 0;
  error.clear();
  for (auto it = std::filesystem::directory_iterator("/proc/driver/nvidia/gpus", error);
       !error && it != std::filesystem::directory_iterator(); it.increment(error)) {
    ++gpus;
  }
  return std::max<int64_t>(1, gpus);
}

struct RunFlags {
  std::string config;
  std::vector<std::string> overrides;
  int64_t steps = 0;
  std::string out;
  std::string resume;  // a checkpoint to continue from (checkpoint.resume_from)
  bool reference = false;
  int threads = 0;
  std::string listen = "127.0.0.1:0";
  bool listen_given = false;  // --listen on the command line
  double step_timeout_s = 0;  // 0: failure.step_timeout_s
  std::string trace;          // FIRST:LAST of steps to record a timeline of
  double log_every_s = 0;     // in a log, also a progress line once this many seconds passed
  // Encoder workers started in place of ones that died while the run trained, at most.
  int replace_workers = 0;
  // Each worker an NCCL host of its own (NCCL_HOSTID), so that ranks of one NCCL group may share
  // a GPU: checking a multi-rank layout on a machine with fewer GPUs.
  bool nccl_host_per_worker = false;
};

volatile sig_atomic_t g_interrupted = 0;
volatile sig_atomic_t g_signals = 0;  // how many came: a second one ends the workers at once
// Set while the data set is generated or indexed, which this process does before any worker
// starts and which runs to its end: a first signal says so, a second ends the process at once.
// Nothing half-written is then taken as complete: every file of the data set and its index is
// written to a temporary name and renamed, the manifests after the images and the tokenizer (an
// index missing is built at the next start), and the run directory is not taken yet.
volatile sig_atomic_t g_preparing_data = 0;
void SayFromHandler(const char* text) {
  (void)!::write(STDERR_FILENO, text, std::strlen(text));  // async-signal-safe, unlike std::cerr
}
void OnSignal(int signal) {  // SIGINT or SIGTERM
  g_interrupted = signal;
  if (g_signals < 2) g_signals = g_signals + 1;
  if (!g_preparing_data) return;
  if (g_signals == 1) {
    SayFromHandler(
        "\nhetpar run: signalled while the data set is prepared; it stops once that is done, "
        "before any worker starts (signal again to end at once)\n");
  } else {
    SayFromHandler(
        "\nhetpar run: signalled again while the data set is prepared: ended at once; nothing "
        "was trained; what was not finished is done again on the next start\n");
    ::_exit(130);
  }
}

absl::StatusOr<config::LoadedRunSpec> LoadSpec(const RunFlags& flags) {
  config::LoadOptions load;
  load.overrides = flags.overrides;
  // Errors about these name the flag the user gave, not a --set.
  if (flags.steps > 0) {
    load.AddFlagOverride(absl::StrCat("run.steps=", flags.steps),
                         absl::StrCat("--steps ", flags.steps));
  }
  if (!flags.out.empty()) {
    load.AddFlagOverride(absl::StrCat("run.out_dir=", flags.out), "--out " + flags.out);
  }
  if (!flags.resume.empty()) {
    load.AddFlagOverride(absl::StrCat("checkpoint.resume_from=", flags.resume),
                         "--resume " + flags.resume);
  }
  return config::LoadRunSpecFile(flags.config, load);
}

int RunReferenceProcess(const RunFlags& flags, const v1::RunSpec& spec) {
  // Without --out the reference goes beside the run it checks, not over it: runs/tiny and
  // runs/tiny-reference, which `hetpar compare` takes.
  std::string out_dir = spec.run().out_dir();
  if (flags.out.empty()) {
    while (out_dir.size() > 1 && out_dir.back() == '/') out_dir.pop_back();  // runs/tiny/
    out_dir += "-reference";
  }
  std::vector<std::string> argv = {WorkerBinary("hetpar-reference"),
                                   "train",
                                   "--config",
                                   flags.config,
                                   "--out",
                                   out_dir,
                                   "--progress"};
  for (const auto& o : flags.overrides) {
    argv.push_back("--set");
    argv.push_back(o);
  }
  if (flags.steps > 0) argv.insert(argv.end(), {"--steps", std::to_string(flags.steps)});
  if (flags.threads > 0) argv.insert(argv.end(), {"--threads", std::to_string(flags.threads)});
  std::error_code ec;
  std::filesystem::create_directories(out_dir + "/log", ec);
  auto process = LocalProcess::Spawn("reference", argv, {}, out_dir + "/log/reference.log");
  if (!process.ok()) {
    std::cerr << "hetpar run: " << process.status().message() << "\n";
    return kExitFailure;
  }
  std::cerr << "hetpar run: reference trainer (pid " << (*process)->pid() << "), log "
            << (*process)->log_path() << "\n";
  // Each signal is passed on once: SIGTERM, and SIGKILL for a second one, which ends a run's
  // workers at once too.
  int passed_on = 0;
  while (!(*process)->Poll().has_value()) {
    if (g_signals > passed_on) {
      passed_on = g_signals;
      if (passed_on >= 2) {
        std::cerr << "\nhetpar run: signalled again: the reference trainer is killed\n";
      }
      (*process)->Signal(passed_on >= 2 ? SIGKILL : SIGTERM);
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
  const int code = *(*process)->Poll();
  if (code != 0 && g_interrupted) {
    // The trainer ended by the signal hetpar passed on (or by the terminal's own SIGINT).
    std::cerr << "hetpar run: the reference run stopped ("
              << (g_interrupted == SIGTERM ? "terminated" : "interrupted")
              << ") before its last step; its log: " << (*process)->log_path() << "\n";
    return 130;
  }
  if (code != 0) {
    std::cerr << "hetpar run: the reference trainer failed (exit " << code << "):\n"
              << (*process)->LogTail(15);
    return kExitFailure;
  }
  std::cerr << (*process)->LogTail(3);
  std::cout << "hetpar run: done; run directory " << out_dir << "\n";
  return kExitOk;
}

// The validation summary a user reads at the end of a run.
void PrintEvaluation(const std::string& eval_line) {
  nlohmann::json j = nlohmann::json::parse(eval_line, nullptr, false);
  if (j.is_discarded() || !j.contains("eval")) return;
  const nlohmann::json& e = j["eval"];
  auto accuracy = [&](const char* pass, const char* metric) {
    return e.contains(pass) && e[pass].contains(metric) ? e[pass][metric].get<double>() : 0.0;
  };
  std::cout << absl::StrFormat(
      "validation (%d samples): caption token accuracy %.3f with images, %.3f with blank images "
      "(text-only baseline): %+.3f from the images\n",
      e.value("samples", 0), accuracy("with_images", "caption_token_accuracy"),
      accuracy("blank_images", "caption_token_accuracy"),
      accuracy("with_images", "caption_token_accuracy") -
          accuracy("blank_images", "caption_token_accuracy"));
  for (const char* attribute : {"colour", "shape", "position", "size"}) {
    const std::string key = absl::StrCat(attribute, "_accuracy");
    std::cout << absl::StrFormat("  %-8s %.3f with images, %.3f blank\n", attribute,
                                 accuracy("with_images", key.c_str()),
                                 accuracy("blank_images", key.c_str()));
  }
}

int RunDistributed(const RunFlags& flags, const v1::RunSpec& spec) {
  const std::string out_dir = spec.run().out_dir();
  const bool colocated = spec.placement() == v1::PLACEMENT_COLOCATED;
  // Held until the run ends: no other live run writes into checkpoint.dir.
  absl::StatusOr<std::unique_ptr<DirectoryLock>> checkpoint_claim =
      coordinator::ClaimCheckpointDir(spec);
  if (!checkpoint_claim.ok()) {
    std::cerr << "hetpar run: " << checkpoint_claim.status().message() << "\n";
    return absl::IsFailedPrecondition(checkpoint_claim.status()) ? kExitInvalidInput : kExitFailure;
  }
  if (absl::Status s = coordinator::CheckCheckpointDirForNewRun(spec); !s.ok()) {
    std::cerr << "hetpar run: " << s.message() << "\n";
    return kExitInvalidInput;
  }
  // No earlier coordinator of this checkpoint.dir is live (the claim): its pins hold nothing now
  // and would keep their checkpoints from ever being pruned (common/checkpoint_pin.h).
  if (!spec.checkpoint().dir().empty()) {
    if (absl::Status s = UnpinCheckpoints(spec.checkpoint().dir()); !s.ok()) {
      HETPAR_LOG(WARNING) << s.message();
    }
  }
  int64_t first_step = 0;  // a resumed run starts at its checkpoint's step
  std::optional<config::CheckpointSummary> resumed;
  if (!spec.checkpoint().resume_from().empty()) {
    absl::StatusOr<config::CheckpointSummary> resume =
        config::ReadCheckpointSummary(spec.checkpoint().resume_from());
    if (resume.ok()) {
      first_step = resume->step;
      resumed = *std::move(resume);
    }
  }
  // Resumed in a directory whose run went further: its later checkpoints are not this run's to
  // continue from (below, the stopped run's "continue it with --resume").
  const std::vector<coordinator::CheckpointWrite> foreign =
      spec.checkpoint().resume_from().empty()
          ? std::vector<coordinator::CheckpointWrite>()
          : coordinator::CompleteCheckpointsAfter(spec.checkpoint().dir(), first_step);
  // The data set first (generated when the spec asks for a synthetic one), so no worker races
  // to write it.
  g_preparing_data = 1;
  if (g_interrupted) {
    // Signalled before the preparation began (the handler said nothing then).
    std::cerr << "hetpar run: " << (g_interrupted == SIGTERM ? "terminated" : "interrupted")
              << " before the run started; nothing was trained\n";
    return 130;
  }
  auto batches = data::BatchSource::Create(spec);
  g_preparing_data = 0;
  if (!batches.ok()) {
    std::cerr << "hetpar run: cannot open the training data: " << batches.status().message()
              << "\n";
    return kExitInvalidInput;
  }
  if (g_interrupted) {
    // During the data set's generation or indexing, which runs to its end: no worker starts.
    std::cerr << "hetpar run: " << (g_interrupted == SIGTERM ? "terminated" : "interrupted")
              << " before the run started; nothing was trained\n";
    return 130;
  }
  if (resumed.has_value()) {
    // Before any worker starts: a data index that changed mid-epoch cannot continue the order.
    const absl::StatusOr<std::optional<data::SamplerCursor>> cursor = coordinator::ResumeCursor(
        spec, *resumed, static_cast<int64_t>((*batches)->index().records.size()),
        (*batches)->index().IdDigest());
    if (!cursor.ok()) {
      std::cerr << "hetpar run: " << cursor.status().message() << "\n";
      return kExitInvalidInput;
    }
  }

  // The run's token: coordinator.token_file's where the config names one (then `hetpar status`
  // and workers elsewhere can hold it beforehand), else a fresh one.
  absl::StatusOr<std::string> token;
  if (const std::string& file = spec.coordinator().token_file(); !file.empty()) {
    absl::StatusOr<coordinator::RunToken> read = coordinator::ReadTokenFile(file);
    if (!read.ok()) {
      std::cerr << "hetpar run: coordinator.token_file: " << read.status().message() << "\n";
      return kExitInvalidInput;
    }
    token = read->value;
  } else {
    token = coordinator::GenerateToken();
  }
  if (!token.ok()) {
    std::cerr << "hetpar run: " << token.status().message() << "\n";
    return kExitFailure;
  }
  coordinator::ServerOptions options;
  options.listen_address = flags.listen;
  options.token = *token;
  options.controller.step_timeout = absl::Seconds(flags.step_timeout_s);
  options.controller.keep_committed_steps = true;  // metrics.jsonl has a line for every step
  // The coordinator plans over the data set opened above instead of reading it again.
  auto planner = coordinator::MakeStepPlanner(spec, /*synthetic=*/false, *std::move(batches));
  if (!planner.ok()) {
    std::cerr << "hetpar run: cannot plan steps: " << planner.status().message() << "\n";
    return kExitInvalidInput;
  }
  auto server = coordinator::CoordinatorServer::Create(spec, options, *std::move(planner));
  if (!server.ok()) {
    std::cerr << "hetpar run: cannot start the coordinator: " << server.status().message() << "\n";
    return kExitFailure;
  }
  std::unique_ptr<coordinator::MetricsExporter> exporter;
  if (const std::string& listen = spec.coordinator().metrics_listen(); !listen.empty()) {
    coordinator::CoordinatorServer* raw = server->get();
    auto started = coordinator::MetricsExporter::Start(listen, [raw] { return raw->Status(); });
    if (!started.ok()) {
      std::cerr << "hetpar run: coordinator.metrics_listen: " << started.status().message() << "\n";
      (*server)->Shutdown(absl::Seconds(2));
      return kExitFailure;
    }
    exporter = *std::move(started);
    std::cerr << "hetpar run: Prometheus metrics at " << exporter->url() << "\n";
  }

  const size_t colon = flags.listen.rfind(':');
  std::cerr << "hetpar run: coordinator at "
            << (colon == std::string::npos ? "port " : flags.listen.substr(0, colon + 1))
            << (*server)->port() << " (hetpar status --coordinator ADDR)\n";

  const int64_t encoder_ranks = spec.encoder().layout().dp() * spec.encoder().layout().tp();
  const auto& ll = spec.llm().layout();
  const int64_t llm_ranks = ll.dp() * ll.tp() * ll.cp() * ll.pp();
  // Colocated: every process is a rank of both modules (the layouts cover the same ranks).
  const int64_t workers = colocated ? encoder_ranks : encoder_ranks + llm_ranks;
  const int threads =
      flags.threads > 0
          ? flags.threads
          : static_cast<int>(std::max<int64_t>(1, std::thread::hardware_concurrency() / workers));
  // `hetpar status` and `hetpar scale --coordinator ADDR` of this user find the run's token.
  const std::string token_path = coordinator::LocalTokenPath((*server)->port());
  if (absl::Status s = coordinator::WriteLocalTokenFile(token_path, *token); !s.ok()) {
    std::cerr << "hetpar run: " << s.message() << "\n";
    (*server)->Stop("the run token could not be written");
    return kExitFailure;
  }
  struct RemoveToken {
    std::string path;
    ~RemoveToken() { ::unlink(path.c_str()); }
  } remove_token{token_path};
  std::vector<std::unique_ptr<LocalProcess>> processes;
  const std::map<std::string, std::string> env = {{"HETPAR_TOKEN", *token}};
  // The encoder pool's ranks start with the run's first encoder.initial_replicas replicas; the
  // others are started when the pool grows (the loop below).
  const int64_t encoder_tp = spec.encoder().layout().tp();
  const int64_t initial_encoder_ranks =
      colocated || spec.encoder().initial_replicas() <= 0
          ? encoder_ranks
          : std::min(encoder_ranks, spec.encoder().initial_replicas() * encoder_tp);
  // The newest process of each worker (by its index: encoder ranks, then LLM ranks), and how many
  // each has had.
  std::map<int64_t, LocalProcess*> process_of;
  std::map<int64_t, int> starts;
  // run.device cuda: worker i computes on GPU i mod the visible GPUs (a module group's ranks
  // need distinct GPUs: NCCL refuses two on one).
  const int64_t gpus = spec.run().device() == "cuda" ? VisibleGpus() : 0;
  if (gpus > 0) {
    std::cerr << "hetpar run: " << workers << " workers on " << gpus
              << " GPU(s), worker i on GPU i mod " << gpus << "\n";
  }
  // NCCL refuses two ranks on one GPU, and every boundary pair is an NCCL communicator.
  if (spec.transport() == v1::TRANSPORT_KIND_NCCL && workers > gpus) {
    std::cerr << "hetpar run: transport: nccl needs a GPU per worker process, and this run "
                 "starts "
              << workers << " workers on " << gpus
              << " visible GPU(s) (NCCL refuses two ranks on one GPU); use transport: ucx, which "
                 "moves CUDA memory between processes on one GPU by CUDA IPC\n";
    return kExitInvalidInput;
  }
  // Every refusal above leaves the run directory as it was (a refused resume keeps the run it
  // resumes); from here it is this run's, and no other process's (RunDirectory's lock).
  auto run_dir = RunDirectory::Create(out_dir, spec);
  if (!run_dir.ok()) {
    std::cerr << "hetpar run: " << run_dir.status().message() << "\n";
    (*server)->Shutdown(absl::Seconds(2));
    return absl::IsFailedPrecondition(run_dir.status()) ? kExitInvalidInput : kExitFailure;
  }
  ClearRunOutputs(out_dir);
  auto spawn = [&](int64_t i, const std::string& name) -> absl::Status {
    const bool encoder = i < encoder_ranks;
    const int64_t rank = encoder ? i : i - encoder_ranks;
    std::vector<std::string> argv = {
        WorkerBinary(encoder && !colocated ? "hetpar-encoder" : "hetpar-llm"), "--coordinator",
        (*server)->address(), "--rank", std::to_string(rank), "--out", out_dir, "--threads",
        std::to_string(threads),
        // The coordinator lives in this process: a worker that lost it has nothing to wait for.
        "--reconnect-timeout", "0"};
    if (colocated) argv.push_back("--colocated");
    if (!flags.trace.empty()) argv.insert(argv.end(), {"--trace", flags.trace});
    if (gpus > 0) argv.insert(argv.end(), {"--cuda-device", std::to_string(i % gpus)});
    std::map<std::string, std::string> worker_env = env;
    if (flags.nccl_host_per_worker) {
      // NCCL refuses two ranks of one host on one GPU; told they are hosts of their own, it
      // joins them over its socket transport on loopback.
      worker_env["NCCL_HOSTID"] = absl::StrCat("hetpar-", ::getpid(), "-worker-", i);
      for (const auto& [variable, value] : transport::nccl::kLoopbackEnvironment) {
        if (std::getenv(variable) == nullptr) worker_env[variable] = value;
      }
    }
    LocalProcess::Options spawn_options;
    spawn_options.own_group = true;
    spawn_options.drop_hetpar_env = true;
    auto process =
        LocalProcess::Spawn(name, argv, worker_env, (*run_dir)->LogPath(name), spawn_options);
    if (!process.ok()) return process.status();
    processes.push_back(std::move(process).value());
    process_of[i] = processes.back().get();
    ++starts[i];
    return absl::OkStatus();
  };
  for (int64_t i = 0; i < workers; ++i) {
    const bool encoder = i < encoder_ranks;
    if (encoder && !colocated && i >= initial_encoder_ranks) continue;  // a vacant replica
    const int64_t rank = encoder ? i : i - encoder_ranks;
    const std::string role = colocated ? "colocated" : encoder ? "encoder" : "llm";
    const std::string name = absl::StrCat(role, "-", rank);
    if (absl::Status s = spawn(i, name); !s.ok()) {
      std::cerr << "hetpar run: cannot start " << name << ": " << s.message() << "\n";
      (*server)->Stop("a worker could not be started");
      return kExitFailure;
    }
  }
  int replaced = 0;
  // Replicas that admit workers (an encoder pool below its target, a lost LLM replica): start
  // their ranks, in place of workers that died or for a larger pool. A replica that lost a worker
  // counts once against --replace-workers, however many of its ranks are started again (the
  // coordinator ends the lost worker's TP, CP and pipeline peers too): `replacing` holds the
  // ranks started for each replica counted, until it joins; one of those dying counts again.
  const int64_t llm_group = ll.tp() * ll.cp();  // LLM ranks of one replica in one stage
  // The worker indices of `module`'s DP replica `d` (encoder ranks first, then the LLM's).
  auto replica_indices = [&](const std::string& module, int64_t d) {
    std::vector<int64_t> indices;
    if (module == "encoder") {
      for (int64_t t = 0; t < encoder_tp; ++t) indices.push_back(d * encoder_tp + t);
    } else {
      for (int64_t r = 0; r < llm_ranks; ++r) {
        if ((r / llm_group) % ll.dp() == d) indices.push_back(encoder_ranks + r);
      }
    }
    return indices;
  };
  std::map<std::pair<std::string, int64_t>, std::set<int64_t>> replacing;  // (module, replica)
  // Workers started for a replica that admits workers, until it joins: one may still be starting
  // when the run is done (the coordinator then refuses it).
  std::map<std::pair<std::string, int64_t>, std::set<const LocalProcess*>> late;
  auto is_late = [&](const LocalProcess* process) {
    for (const auto& [replica, started] : late) {
      if (started.count(process) != 0) return true;
    }
    return false;
  };
  // Processes that exited while the run trained, left to the coordinator's judgement.
  std::set<const LocalProcess*> lost;
  // The workers of the replicas the coordinator took out of the run (the lost one, and the peers
  // it ended with it, which exit with a failure in their own time, maybe after the run trained),
  // marked as each loss first shows in the status.
  std::set<const LocalProcess*> taken_out;
  std::set<std::tuple<int64_t, int, int64_t>> losses_seen;  // (generation, module, replica)
  auto mark_losses = [&](const v1::StatusResponse& status) {
    // A replica no longer admitting workers joined (or was closed): its workers are no longer late.
    std::set<std::pair<std::string, int64_t>> open;
    for (int64_t d : status.encoder_replicas_open()) open.insert({"encoder", d});
    for (int64_t d : status.llm_replicas_open()) open.insert({"llm", d});
    for (auto it = late.begin(); it != late.end();) {
      it = open.count(it->first) == 0 ? late.erase(it) : std::next(it);
    }
    for (const v1::PoolChange& change : status.pool_changes()) {
      if (change.kind() != v1::POOL_CHANGE_LOST) continue;
      if (!losses_seen.insert({change.generation(), change.module(), change.replica()}).second) {
        continue;
      }
      const std::string module = change.module() == v1::MODULE_ENCODER ? "encoder" : "llm";
      for (int64_t i : replica_indices(module, change.replica())) {
        auto it = process_of.find(i);
        if (it != process_of.end()) taken_out.insert(it->second);
      }
    }
  };
  auto fill_open_replicas = [&](const v1::StatusResponse& status) -> absl::Status {
    std::map<std::pair<std::string, int64_t>, std::vector<int64_t>> wanted;  // -> worker indices
    for (int64_t d : status.encoder_replicas_open()) {
      wanted[{"encoder", d}] = replica_indices("encoder", d);
    }
    for (int64_t d : status.llm_replicas_open()) wanted[{"llm", d}] = replica_indices("llm", d);
    for (auto it = replacing.begin(); it != replacing.end();) {
      it = wanted.count(it->first) == 0 ? replacing.erase(it) : std::next(it);
    }
    for (const auto& [replica, indices] : wanted) {
      const std::string& module = replica.first;
      auto counted = replacing.find(replica);
      std::vector<int64_t> ended;  // ranks without a running process
      bool died = false;           // one that exited with a failure, not yet counted
      for (int64_t i : indices) {
        auto it = process_of.find(i);
        if (it == process_of.end()) {
          ended.push_back(i);
          continue;
        }
        const std::optional<int> code = it->second->Poll();
        if (!code.has_value()) continue;  // still running (registered, or a removed one leaving)
        ended.push_back(i);
        died |= *code != 0 && (counted == replacing.end() || counted->second.count(i) != 0);
      }
      if (ended.empty()) continue;
      if (died) {
        if (replaced >= flags.replace_workers) continue;
        ++replaced;
        counted = replacing.emplace(replica, std::set<int64_t>()).first;
      }
      const bool replacement = counted != replacing.end();
      // Without a replacement an LLM replica that left stays out of the run.
      if (module == "llm" && !replacement) continue;
      for (int64_t i : ended) {
        const int64_t rank = module == "encoder" ? i : i - encoder_ranks;
        const std::string name = starts[i] == 0 ? absl::StrCat(module, "-", rank)
                                                : absl::StrCat(module, "-", rank, ".", starts[i]);
        HETPAR_RETURN_IF_ERROR(spawn(i, name));
        late[replica].insert(processes.back().get());
        if (replacement) counted->second.insert(i);
        std::cerr << "\nhetpar run: started " << name << " (pid " << processes.back()->pid()
                  << ") for " << module << " replica " << replica.second
                  << (replacement ? absl::StrCat(", in place of a worker that died or was ended "
                                                 "with it (replacement ",
                                                 replaced, " of --replace-workers ",
                                                 flags.replace_workers, ")")
                                  : std::string(", which the pool grew into"))
                  << "\n";
      }
    }
    return absl::OkStatus();
  };
  std::cerr << "hetpar run: " << spec.run().name() << ": coordinator on " << (*server)->address()
            << ", "
            << (colocated
                    ? absl::StrCat(workers, " colocated workers (each a rank of both modules)")
                    : absl::StrCat(encoder_ranks, " encoder and ", llm_ranks, " LLM workers"))
            << " started (logs in " << out_dir << "/log)\n";

  const bool tty = ::isatty(STDERR_FILENO) != 0;
  const absl::Time start = absl::Now();
  double last_loss = 0;
  ProgressLine progress(spec.run().steps(), first_step, spec.run().log_every(), flags.log_every_s,
                        tty, start, stderr);
  StepMetricsWriter metrics(
      run_dir->get(), spec.run().peak_tflops(),
      [&](const v1::StepTiming& t) {
        last_loss = t.loss();
        progress.Committed(t, absl::Now());
      },
      first_step);
  std::string failure;
  v1::RunState state = v1::RUN_STATE_WAITING;
  bool stop_sent = false;
  bool ended_at_once = false;  // a second signal: every worker was sent SIGINT
  while (state != v1::RUN_STATE_DONE && state != v1::RUN_STATE_FAILED) {
    state = (*server)->WaitForEnd(absl::Milliseconds(100));
    if (g_signals >= 2 && stop_sent && !ended_at_once) {
      // The workers are in process groups of their own (a terminal's signals reach only this
      // process): a second Ctrl-C is passed on, and each ends at once, once the checkpoint it is
      // writing is complete.
      std::cerr << "\nhetpar run: another signal; ending every worker now (each lets the "
                   "checkpoint it is writing finish)\n";
      for (auto& process : processes) process->Signal(SIGINT);
      ended_at_once = true;
    }
    if (g_interrupted && !stop_sent) {
      // SIGTERM (a scheduler ending the job): the step in flight commits with a checkpoint first
      // when the run writes checkpoints.
      const bool checkpoint = g_interrupted == SIGTERM && !spec.checkpoint().dir().empty();
      std::cerr << "\nhetpar run: " << (g_interrupted == SIGTERM ? "terminated" : "interrupted")
                << "; stopping every worker"
                << (checkpoint ? " after a checkpoint of the step in flight" : "") << "\n";
      failure = "interrupted";
      (*server)->Stop(g_interrupted == SIGTERM ? "terminated" : "interrupted", checkpoint);
      stop_sent = true;
    }
    for (auto& process : processes) {
      const std::optional<int> code = process->Poll();
      if (!code.has_value() || *code == 0 || !failure.empty() || lost.count(process.get()) != 0 ||
          state == v1::RUN_STATE_FAILED) {
        // A failed run's workers exit with its reason: the coordinator's message says it first
        // (those that did not are listed after it, below).
        continue;
      }
      if (state == v1::RUN_STATE_RUNNING) {
        // While the run trains the coordinator decides: it goes on without an encoder replica
        // (or fails the run, which ends this loop).
        lost.insert(process.get());
        std::cerr << "\nhetpar run: " << process->name() << " (pid " << process->pid()
                  << ") exited with code " << *code
                  << "; the coordinator decides whether the run goes on without it\n";
        continue;
      }
      // A peer the coordinator ended with a lost worker may exit after the run trained; one
      // started for a replica that admitted workers and still starting as the run ends is
      // refused by the coordinator, and judged at the end, by the run's state.
      mark_losses((*server)->Status());
      if (taken_out.count(process.get()) != 0 || is_late(process.get())) continue;
      failure = absl::StrCat(process->name(), " (pid ", process->pid(), ") exited with code ",
                             *code, "; the end of its log:\n", process->LogTail(8));
      (*server)->Stop(absl::StrCat(process->name(), " exited with code ", *code));
      stop_sent = true;
    }
    // In this order: a pool change the status shows as recovered has its step among those taken.
    const v1::StatusResponse status = (*server)->Status();
    const std::vector<v1::StepTiming> committed = (*server)->TakeCommittedSteps();
    mark_losses(status);
    if (absl::Status s = metrics.Follow(status, committed); !s.ok() && failure.empty()) {
      failure = std::string(s.message());
    }
    if (state == v1::RUN_STATE_RUNNING && failure.empty() && !colocated) {
      if (absl::Status s = fill_open_replicas(status); !s.ok()) {
        failure = absl::StrCat("cannot start an encoder worker: ", s.message());
        (*server)->Stop(failure);
        stop_sent = true;
      }
    }
  }
  const v1::StatusResponse final_status = (*server)->Status();
  const std::vector<v1::StepTiming> last_committed = (*server)->TakeCommittedSteps();
  mark_losses(final_status);
  if (absl::Status s = metrics.Follow(final_status, last_committed); !s.ok() && failure.empty()) {
    failure = std::string(s.message());
  }
  if (absl::Status s = metrics.WriteLedger(final_status); !s.ok() && failure.empty()) {
    failure = std::string(s.message());
  }
  // A failed run's workers that did not end with its reason (a crash, a kill): their own words.
  std::string not_told;
  for (auto& process : processes) {
    const int code = process->WaitOrKill(absl::Seconds(15));
    if (code == 0) continue;
    if (state != v1::RUN_STATE_FAILED &&
        (lost.count(process.get()) != 0 || taken_out.count(process.get()) != 0)) {
      // One whose exit the loop above did not see (the run ended first) is told here.
      if (lost.count(process.get()) == 0) {
        std::cerr << "hetpar run: " << process->name() << " (pid " << process->pid()
                  << ") exited with code " << code
                  << "; the coordinator had taken its replica out of the run\n";
      }
      continue;
    }
    if (state == v1::RUN_STATE_DONE && is_late(process.get())) {
      // The run had every output it needed: the worker came too late to join it.
      std::cerr << "hetpar run: " << process->name() << " (started for a replica that admitted "
                << "workers) exited with code " << code << ": the run was done before it joined\n";
      continue;
    }
    if (state == v1::RUN_STATE_FAILED) {
      const std::string tail = process->LogTail(8);
      // Its own last words ("... worker failed: CODE: <error>"), which it told the coordinator
      // (WorkerFailure): not repeated when the run's reason holds them.
      std::string own;
      if (const size_t at = tail.rfind("worker failed: "); at != std::string::npos) {
        const size_t code_end = tail.find(": ", at + 15);
        if (code_end != std::string::npos) {
          own = tail.substr(code_end + 2, tail.find('\n', code_end) - code_end - 2);
          own = own.substr(0, 200);
        }
      }
      const bool told = !own.empty() && final_status.state_message().find(own) != std::string::npos;
      if (tail.find("run failed: ") == std::string::npos && !told) {
        absl::StrAppend(&not_told, "\n", process->name(), " exited with code ", code,
                        "; the end of its log:\n", tail);
      }
    } else if (failure.empty() && lost.count(process.get()) == 0) {
      failure = absl::StrCat(process->name(), " exited with code ", code, "; the end of its log:\n",
                             process->LogTail(8));
    }
  }
  exporter.reset();
  (*server)->Shutdown(absl::Seconds(2));
  if (ended_at_once) {
    std::cerr << "hetpar run: " << spec.run().name() << " ended at a second signal after "
              << final_status.committed_steps() << " of " << final_status.total_steps()
              << " steps, its workers at once: its final outputs may be missing; run directory "
              << out_dir << "\n";
    return 130;
  }
  if (state == v1::RUN_STATE_FAILED && (failure.empty() || failure == "interrupted")) {
    // A run that failed after a signal (as it stopped) failed: its reason, not "interrupted".
    failure = absl::StrCat(final_status.state_message(), not_told,
                           failure == "interrupted" ? " (after the run was interrupted)" : "");
  }
  // A signal that came as the last step committed leaves the run done.
  if (failure == "interrupted" && state != v1::RUN_STATE_FAILED &&
      final_status.committed_steps() >= final_status.total_steps()) {
    failure.clear();
  } else if (failure == "interrupted" && state != v1::RUN_STATE_FAILED) {
    // Stopped as asked (Ctrl-C, SIGTERM): not a failure, and it says how the run goes on.
    std::string next = "it wrote no checkpoint (no checkpoint.dir): a new run starts over";
    if (!spec.checkpoint().dir().empty()) {
      const std::optional<coordinator::FoundCheckpoint> newest =
          coordinator::NewestCompleteCheckpoint(
              spec.checkpoint().dir(), final_status.committed_steps(), spec.run().name(), foreign);
      next = newest.has_value()
                 ? absl::StrCat("continue it with --resume ", newest->path, " (step ",
                                newest->step, ")")
                 : std::string("it has no complete checkpoint yet: a new run starts over");
    }
    std::cerr << "hetpar run: " << spec.run().name() << " stopped ("
              << (g_interrupted == SIGTERM ? "terminated" : "interrupted") << ") after "
              << final_status.committed_steps() << " of " << final_status.total_steps()
              << " steps; " << next << "; run directory " << out_dir << "\n";
    return 130;
  }
  if (!failure.empty()) {
    std::cerr << "hetpar run: " << spec.run().name() << " failed after " << metrics.written()
              << " committed steps: " << failure << "\n";
    return failure == "interrupted" ? 130 : kExitFailure;
  }
  std::cerr << "hetpar run: writing the final parameters"
            << (spec.data().val_manifest().empty() ? "" : " and evaluating the validation split")
            << "\n";
  std::string eval_line;
  if (absl::Status s = FinishRunDirectory(**run_dir, spec, flags.threads, &eval_line, nullptr,
                                          [] { return g_interrupted != 0; });
      !s.ok()) {
    if (g_interrupted) {
      // Trained and saved: only the evaluation is missing (a terminal's Ctrl-C reaches the
      // evaluator too, which then fails with 130).
      std::cerr << "hetpar run: " << spec.run().name() << " trained " << metrics.written()
                << " steps and saved its model in " << out_dir << "/model, but was "
                << (g_interrupted == SIGTERM ? "terminated" : "interrupted")
                << " before its evaluation ended: " << s.message() << "\n";
      return 130;
    }
    std::cerr << "hetpar run: " << s.message() << "\n";
    if (const std::vector<std::string> cut = (*server)->CutAtStop(); !cut.empty()) {
      std::cerr << "hetpar run: the stop's deadline ended the sessions of "
                << absl::StrJoin(cut, ", ") << " before they had sent their outputs\n";
    }
    return kExitFailure;
  }
  if (!flags.trace.empty()) {
    std::cerr << "hetpar run: timeline of steps " << flags.trace << ": " << out_dir
              << "/trace.json (open it in https://ui.perfetto.dev)\n";
  }
  if (!eval_line.empty()) PrintEvaluation(eval_line);
  std::cout << absl::StrFormat(
      "hetpar run: %s done: %d steps in %s, final loss %.4f; run directory %s\n", spec.run().name(),
      metrics.written(), HumanDuration(absl::ToDoubleSeconds(absl::Now() - start)), last_loss, out_dir);
  return kExitOk;
}

int Run(const RunFlags& flags) {
  auto loaded = LoadSpec(flags);
  if (!loaded.ok()) {
    std::cerr << "hetpar: invalid config " << flags.config << ":\n"
              << loaded.status().message() << "\n";
    return kExitInvalidInput;
  }
  if (flags.nccl_host_per_worker && (flags.reference || loaded->spec.run().device() != "cuda" ||
                                     loaded->spec.transport() == v1::TRANSPORT_KIND_NCCL)) {
    std::cerr << "hetpar run: --nccl-host-per-worker is for the NCCL groups of a distributed run "
                 "on CUDA with transport ucx; this run has run.device '"
              << loaded->spec.run().device() << "'" << (flags.reference ? " and --reference" : "")
              << (loaded->spec.transport() == v1::TRANSPORT_KIND_NCCL ? " and transport nccl" : "")
              << "\n";
    return kExitInvalidInput;
  }
  // Flags a run of this kind would not honour are refused, not ignored.
  if (flags.reference) {
    std::vector<std::string> unused;
    if (!flags.trace.empty()) unused.push_back("--trace");
    if (flags.log_every_s > 0) unused.push_back("--log-every-seconds");
    if (flags.replace_workers > 0) unused.push_back("--replace-workers");
    if (flags.listen_given) unused.push_back("--listen");
    if (flags.step_timeout_s > 0) unused.push_back("--step-timeout");
    if (!unused.empty()) {
      std::cerr << "hetpar run: " << absl::StrJoin(unused, ", ")
                << (unused.size() == 1 ? " is" : " are")
                << " for a distributed run, and --reference trains in one process without a "
                   "coordinator or workers; remove "
                << (unused.size() == 1 ? "it" : "them") << "\n";
      return kExitInvalidInput;
    }
  }
  if (flags.replace_workers > 0 && loaded->spec.placement() == v1::PLACEMENT_COLOCATED) {
    std::cerr << "hetpar run: --replace-workers " << flags.replace_workers
              << ": a colocated run has no replica to refill (each worker holds ranks of both "
                 "modules, and losing one ends the run); remove it\n";
    return kExitInvalidInput;
  }
  if (flags.reference && (!loaded->spec.checkpoint().dir().empty() ||
                          !loaded->spec.checkpoint().resume_from().empty())) {
    std::cerr << "hetpar run: --reference trains from step 0 and writes no checkpoints; remove "
                 "--resume and the checkpoint section (checkpoint.dir='"
              << loaded->spec.checkpoint().dir() << "', checkpoint.resume_from='"
              << loaded->spec.checkpoint().resume_from() << "')\n";
    return kExitInvalidInput;
  }
  struct sigaction action = {};
  action.sa_handler = OnSignal;
  sigfillset(&action.sa_mask);  // one handler at a time: SIGINT and SIGTERM count together
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
  return flags.reference ? RunReferenceProcess(flags, loaded->spec)
                         : RunDistributed(flags, loaded->spec);
}

void AddRunCommand(CLI::App& app, int* exit_code) {
  auto flags = std::make_shared<RunFlags>();
  CLI::App* command = app.add_subcommand(
      "run",
      "Train a RunSpec on this machine: start a coordinator, spawn the encoder pool and the LLM "
      "ranks, show progress and write the run directory (config.yaml, metrics.jsonl, log/)");
  command->add_option("-c,--config", flags->config, "RunSpec YAML file")->required();
  command->add_option("--set", flags->overrides,
                      "Override a field, e.g. --set llm.layout.tp=2 (repeatable)");
  command->add_option("--steps", flags->steps, "Steps to train (overrides run.steps)")
      ->check(hetpar::kPositiveNumber);
  command->add_option("--out", flags->out, "Run directory (overrides run.out_dir)");
  command->add_option("--resume", flags->resume,
                      "Continue from a checkpoint (a step-NNNNNN directory of checkpoint.dir), on "
                      "this config's layout: sets checkpoint.resume_from");
  command->add_flag("--reference", flags->reference,
                    "Train both modules in one process at tp 1, dp 1 (the parity baseline); "
                    "without --out, into run.out_dir with -reference appended");
  command
      ->add_option("--threads", flags->threads,
                   "Intra-op threads per worker (default: cores / workers)")
      ->check(hetpar::kPositiveNumber);
  command
      ->add_option("--log-every-seconds", flags->log_every_s,
                   "When stderr is not a terminal, also print a progress line once this many "
                   "seconds have passed since the last (besides every run.log_every steps)")
      ->check(hetpar::kNonNegativeNumber);
  command
      ->add_option("--trace", flags->trace,
                   "Record a timeline of steps FIRST:LAST (or one STEP, 0-based) of every rank "
                   "into <out>/trace.json (Chrome trace events; opens in the Perfetto UI)")
      ->check([](const std::string& text) {
        auto range = trace::ParseStepRange(text);
        return range.ok() ? std::string() : std::string(range.status().message());
      });
  command
      ->add_option("--replace-workers", flags->replace_workers,
                   "Start the ranks of a DP replica (encoder, or LLM with llm.layout.dp > 1) "
                   "that lost a worker while the run trains again: the one that died and the "
                   "peers ended with it (the replica joins the run again at a step boundary), "
                   "for at most this many replicas; 0: the run goes on without the lost replica")
      ->capture_default_str()
      ->check(hetpar::kNonNegativeNumber);
  command->add_flag(
      "--nccl-host-per-worker", flags->nccl_host_per_worker,
      "run.device cuda: give each worker an NCCL host of its own (NCCL_HOSTID; "
      "NCCL's socket transport on loopback), so that ranks of one TP, CP, DP or PP "
      "group may share a GPU. For checking a multi-rank layout on fewer GPUs, not for speed");
  command
      ->add_option("--listen", flags->listen,
                   "Address of this run's coordinator (port 0 picks a free one, logged at the "
                   "start; hetpar status --coordinator ADDR finds it). The config's "
                   "coordinator.listen is not used here: it is hetpar coordinator's address")
      ->capture_default_str();
  command
      ->add_option("--step-timeout", flags->step_timeout_s,
                   "Seconds a step attempt may take before it is aborted (default: "
                   "failure.step_timeout_s)")
      ->check(hetpar::kPositiveNumber);
  command->callback([command, flags, exit_code] {
    flags->listen_given = command->count("--listen") > 0;
    *exit_code = Run(*flags);
  });
}

}  // namespace

HETPAR_REGISTER_COMMAND(5, AddRunCommand);

}  // namespace hetpar::cli
