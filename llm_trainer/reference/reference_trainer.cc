#include "llm_trainer/reference/reference_trainer.h"

#include <ATen/ATen.h>

#include <chrono>
#include <cmath>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/data/batch_source.h"
#include "common/logging.h"
#include "common/nn/communicator.h"
#include "common/nn/execution_context.h"
#include "common/nn/export.h"
#include "common/nn/torch_status.h"
#include "common/plan/layout.h"
#include "common/plan/step_plan.h"
#include "common/run_directory.h"
#include "common/status.h"
#include "common/train/batch.h"
#include "common/train/checkpoint.h"
#include "common/train/optimizer.h"
#include "encoder_service/encoder.h"
#include "llm_trainer/language_model.h"
#include "llm_trainer/llm_inputs.h"
#include "llm_trainer/reference/evaluation.h"
#include "nlohmann/json.hpp"

namespace hetpar::llm {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

nlohmann::json SumsJson(const train::OwnedSums& sums) {
  return {{"sum", sums.sum}, {"l2", std::sqrt(sums.square_sum)}};
}

// Both modules at tp = 1 in this process, initialised from the run seed.
struct SingleProcessModels {
  std::unique_ptr<nn::Communicator> single = nn::Communicator::CreateSingle();
  std::unique_ptr<encoder::VisionEncoder> encoder;
  std::unique_ptr<LanguageModel> llm;
};

absl::StatusOr<SingleProcessModels> CreateSingleProcessModels(const hetpar::v1::RunSpec& spec) {
  SingleProcessModels models;
  // run.device: the reference computes where a worker would (the GPU of its local rank).
  HETPAR_ASSIGN_OR_RETURN(const int cuda_index, nn::LocalCudaIndexFromEnvironment());
  HETPAR_ASSIGN_OR_RETURN(const nn::ExecutionContext execution,
                          nn::ExecutionContext::FromSpec(spec, cuda_index));
  HETPAR_ASSIGN_OR_RETURN(encoder::EncoderOptions encoder_options,
                          encoder::EncoderOptionsFromSpec(spec));
  encoder_options.sequence_parallel = false;  // tp = 1
  encoder_options.device = execution.device();
  HETPAR_ASSIGN_OR_RETURN(
      models.encoder,
      encoder::VisionEncoder::Create(spec.encoder().model(), encoder_options, *models.single));
  HETPAR_ASSIGN_OR_RETURN(LlmOptions llm_options, LlmOptionsFromSpec(spec));
  llm_options.sequence_parallel = false;
  llm_options.device = execution.device();
  HETPAR_ASSIGN_OR_RETURN(models.llm,
                          LanguageModel::Create(spec.llm().model(), llm_options, *models.single));
  // A run that starts from earlier parameters (encoder.init_from, llm.init_from).
  if (!spec.encoder().init_from().empty()) {
    HETPAR_RETURN_IF_ERROR(nn::LoadInitialParameters(
        models.encoder->parameters(), "encoder.init_from", spec.encoder().init_from()));
  }
  if (!spec.llm().init_from().empty()) {
    HETPAR_RETURN_IF_ERROR(nn::LoadInitialParameters(models.llm->parameters(), "llm.init_from",
                                                     spec.llm().init_from()));
  }
  return models;
}

}  // namespace

