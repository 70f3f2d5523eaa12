#include "llm_trainer/llm_runtime.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/nn/device_copy.h"
#include "common/plan/sequence_sharding.h"
#include "common/status.h"
#include "common/trace/recorder.h"
#include "common/train/optimizer.h"
#include "llm_trainer/llm_inputs.h"

namespace hetpar::llm {
namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Indices, in the microbatch's full image-row order (sample by sample, image by image), of the
// rows in this rank's image-row buffer: the rows whose sequence positions the rank's CP rank
// holds and, under sequence parallelism, its TP rank too (plan/sequence_sharding.h).
absl::StatusOr<std::vector<int64_t>> BufferRows(const plan::RankStepPlan& plan,
                                                const plan::LlmMicrobatch& mb,
                                                const plan::SequenceSharding& sharding,
                                                int64_t cp_rank, int64_t tp_rank) {
  std::vector<int64_t> rows;
  int64_t full = 0;
  for (int64_t index : mb.samples) {
    const plan::SampleDescriptor* sample = plan.Sample(index);
    if (sample == nullptr) {
      return absl::InternalError(absl::StrCat("step ", plan.step, " plan for rank ", plan.rank,
                                              " has no descriptor of batch sample ", index));
    }
    for (int64_t start : sample->image_starts) {
      for (int64_t r = 0; r < sample->tokens_per_image; ++r, ++full) {
        const auto& segment = sharding.segments()[sharding.SegmentOf(start + r)];
        if (segment.cp_rank == cp_rank && (segment.tp_rank < 0 || segment.tp_rank == tp_rank)) {
          rows.push_back(full);
        }
      }
    }
  }
  return rows;
}

// Rows of this rank's image-row buffer in `wave` (0 when the plan lists none).
int64_t BufferRowsOfWave(const plan::RankStepPlan& plan, int64_t wave) {
  return wave < static_cast<int64_t>(plan.image_rows.size()) ? plan.image_rows[wave] : 0;
}

}  // namespace

absl::StatusOr<std::vector<std::vector<LlmSample>>> LlmRuntime::LoadSamples(
    const plan::RankStepPlan& plan, LlmStepStats* stats) const {
  std::vector<std::vector<LlmSample>> wave_samples;
  for (const plan::LlmMicrobatch& mb : plan.microbatches) {
    std::vector<LlmSample>& samples = wave_samples.emplace_back();
    for (int64_t index : mb.samples) {
      const plan::SampleDescriptor* sample = plan.Sample(index);
      if (sample == nullptr) {
        return absl::InternalError(absl::StrCat("step ", plan.step, " plan for rank ", plan.rank,
                                                " has no descriptor of batch sample ", index));
      }
      HETPAR_ASSIGN_OR_RETURN(const data::IndexRecord* record, data_->RecordFor(*sample));
      data::LoadedSample loaded;
      loaded.id = record->id;
      HETPAR_ASSIGN_OR_RETURN(loaded.tokens, data_->loader().Tokenize(record->ordinal));
      HETPAR_RETURN_IF_ERROR(data_->CheckTokens(*record, loaded.tokens));
      samples.push_back(LlmSampleOf(loaded, record->tokens_per_image));
      if (stats != nullptr) {
        stats->tokens += loaded.tokens.length();
        stats->images += loaded.tokens.images();
      }
    }
  }
  return wave_samples;
}

