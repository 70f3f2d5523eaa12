#include "coordinator/cli/step_metrics.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/logging.h"
#include "common/plan/flops.h"
#include "common/status.h"
#include "common/trace/recorder.h"
#include "coordinator/cli/local_process.h"

namespace hetpar::cli {

nlohmann::json StepMetricsLine(const v1::StepTiming& t, double peak_tflops) {
  nlohmann::json line = {{"step", t.step()},
                         {"loss", t.loss()},
                         {"grad_norm", t.grad_norm()},
                         {"tokens", t.tokens()},
                         {"images", t.images()},
                         {"step_time_s", t.duration_s()},
                         {"generation", t.generation()}};
  // A step whose gradient norm was not finite is committed without an update.
  if (t.skipped()) line["skipped"] = true;
  double model_flops = 0;
  for (const auto& [module, m] : t.modules()) model_flops += m.model_flops();
  line["tflops"] = plan::AchievedRate(model_flops, t.duration_s(), 1, 0).tflops;
  for (const auto& [module, m] : t.modules()) {
    nlohmann::json j = {{"compute_s", m.compute_s()},
                        {"bridge_wait_s", m.bridge_wait_s()},
                        {"collective_s", m.collective_s()},
                        {"idle_s", m.idle_s()},
                        {"data_s", m.data_s()},
                        {"grad_norm_wait_s", m.grad_norm_wait_s()},
                        {"optimizer_s", m.optimizer_s()},
                        {"bridge_messages", m.bridge_messages()},
                        {"bridge_bytes", m.bridge_bytes()},
                        {"bridge_transfer_s", m.bridge_transfer_s()}};
    const plan::FlopRate rate =
        plan::AchievedRate(m.model_flops(), t.duration_s(), m.ranks(), peak_tflops);
    j["model_tflop"] = m.model_flops() / 1e12;
    j["tflops"] = rate.tflops;
    j["tflops_per_rank"] = rate.tflops_per_rank;
    if (rate.utilization >= 0) j["utilization"] = rate.utilization;
    if (module == "encoder") {
      j["peak_live_jobs"] = m.peak_live_jobs();
      j["peak_live_output_bytes"] = m.peak_live_output_bytes();
    }
    line[module] = std::move(j);
  }
  return line;
}

namespace {

const char* PoolChangeKindName(v1::PoolChangeKind kind) {
  switch (kind) {
    case v1::POOL_CHANGE_JOINED:
      return "joined";
    case v1::POOL_CHANGE_REMOVED:
      return "removed";
    case v1::POOL_CHANGE_LOST:
    case v1::POOL_CHANGE_KIND_UNSPECIFIED:
    case v1::PoolChangeKind_INT_MIN_SENTINEL_DO_NOT_USE_:
    case v1::PoolChangeKind_INT_MAX_SENTINEL_DO_NOT_USE_:
      break;
  }
  return "lost";
}

}  // namespace

absl::Status StepMetricsWriter::WriteLedger(const v1::StatusResponse& status) {
  if (status.samples_trained() <= 0) return absl::OkStatus();
  const nlohmann::json line = {{"ledger",
                                {{"trained", status.samples_trained()},
                                 {"repeated", status.samples_repeated()},
                                 {"lost", status.samples_lost()}}}};
  return dir_->AppendMetrics(line.dump());
}

absl::Status StepMetricsWriter::Follow(const v1::StatusResponse& status,
                                       const std::vector<v1::StepTiming>& committed) {
  // The coordinator hands each committed step over once: what cannot be written now is kept and
  // written first next time.
  pending_.insert(pending_.end(), committed.begin(), committed.end());
  for (; !pending_.empty(); pending_.pop_front()) {
    const v1::StepTiming& t = pending_.front();
    if (!t.committed() || t.step() < written_) continue;
    if (t.step() > written_) {
      HETPAR_LOG(WARNING) << "metrics of steps " << written_ << " to " << t.step() - 1
                          << " were committed but not seen; their lines are missing";
    }
    if (absl::Status s = dir_->AppendMetrics(StepMetricsLine(t, peak_tflops_).dump()); !s.ok()) {
      return s;
    }
    written_ = t.step() + 1;
    if (on_step_) on_step_(t);
  }
  // A replica that left the run: one line once the run has recovered from it (its next step
  // committed), with the time that took.
  for (; pool_changes_written_ < status.pool_changes_size(); ++pool_changes_written_) {
    const v1::PoolChange& change = status.pool_changes(pool_changes_written_);
    if (change.recovery_s() < 0) break;
    nlohmann::json line = {{"pool_change",
                            {{"step", change.step()},
                             {"generation", change.generation()},
                             {"module", change.module() == v1::MODULE_LLM ? "llm" : "encoder"},
                             {"kind", PoolChangeKindName(change.kind())},
                             {"replica", change.replica()},
                             {"replicas", change.replicas_after()},
                             {"cause", change.cause()},
                             {"unix_time", change.unix_time()},
                             {"recovery_s", change.recovery_s()}}}};
    if (absl::Status s = dir_->AppendMetrics(line.dump()); !s.ok()) return s;
  }
  return absl::OkStatus();
}

ProgressLine::ProgressLine(int64_t total_steps, int64_t first_step, int64_t log_every,
                           double log_every_s, bool tty, absl::Time start, std::FILE* out)
    : total_(total_steps),
      first_step_(first_step),
      log_every_(std::max<int64_t>(1, log_every)),
      log_every_s_(log_every_s),
      tty_(tty),
      start_(start),
      last_line_(start),
      out_(out) {}

void ProgressLine::Committed(const v1::StepTiming& step, absl::Time now) {
  constexpr size_t kRateWindow = 20;
  if (commits_.empty()) {
    // From the first step's start: the wait for workers and the data set before it is no step's.
    start_ = std::min(now, std::max(start_, now - absl::Seconds(step.duration_s())));
    last_line_ = start_;
  }
  double step_flops = 0;
  for (const auto& [module, split] : step.modules()) step_flops += split.model_flops();
  commits_.push_back({now, step.tokens(), step_flops});
  if (commits_.size() > kRateWindow + 1) commits_.pop_front();
  const int64_t done = step.step() + 1;
  if (!tty_ && done != total_ && done % log_every_ != 0 &&
      !(log_every_s_ > 0 && absl::ToDoubleSeconds(now - last_line_) >= log_every_s_)) {
    return;
  }
  last_line_ = now;
  // The commit before a full window is kept as its start.
  const bool full = commits_.size() == kRateWindow + 1;
  int64_t window_tokens = 0;
  double window_flops = 0;
  for (size_t i = full ? 1 : 0; i < commits_.size(); ++i) {
    window_tokens += commits_[i].tokens;
    window_flops += commits_[i].model_flops;
  }
  const double window_s =
      std::max(absl::ToDoubleSeconds(now - (full ? commits_.front().when : start_)), 1e-9);
  // Model FLOPs of both modules (common/plan/flops.h) over the same window.
  const double flops_per_s = window_flops / window_s;
  const std::string rate = flops_per_s >= 1e12 ? absl::StrFormat("%.2f TFLOPS", flops_per_s / 1e12)
                                               : absl::StrFormat("%.1f GFLOP/s", flops_per_s / 1e9);
  // This process's steps: a resumed run's earlier steps took no time here.
  const int64_t here = std::max<int64_t>(1, done - first_step_);
  const double eta_s = absl::ToDoubleSeconds(now - start_) / here * (total_ - done);
  constexpr int kWidth = 24;
  const int filled = total_ > 0 ? static_cast<int>(kWidth * done / total_) : 0;
  const std::string bar = std::string(filled, '#') + std::string(kWidth - filled, '.');
  const std::string text =
      absl::StrFormat("step %d/%d [%s] loss %.4f  %.0f tok/s  %s  ETA %s", done, total_, bar,
                      step.loss(), window_tokens / window_s, rate, HumanDuration(eta_s));
  if (tty_) {
    std::fprintf(out_, "\r%s   ", text.c_str());
    if (done == total_) std::fprintf(out_, "\n");
  } else {
    std::fprintf(out_, "%s\n", text.c_str());
  }
  std::fflush(out_);
}

std::string HumanDuration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const int64_t s = static_cast<int64_t>(seconds + 0.5);
  if (s >= 3600) return absl::StrFormat("%dh%02dm", s / 3600, (s / 60) % 60);
  if (s >= 60) return absl::StrFormat("%dm%02ds", s / 60, s % 60);
  return absl::StrFormat("%ds", s);
}

