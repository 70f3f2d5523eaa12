#include "common/worker/worker_main.h"

#include <ATen/Parallel.h>
#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <future>
#include <iostream>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/cli_checks.h"
#include "common/control/client.h"
#include "common/control/security.h"
#include "common/errno_status.h"
#include "common/logging.h"
#include "common/nn/communicator.h"
#include "common/status.h"
#include "common/trace/recorder.h"
#include "common/version.h"
#include "common/worker/launch_options.h"
#include "common/worker/module_state.h"
#include "common/worker/outputs.h"
#include "common/worker/step_driver.h"

namespace hetpar::worker {
namespace {

constexpr int kExitFailure = 1;
constexpr int kExitInvalidInput = 2;

// --ready-file: the file exists while this worker trains with the run, from its first committed
// step (applied or skipped) until its step driver returns, so that a container's readiness probe
// (`test -e FILE`) says whether the worker is an active member (docs/deploy.md). Set once at start,
// before any thread, and read-only afterwards.
std::string g_ready_file;

// At start: removes a copy an earlier process left (one that crashed, or this one before it
// restarted itself to register again), and checks that the file can be made there, so that a
// probe that could never succeed fails the start instead of holding the pod unready.
absl::Status PrepareReadyFile(const std::string& path) {
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    return ErrnoStatus(errno, absl::StrCat("removing '", path, "', left by an earlier start"));
  }
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat("creating '", path, "'"));
  ::close(fd);
  if (::unlink(path.c_str()) != 0) return ErrnoStatus(errno, absl::StrCat("removing '", path, "'"));
  return absl::OkStatus();
}

