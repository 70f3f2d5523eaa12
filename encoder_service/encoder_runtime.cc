#include "encoder_service/encoder_runtime.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <deque>
#include <map>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/nn/device_copy.h"
#include "common/status.h"
#include "common/trace/recorder.h"
#include "common/train/batch.h"
#include "common/train/optimizer.h"

namespace hetpar::encoder {
namespace {

using Clock = trace::Clock;

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

struct LiveJob {
  const plan::EncoderJob* job;
  at::Tensor output;
  train::PendingSends sends;
};

}  // namespace

absl::StatusOr<EncoderStepStats> EncoderRuntime::RunStep(const plan::RankStepPlan& plan) {
  return RunStepAround(plan, nullptr);
}

absl::StatusOr<EncoderStepStats> EncoderRuntime::RunStepAround(
    const plan::RankStepPlan& plan, const std::function<absl::Status()>& between) {
  EncoderStepStats stats;
  stats.compute = nn::ComputeSpans(model_->options().device);
  const auto& em = model_->model();
  const int64_t bytes_sent0 = boundary_->bytes_sent();
  const int64_t bytes_received0 = boundary_->bytes_received();
  // The samples of this step whose tokens were checked against their index records, by batch
  // index (a sample's images may span jobs, and ranks): their records and the images their
  // sequences keep. Each job decodes only its own images, and frees them once they are a tensor.
  struct CheckedSample {
    const data::IndexRecord* record;
    int64_t images;
  };
  std::map<int64_t, CheckedSample> checked;
  std::deque<LiveJob> live;

  // A frozen encoder takes no gradients back: a job is done once its rows are sent.
  const bool takes_gradients = model_->TakesGradients();
  if (takes_gradients) {
    if (reducer_ == nullptr) {
      reducer_ = std::make_unique<train::GradientReducer>(&model_->parameters(),
                                                          options_.grad_bucket_bytes);
    }
    HETPAR_RETURN_IF_ERROR(reducer_->BeginStep(dp_));
  }
  // A step that fails half-way gives up the gradient all-reduces it started.
  absl::Cleanup abandon_reduction = [this] {
    if (reducer_ != nullptr) reducer_->Abandon();
  };
  size_t retired = 0;
  auto retire_oldest = [&]() -> absl::Status {
    LiveJob job = std::move(live.front());
    live.pop_front();
    // The step's last backward starts the DP all-reduce of each gradient bucket it completes.
    if (++retired == plan.encoder_jobs.size() && takes_gradients) reducer_->ArmLastBackward();
    const int64_t wave = job.job->wave;
    auto t0 = Clock::now();
    if (takes_gradients) {
      // The gradient lands in host memory (pinned for a model on a GPU), or on the device when
      // the boundary moves device memory; the TP sum and backward run on the model's device.
      const bool on_host = !boundary_->device_direct();
      at::Tensor grad = at::zeros(
          job.output.sizes(), job.output.options()
                                  .device(on_host ? c10::Device(c10::kCPU) : job.output.device())
                                  .pinned_memory(on_host && job.output.is_cuda()));
      HETPAR_RETURN_IF_ERROR(boundary_->ReceiveBackward(plan, wave, grad));
      grad = nn::ToDevice(grad, job.output.device());
      stats.bridge_wait_s += Since(t0);
      trace::Record(trace::kEncoderLane, "wait for gradients", "bridge_wait", t0, {{"wave", wave}});
      t0 = Clock::now();
      HETPAR_RETURN_IF_ERROR(tp_->AllReduce(grad));
      stats.collective_s += Since(t0);
      trace::Record(trace::kEncoderLane, "tp all-reduce gradients", "collective", t0,
                    {{"wave", wave}});
      t0 = Clock::now();
      stats.compute.Begin();
      const absl::Status backward = model_->Backward(job.output, grad);
      stats.compute.End();
      HETPAR_RETURN_IF_ERROR(backward);
      trace::Record(trace::kEncoderLane, "backward", "compute", t0, {{"wave", wave}});
      t0 = Clock::now();
    }
    HETPAR_RETURN_IF_ERROR(job.sends.Wait(absl::Now() + options_.timeout));
    stats.bridge_wait_s += Since(t0);
    trace::Record(trace::kEncoderLane, "wait for row sends", "bridge_wait", t0, {{"wave", wave}});
    return absl::OkStatus();
  };

  for (const plan::EncoderJob& job : plan.encoder_jobs) {
    std::vector<std::vector<float>> job_pixels;
    job_pixels.reserve(job.images.size());
    const auto t_data = Clock::now();
    for (const plan::ImageRef& ref : job.images) {
      auto it = checked.find(ref.sample);
      if (it == checked.end()) {
        const plan::SampleDescriptor* sample = plan.Sample(ref.sample);
        if (sample == nullptr) {
          return absl::InternalError(absl::StrCat("step ", plan.step, " plan for rank ", plan.rank,
                                                  " has no descriptor of batch sample ",
                                                  ref.sample));
        }
        HETPAR_ASSIGN_OR_RETURN(const data::IndexRecord* record, data_->RecordFor(*sample));
        HETPAR_ASSIGN_OR_RETURN(data::TokenSequence tokens,
                                data_->loader().Tokenize(record->ordinal));
        HETPAR_RETURN_IF_ERROR(data_->CheckTokens(*record, tokens));
        it = checked.emplace(ref.sample, CheckedSample{record, tokens.images()}).first;
      }
      const data::IndexRecord& record = *it->second.record;
      if (ref.image < 0 || ref.image >= it->second.images) {
        return absl::InternalError(absl::StrCat("sample ", record.id, " has ", it->second.images,
                                                " images; the plan asks for image ", ref.image));
      }
      HETPAR_ASSIGN_OR_RETURN(std::vector<float> image,
                              data_->loader().LoadImage(record.ordinal, ref.image));
      job_pixels.push_back(std::move(image));
    }
    std::vector<const std::vector<float>*> pixels;
    pixels.reserve(job_pixels.size());
    for (const std::vector<float>& image : job_pixels) pixels.push_back(&image);
    stats.data_s += Since(t_data);
    trace::Record(trace::kEncoderLane, "load images", "data", t_data, {{"wave", job.wave}});
    auto t0 = Clock::now();
    stats.compute.Begin();
    absl::StatusOr<at::Tensor> encoded =
        train::ImagesTensor(pixels, em.channels(), em.image_size(), model_->parameters().dtype());
    if (encoded.ok()) encoded = model_->Forward(*encoded);
    stats.compute.End();
    HETPAR_ASSIGN_OR_RETURN(at::Tensor output, std::move(encoded));
    trace::Record(trace::kEncoderLane, "forward", "compute", t0,
                  {{"wave", job.wave}, {"images", static_cast<int64_t>(job.images.size())}});
    if (output.size(0) != job.rows) {
      return absl::InternalError(absl::StrCat("encoder job of wave ", job.wave, " produced ",
                                              output.size(0), " rows; the plan expects ",
                                              job.rows));
    }
    at::Tensor rows = output.detach().contiguous();
    HETPAR_ASSIGN_OR_RETURN(train::PendingSends sends,
                            boundary_->SendForward(plan, job.wave, rows));
    if (takes_gradients) {
      // The gradients of this job may come back while later jobs compute.
      HETPAR_RETURN_IF_ERROR(boundary_->PostBackwardReceives(plan, job.wave));
    } else {
      output = at::Tensor();  // the sends hold their own copy; nothing waits for a gradient
    }
    live.push_back({&job, output, std::move(sends)});
    int64_t live_bytes = 0;
    for (const LiveJob& j : live) {
      if (j.output.defined()) live_bytes += j.output.numel() * j.output.element_size();
    }
    stats.peak_live_jobs = std::max<int64_t>(stats.peak_live_jobs, live.size());
    stats.peak_live_output_bytes = std::max(stats.peak_live_output_bytes, live_bytes);
    ++stats.jobs;
    stats.images += static_cast<int64_t>(job.images.size());
    if (!between && static_cast<int64_t>(live.size()) >= options_.max_inflight) {
      HETPAR_RETURN_IF_ERROR(retire_oldest());
    }
  }
  if (between) HETPAR_RETURN_IF_ERROR(between());
  while (!live.empty()) HETPAR_RETURN_IF_ERROR(retire_oldest());

  auto t0 = Clock::now();
  // The DP sums first: FinishGradients sums sequence-parallel partials over TP in place, which
  // must not race the buckets' all-reduces (the two sums commute).
  if (takes_gradients) HETPAR_RETURN_IF_ERROR(reducer_->Finish());
  HETPAR_RETURN_IF_ERROR(model_->FinishGradients());
  stats.collective_s += Since(t0);
  trace::Record(trace::kEncoderLane, "gradient all-reduce", "collective", t0);
  stats.bytes_sent = boundary_->bytes_sent() - bytes_sent0;
  stats.bytes_received = boundary_->bytes_received() - bytes_received0;
  return stats;
}

}  // namespace hetpar::encoder
