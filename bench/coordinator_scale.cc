// coordinator_scale: one coordinator process serving 1024 simulated workers (sessions of one
// client process over a few connections) that register, heartbeat at 1 Hz and run steps planned
// for a 1024-rank layout (512 encoder ranks, 512 LLM ranks) at one step per second.
//
// JSON lines on stdout:
//   registration  seconds until every worker has registered and holds its full assignment
//   heartbeat_rtt p50/p99 of heartbeat -> ack round trips, as the workers see them
//   idle_cpu      the coordinator's CPU share of one core with every session heartbeating and
//                 no steps: the same-run baseline
//   step_cpu      the coordinator's CPU time per step and its share of one core at the step
//                 rate, against the 5% goal and as a ratio to idle_cpu; plus plan fan-out time
//   plan_build    time to build one step plan and every rank's part of it (in-process)
//
//   coordinator_scale [--workers 1024] [--steps 10] [--step-interval-s 1] [--idle-s 5]
//                     [--connections 16]
//
// The coordinator runs in a forked child (the CPU figures are its own: getrusage in the child,
// read through the Status RPC); the workers run in this process.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/control/client.h"
#include "common/logging.h"
#include "coordinator/server.h"
#include "coordinator/step_planner.h"

namespace hetpar::coordinator {
namespace {

constexpr char kToken[] = "coordinator-scale-bench-token";

struct Options {
  int64_t workers = 1024;
  int steps = 10;
  double step_interval_s = 1.0;
  double idle_s = 5.0;
  int connections = 16;
};

// Half the workers are encoder ranks (dp = workers / 2, tp 1), half LLM ranks (tp 4).
v1::RunSpec BenchSpec(const Options& options) {
  v1::RunSpec spec;
  const int64_t half = options.workers / 2;
  spec.mutable_run()->set_name("coordinator-scale");
  spec.mutable_run()->set_steps(1000000);
  spec.mutable_run()->set_global_batch(half / 2);  // llm dp = half / 4; 2 waves of 1 sample
  spec.mutable_run()->set_micro_batch(1);
  spec.mutable_run()->set_seed(1);
  spec.mutable_run()->set_grad_clip(1.0);
  spec.mutable_run()->set_dtype(v1::DTYPE_FLOAT32);
  spec.set_placement(v1::PLACEMENT_NON_COLOCATED);
  auto* em = spec.mutable_encoder()->mutable_model();
  em->set_image_size(32);
  em->set_patch(8);
  em->set_hidden(64);
  em->set_layers(2);
  em->set_heads(4);
  em->set_mlp(128);
  em->set_out_hidden(64);
  em->set_channels(3);
  auto* el = spec.mutable_encoder()->mutable_layout();
  el->set_dp(half);
  el->set_tp(1);
  el->set_cp(1);
  el->set_pp(1);
  auto* lm = spec.mutable_llm()->mutable_model();
  lm->set_hidden(64);
  lm->set_layers(2);
  lm->set_heads(4);
  lm->set_kv_heads(4);
  lm->set_ffn(128);
  lm->set_vocab(256);
  lm->set_seq_len(128);
  auto* ll = spec.mutable_llm()->mutable_layout();
  ll->set_dp(half / 4);
  ll->set_tp(4);
  ll->set_cp(1);
  ll->set_pp(1);
  spec.mutable_coordinator()->set_heartbeat_timeout_s(5);  // heartbeats every 1 s
  spec.mutable_coordinator()->set_register_timeout_s(300);
  return spec;
}

// ------------------------------------------------------------------------------------------------
// The coordinator process.

[[noreturn]] void RunCoordinatorChild(const v1::RunSpec& spec, int port_fd, int stop_fd) {
  // One line per registration of 1024 workers is not what this measures.
  SetLogLevel(LogLevel::kWarning);
  // As `hetpar coordinator` runs: without absl's lock-order graph (a debugging aid).
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  auto planner = MakeStepPlanner(spec, /*synthetic_batches=*/true);
  if (!planner.ok()) {
    std::cerr << "planner: " << planner.status() << "\n";
    _exit(1);
  }
  ServerOptions options;
  options.listen_address = "127.0.0.1:0";
  options.token = kToken;
  options.controller.step_timeout = absl::Seconds(120);
  auto server = CoordinatorServer::Create(spec, options, *std::move(planner));
  if (!server.ok()) {
    std::cerr << "coordinator: " << server.status() << "\n";
    _exit(1);
  }
  const int port = (*server)->port();
  if (write(port_fd, &port, sizeof(port)) != sizeof(port)) _exit(1);
  close(port_fd);
  char byte;
  while (read(stop_fd, &byte, 1) > 0) {
  }
  (*server)->Shutdown(absl::Seconds(1));
  _exit(0);
}

// ------------------------------------------------------------------------------------------------
// The workers.

struct SimWorker {
  std::unique_ptr<WorkerSession> session;
  v1::Assignment assignment;
  bool counts_loss = false;
  // Written by the session's message callback, read by the driver (under Bench::mu).
  bool full_assignment = false;
  int64_t plan_step = -1;
  int64_t plan_generation = 0;
  int64_t loss_tokens = 0;
  int64_t norm_step = -1;
  int64_t commit_step = -1;
};

class Bench {
 public:
  explicit Bench(Options options) : options_(options) {}