absl::StatusOr<ReferenceStepResult> RunReferenceStep(const data::BatchSource& batches,
                                                     const plan::StepPlan& step_plan,
                                                     encoder::VisionEncoder& vision,
                                                     LanguageModel& language) {
  ReferenceStepResult out;
  const auto& em = vision.model();
  const int64_t waves = step_plan.llm.waves;
  const int64_t replicas = step_plan.llm.replicas;
  for (int64_t wave = 0; wave < waves; ++wave) {
    for (int64_t replica = 0; replica < replicas; ++replica) {
      const plan::LlmMicrobatch& mb = step_plan.llm.microbatches[replica * waves + wave];
      if (mb.samples.empty()) continue;  // a replica taking one wave fewer
      std::vector<data::LoadedSample> loaded;
      for (int64_t index : mb.samples) {
        HETPAR_ASSIGN_OR_RETURN(const data::IndexRecord* record,
                                batches.Record(step_plan.samples[index].id));
        HETPAR_ASSIGN_OR_RETURN(data::LoadedSample sample, batches.loader().Load(record->ordinal));
        loaded.push_back(std::move(sample));
      }
      std::vector<LlmSample> samples;
      std::vector<const std::vector<float>*> pixels;
      for (const auto& sample : loaded) {
        samples.push_back(LlmSampleOf(sample, vision.tokens_per_image()));
        for (const auto& image : sample.images) pixels.push_back(&image);
        out.tokens += sample.tokens.length();
      }
      out.images += static_cast<int64_t>(pixels.size());
      at::Tensor image_rows;
      const auto t0 = Clock::now();
      if (!pixels.empty()) {
        HETPAR_ASSIGN_OR_RETURN(at::Tensor pixels_tensor,
                                train::ImagesTensor(pixels, em.channels(), em.image_size(),
                                                    vision.parameters().dtype()));
        HETPAR_ASSIGN_OR_RETURN(image_rows, vision.Forward(pixels_tensor));
      }
      const auto t1 = Clock::now();
      HETPAR_ASSIGN_OR_RETURN(LlmForwardResult result,
                              language.Forward(samples, image_rows, step_plan.n_global));
      // The image rows are the encoder's output itself: backward runs on into the encoder.
      HETPAR_RETURN_IF_ERROR(language.Backward(result.loss));
      out.encoder_compute_s += Seconds(t1 - t0);
      out.llm_compute_s += Seconds(Clock::now() - t1);
      out.loss += result.loss.item<double>();
    }
  }
  return out;
}

absl::Status RunReference(const hetpar::v1::RunSpec& spec, const ReferenceOptions& options) {
  if (!spec.checkpoint().dir().empty() || !spec.checkpoint().resume_from().empty()) {
    return absl::InvalidArgumentError(
        "the reference trainer trains from step 0 and writes no checkpoints: remove "
        "checkpoint.dir and checkpoint.resume_from");
  }
  HETPAR_ASSIGN_OR_RETURN(auto batches, data::BatchSource::Create(spec));
  HETPAR_ASSIGN_OR_RETURN(plan::Placement placement, plan::PlacementFromRunSpec(spec));
  HETPAR_ASSIGN_OR_RETURN(auto run_dir, RunDirectory::Create(options.out_dir, spec));

  HETPAR_ASSIGN_OR_RETURN(SingleProcessModels models, CreateSingleProcessModels(spec));
  auto& vision = models.encoder;
  auto& language = models.llm;
  HETPAR_ASSIGN_OR_RETURN(auto encoder_opt, train::ModuleOptimizer::Create(
                                                &vision->parameters(), spec.encoder().optimizer()));
  HETPAR_ASSIGN_OR_RETURN(auto llm_opt, train::ModuleOptimizer::Create(&language->parameters(),
                                                                       spec.llm().optimizer()));

  data::SamplerCursor cursor;
  const auto run_start = Clock::now();
  for (int64_t step = 0; step < spec.run().steps(); ++step) {
    const auto step_start = Clock::now();
    HETPAR_ASSIGN_OR_RETURN(data::GlobalBatch batch,
                            batches->Take(cursor, spec.run().global_batch()));
    HETPAR_ASSIGN_OR_RETURN(plan::StepPlanOptions plan_options,
                            plan::StepPlanOptionsFromRunSpec(spec, step, 0));
    HETPAR_ASSIGN_OR_RETURN(plan::StepPlan step_plan,
                            plan::BuildStepPlan(placement, batch.samples, plan_options));
    HETPAR_ASSIGN_OR_RETURN(ReferenceStepResult result,
                            RunReferenceStep(*batches, step_plan, *vision, *language));
    HETPAR_RETURN_IF_ERROR(vision->FinishGradients());
    HETPAR_RETURN_IF_ERROR(language->FinishGradients());
    const train::OwnedSums encoder_grads = train::OwnedGradSums(vision->parameters());
    const train::OwnedSums llm_grads = train::OwnedGradSums(language->parameters());
    const double grad_norm = std::sqrt(encoder_grads.square_sum + llm_grads.square_sum);
    // As a distributed run: a step whose norm is not finite is skipped (no update), and its
    // samples count as trained.
    const bool skipped = !std::isfinite(grad_norm);
    if (skipped) {
      vision->parameters().ZeroGrad();
      language->parameters().ZeroGrad();
    } else {
      const double clip = train::ClipCoefficient(grad_norm, spec.run().grad_clip());
      HETPAR_RETURN_IF_ERROR(encoder_opt->Step(step, clip));
      HETPAR_RETURN_IF_ERROR(llm_opt->Step(step, clip));
    }
    cursor = batch.next;

    const double step_time = Seconds(Clock::now() - step_start);
    nlohmann::json line = {
        {"step", step},
        {"loss", result.loss},
        {"grad_norm", grad_norm},
        {"tokens", result.tokens},
        {"images", result.images},
        {"n_global", step_plan.n_global},
        {"step_time_s", step_time},
        {"encoder", {{"compute_s", result.encoder_compute_s}, {"bridge_wait_s", 0.0}}},
        {"llm", {{"compute_s", result.llm_compute_s}, {"bridge_wait_s", 0.0}}},
        {"cursor", cursor.ToString()},
    };
    if (skipped) line["skipped"] = true;
    HETPAR_RETURN_IF_ERROR(run_dir->AppendMetrics(line.dump()));
    if (options.progress &&
        (step % spec.run().log_every() == 0 || step + 1 == spec.run().steps())) {
      const double elapsed = Seconds(Clock::now() - run_start);
      const double eta = elapsed / (step + 1) * (spec.run().steps() - step - 1);
      HETPAR_LOG(INFO) << "step " << step + 1 << "/" << spec.run().steps() << "  loss "
                       << result.loss << "  grad_norm " << grad_norm << "  "
                       << static_cast<int64_t>(result.tokens / step_time) << " tok/s  ETA "
                       << static_cast<int64_t>(eta) << " s";
    }
  }
  nlohmann::json final_line = {
      {"final_params",
       {{"encoder", SumsJson(train::OwnedParamSums(vision->parameters()))},
        {"llm", SumsJson(train::OwnedParamSums(language->parameters()))}}}};
  HETPAR_RETURN_IF_ERROR(run_dir->AppendMetrics(final_line.dump()));
  if (!options.evaluate || spec.data().val_manifest().empty()) return absl::OkStatus();
  EvaluationOptions eval_options;
  eval_options.step = spec.run().steps();
  HETPAR_ASSIGN_OR_RETURN(EvaluationResult eval,
                          EvaluateCaptioning(spec, *vision, *language, eval_options));
  if (options.progress) HETPAR_LOG(INFO) << "validation: " << eval.ToJson();
  return run_dir->AppendMetrics(eval.ToJson());
}