// Sums the owned-parameter files the workers of DP replica 0 write.
absl::StatusOr<nlohmann::json> FinalParams(const std::string& out_dir, const v1::RunSpec& spec) {
  std::map<std::string, std::pair<double, double>> sums;
  std::map<std::string, int64_t> ranks;  // module -> the files of DP replica 0 read
  std::error_code ec;
  int64_t files = 0;  // every sums file, of any replica
  for (const auto& entry : std::filesystem::directory_iterator(out_dir + "/workers", ec)) {
    if (entry.path().extension() != ".json") continue;  // rank-<r>.json; not the .steps.jsonl
    ++files;
    std::ifstream in(entry.path());
    nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
    if (j.is_discarded()) {
      return absl::DataLossError(absl::StrCat("cannot parse '", entry.path().string(), "'"));
    }
    if (j["dp"].get<int64_t>() != 0) continue;
    auto& s = sums[j["module"].get<std::string>()];
    s.first += j["sum"].get<double>();
    s.second += j["square_sum"].get<double>();
    ++ranks[j["module"].get<std::string>()];
  }
  if (files == 0) {
    return absl::NotFoundError(
        absl::StrCat("no worker sent its parameter sums (", out_dir, "/workers)"));
  }
  // Every TP rank of every stage of replica 0 (its CP rank 0) sends its share: a sum of fewer,
  // or none of a module while other workers sent theirs, is not the model's.
  for (const auto& [module, layout] :
       {std::pair<std::string, const v1::Layout*>{"encoder", &spec.encoder().layout()},
        {"llm", &spec.llm().layout()}}) {
    const int64_t expected =
        std::max<int64_t>(1, layout->tp()) * std::max<int64_t>(1, layout->pp());
    if (ranks[module] != expected) {
      return absl::DataLossError(absl::StrCat(
          "the workers' parameter sums under '", out_dir, "/workers' are incomplete: ",
          ranks[module], " of the ", expected, " ranks of the ", module,
          "'s DP replica 0 sent theirs"));
    }
  }
  nlohmann::json out;
  for (const auto& [module, s] : sums)
    out[module] = {{"sum", s.first}, {"l2", std::sqrt(s.second)}};
  return out;
}