  void OnMessage(int index, const v1::CoordinatorMessage& message) {
    const int64_t now_ns = absl::GetCurrentTimeNanos();
    absl::MutexLock lock(&mu_);
    SimWorker& w = workers_[index];
    switch (message.kind_case()) {
      case v1::CoordinatorMessage::kHeartbeatAck:
        rtt_ms_.push_back((now_ns - message.heartbeat_ack().client_time_ns()) * 1e-6);
        break;
      case v1::CoordinatorMessage::kAssignment:
        if (message.assignment().peers_complete() && !w.full_assignment) {
          w.full_assignment = true;
          ++assigned_;
        }
        break;
      case v1::CoordinatorMessage::kStepPlan: {
        w.plan_step = message.step_plan().step();
        w.plan_generation = message.step_plan().generation();
        w.loss_tokens = 0;
        for (const auto& mb : message.step_plan().rank_plan().microbatches()) {
          w.loss_tokens += mb.loss_tokens();
        }
        last_plan_ns_ = std::max(last_plan_ns_, now_ns);
        ++plans_;
        break;
      }
      case v1::CoordinatorMessage::kGradNorm:
        w.norm_step = message.grad_norm().step();
        ++norms_;
        break;
      case v1::CoordinatorMessage::kCommit:
        w.commit_step = message.commit().step();
        ++commits_;
        break;
      case v1::CoordinatorMessage::kAbort:
      case v1::CoordinatorMessage::kMembershipChange:
      case v1::CoordinatorMessage::kStop:
        if (!finished_) {
          std::cerr << "unexpected message: " << message.ShortDebugString() << "\n";
          aborted_ = true;
        }
        break;
      case v1::CoordinatorMessage::kBatch:  // unpacked by WorkerSession
      case v1::CoordinatorMessage::KIND_NOT_SET:
        break;
    }
  }

  int Run(const std::string& address);

 private:
  // Waits until `counter` reaches `target` (or a step is aborted); false on timeout or abort.
  bool AwaitCount(const int64_t* counter, int64_t target, absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    auto reached = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return *counter >= target || aborted_; };
    return mu_.AwaitWithTimeout(absl::Condition(&reached), timeout) && !aborted_;
  }
  absl::StatusOr<double> CoordinatorCpu(AdminClient& admin) {
    auto status = admin.Status();
    if (!status.ok()) return status.status();
    return status->cpu_seconds();
  }

  Options options_;
  absl::Mutex mu_;
  std::vector<SimWorker> workers_;
  std::vector<double> rtt_ms_ ABSL_GUARDED_BY(mu_);
  int64_t assigned_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t plans_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t norms_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t commits_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t last_plan_ns_ ABSL_GUARDED_BY(mu_) = 0;
  bool aborted_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;  // the bench stops the run itself
};

double Percentile(std::vector<double> values, double q) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t i = std::min(values.size() - 1, static_cast<size_t>(q * (values.size() - 1) + 0.5));
  return values[i];
}