absl::Status ExportCheckpoint(const hetpar::v1::RunSpec& spec, const std::string& checkpoint_dir,
                              const std::string& model_dir) {
  HETPAR_ASSIGN_OR_RETURN(SingleProcessModels models, CreateSingleProcessModels(spec));
  HETPAR_RETURN_IF_ERROR(
      train::LoadModuleState(checkpoint_dir, "encoder", models.encoder->parameters(), nullptr));
  HETPAR_RETURN_IF_ERROR(
      train::LoadModuleState(checkpoint_dir, "llm", models.llm->parameters(), nullptr));
  HETPAR_RETURN_IF_ERROR(nn::SaveFullParameters(models.encoder->parameters(), *models.single,
                                                model_dir + "/encoder.hpar"));
  return nn::SaveFullParameters(models.llm->parameters(), *models.single, model_dir + "/llm.hpar");
}

absl::StatusOr<std::string> EvaluateSavedModel(const hetpar::v1::RunSpec& spec,
                                               const std::string& model_dir, int64_t step) {
  HETPAR_ASSIGN_OR_RETURN(SingleProcessModels models, CreateSingleProcessModels(spec));
  auto& vision = models.encoder;
  auto& language = models.llm;
  HETPAR_RETURN_IF_ERROR(nn::LoadFullParameters(vision->parameters(), model_dir + "/encoder.hpar"));
  HETPAR_RETURN_IF_ERROR(nn::LoadFullParameters(language->parameters(), model_dir + "/llm.hpar"));
  EvaluationOptions eval_options;
  eval_options.step = step;
  HETPAR_ASSIGN_OR_RETURN(EvaluationResult eval,
                          EvaluateCaptioning(spec, *vision, *language, eval_options));
  return eval.ToJson();
}

}  // namespace hetpar::llm