// Makes the ready file, holding the first step this worker committed; false (and a warning) when
// it cannot.
bool MarkReady(int64_t step) {
  const std::string text = absl::StrCat("trains with the run since step ", step, "\n");
  const int fd = ::open(g_ready_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  const bool written =
      fd >= 0 && ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  const int error = errno;
  if (fd >= 0) ::close(fd);
  if (!written) {
    HETPAR_LOG(WARNING) << "--ready-file: cannot write '" << g_ready_file
                        << "': " << std::strerror(error) << "; this worker stays unready";
    return false;
  }
  HETPAR_LOG(INFO) << "ready: trains with the run since step " << step << " ('" << g_ready_file
                   << "' made)";
  return true;
}

// Removes the ready file, if any: the worker no longer trains with the run.
void ClearReady() {
  if (g_ready_file.empty()) return;
  if (::unlink(g_ready_file.c_str()) != 0 && errno != ENOENT) {
    HETPAR_LOG(WARNING) << "--ready-file: cannot remove '" << g_ready_file
                        << "': " << std::strerror(errno);
  }
}

// A worker that lost its coordinator replaces itself with a fresh copy of its program (execv of
// its own binary, the same arguments), so nothing of the interrupted run survives (process
// groups, data-plane endpoints, a half-done step): the copy registers anew with the restarted
// coordinator, which resumes the run from its newest checkpoint. The copy inherits the deadline
// for the coordinator to come back in this variable (Unix seconds).
constexpr char kReconnectDeadlineEnv[] = "HETPAR_RECONNECT_DEADLINE";

// The session of the run this worker trains in, while its step driver runs: a SIGTERM then asks
// the coordinator to let the worker leave after the step in flight (Leave) instead of ending the
// process at once.
// Held while the signal thread uses the session, so that Serve's clearing of it waits for that
// use to end before the session can be destroyed.
absl::Mutex g_training_session_mu;
coordinator::WorkerSession* g_training_session ABSL_GUARDED_BY(g_training_session_mu) = nullptr;

// Marks every descriptor above stderr close-on-exec: the copy must not keep the sockets of the
// lost run's process groups open, or its peers would not see them close.
void CloseOnExecAboveStderr() {
  std::vector<int> fds;
  if (DIR* dir = ::opendir("/proc/self/fd")) {
    while (const dirent* entry = ::readdir(dir)) {
      const int fd = std::atoi(entry->d_name);
      if (fd > 2 && fd != ::dirfd(dir)) fds.push_back(fd);
    }
    ::closedir(dir);
  }
  for (int fd : fds) ::fcntl(fd, F_SETFD, FD_CLOEXEC);
}

// Tries of the restart's execve that fail for a reason that can pass (see RestartToReRegister).
constexpr int kRestartAttempts = 5;

[[noreturn]] void RestartToReRegister(const std::vector<std::string>& args,
                                      absl::Duration reconnect_timeout, const absl::Status& why) {
  const absl::Time deadline = absl::Now() + reconnect_timeout;
  HETPAR_LOG(WARNING) << (absl::IsAborted(why) ? "the coordinator ended this worker's session ("
                                                : "lost the coordinator (")
                      << why.message()
                      << "); restarting this worker to register again with it (waiting up to "
                      << absl::FormatDuration(reconnect_timeout) << ", --reconnect-timeout)";
  ClearReady();  // no longer trains with the run; the copy makes it again after its first step
  // The checkpoint of the step just committed may still be being written: a restarted
  // coordinator resumes from it once it is complete, so it is not cut off here.
  if (const int running = AwaitCheckpointWrites(); running > 0) {
    HETPAR_LOG(WARNING) << running << " checkpoint write(s) still running past their deadline; "
                        << "restarting without them";
  }
  RemoveOutputScratch();  // the copy sweeps what is left too (it keeps the pid)
  std::cerr.flush();
  std::clog.flush();
  std::fflush(nullptr);
  // The copy's arguments and environment are built here, from copies: no setenv (which may
  // reallocate the environment other threads read), no pointer into memory of the lost run.
  std::vector<std::string> env;
  const std::string prefix = std::string(kReconnectDeadlineEnv) + "=";
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    if (std::string_view(*e).substr(0, prefix.size()) != prefix) env.emplace_back(*e);
  }
  env.push_back(prefix + std::to_string(absl::ToUnixSeconds(deadline)));
  std::vector<char*> argv_copy;
  for (const std::string& a : args) argv_copy.push_back(const_cast<char*>(a.c_str()));
  argv_copy.push_back(nullptr);
  std::vector<char*> envp;
  for (std::string& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  CloseOnExecAboveStderr();
  sigset_t none;
  sigemptyset(&none);
  pthread_sigmask(SIG_SETMASK, &none, nullptr);
  // A failure that can pass (ENOMEM, EAGAIN, ETXTBSY) is tried again, a few times.
  for (int attempt = 1;; ++attempt) {
    ::execve("/proc/self/exe", argv_copy.data(), envp.data());
    const int error = errno;
    const bool transient = error == ENOMEM || error == EAGAIN || error == ETXTBSY;
    if (!transient || attempt == kRestartAttempts) {
      HETPAR_LOG(ERROR) << "cannot restart this worker: execve (attempt " << attempt << " of "
                        << kRestartAttempts << "): " << std::strerror(error);
      break;
    }
    HETPAR_LOG(WARNING) << "restarting this worker: execve: " << std::strerror(error)
                        << "; trying again (attempt " << attempt + 1 << " of "
                        << kRestartAttempts << ")";
    std::fflush(nullptr);
    absl::SleepFor(absl::Milliseconds(500) * attempt);
  }
  std::fflush(nullptr);
  std::_Exit(kExitFailure);
}

absl::Status Serve(const WorkerOptions& options, const ModuleFactory& factory) {
  HETPAR_ASSIGN_OR_RETURN(std::unique_ptr<WorkerContext> context,
                          WorkerContext::Bootstrap(options));
  // A failure of this worker's own (not a stop the coordinator sent) is told to the coordinator
  // before the exit, so that it names the error where it takes the worker out; the session's
  // close delivers it before the half-close.
  const auto tell_coordinator = [&context](const absl::Status& failure) {
    if (context->session().ended()) return;  // the coordinator ended it: nobody to tell
    if (absl::Status s =
            context->session().SendFailure(std::string(failure.message()), IsEndsRun(failure));
        !s.ok()) {
      HETPAR_LOG(WARNING) << "cannot tell the coordinator why this worker fails: " << StatusText(s);
      return;
    }
    (void)context->Close(absl::Seconds(10));
  };
  // The modules, with the state a resumed run loads (a checkpoint shard that fails its CRC-32,
  // a missing file): every rank registered by now, so the coordinator hears why this one goes.
  absl::StatusOr<std::unique_ptr<ModuleRuntime>> created = factory(*context);
  if (!created.ok()) {
    tell_coordinator(created.status());
    return created.status();
  }
  std::unique_ptr<ModuleRuntime> modules = *std::move(created);
  SessionChannel channel(&context->session());
  StepDriverOptions driver_options;
  driver_options.timeout = context->coordinator_timeout();
  driver_options.step_timeout = absl::Seconds(context->spec().failure().step_timeout_s());
  driver_options.initial_generation = context->store_generation();
  driver_options.initial_replicas.encoder = context->AssignedReplicas(v1::MODULE_ENCODER);
  driver_options.initial_replicas.llm = context->AssignedReplicas(v1::MODULE_LLM);
  driver_options.interrupt = &context->interrupt();
  driver_options.on_membership_change = [&context](const v1::MembershipChange& change) {
    return context->ConnectJoined(change);
  };
  driver_options.check_collectives = [&context](int64_t generation) {
    return context->aborter().CheckGeneration(generation);
  };
  const int64_t world_rank = context->world_rank();
  // Trace events of the traced steps go to <out>/trace/rank-<r>.jsonl after each step, the
  // process's name first.
  std::vector<std::string> pending_trace;
  if (options.trace_first >= 0 && !options.out_dir.empty()) {
    std::string name = absl::StrCat("rank ", world_rank, ":");
    for (v1::Module module : {v1::MODULE_ENCODER, v1::MODULE_LLM}) {
      if (const v1::RankCoordinates* c = context->Coordinates(module)) {
        absl::StrAppend(&name, " ", module == v1::MODULE_ENCODER ? "encoder" : "llm", " dp ",
                        c->dp(), " tp ", c->tp());
      }
    }
    pending_trace.push_back(trace::ProcessNameEvent(world_rank, name));
  }
  const std::string trace_path =
      absl::StrCat(options.out_dir, "/trace/rank-", world_rank, ".jsonl");
  auto flush_trace = [&] {
    if (options.trace_first < 0 || options.out_dir.empty()) return;
    for (std::string& e : trace::Recorder::Process().TakeJson(world_rank)) {
      pending_trace.push_back(std::move(e));
    }
    if (absl::Status s = trace::AppendEvents(trace_path, pending_trace); !s.ok()) {
      HETPAR_LOG(WARNING) << "trace events not written: " << StatusText(s);
    }
    pending_trace.clear();
  };
  bool ready = false;
  driver_options.on_committed = [&ready](int64_t step) {
    if (!ready && !g_ready_file.empty()) ready = MarkReady(step);
  };
  driver_options.on_applied = [&](int64_t step, const std::vector<ModuleTimings>& timings) {
    for (const ModuleTimings& t : timings) {
      if (absl::Status s = AppendStepTimings(options.out_dir, world_rank, step, t); !s.ok()) {
        HETPAR_LOG(WARNING) << "step timings not written: " << StatusText(s);
      }
    }
    flush_trace();
  };
  StepDriver driver(&channel, modules.get(), driver_options);
  if (context->joining()) {
    HETPAR_LOG(INFO) << "joined the running run; the module's state comes from a live replica "
                        "before the first step";
  }
  {
    absl::MutexLock lock(&g_training_session_mu);
    g_training_session = &context->session();
  }
  const absl::Status run = driver.Run();
  {
    absl::MutexLock lock(&g_training_session_mu);
    g_training_session = nullptr;
  }
  ClearReady();
  flush_trace();
  if (!run.ok()) {
    if (!driver.ended_by_coordinator()) tell_coordinator(run);
    return run;
  }
  if (driver.left_run()) {
    // The run goes on without this worker's replica: its outputs are the others' to write.
    HETPAR_LOG(INFO) << driver.steps_applied() << " steps applied; left the run";
    return context->Close(absl::Seconds(10));
  }
  // The stop raised the step interrupt; the outputs' gathers must not see it.
  context->interrupt().Clear();
  HETPAR_LOG(INFO) << driver.steps_applied() << " steps applied, " << driver.steps_discarded()
                   << " discarded";
  // Tells the coordinator the outputs are under way: gathering a large model and writing it
  // takes a while before its first chunk arrives, and the stop's deadline allows for it.
  v1::Progress outputs;
  outputs.set_phase(coordinator::kOutputsPhase);
  if (absl::Status s = context->session().SendProgress(outputs); !s.ok()) {
    HETPAR_LOG(WARNING) << "cannot tell the coordinator the outputs are under way: "
                        << StatusText(s);
  }
  if (absl::Status s = modules->WriteOutputs(
          [&](const std::string& name, const std::string& local_path) {
            return context->PutOutput(name, local_path);
          },
          world_rank);
      !s.ok()) {
    tell_coordinator(s);
    return s;
  }
  return context->Close(absl::Seconds(10));
}

}  // namespace