int Bench::Run(const std::string& address) {
  const int64_t n = options_.workers;
  workers_.resize(n);
  std::vector<std::shared_ptr<CoordinatorConnection>> connections;
  for (int c = 0; c < options_.connections; ++c) {
    ClientOptions client;
    client.address = address;
    client.token = kToken;
    client.dedicated_connection = true;
    client.rpc_timeout = absl::Seconds(60);
    auto connection = CoordinatorConnection::Create(client);
    if (!connection.ok()) {
      std::cerr << connection.status() << "\n";
      return 1;
    }
    connections.push_back(*connection);
  }
  AdminClient admin(connections[0]);

  // Registration: several threads register the workers; encoders first, then LLM ranks.
  const absl::Time registration_start = absl::Now();
  std::atomic<int64_t> next{0};
  std::atomic<bool> failed{false};
  std::vector<std::thread> registrars;
  for (int t = 0; t < 16; ++t) {
    registrars.emplace_back([&] {
      for (int64_t i = next++; i < n && !failed; i = next++) {
        WorkerSession::Options session;
        session.registration.set_role(i < n / 2 ? v1::WORKER_ROLE_ENCODER : v1::WORKER_ROLE_LLM);
        session.registration.set_requested_rank(i < n / 2 ? i : i - n / 2);
        session.registration.set_host(absl::StrCat("sim-", i));
        session.registration.set_data_address(
            absl::StrCat("10.0.", i / 256, ".", i % 256, ":7000"));
        const int index = static_cast<int>(i);
        session.on_message = [this, index](const v1::CoordinatorMessage& m) {
          OnMessage(index, m);
        };
        auto started = WorkerSession::Start(connections[i % connections.size()], session);
        if (!started.ok()) {
          std::cerr << "worker " << i << ": " << started.status() << "\n";
          failed = true;
          return;
        }
        SimWorker& w = workers_[i];
        w.assignment = (*started)->registration().assignment();
        w.session = *std::move(started);
        absl::MutexLock lock(&mu_);
        if (w.assignment.peers_complete() && !w.full_assignment) {
          w.full_assignment = true;
          ++assigned_;
        }
      }
    });
  }
  for (auto& t : registrars) t.join();
  if (failed) return 1;
  if (!AwaitCount(&assigned_, n, absl::Seconds(120))) {
    std::cerr << "not every worker got its assignment\n";
    return 1;
  }
  const double registration_s = absl::ToDoubleSeconds(absl::Now() - registration_start);
  for (auto& w : workers_) {
    w.assignment = w.session->assignment();
    for (const auto& rank : w.assignment.ranks()) {
      w.counts_loss = w.counts_loss || (rank.module() == v1::MODULE_LLM && rank.tp() == 0);
    }
  }
  std::cout << absl::StrFormat(
                   "{\"bench\":\"coordinator_scale\",\"metric\":\"registration\",\"workers\":%d,"
                   "\"seconds\":%.3f,\"registrations_per_s\":%.1f}",
                   n, registration_s, n / registration_s)
            << std::endl;

  // Steps start as soon as every session is open; the first plans arrive now. Hold step 0 back
  // while measuring the heartbeat-only baseline: reports are what advance steps.
  if (!AwaitCount(&plans_, n, absl::Seconds(120))) {
    std::cerr << "step 0 plans did not arrive\n";
    return 1;
  }
  {
    absl::MutexLock lock(&mu_);
    rtt_ms_.clear();
  }
  auto idle_cpu_start = CoordinatorCpu(admin);
  const absl::Time idle_start = absl::Now();
  absl::SleepFor(absl::Seconds(options_.idle_s));
  auto idle_cpu_end = CoordinatorCpu(admin);
  const double idle_wall = absl::ToDoubleSeconds(absl::Now() - idle_start);
  if (!idle_cpu_start.ok() || !idle_cpu_end.ok()) return 1;
  const double idle_fraction = (*idle_cpu_end - *idle_cpu_start) / idle_wall;
  std::cout << absl::StrFormat(
                   "{\"bench\":\"coordinator_scale\",\"metric\":\"idle_cpu\",\"workers\":%d,"
                   "\"heartbeat_hz\":1,\"seconds\":%.2f,\"fraction_of_core\":%.5f}",
                   n, idle_wall, idle_fraction)
            << std::endl;

  // Steps at one per `step_interval_s`: grad-norm partials as soon as the plan is in, reports at
  // the step's slot.
  auto step_cpu_start = CoordinatorCpu(admin);
  const absl::Time steps_start = absl::Now();
  std::vector<double> fanout_ms;
  for (int step = 0; step < options_.steps; ++step) {
    if (!AwaitCount(&plans_, n * (step + 1), absl::Seconds(60))) {
      std::cerr << "plans of step " << step << " did not arrive\n";
      return 1;
    }
    for (auto& w : workers_) {
      for (const auto& rank : w.assignment.ranks()) {
        if (rank.dp() != 0) continue;
        v1::GradNormPartial partial;
        partial.set_step(step);
        partial.set_generation(w.plan_generation);
        partial.set_module(rank.module());
        partial.set_sum_squares(1e-4);
        (void)w.session->SendGradNormPartial(partial);
      }
    }
    if (!AwaitCount(&norms_, n * (step + 1), absl::Seconds(60))) {
      std::cerr << "grad norms of step " << step << " did not arrive\n";
      return 1;
    }
    const absl::Time slot = steps_start + absl::Seconds(options_.step_interval_s * (step + 1));
    if (absl::Now() < slot) absl::SleepFor(slot - absl::Now());
    const int64_t reports_sent_ns = absl::GetCurrentTimeNanos();
    for (auto& w : workers_) {
      v1::StepReport report;
      report.set_step(step);
      report.set_generation(w.plan_generation);
      report.set_ok(true);
      if (w.counts_loss) {
        report.set_loss_tokens(w.loss_tokens);
        report.set_loss_sum(2.0 * static_cast<double>(w.loss_tokens));
      }
      (void)w.session->SendReport(report);
    }
    if (!AwaitCount(&commits_, n * (step + 1), absl::Seconds(60))) {
      std::cerr << "commits of step " << step << " did not arrive\n";
      return 1;
    }
    // The next step's plans: time from the last report sent to the last plan received.
    if (!AwaitCount(&plans_, n * (step + 2), absl::Seconds(60))) return 1;
    absl::MutexLock lock(&mu_);
    fanout_ms.push_back((last_plan_ns_ - reports_sent_ns) * 1e-6);
  }
  auto step_cpu_end = CoordinatorCpu(admin);
  const double steps_wall = absl::ToDoubleSeconds(absl::Now() - steps_start);
  if (!step_cpu_start.ok() || !step_cpu_end.ok()) return 1;
  const double cpu_per_step = (*step_cpu_end - *step_cpu_start) / options_.steps;
  const double step_fraction = (*step_cpu_end - *step_cpu_start) / steps_wall;
  std::vector<double> rtt;
  {
    absl::MutexLock lock(&mu_);
    rtt = rtt_ms_;
  }
  std::cout << absl::StrFormat(
                   "{\"bench\":\"coordinator_scale\",\"metric\":\"heartbeat_rtt\",\"workers\":%d,"
                   "\"samples\":%d,\"p50_ms\":%.3f,\"p99_ms\":%.3f,\"max_ms\":%.3f}",
                   n, rtt.size(), Percentile(rtt, 0.5), Percentile(rtt, 0.99), Percentile(rtt, 1.0))
            << std::endl;
  std::cout
      << absl::StrFormat(
             "{\"bench\":\"coordinator_scale\",\"metric\":\"step_cpu\",\"workers\":%d,"
             "\"steps\":%d,\"steps_per_s\":%.3f,\"cpu_ms_per_step\":%.2f,"
             "\"fraction_of_core\":%.5f,\"goal_fraction_of_core\":0.05,"
             "\"ratio_to_idle\":%.2f,\"plan_fanout_p50_ms\":%.1f,\"plan_fanout_max_ms\":%.1f}",
             n, options_.steps, options_.steps / steps_wall, cpu_per_step * 1e3, step_fraction,
             idle_fraction > 0 ? step_fraction / idle_fraction : 0.0, Percentile(fanout_ms, 0.5),
             Percentile(fanout_ms, 1.0))
      << std::endl;
  {
    absl::MutexLock lock(&mu_);
    finished_ = true;
  }
  (void)admin.Stop("bench over");
  for (auto& w : workers_) (void)w.session->Close(absl::Seconds(10));
  return 0;
}