void LlmRuntime::AbandonStage(const plan::RankStepPlan& plan) {
  train::StageLink* link = pipeline_.link;
  if (link == nullptr) return;
  if (link->attempt() != plan.attempt) link->BeginAttempt(plan.attempt);  // a step not run here
  if (stage_rows_.step != plan.step || stage_rows_.attempt != plan.attempt) {
    absl::StatusOr<std::vector<std::vector<LlmSample>>> wave_samples = LoadSamples(plan, nullptr);
    if (!wave_samples.ok()) {
      HETPAR_LOG(WARNING) << "step " << plan.step << " (attempt " << plan.attempt
                          << "): cannot size the neighbouring stages' messages to absorb them: "
                          << StatusText(wave_samples.status());
      return;
    }
    stage_rows_ = {plan.step, plan.attempt, {}};
    for (const std::vector<LlmSample>& samples : *wave_samples) {
      stage_rows_.rows.push_back(model_->StageRows(samples));
    }
  }
  std::vector<train::StageLink::Expected> expected;
  for (size_t m = 0; m < stage_rows_.rows.size(); ++m) {
    const int64_t microbatch = static_cast<int64_t>(m);
    if (!model_->first_stage()) {
      expected.push_back(
          {pipeline_.previous_rank, plan::Direction::kForward, microbatch, stage_rows_.rows[m]});
    }
    if (!model_->last_stage()) {
      expected.push_back(
          {pipeline_.next_rank, plan::Direction::kBackward, microbatch, stage_rows_.rows[m]});
    }
  }
  const int64_t row_bytes =
      model_->model().hidden() * at::elementSize(model_->parameters().dtype());
  link->Abandon(plan.step, expected, row_bytes);
}

