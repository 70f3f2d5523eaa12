// The LLM role's step: for each wave in order, receive the microbatch's image rows from the
// encoder ranks, share them inside the TP group, run forward and backward, and send the
// gradient of every received row back to the encoder rank that sent it.
//
// Image rows: the rank's per-wave buffer holds its microbatch's image rows in sample and image
// order (plan/boundary_plan.h). Each block lands on one TP rank; a TP all-reduce of the buffer
// (zeros where another rank landed) gives every TP rank all rows (the plan's LLM share step).
// The buffer is an autograd leaf; its gradient is the same on every TP rank after the model's
// input all-reduce, or partial per rank under sequence parallelism, where a TP all-reduce
// completes it before the lander sends its rows back.
//
// Loss: each microbatch contributes sum(token losses) / N_global; the step's token-loss sum and
// loss-token count are reported so the coordinator can form the global batch's loss. After the
// last wave the parameter gradients are summed over the DP group.
//
// Pipeline parallelism (the model is stage s of S > 1): the rank runs the replica's M
// microbatches in the 1F1B order (Megatron's non-interleaved schedule): min(S - s - 1, M)
// forwards, then one forward and one backward at a time, then the remaining backwards. Only the
// first stage receives image rows and sends their gradients back; a later stage receives its
// input from the previous stage (train::StageLink) and sends the input's gradient back to it; a
// stage other than the last sends its output on and receives the output's gradient. The last
// stage computes the loss. Sends are posted and waited for at the end of the step; every
// receive is posted one microbatch ahead of the one that needs it. Without PP (S = 1) the
// schedule is forward and backward of each microbatch in turn.
#ifndef HETPAR_LLM_TRAINER_LLM_RUNTIME_H_
#define HETPAR_LLM_TRAINER_LLM_RUNTIME_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/data/batch_source.h"
#include "common/nn/communicator.h"
#include "common/nn/compute_spans.h"
#include "common/plan/step_plan.h"
#include "common/train/boundary.h"
#include "common/train/grad_reducer.h"
#include "common/train/stage_link.h"
#include "llm_trainer/language_model.h"

namespace hetpar::llm {

struct LlmStepStats {
  // The sum over this replica's microbatches of sum(token losses)/N_global, a float64 scalar on
  // the model's device (undefined off the last pipeline stage): RunStep does not wait for the
  // device to compute it; the module reads it with the step's gradient norm (one host sync).
  at::Tensor loss;
  int64_t loss_tokens = 0;  // loss tokens of this replica's microbatches
  int64_t tokens = 0;       // sequence positions of this replica's microbatches
  int64_t images = 0;
  // Forward and backward, each a span: the device's time on a GPU, read (Seconds) after the
  // step's host sync (LlmModule::RunStep).
  nn::ComputeSpans compute;
  double bridge_wait_s = 0;    // waiting for image rows and for gradient sends to complete
  double collective_s = 0;     // TP share of image rows and gradients, DP gradient sum
  double pipeline_wait_s = 0;  // waiting for the neighbouring stages' activations and gradients
  int64_t pipeline_bytes = 0;  // activation and gradient rows sent to the neighbouring stages
  double data_s = 0;           // loading and tokenizing the samples (before the first wave waits)
  int64_t bytes_sent = 0;
  int64_t bytes_received = 0;
};

struct LlmRuntimeOptions {
  absl::Duration timeout = absl::Seconds(120);  // bound of every boundary wait
  // Colocated schedule: the encoder ranks take the gradients only in their backward phase, after
  // this step returns, so RunStep leaves its gradient sends pending for WaitForSends.
  bool defer_send_wait = false;
  // How many waves past the one computing have their image-row buffers allocated and receives
  // posted (0: all of the step's waves). The encoder runs at most run.max_inflight waves ahead,
  // so more never has data to land and would only hold buffers.
  int64_t post_ahead = 0;
  // Whether the image rows' gradients go back to the encoder (false for a frozen encoder:
  // plan::ImageGradientsCross).
  bool image_gradients = true;
  // The DP gradient all-reduce bucket size (run.grad_bucket_mib).
  int64_t grad_bucket_bytes = int64_t{25} << 20;
};

// The model's neighbouring pipeline stages: the ranks of the same (dp, cp, tp) one stage before
// and after (-1 where there is none) and the link to them. Without PP, none.
struct PipelinePeers {
  train::StageLink* link = nullptr;
  int64_t previous_rank = -1;
  int64_t next_rank = -1;
};

// Borrows everything; one thread calls RunStep.
class LlmRuntime {
 public:
  LlmRuntime(LanguageModel* model, nn::Communicator* tp, nn::Communicator* dp,
             const data::BatchSource* data, train::BoundaryCommunicator* boundary,
             const LlmRuntimeOptions& options, PipelinePeers pipeline = {})
      : model_(model),
        tp_(tp),
        dp_(dp),
        data_(data),
        boundary_(boundary),
        options_(options),
        pipeline_(pipeline) {}

  absl::StatusOr<LlmStepStats> RunStep(const plan::RankStepPlan& plan);
  // Waits for the gradient sends RunStep left pending (defer_send_wait).
  absl::Status WaitForSends();
  // With pipeline stages: the attempt of `plan` failed or was aborted (or was not run on this
  // rank), and the stage link absorbs the neighbouring stages' messages of it
  // (train::StageLink::Abandon), sized from the plan's samples.
  void AbandonStage(const plan::RankStepPlan& plan);

 private:
  // The plan's samples, microbatch by microbatch; counts their tokens and images into `stats`
  // (may be null).
  absl::StatusOr<std::vector<std::vector<LlmSample>>> LoadSamples(const plan::RankStepPlan& plan,
                                                                  LlmStepStats* stats) const;

  LanguageModel* model_;
  nn::Communicator* tp_;
  nn::Communicator* dp_;
  const data::BatchSource* data_;
  train::BoundaryCommunicator* boundary_;
  LlmRuntimeOptions options_;
  PipelinePeers pipeline_;
  std::vector<train::PendingSends> deferred_;
  std::unique_ptr<train::GradientReducer> reducer_;  // created at the first step
  struct StageRows {
    int64_t step = -1;
    int64_t attempt = -1;
    std::vector<int64_t> rows;  // per microbatch, this rank's rows of a stage message
  };
  StageRows stage_rows_;  // of the last attempt whose samples were loaded
};

}  // namespace hetpar::llm

#endif  // HETPAR_LLM_TRAINER_LLM_RUNTIME_H_