int WorkerMain(int argc, char** argv, const WorkerBinary& binary, const ModuleFactory& factory) {
  CLI::App app{binary.description +
               "\n\nEvery option can also be set by the environment variable named in its line "
               "(HETPAR_ and the option's name in capitals); an option on the command line wins."};
  app.name(binary.name);
  app.set_version_flag("--version", binary.name + " " + HETPAR_VERSION);
  WorkerOptions options;
  options.role = binary.role;
  std::string token_file;
  std::string interface;
  RankRequest rank;
  int threads = 0;
  double timeout_s = absl::ToDoubleSeconds(options.timeout);
  double connect_timeout_s = absl::ToDoubleSeconds(options.connect_timeout);
  bool colocated = false;
  bool linger = false;
  double reconnect_timeout_s = 600;
  std::string trace_steps;
  app.add_option("--coordinator", options.coordinator, "Coordinator address (host:port)")
      ->envname("HETPAR_COORDINATOR")
      ->capture_default_str();
  app.add_option("--token-file", token_file,
                 "File holding the run token (else the HETPAR_TOKEN environment variable holds "
                 "the token itself)")
      ->envname(coordinator::kTokenFileEnvVar);
  app.add_option("--tls-ca", options.tls.ca_file,
                 "PEM CA of the coordinator's certificate; enables TLS")
      ->envname("HETPAR_TLS_CA");
  app.add_option("--tls-cert", options.tls.cert_file, "PEM client certificate (mutual TLS)")
      ->envname("HETPAR_TLS_CERT");
  app.add_option("--tls-key", options.tls.key_file, "PEM key of --tls-cert")
      ->envname("HETPAR_TLS_KEY");
  app.add_option("--tls-server-name", options.tls.server_name,
                 "Name to check the coordinator's certificate against (default: its host)")
      ->envname("HETPAR_TLS_SERVER_NAME");
  app.add_option("--rank", rank.rank,
                 "Rank to take in the module's grid (default: the lowest free one)")
      ->envname("HETPAR_RANK")
      ->check(hetpar::kNonNegativeNumber);
  app.add_option("--replica", rank.replica,
                 "With --ranks-per-replica and --local-rank: take rank replica * "
                 "ranks-per-replica + local-rank (a pod's or node's index)")
      ->envname("HETPAR_REPLICA")
      ->check(hetpar::kNonNegativeNumber);
  app.add_option("--ranks-per-replica", rank.ranks_per_replica,
                 "Ranks each replica (pod, node) hosts")
      ->envname("HETPAR_RANKS_PER_REPLICA")
      ->check(hetpar::kPositiveNumber);
  app.add_option("--local-rank", rank.local_rank, "This worker's rank inside its replica")
      ->envname("HETPAR_LOCAL_RANK")
      ->check(hetpar::kNonNegativeNumber);
  app.add_option("--pipeline-stages", rank.pipeline_stages,
                 "With --replica: the replica's ranks are split over this many pipeline stages "
                 "(llm.layout.pp), so its local rank l takes rank l % P of stage l / P, P = "
                 "ranks-per-replica / stages (default 1)")
      ->envname("HETPAR_PIPELINE_STAGES")
      ->check(hetpar::kPositiveNumber);
  app.add_option("--replicas", rank.replicas,
                 "With --pipeline-stages: the module's DP replicas (llm.layout.dp)")
      ->envname("HETPAR_REPLICAS")
      ->check(hetpar::kPositiveNumber);
  app.add_option("--cuda-device", options.cuda_device,
                 "The GPU this worker computes on when the run's run.device is cuda (default: "
                 "LOCAL_RANK, else 0: a container given one GPU)")
      ->envname("HETPAR_CUDA_DEVICE")
      ->check(hetpar::kNonNegativeNumber);
  CLI::Option* host =
      app.add_option("--host", options.host,
                     "Address this worker's process groups listen on and that it advertises to "
                     "its peers (a pod IP, a node's address)")
          ->envname("HETPAR_HOST")
          ->capture_default_str();
  app.add_option("--interface", interface,
                 "Advertise the IPv4 address of this network interface instead of --host "
                 "(e.g. eth0, ib0)")
      ->envname("HETPAR_INTERFACE")
      ->excludes(host);
  app.add_option(
         "--timeout", timeout_s,
         "Seconds any wait for peers or the coordinator may last before the worker fails "
         "(default: the RunSpec's failure.peer_timeout_s and failure.coordinator_timeout_s)")
      ->envname("HETPAR_TIMEOUT")
      ->check(hetpar::kPositiveNumber);
  app.add_option("--connect-timeout", connect_timeout_s,
                 "Seconds to wait for the coordinator to answer at start and admit this worker "
                 "(a worker may start before it, or before its lost predecessor is found gone)")
      ->envname("HETPAR_CONNECT_TIMEOUT")
      ->capture_default_str()
      ->check(hetpar::kPositiveNumber);
  app.add_option("--reconnect-timeout", reconnect_timeout_s,
                 "Seconds a worker that lost its coordinator waits for a restarted one to "
                 "register with again, instead of exiting (0: exit at once)")
      ->envname("HETPAR_RECONNECT_TIMEOUT")
      ->capture_default_str()
      ->check(hetpar::kNonNegativeNumber);
  app.add_option("--out", options.out_dir,
                 "Directory for this worker's step timings and timeline (default: none); its "
                 "parameter sums and model files go to the coordinator's run directory")
      ->envname("HETPAR_OUT");
  app.add_option("--trace", trace_steps,
                 "Record a timeline of these steps (FIRST:LAST or STEP, 0-based) into "
                 "<out>/trace/rank-<r>.jsonl (docs/observability.md)")
      ->envname("HETPAR_TRACE");
  app.add_option("--threads", threads, "Intra-op threads (default: the machine's cores)")
      ->envname("HETPAR_THREADS")
      ->check(hetpar::kNonNegativeNumber);
  app.add_option("--ready-file", options.ready_file,
                 "A file this worker makes once it trains with the run (its first step committed) "
                 "and removes when it stops training, for a readiness probe (test -e FILE); "
                 "its directory must exist")
      ->envname("HETPAR_READY_FILE");
  app.add_flag("--linger", linger,
               "When the run ends, stay idle until terminated instead of exiting (for a "
               "Kubernetes StatefulSet, which would restart the worker into a finished run)")
      ->envname("HETPAR_LINGER");
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
  // A write to a peer that has gone (a Gloo socket whose peer restarted or died; Gloo writes
  // with writev, without MSG_NOSIGNAL) must fail that write with EPIPE, which the step reports,
  // not end this process without a word.
  ::signal(SIGPIPE, SIG_IGN);
  // SIGINT and SIGTERM go to one thread (below): block them before any thread starts (the
  // intra-op pool, gRPC, UCX), so every thread inherits the mask.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  absl::StatusOr<std::optional<int64_t>> requested = RequestedRank(rank);
  if (!requested.ok()) {
    std::cerr << binary.name << ": " << requested.status().message() << "\n";
    return kExitInvalidInput;
  }
  options.requested_rank = requested->value_or(-1);
  if (!options.ready_file.empty()) {
    if (absl::Status s = PrepareReadyFile(options.ready_file); !s.ok()) {
      std::cerr << binary.name << ": --ready-file: " << s.message() << "\n";
      return kExitInvalidInput;
    }
    g_ready_file = options.ready_file;
  }
  if (!interface.empty()) {
    absl::StatusOr<std::string> address = InterfaceAddress(interface);
    if (!address.ok()) {
      std::cerr << binary.name << ": --interface: " << address.status().message() << "\n";
      return kExitInvalidInput;
    }
    options.host = *address;
  }
  options.connect_timeout = absl::Seconds(connect_timeout_s);
  if (const char* inherited = std::getenv(kReconnectDeadlineEnv); inherited != nullptr) {
    // A copy restarted after its coordinator was lost: wait for the coordinator until the
    // deadline the lost run's worker set.
    const absl::Duration left = absl::FromUnixSeconds(std::atoll(inherited)) - absl::Now();
    ::unsetenv(kReconnectDeadlineEnv);
    if (left <= absl::ZeroDuration()) {
      std::cerr << binary.name << ": the coordinator did not come back within --reconnect-timeout "
                << reconnect_timeout_s << " s\n";
      return kExitFailure;
    }
    options.connect_timeout = left;
    std::cerr << binary.name << ": registering again after the coordinator was lost (waiting up to "
              << absl::FormatDuration(absl::Trunc(left, absl::Seconds(1))) << ")\n";
  }
  if (reconnect_timeout_s > 0) {
    const absl::Duration reconnect = absl::Seconds(reconnect_timeout_s);
    options.on_coordinator_lost = [args = std::vector<std::string>(argv, argv + argc),
                                   reconnect](const absl::Status& why) {
      RestartToReRegister(args, reconnect, why);
    };
  } else {
    // No restart: a worker the coordinator declared dead exits here, since its step may hang
    // and never read the session's end. A lost coordinator fails the worker's next wait.
    options.on_coordinator_lost = [name = binary.name](const absl::Status& why) {
      if (!absl::IsAborted(why)) return;
      HETPAR_LOG(ERROR) << "the coordinator ended this worker's session: " << why.message();
      ClearReady();
      std::cerr.flush();
      std::fflush(nullptr);
      std::_Exit(kExitFailure);
    };
  }
  if (!trace_steps.empty()) {
    absl::StatusOr<std::pair<int64_t, int64_t>> range = trace::ParseStepRange(trace_steps);
    if (!range.ok()) {
      std::cerr << binary.name << ": --trace: " << range.status().message() << "\n";
      return kExitInvalidInput;
    }
    options.trace_first = range->first;
    trace::Recorder::Process().Configure(range->first, range->second);
  }
  if (colocated) options.role = Role::kColocated;
  options.timeout = absl::Seconds(timeout_s);
  at::set_num_threads(
      threads > 0 ? threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  SetLogTag(RoleName(options.role));
  if (absl::Status address = coordinator::CheckCoordinatorAddress(options.coordinator);
      !address.ok()) {
    std::cerr << binary.name << ": --coordinator: " << address.message() << "\n";
    return kExitInvalidInput;
  }
  auto token = coordinator::ResolveToken(token_file, "");
  if (!token.ok() && absl::IsNotFound(token.status()) && token_file.empty()) {
    // On the coordinator's machine: the token it generated for itself, as `hetpar status` reads
    // it (hetpar run passes its workers the token; this is for workers started by hand).
    const std::string local = coordinator::LocalTokenPath(coordinator::PortOf(options.coordinator));
    std::error_code unreadable;
    if (std::filesystem::exists(local, unreadable)) {
      token = coordinator::ReadTokenFile(local);
    } else {
      token = absl::NotFoundError(absl::StrCat(
          token.status().message(), "; or run on the coordinator's machine, where it keeps a "
          "generated token in ", local));
    }
  }
  if (!token.ok()) {
    std::cerr << binary.name << ": " << token.status().message() << "\n";
    return kExitInvalidInput;
  }
  options.token = token->value;
  // During the run the first SIGTERM (a pod removed, a node drained) asks the coordinator to let
  // this worker leave after the step in flight (an encoder replica leaves the pool; any other
  // worker's run stops, with a checkpoint when it writes them); SIGINT, a second SIGTERM, or one
  // while no step driver runs end the process at once. After the run (--linger) a signal ends
  // the idle wait with the run's exit code.
  std::atomic<bool> run_over{false};
  std::promise<void> terminated;
  // Set once a SIGTERM asked to leave: the pod is going away, so the worker does not linger.
  std::atomic<bool> leave_asked{false};
  std::thread waiter([&] {
    while (true) {
      int signal = 0;
      if (sigwait(&signals, &signal) != 0) return;
      if (run_over.load()) {
        terminated.set_value();
        return;
      }
      absl::ReleasableMutexLock lock(&g_training_session_mu);
      coordinator::WorkerSession* session = g_training_session;
      if (signal == SIGTERM && !leave_asked.load() && session != nullptr) {
        leave_asked.store(true);
        const absl::Status sent = session->SendLeave("SIGTERM");
        lock.Release();
        HETPAR_LOG(WARNING) << "SIGTERM: "
                            << (sent.ok() ? "asked the coordinator to let this worker leave "
                                            "after the step in flight (a second signal ends it, "
                                            "once the checkpoint being written is)"
                                          : absl::StrCat("cannot ask the coordinator to leave (",
                                                         sent.message(), ")"));
        if (sent.ok()) continue;
      }
      HETPAR_LOG(WARNING) << "terminated by signal " << signal << " during the run";
      ClearReady();
      // The checkpoint of a committed step being written (a terminal's Ctrl-C reaches every
      // worker at once) is let finish within its bound: cut off, it would be lost. Another
      // signal ends the wait.
      if (RunningCheckpointWrites writes = CheckpointWritesRunning(); writes.running > 0) {
        HETPAR_LOG(WARNING) << "waiting for the checkpoint being written to finish before "
                               "exiting (another signal ends this worker at once)";
        // The bound of the writes running now: later ones (the worker trains on meanwhile when
        // only it got the signal) do not move it.
        const absl::Time bound = writes.bound;
        const timespec slice = {0, 100 * 1000 * 1000};
        while (writes.running > 0 && absl::Now() < bound) {
          // Once the run is over, the main thread's wake-up (a SIGTERM of its own) is no one's
          // request to hurry.
          if (sigtimedwait(&signals, nullptr, &slice) > 0 && !run_over.load()) {
            HETPAR_LOG(WARNING) << "another signal: exiting without the checkpoint";
            break;
          }
          writes = CheckpointWritesRunning();
        }
      }
      RemoveOutputScratch();  // a model file being sent would stay in $TMPDIR
      std::cerr.flush();
      std::clog.flush();
      std::fflush(nullptr);
      std::_Exit(128 + signal);
    }
  });
  // Set when the run goes on without this worker's replica (StopRun.replica_left), whether the
  // run had started or not.
  auto replica_left_flag = std::make_shared<std::atomic<bool>>(false);
  options.on_replica_left = [replica_left_flag] { replica_left_flag->store(true); };
  if (const int swept = SweepStaleOutputScratch(); swept > 0) {
    HETPAR_LOG(INFO) << "removed " << swept << " output scratch director"
                     << (swept == 1 ? "y" : "ies")
                     << " in $TMPDIR left by a worker that ended without removing it";
  }
  absl::Status status = Serve(options, factory);
  // Stopped before the run started: the session closed as the stop asked (Bootstrap said so).
  if (coordinator::IsStoppedBeforeStart(status)) status = absl::OkStatus();
  run_over.store(true);
  const bool replica_left = replica_left_flag->load();
  if (!status.ok()) {
    HETPAR_LOG(ERROR) << RoleName(options.role) << " worker failed: " << StatusText(status);
  }
  const int code = status.ok() ? 0 : kExitFailure;
  if (replica_left && linger) {
    // The run goes on: a copy started again registers into the vacant replica.
    HETPAR_LOG(INFO) << "not lingering: the run goes on, and this worker's replica admits it "
                        "again once started anew";
  }
  if (linger && !leave_asked.load() && !replica_left) {
    HETPAR_LOG(INFO) << "run over; idle until terminated (--linger)";
    terminated.get_future().wait();
  } else {
    // Wake the signal thread so it returns.
    ::pthread_kill(waiter.native_handle(), SIGTERM);
  }
  waiter.join();
  if (const int running = nn::RendezvousThreadsRunning(); running > 0) {
    // A rendezvous a step's abort gave up may still wait on its peers: its thread must not meet
    // the process's static destructors.
    HETPAR_LOG(INFO) << "exiting with " << running
                     << " given-up group rendezvous still running on their own threads";
    std::cerr.flush();
    std::clog.flush();
    std::fflush(nullptr);
    std::_Exit(code);
  }
  return code;
}

}  // namespace hetpar::worker