absl::StatusOr<LlmStepStats> LlmRuntime::RunStep(const plan::RankStepPlan& plan) {
  // Sends a failed attempt left deferred (its encoder phase failed after this one): given up
  // here, so that this attempt's WaitForSends waits on its own sends only.
  deferred_.clear();
  LlmStepStats stats;
  const int64_t stages = model_->options().pp_stages;
  const int64_t stage = model_->options().pp_stage;
  if (plan.llm_coords.pp != stage) {
    return absl::InternalError(
        absl::StrCat("LLM rank ", plan.rank, " is at pp ", plan.llm_coords.pp,
                     " in the plan but its model is stage ", stage, " of ", stages));
  }
  const bool first = model_->first_stage();
  const bool last = model_->last_stage();
  if ((!first && pipeline_.previous_rank < 0) || (!last && pipeline_.next_rank < 0) ||
      (stages > 1 && pipeline_.link == nullptr)) {
    return absl::InternalError(absl::StrCat("LLM rank ", plan.rank, " is pipeline stage ", stage,
                                            " of ", stages, " without a link to its neighbours"));
  }
  if (plan.llm_coords.cp != model_->cp_rank()) {
    return absl::InternalError(absl::StrCat("LLM rank ", plan.rank, " is at cp ",
                                            plan.llm_coords.cp, " in the plan but at CP rank ",
                                            model_->cp_rank(), " of its model's group"));
  }
  const bool sequence_parallel = model_->options().sequence_parallel && tp_->size() > 1;
  HETPAR_ASSIGN_OR_RETURN(plan::SequenceSharding sharding,
                          plan::SequenceSharding::Create(plan.seq_len, model_->cp_size(),
                                                         tp_->size(), sequence_parallel));
  const int64_t hidden = model_->model().hidden();
  const int64_t bytes_sent0 = boundary_->bytes_sent();
  const int64_t bytes_received0 = boundary_->bytes_received();
  const int64_t stage_bytes0 = pipeline_.link != nullptr ? pipeline_.link->bytes_sent() : 0;
  if (pipeline_.link != nullptr) pipeline_.link->BeginAttempt(plan.attempt);
  if (reducer_ == nullptr) {
    reducer_ =
        std::make_unique<train::GradientReducer>(&model_->parameters(), options_.grad_bucket_bytes);
  }
  HETPAR_RETURN_IF_ERROR(reducer_->BeginStep(dp_));
  // A step that fails half-way gives up the gradient all-reduces it started.
  absl::Cleanup abandon_reduction = [this] { reducer_->Abandon(); };
  std::vector<train::PendingSends> sends;
  // The data plane's messages land in host memory (pinned when the model is on a GPU), or on the
  // device when the boundary moves device memory; the model's tensors live on its device.
  const c10::Device device = model_->options().device;
  stats.compute = nn::ComputeSpans(device);
  const at::TensorOptions row_options =
      at::TensorOptions().dtype(model_->parameters().dtype()).device(device);
  const at::TensorOptions host_rows =
      at::TensorOptions().dtype(model_->parameters().dtype()).pinned_memory(device.is_cuda());
  // Later waves' image rows land in their buffers while earlier waves compute (receives posted
  // options_.post_ahead waves ahead); the samples' text is loaded while the encoder computes
  // the first wave. Only the first stage receives image rows.
  const size_t waves = plan.microbatches.size();
  std::vector<at::Tensor> buffers(waves);
  size_t posted = 0;  // microbatches whose buffers exist and whose receives are posted
  auto post_through = [&](size_t last_mb) -> absl::Status {
    for (; first && posted < waves && posted <= last_mb; ++posted) {
      const plan::LlmMicrobatch& mb = plan.microbatches[posted];
      if (mb.image_rows <= 0) continue;
      buffers[posted] = at::zeros({BufferRowsOfWave(plan, mb.wave), hidden},
                                  boundary_->device_direct() ? row_options : host_rows);
      HETPAR_RETURN_IF_ERROR(boundary_->PostForwardReceives(plan, mb.wave, buffers[posted]));
    }
    return absl::OkStatus();
  };
  const size_t ahead = options_.post_ahead > 0 ? static_cast<size_t>(options_.post_ahead) : waves;
  HETPAR_RETURN_IF_ERROR(post_through(ahead));
  auto t_data = Clock::now();
  HETPAR_ASSIGN_OR_RETURN(std::vector<std::vector<LlmSample>> wave_samples,
                          LoadSamples(plan, &stats));
  if (pipeline_.link != nullptr) {
    stage_rows_ = {plan.step, plan.attempt, {}};
    for (const std::vector<LlmSample>& samples : wave_samples) {
      stage_rows_.rows.push_back(model_->StageRows(samples));
    }
  }
  stats.data_s += Since(t_data);
  trace::Record(trace::kLlmLane, "load samples", "data", t_data);

  // Receives from the neighbouring stages, posted one microbatch ahead: the previous stage's
  // activations (forward) and the next stage's gradients (backward), each [StageRows, hidden].
  auto post_stage = [&](plan::Direction direction, size_t m) -> absl::Status {
    if (m >= waves) return absl::OkStatus();
    const bool forward = direction == plan::Direction::kForward;
    if (forward ? first : last) return absl::OkStatus();
    at::Tensor rows = at::empty({model_->StageRows(wave_samples[m]), hidden}, host_rows);
    return pipeline_.link->Post(forward ? pipeline_.previous_rank : pipeline_.next_rank, plan.step,
                                direction, static_cast<int64_t>(m), rows);
  };
  auto receive_stage = [&](plan::Direction direction, size_t m) -> absl::StatusOr<at::Tensor> {
    const bool forward = direction == plan::Direction::kForward;
    HETPAR_RETURN_IF_ERROR(post_stage(direction, m));
    HETPAR_RETURN_IF_ERROR(post_stage(direction, m + 1));
    auto t0 = Clock::now();
    HETPAR_ASSIGN_OR_RETURN(
        at::Tensor rows,
        pipeline_.link->Receive(forward ? pipeline_.previous_rank : pipeline_.next_rank, plan.step,
                                direction, static_cast<int64_t>(m)));
    stats.pipeline_wait_s += Since(t0);
    trace::Record(trace::kLlmLane, forward ? "wait for activations" : "wait for stage gradients",
                  "pipeline_wait", t0, {{"microbatch", static_cast<int64_t>(m)}});
    return nn::ToDevice(rows, device);
  };

  // What a microbatch keeps from its forward to its backward.
  struct InFlight {
    at::Tensor image_rows;  // the first stage's image-row leaf (undefined without images)
    at::Tensor input;       // a later stage's input leaf
    at::Tensor output;      // a non-last stage's output
    at::Tensor loss;        // the last stage's loss
    at::Tensor owned_index;
  };
  std::vector<InFlight> in_flight(waves);
  at::Tensor loss_total;  // the last stage's loss over the waves so far

  auto forward = [&](size_t m) -> absl::Status {
    const plan::LlmMicrobatch& mb = plan.microbatches[m];
    const int64_t wave = mb.wave;
    const std::vector<LlmSample>& samples = wave_samples[m];
    InFlight& f = in_flight[m];
    if (first) {
      HETPAR_RETURN_IF_ERROR(post_through(m + ahead));
      // This rank's buffer rows, as indices into the microbatch's full image rows.
      HETPAR_ASSIGN_OR_RETURN(
          std::vector<int64_t> owned,
          BufferRows(plan, mb, sharding, plan.llm_coords.cp, plan.llm_coords.tp));
      const int64_t buffer_rows = BufferRowsOfWave(plan, wave);
      if (static_cast<int64_t>(owned.size()) != buffer_rows) {
        return absl::InternalError(absl::StrCat("wave ", wave, ": the plan gives rank ", plan.rank,
                                                " ", buffer_rows,
                                                " image rows; its sequence shard "
                                                "holds ",
                                                owned.size()));
      }
      f.owned_index = nn::IndexTensor(owned, device);
      if (mb.image_rows > 0) {
        at::Tensor& buffer = buffers[m];
        auto t0 = Clock::now();
        HETPAR_RETURN_IF_ERROR(boundary_->ReceiveForward(plan, wave, buffer));
        stats.bridge_wait_s += Since(t0);
        trace::Record(trace::kLlmLane, "wait for image rows", "bridge_wait", t0, {{"wave", wave}});
        // Every TP rank needs all rows of its CP rank: place ours, zeros elsewhere (and in rows
        // other CP ranks hold), and sum over the TP group.
        at::Tensor full = at::zeros({mb.image_rows, hidden}, row_options);
        if (buffer_rows > 0) full.index_copy_(0, f.owned_index, nn::ToDevice(buffer, device));
        buffer = at::Tensor();
        t0 = Clock::now();
        HETPAR_RETURN_IF_ERROR(tp_->AllReduce(full));
        stats.collective_s += Since(t0);
        trace::Record(trace::kLlmLane, "tp all-reduce image rows", "collective", t0,
                      {{"wave", wave}});
        f.image_rows = options_.image_gradients ? full.requires_grad_(true) : full;
      }
    } else {
      HETPAR_ASSIGN_OR_RETURN(f.input, receive_stage(plan::Direction::kForward, m));
      f.input.requires_grad_(true);
    }
    auto t0 = Clock::now();
    stats.compute.Begin();
    absl::StatusOr<LlmStageResult> forwarded =
        model_->ForwardStage(samples, f.image_rows, f.input, plan.n_global);
    stats.compute.End();
    HETPAR_ASSIGN_OR_RETURN(LlmStageResult result, std::move(forwarded));
    trace::Record(trace::kLlmLane, "forward", "compute", t0,
                  {{"wave", wave}, {"samples", static_cast<int64_t>(samples.size())}});
    if (last) {
      f.loss = result.loss;
      // Summed in float64 on the loss's device; read with the step's gradient norm.
      const at::Tensor wave_loss = result.loss.detach().to(at::kDouble);
      loss_total = loss_total.defined() ? loss_total + wave_loss : wave_loss;
      stats.loss_tokens += result.loss_tokens;
    } else {
      f.output = result.output;
      HETPAR_RETURN_IF_ERROR(pipeline_.link->Send(pipeline_.next_rank, plan.step,
                                                  plan::Direction::kForward,
                                                  static_cast<int64_t>(m), f.output));
    }
    return absl::OkStatus();
  };

  auto backward = [&](size_t m) -> absl::Status {
    const plan::LlmMicrobatch& mb = plan.microbatches[m];
    const int64_t wave = mb.wave;
    InFlight f = std::move(in_flight[m]);
    at::Tensor output_grad;
    if (!last) {
      HETPAR_ASSIGN_OR_RETURN(output_grad, receive_stage(plan::Direction::kBackward, m));
    }
    auto t0 = Clock::now();
    // The step's last backward starts the DP all-reduce of each gradient bucket it completes.
    if (m + 1 == waves) reducer_->ArmLastBackward();
    stats.compute.Begin();
    const absl::Status backward =
        last ? model_->Backward(f.loss) : model_->BackwardStage(f.output, output_grad);
    stats.compute.End();
    HETPAR_RETURN_IF_ERROR(backward);
    trace::Record(trace::kLlmLane, "backward", "compute", t0, {{"wave", wave}});
    if (!first) {
      at::Tensor grad = f.input.grad();
      if (!grad.defined()) grad = at::zeros_like(f.input);
      return pipeline_.link->Send(pipeline_.previous_rank, plan.step, plan::Direction::kBackward,
                                  static_cast<int64_t>(m), grad);
    }
    if (mb.image_rows > 0 && options_.image_gradients) {
      at::Tensor grad = f.image_rows.grad();
      if (!grad.defined()) grad = at::zeros_like(f.image_rows);
      if (model_->image_rows_grad_is_partial()) {
        t0 = Clock::now();
        HETPAR_RETURN_IF_ERROR(tp_->AllReduce(grad));
        stats.collective_s += Since(t0);
        trace::Record(trace::kLlmLane, "tp all-reduce row gradients", "collective", t0,
                      {{"wave", wave}});
      }
      grad = grad.index_select(0, f.owned_index).contiguous();
      HETPAR_ASSIGN_OR_RETURN(train::PendingSends pending,
                              boundary_->SendBackward(plan, wave, grad));
      sends.push_back(std::move(pending));
    }
    return absl::OkStatus();
  };

  // 1F1B: warm-up forwards, then one forward and one backward at a time, then the rest.
  const size_t warmup = std::min<size_t>(static_cast<size_t>(stages - stage - 1), waves);
  size_t forwards = 0, backwards = 0;
  for (; forwards < warmup; ++forwards) HETPAR_RETURN_IF_ERROR(forward(forwards));
  for (; forwards < waves; ++forwards, ++backwards) {
    HETPAR_RETURN_IF_ERROR(forward(forwards));
    HETPAR_RETURN_IF_ERROR(backward(backwards));
  }
  for (; backwards < waves; ++backwards) HETPAR_RETURN_IF_ERROR(backward(backwards));
  stats.loss = loss_total;

  auto t0 = Clock::now();
  if (options_.defer_send_wait) {
    for (auto& pending : sends) deferred_.push_back(std::move(pending));
  } else {
    for (auto& pending : sends) {
      HETPAR_RETURN_IF_ERROR(pending.Wait(absl::Now() + options_.timeout));
    }
  }
  stats.bridge_wait_s += Since(t0);
  trace::Record(trace::kLlmLane, "wait for gradient sends", "bridge_wait", t0);
  if (pipeline_.link != nullptr) {
    t0 = Clock::now();
    HETPAR_RETURN_IF_ERROR(pipeline_.link->WaitSends());
    stats.pipeline_wait_s += Since(t0);
    trace::Record(trace::kLlmLane, "wait for stage sends", "pipeline_wait", t0);
    stats.pipeline_bytes = pipeline_.link->bytes_sent() - stage_bytes0;
  }
  t0 = Clock::now();
  // The DP sums first: FinishGradients sums sequence-parallel partials over TP in place, which
  // must not race the buckets' all-reduces (the two sums commute).
  HETPAR_RETURN_IF_ERROR(reducer_->Finish());
  HETPAR_RETURN_IF_ERROR(model_->FinishGradients());
  stats.collective_s += Since(t0);
  trace::Record(trace::kLlmLane, "gradient all-reduce", "collective", t0);
  stats.bytes_sent = boundary_->bytes_sent() - bytes_sent0;
  stats.bytes_received = boundary_->bytes_received() - bytes_received0;
  return stats;
}

absl::Status LlmRuntime::WaitForSends() {
  const absl::Time deadline = absl::Now() + options_.timeout;
  // Taken out first: a failure leaves none for the next attempt.
  std::vector<train::PendingSends> sends;
  sends.swap(deferred_);
  for (auto& pending : sends) HETPAR_RETURN_IF_ERROR(pending.Wait(deadline));
  return absl::OkStatus();
}

}  // namespace hetpar::llm
