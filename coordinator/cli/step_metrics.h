// The per-step lines of a run's metrics.jsonl, made from the coordinator's record of committed
// steps (v1::StepTiming). `hetpar run` and `hetpar coordinator` write the same lines:
//
//   {"step", "loss", "grad_norm", "tokens", "images", "step_time_s", "generation",
//    "encoder": {...}, "llm": {...}}
//
// with each module's split as in v1::ModuleStepSplit.
#ifndef HETPAR_COORDINATOR_CLI_STEP_METRICS_H_
#define HETPAR_COORDINATOR_CLI_STEP_METRICS_H_

#include <cstdint>
#include <cstdio>
#include <deque>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/run_directory.h"
#include "hetpar/v1/coordinator.pb.h"
#include "nlohmann/json.hpp"

namespace hetpar::cli {

// `peak_tflops` (run.peak_tflops, per rank) adds each module's "utilization" when > 0.
nlohmann::json StepMetricsLine(const v1::StepTiming& step, double peak_tflops = 0);

// Appends each committed step's line, oldest first, once, from what the coordinator's
// TakeCommittedSteps returns (its server made with controller.keep_committed_steps, so that no
// step is missed however many commit between two calls), and the pool-change lines from its
// status.
class StepMetricsWriter {
 public:
  // `on_step` (optional) sees each step written. `first_step`: the first step the run trains
  // (a resumed run starts at its checkpoint's step).
  explicit StepMetricsWriter(RunDirectory* dir, double peak_tflops = 0,
                             std::function<void(const v1::StepTiming&)> on_step = nullptr,
                             int64_t first_step = 0)
      : dir_(dir), peak_tflops_(peak_tflops), on_step_(std::move(on_step)), written_(first_step) {}

  // `committed`: the steps committed since the last call, oldest first. A gap (a step missing
  // from them) is reported in the log. Steps whose line could not be written (the error is
  // returned) are written first on the next call.
  absl::Status Follow(const v1::StatusResponse& status,
                      const std::vector<v1::StepTiming>& committed);
  // At the run's end: the sample ledger's line, {"ledger": {"trained", "repeated", "lost"}}
  // (exactly-once data when repeated and lost are 0). Nothing when no sample was trained.
  absl::Status WriteLedger(const v1::StatusResponse& status);
  int64_t written() const { return written_; }  // the next step expected

 private:
  RunDirectory* dir_;
  double peak_tflops_;
  std::function<void(const v1::StepTiming&)> on_step_;
  int64_t written_;
  std::deque<v1::StepTiming> pending_;  // taken from the coordinator, not written yet
  int pool_changes_written_ = 0;
};

// The progress line of a run, the same for `hetpar run` and `hetpar coordinator`:
//
//   step 120/3000 [#.......................] loss 4.1023  5210 tok/s  1.2 GFLOP/s  ETA 9m30s
//
// the token and model-FLOP rates over the last 20 committed steps (from the first step's start
// until there are that many), the ETA from this process's steps so far (the wait for workers
// before the first step counts for none). On a terminal (`tty`) the line
// redraws at every step; in a log, one line every `log_every` steps (run.log_every), once
// `log_every_s` seconds have passed since the last line (when > 0), and at the last step.
class ProgressLine {
 public:
  ProgressLine(int64_t total_steps, int64_t first_step, int64_t log_every, double log_every_s,
               bool tty, absl::Time start, std::FILE* out);
  // A committed step, as StepMetricsWriter's on_step sees it.
  void Committed(const v1::StepTiming& step, absl::Time now);

 private:
  struct Commit {
    absl::Time when;
    int64_t tokens;
    double model_flops;
  };
  int64_t total_;
  int64_t first_step_;
  int64_t log_every_;
  double log_every_s_;
  bool tty_;
  absl::Time start_;
  absl::Time last_line_;
  std::FILE* out_;
  std::deque<Commit> commits_;
};

// A duration for people: "42s", "3m07s", "2h05m"; "?" for a negative or infinite one.
std::string HumanDuration(double seconds);

// The final parameter line's value, {"encoder": {"sum", "l2"}, "llm": {...}}, from the
// owned-parameter sums the workers of DP replica 0 sent into <out_dir>/workers
// (common/worker/outputs.h). NotFound when no worker sent any (workers that send no outputs),
// DataLoss when not every rank that holds replica 0's parameters (TP x PP of each module's
// layout in `spec`) sent its sums.
absl::StatusOr<nlohmann::json> FinalParams(const std::string& out_dir, const v1::RunSpec& spec);

// Removes what a previous run left in the run directory that the coordinator's end-of-run steps
// read (the workers' sums, timelines, the evaluation), so that they never mix two runs.
void ClearRunOutputs(const std::string& out_dir);

// The end of a run that is done, the same for `hetpar run` and `hetpar coordinator`: appends the
// final parameter line, merges the workers' timelines when they left some (`trace/`), and, when
// the RunSpec has a validation split, evaluates the model files the workers sent
// (`hetpar-reference evaluate`, its log in log/evaluate.log, `threads` intra-op threads; 0: its
// default) and appends the {"eval": ...} line. `eval_line` receives that line. Progress goes to
// the log; errors name what is missing. With `evaluation_error`, a failed evaluation is told
// there (with how to run it again) instead of failing the call: the model is saved by then.
// `interrupted` (optional), polled while the evaluation runs: once true, the evaluation is ended
// (SIGINT) and the call returns Cancelled.
absl::Status FinishRunDirectory(RunDirectory& dir, const v1::RunSpec& spec, int threads,
                                std::string* eval_line, std::string* evaluation_error = nullptr,
                                const std::function<bool()>& interrupted = {});

}  // namespace hetpar::cli

#endif  // HETPAR_COORDINATOR_CLI_STEP_METRICS_H_