// Step plan construction alone, in this process: planner + every rank's RankStepPlan.
void PlanBuild(const v1::RunSpec& spec) {
  auto planner = MakeStepPlanner(spec, true);
  auto membership = Membership::Create(spec);
  if (!planner.ok() || !membership.ok()) return;
  const int64_t half = spec.encoder().layout().dp();
  for (int64_t i = 0; i < 2 * half; ++i) {
    v1::RegisterRequest request;
    request.set_role(i < half ? v1::WORKER_ROLE_ENCODER : v1::WORKER_ROLE_LLM);
    (void)membership->Admit(request, 1, absl::Now());
  }
  constexpr int kRepeats = 5;
  const absl::Time start = absl::Now();
  size_t bytes = 0;
  for (int r = 0; r < kRepeats; ++r) {
    auto step = (*planner)->Plan(r, 1, *membership);
    if (!step.ok()) {
      std::cerr << step.status() << "\n";
      return;
    }
    bytes = 0;
    for (const auto& [id, plan] : step->worker_plans) bytes += plan.ByteSizeLong();
    (*planner)->Committed(r);
  }
  const double ms = absl::ToDoubleMilliseconds(absl::Now() - start) / kRepeats;
  std::cout << absl::StrFormat(
                   "{\"bench\":\"coordinator_scale\",\"metric\":\"plan_build\",\"ranks\":%d,"
                   "\"ms_per_step\":%.2f,\"plan_bytes_per_step\":%d}",
                   2 * half, ms, bytes)
            << std::endl;
}

}  // namespace
}  // namespace hetpar::coordinator