void ClearRunOutputs(const std::string& out_dir) {
  std::error_code ec;
  std::filesystem::remove_all(out_dir + "/workers", ec);
  std::filesystem::remove_all(out_dir + "/trace", ec);
  std::filesystem::remove(out_dir + "/trace.json", ec);
  std::filesystem::remove(out_dir + "/eval.json", ec);
  for (const auto& entry : std::filesystem::directory_iterator(out_dir + "/model", ec)) {
    // Pipeline stages' parts of an earlier run would be joined with this run's.
    if (entry.path().filename().string().find(".hpar.stage-") != std::string::npos) {
      std::filesystem::remove(entry.path(), ec);
    }
  }
}

absl::Status FinishRunDirectory(RunDirectory& dir, const v1::RunSpec& spec, int threads,
                                std::string* eval_line, std::string* evaluation_error,
                                const std::function<bool()>& interrupted) {
  const std::string& out_dir = dir.path();
  HETPAR_ASSIGN_OR_RETURN(nlohmann::json params, FinalParams(out_dir, spec));
  HETPAR_RETURN_IF_ERROR(dir.AppendMetrics(nlohmann::json{{"final_params", params}}.dump()));
  if (std::filesystem::exists(out_dir + "/trace")) {
    absl::StatusOr<int64_t> events =
        trace::MergeTraceFiles(out_dir + "/trace", out_dir + "/trace.json");
    if (events.ok()) {
      HETPAR_LOG(INFO) << "timeline: " << out_dir << "/trace.json (" << *events
                       << " events; open it in https://ui.perfetto.dev)";
    } else {
      HETPAR_LOG(WARNING) << "no timeline: " << events.status().message();
    }
  }
  if (spec.data().val_manifest().empty()) return absl::OkStatus();
  for (const char* module : {"encoder", "llm"}) {
    const std::string model = absl::StrCat(out_dir, "/model/", module, ".hpar");
    if (!std::filesystem::exists(model)) {
      return absl::DataLossError(absl::StrCat("cannot evaluate: ", model,
                                              " is missing (DP replica 0 of the ", module,
                                              " sends it when the run ends)"));
    }
  }
  HETPAR_LOG(INFO) << "evaluating the validation split with and without images";
  std::vector<std::string> argv = {WorkerBinary("hetpar-reference"), "evaluate", "--config",
                                   out_dir + "/config.yaml",         "--out",    out_dir};
  if (threads > 0) argv.insert(argv.end(), {"--threads", std::to_string(threads)});
  absl::StatusOr<std::unique_ptr<LocalProcess>> evaluator =
      LocalProcess::Spawn("evaluate", argv, {}, dir.LogPath("evaluate"));
  if (!evaluator.ok()) return evaluator.status();
  const int code = (*evaluator)->WaitOrKill(absl::Minutes(30), interrupted);
  if (interrupted && interrupted()) {
    return absl::CancelledError(
        absl::StrCat("interrupted during the evaluation (its log: ", dir.LogPath("evaluate"), ")"));
  }
  std::ifstream in(out_dir + "/eval.json");
  std::string line;
  if (code != 0 || !std::getline(in, line)) {
    const std::string failed =
        absl::StrCat("the evaluation failed (exit ", code, "):\n", (*evaluator)->LogTail(10));
    if (evaluation_error == nullptr) return absl::InternalError(failed);
    *evaluation_error = absl::StrCat(
        failed, "\nThe run's model is in ", out_dir, "/model; evaluate it where run.device (",
        spec.run().device().empty() ? "cpu" : spec.run().device(), ") is at hand: ",
        WorkerBinary("hetpar-reference"), " evaluate --config ", out_dir, "/config.yaml --out ",
        out_dir);
    return absl::OkStatus();
  }
  HETPAR_RETURN_IF_ERROR(dir.AppendMetrics(line));
  if (eval_line != nullptr) *eval_line = line;
  return absl::OkStatus();
}

}  // namespace hetpar::cli
