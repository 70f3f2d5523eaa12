// `hetpar status`: what a running coordinator knows about its run.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/cli_checks.h"
#include "common/plan/flops.h"
#include "coordinator/cli/commands.h"
#include "coordinator/cli/connection_flags.h"
#include "coordinator/membership.h"
#include "coordinator/run_controller.h"
#include "google/protobuf/util/json_util.h"

namespace hetpar::cli {
namespace {

std::string Seconds(double s) {
  if (s < 10) return absl::StrFormat("%.1fs", s);
  if (s < 3600) return absl::StrFormat("%.0fs", s);
  return absl::StrFormat("%.1fh", s / 3600);
}

std::string RanksText(const v1::WorkerStatus& w) {
  std::vector<std::string> parts;
  for (const auto& r : w.ranks()) {
    std::string text = absl::StrCat(coordinator::ModuleName(r.module()), " ", r.rank(), " (dp ",
                                    r.dp(), " tp ", r.tp());
    if (r.module() == v1::MODULE_LLM) absl::StrAppend(&text, " cp ", r.cp(), " pp ", r.pp());
    parts.push_back(text + ")");
  }
  return absl::StrJoin(parts, " + ");
}

void PrintStatus(const v1::StatusResponse& s) {
  // A run that ended before its last step stopped; it is not done.
  const bool stopped = s.state() == v1::RUN_STATE_DONE && s.committed_steps() < s.total_steps();
  std::cout << "run " << s.run_name() << ": "
            << (stopped ? std::string("stopped")
                        : std::string(coordinator::RunStateName(s.state())))
            << (s.state_message().empty() ? "" : " (" + s.state_message() + ")") << "\n";
  std::cout << "coordinator " << s.listen_address() << ", up " << Seconds(s.uptime_s()) << ", cpu "
            << absl::StrFormat("%.2fs", s.cpu_seconds()) << ", generation " << s.generation()
            << "\n";
  int64_t alive = 0;
  for (const auto& w : s.workers()) alive += w.alive() ? 1 : 0;
  std::cout << "workers: " << alive << " of " << s.expected_workers() << " registered\n";
  std::cout << "steps: " << s.committed_steps() << " of " << s.total_steps() << " committed";
  if (s.skipped_steps() > 0) {
    std::cout << " (" << s.skipped_steps() << " skipped: gradient norm not finite)";
  }
  if (s.step_in_flight() >= 0) std::cout << ", step " << s.step_in_flight() << " in flight";
  if (!s.data_position().empty()) std::cout << ", data at " << s.data_position();
  std::cout << "\n";
  if (s.encoder_replicas_configured() > 0) {
    std::cout << "pools: encoder " << s.encoder_replicas() << " of "
              << s.encoder_replicas_configured() << " replicas (target "
              << s.encoder_replicas_target() << "), llm " << s.llm_replicas() << " of "
              << s.llm_replicas_configured() << " replicas training\n";
    if (s.encoder_replicas_open_size() > 0) {
      std::cout << "  encoder replicas admitting workers: "
                << absl::StrJoin(s.encoder_replicas_open(), ", ") << " ("
                << s.encoder_workers_joining() << " worker(s) registered, joining at the next "
                << "step boundary once a replica's ranks are all there)\n";
    }
    if (s.llm_replicas_open_size() > 0) {
      std::cout << "  llm replicas admitting a replacement: "
                << absl::StrJoin(s.llm_replicas_open(), ", ") << "\n";
    }
    for (const v1::PoolChange& change : s.pool_changes()) {
      const char* what = change.kind() == v1::POOL_CHANGE_JOINED    ? "joined"
                         : change.kind() == v1::POOL_CHANGE_REMOVED ? "was removed"
                                                                    : "was lost";
      std::cout << "  step " << change.step() << ", generation " << change.generation() << ": "
                << (change.module() == v1::MODULE_LLM ? "llm" : "encoder") << " replica "
                << change.replica() << " " << what << " (" << change.replicas_after()
                << " training); "
                << (change.recovery_s() >= 0 ? absl::StrCat("next step committed ",
                                                            Seconds(change.recovery_s()), " later")
                                             : std::string("next step not committed yet"))
                << " - " << change.cause() << "\n";
    }
  }
  if (s.samples_trained() > 0) {
    std::cout << "samples: " << s.samples_trained() << " trained, " << s.samples_repeated()
              << " repeated, " << s.samples_lost() << " lost (exactly once when both are 0)\n";
  }
  if (s.missing_size() > 0) {
    std::cout << "missing " << s.missing_size();
    if (s.missing_deadline_s() > 0) {
      std::cout << " (the run fails in " << Seconds(s.missing_deadline_s())
                << " unless they register)";
    }
    std::cout << ":\n";
    for (const auto& line : s.missing()) std::cout << "  " << line << "\n";
  }
  if (s.workers_size() > 0) {
    std::vector<std::vector<std::string>> rows = {
        {"WORKER", "ROLE", "RANKS", "HOST", "DATA ADDRESS", "HEARTBEAT", "STATE"}};
    for (const auto& w : s.workers()) {
      std::string state = w.alive() ? (w.session_open() ? "alive" : "registered") : "dead";
      if (!w.alive() && !w.dead_reason().empty()) state += ": " + w.dead_reason();
      if (w.alive() && !w.progress().phase().empty()) {
        state += absl::StrCat(" (step ", w.progress().step(), " ", w.progress().phase(), ")");
      }
      rows.push_back({w.worker_id(), coordinator::RoleName(w.role()), RanksText(w),
                      w.host().empty() ? "-" : w.host(),
                      coordinator::DataAddressText(w.data_address()),
                      w.alive() ? Seconds(w.last_heartbeat_age_s()) + " ago" : "-", state});
    }
    std::vector<size_t> width(rows[0].size(), 0);
    for (const auto& row : rows) {
      for (size_t i = 0; i < row.size(); ++i) width[i] = std::max(width[i], row[i].size());
    }
    for (const auto& row : rows) {
      std::string line = " ";
      for (size_t i = 0; i < row.size(); ++i) {
        line += " " + row[i];
        if (i + 1 < row.size()) line += std::string(width[i] - row[i].size(), ' ');
      }
      std::cout << line << "\n";
    }
  }
  if (s.recent_steps_size() > 0) {
    std::cout << "recent steps:\n";
    for (const auto& t : s.recent_steps()) {
      if (t.committed()) {
        std::cout << absl::StrFormat("  step %d  %.3fs  loss %.4f  grad norm %.4f\n", t.step(),
                                     t.duration_s(), t.loss(), t.grad_norm());
        const std::map<std::string, v1::ModuleStepSplit> modules(t.modules().begin(),
                                                                 t.modules().end());
        for (const auto& [module, m] : modules) {
          const plan::FlopRate rate =
              plan::AchievedRate(m.model_flops(), t.duration_s(), m.ranks(), s.peak_tflops());
          std::string flops =
              absl::StrFormat("  %.4g TFLOPS (%.4g per rank", rate.tflops, rate.tflops_per_rank);
          if (rate.utilization >= 0) {
            absl::StrAppendFormat(&flops, ", %.1f%% of peak", 100 * rate.utilization);
          }
          std::cout << absl::StrFormat(
              "    %-7s compute %.3fs  bridge wait %.3fs  collective %.3fs  idle %.3fs%s)\n",
              module, m.compute_s(), m.bridge_wait_s(), m.collective_s(), m.idle_s(), flops);
        }
      } else {
        std::cout << absl::StrFormat("  step %d  %.3fs  aborted: %s\n", t.step(), t.duration_s(),
                                     t.abort_reason());
      }
    }
  }
}

std::string JsonText(const v1::StatusResponse& status) {
  std::string json;
  google::protobuf::util::JsonPrintOptions options;
  options.always_print_primitive_fields = true;
  (void)google::protobuf::util::MessageToJsonString(status, &json, options);
  return json;
}

// `--watch`: on a terminal the screen is cleared and redrawn; otherwise each status is printed
// after a blank line (one JSON object per line with --json). Ends when the run is done or
// failed (exit 0 or 1), or when the coordinator stops answering (exit 1, saying why).
int Watch(coordinator::AdminClient& admin, double interval_s, bool json) {
  const bool tty = ::isatty(STDOUT_FILENO) != 0;
  bool first = true;
  while (true) {
    absl::StatusOr<v1::StatusResponse> status = admin.Status();
    if (!status.ok()) {
      std::cerr << "hetpar: " << status.status().message() << "\n";
      return kExitFailure;
    }
    if (json) {
      std::cout << JsonText(*status) << std::endl;
    } else {
      if (tty) {
        std::cout << "\033[H\033[2J";  // home, clear
      } else if (!first) {
        std::cout << "\n";
      }
      PrintStatus(*status);
      std::cout << std::flush;
    }
    first = false;
    if (status->state() == v1::RUN_STATE_DONE) return kExitOk;
    if (status->state() == v1::RUN_STATE_FAILED) return kExitFailure;
    absl::SleepFor(absl::Seconds(interval_s));
  }
}

void AddStatusCommand(CLI::App& app, int* exit_code) {
  struct Flags {
    ConnectionFlags connection;
    bool json = false;
    bool watch = false;
    double interval_s = 2;
  };
  auto flags = std::make_shared<Flags>();
  CLI::App* command = app.add_subcommand(
      "status",
      "Show a running coordinator's run: state, generation, workers (role, rank, host, last "
      "heartbeat), missing ranks, steps and recent step times");
  AddConnectionFlags(command, &flags->connection);
  command->add_flag("--json", flags->json, "Print the StatusResponse as JSON");
  command->add_flag("--watch", flags->watch,
                    "Redraw the status every --interval seconds until the run ends (Ctrl-C "
                    "leaves); in a log, print it each time");
  command->add_option("--interval", flags->interval_s, "Seconds between redraws with --watch")
      ->check(hetpar::kPositiveNumber)
      ->capture_default_str();
  command->callback([flags, exit_code] {
    auto connection = ConnectFromFlags(flags->connection);
    if (!connection.ok()) {
      std::cerr << "hetpar: " << connection.status().message() << "\n";
      *exit_code = absl::IsInvalidArgument(connection.status()) ? kExitInvalidInput : kExitFailure;
      return;
    }
    coordinator::AdminClient admin(*connection);
    if (flags->watch) {
      *exit_code = Watch(admin, flags->interval_s, flags->json);
      return;
    }
    auto status = admin.Status();
    if (!status.ok()) {
      std::cerr << "hetpar: " << status.status().message() << "\n";
      *exit_code = kExitFailure;
      return;
    }
    if (flags->json) {
      std::string json;
      google::protobuf::util::JsonPrintOptions options;
      options.add_whitespace = true;
      options.always_print_primitive_fields = true;
      (void)google::protobuf::util::MessageToJsonString(*status, &json, options);
      std::cout << json;
    } else {
      PrintStatus(*status);
    }
    *exit_code = kExitOk;
  });
}

}  // namespace

HETPAR_REGISTER_COMMAND(21, AddStatusCommand);

}  // namespace hetpar::cli