int main(int argc, char** argv) {
  using namespace hetpar::coordinator;  // NOLINT
  Options options;
  CLI::App app{"coordinator_scale: a coordinator serving many simulated workers"};
  app.add_option("--workers", options.workers, "Simulated workers (even, a multiple of 8)");
  app.add_option("--steps", options.steps, "Steps to time");
  app.add_option("--step-interval-s", options.step_interval_s, "Seconds per step");
  app.add_option("--idle-s", options.idle_s, "Seconds of heartbeat-only baseline");
  app.add_option("--connections", options.connections, "Client connections");
  CLI11_PARSE(app, argc, argv);
  if (options.workers < 8 || options.workers % 8 != 0) {
    std::cerr << "--workers must be a positive multiple of 8\n";
    return 2;
  }
  const hetpar::v1::RunSpec spec = BenchSpec(options);

  // Fork before anything starts gRPC in this process.
  int port_pipe[2];
  int stop_pipe[2];
  if (pipe(port_pipe) != 0 || pipe(stop_pipe) != 0) return 1;
  const pid_t child = fork();
  if (child < 0) return 1;
  if (child == 0) {
    close(port_pipe[0]);
    close(stop_pipe[1]);
    RunCoordinatorChild(spec, port_pipe[1], stop_pipe[0]);
  }
  close(port_pipe[1]);
  close(stop_pipe[0]);
  int port = 0;
  if (read(port_pipe[0], &port, sizeof(port)) != sizeof(port)) {
    std::cerr << "the coordinator did not start\n";
    return 1;
  }
  int rc = 0;
  {
    Bench bench(options);
    rc = bench.Run(absl::StrCat("127.0.0.1:", port));
  }
  close(stop_pipe[1]);
  int status = 0;
  waitpid(child, &status, 0);
  PlanBuild(spec);
  return rc;
}
