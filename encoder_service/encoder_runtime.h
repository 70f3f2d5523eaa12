// The encoder role's step: encode this replica's jobs wave by wave, send each job's blocks to
// the LLM ranks that need them, and backpropagate each job once its gradients come back.
//
// Schedule (1F1B, static): jobs are taken in wave order; after each forward, when
// `max_inflight` jobs hold activations, the oldest job's gradients are received and it runs
// backward before the next forward. So at most max_inflight jobs are alive, the encoder runs up
// to max_inflight - 1 waves ahead of the LLM, and every TP rank of the replica issues its
// collectives in the same order. Sends overlap the next forward.
//
// Gradients: each block's gradient returns to the TP rank that sent it; a TP all-reduce of the
// job's gradient buffer (zeros where another rank received) gives every TP rank the full
// gradient (the plan's encoder share step). After the last job the parameter gradients are
// summed over the DP group.
#ifndef HETPAR_ENCODER_SERVICE_ENCODER_RUNTIME_H_
#define HETPAR_ENCODER_SERVICE_ENCODER_RUNTIME_H_

#include <cstdint>
#include <functional>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/data/batch_source.h"
#include "common/nn/communicator.h"
#include "common/nn/compute_spans.h"
#include "common/plan/step_plan.h"
#include "common/train/boundary.h"
#include "common/train/grad_reducer.h"
#include "encoder_service/encoder.h"

namespace hetpar::encoder {

struct EncoderStepStats {
  int64_t jobs = 0;
  int64_t images = 0;
  // Forward and backward, each a span: the device's time on a GPU, read (Seconds) after the
  // step's host sync (EncoderModule::RunStep).
  nn::ComputeSpans compute;
  double bridge_wait_s = 0;  // waiting for gradients and for sends to complete
  double collective_s = 0;   // TP gradient share and DP gradient sum
  double data_s = 0;         // loading and decoding the images
  int64_t bytes_sent = 0;
  int64_t bytes_received = 0;
  // Jobs holding activations at once, at most, and the bytes of their boundary outputs then (the
  // autograd graph each job keeps grows with the same rows): max_inflight bounds the first under
  // 1F1B; the colocated schedule keeps every job of the step alive.
  int64_t peak_live_jobs = 0;
  int64_t peak_live_output_bytes = 0;
};

struct EncoderRuntimeOptions {
  int64_t max_inflight = 2;
  absl::Duration timeout = absl::Seconds(120);  // bound of every boundary wait
  // The DP gradient all-reduce bucket size (run.grad_bucket_mib).
  int64_t grad_bucket_bytes = int64_t{25} << 20;
};

// Borrows everything; one thread calls RunStep.
class EncoderRuntime {
 public:
  EncoderRuntime(VisionEncoder* model, nn::Communicator* tp, nn::Communicator* dp,
                 const data::BatchSource* data, train::BoundaryCommunicator* boundary,
                 const EncoderRuntimeOptions& options)
      : model_(model), tp_(tp), dp_(dp), data_(data), boundary_(boundary), options_(options) {}

  // Runs this rank's part of one step; on return the parameter gradients hold the module's
  // gradient (summed over DP). Any failure (a dead peer, a rejected header) aborts the step.
  absl::StatusOr<EncoderStepStats> RunStep(const plan::RankStepPlan& plan);

  // The colocated schedule: every job's forward, then `between` (the LLM's waves on this same
  // process), then every job's backward. A failure of `between` aborts the step.
  absl::StatusOr<EncoderStepStats> RunStepAround(const plan::RankStepPlan& plan,
                                                 const std::function<absl::Status()>& between);

 private:
  VisionEncoder* model_;
  nn::Communicator* tp_;
  nn::Communicator* dp_;
  const data::BatchSource* data_;
  train::BoundaryCommunicator* boundary_;
  EncoderRuntimeOptions options_;
  std::unique_ptr<train::GradientReducer> reducer_;  // created at the first step
};

}  // namespace hetpar::encoder

#endif  // HETPAR_ENCODER_SERVICE_ENCODER_RUNTIME_H_
