// The hot loop on a GPU queues work without waiting for the device (label gpu), in float32 and
// bfloat16: an LLM microbatch's forward and backward (packed samples of different lengths, with
// image rows), an encoder job's forward and backward, and the step-end read of the loss and the
// gradient norm parts, checked with libtorch's CUDA sync debug mode
// (tests/gpu/host_sync_counter.h): the compute with syncs made to throw on every thread
// (autograd runs a CUDA backward on its own device thread), the read with them counted. The
// training thread may wait for the device once per step: that read. The compute is timed as the
// runtimes time it (nn::ComputeSpans: CUDA events around each forward and backward), which must
// add no sync, and whose device time is readable after the step-end read.
//
// Skips, saying why, where no CUDA device is visible or this libtorch has no CUDA.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/nn/communicator.h"
#include "common/nn/compute_spans.h"
#include "common/train/optimizer.h"
#include "encoder_service/encoder.h"
#include "llm_trainer/language_model.h"
#include "tests/util/tiny_llm.h"

#if HETPAR_GPU_HAS_C10_CUDA
#include "tests/gpu/host_sync_counter.h"
#endif

namespace hetpar {
namespace {

constexpr int64_t kVocab = 64;

// head_dim 8, so that bfloat16 takes the varlen flash kernel.
v1::LlmModel TinyLlm() { return testing::TinyLlmForFlash(kVocab); }

v1::EncoderModel TinyEncoder() {
  v1::EncoderModel m;
  m.set_image_size(8);
  m.set_patch(4);  // 4 tokens per image
  m.set_hidden(16);
  m.set_layers(2);
  m.set_heads(4);
  m.set_mlp(32);
  m.set_out_hidden(32);
  m.set_channels(3);
  return m;
}

llm::LlmSample Sample(int64_t length, int64_t salt, std::vector<int64_t> image_positions) {
  return testing::TinyLlmSample(length, salt, kVocab, std::move(image_positions));
}

bool SkipWithoutCuda(std::string* why) {
#if !HETPAR_GPU_HAS_C10_CUDA
  *why = "this libtorch has no CUDA (built without c10_cuda)";
  return true;
#else
  if (!torch::cuda::is_available()) {
    *why = "no CUDA device: torch::cuda::is_available() is false";
    return true;
  }
  return false;
#endif
}

#if HETPAR_GPU_HAS_C10_CUDA
std::string Where(const testing::HostSyncCounter& counter) {
  std::string out;
  for (const std::string& w : counter.where()) out += "\n  " + w;
  return out;
}
#endif

// float32 (attention: one SDPA call per run of equal-length samples) and bfloat16 (one varlen
// flash kernel over the packed samples).
class HostSyncTest : public ::testing::TestWithParam<at::ScalarType> {};

TEST_P(HostSyncTest, AnEncoderJobAndAnLlmMicrobatchQueueWithoutWaitingForTheDevice) {
  std::string why;
  if (SkipWithoutCuda(&why)) GTEST_SKIP() << why;
#if HETPAR_GPU_HAS_C10_CUDA
  const c10::Device gpu(c10::kCUDA, 0);
  static auto single = nn::Communicator::CreateSingle();
  encoder::EncoderOptions encoder_options;
  encoder_options.device = gpu;
  encoder_options.dtype = GetParam();
  auto encoder = encoder::VisionEncoder::Create(TinyEncoder(), encoder_options, *single);
  ASSERT_TRUE(encoder.ok()) << encoder.status();
  llm::LlmOptions llm_options;
  llm_options.device = gpu;
  llm_options.dtype = GetParam();
  llm_options.seed = 11;
  auto lm = llm::LanguageModel::Create(TinyLlm(), llm_options, *single);
  ASSERT_TRUE(lm.ok()) << lm.status();

  // Three samples of two lengths (one SDPA call for the equal pair, one for the other), the
  // second with one image (4 rows) and the third with two (8 rows).
  const std::vector<llm::LlmSample> samples = {Sample(9, 1, {}), Sample(14, 2, {2, 3, 4, 5}),
                                               Sample(14, 3, {1, 2, 3, 4, 8, 9, 10, 11})};
  const at::Tensor images = at::randn({3, 3, 8, 8});  // on the host, as the data loader makes them

  // The step's loss, or undefined after a failure (reported). Each forward and backward is a
  // span of `spans`, as in the runtimes.
  auto run_step = [&](nn::ComputeSpans& spans) -> at::Tensor {
    spans.Begin();
    auto rows = (*encoder)->Forward(images);
    spans.End();
    if (!rows.ok()) {
      ADD_FAILURE() << "encoder forward: " << rows.status();
      return at::Tensor();
    }
    // The LLM takes the encoder's rows as a leaf, as across the boundary.
    const at::Tensor image_rows = rows->detach().requires_grad_(true);
    spans.Begin();
    auto result = (*lm)->ForwardStage(samples, image_rows, at::Tensor(), /*n_global=*/3);
    spans.End();
    if (!result.ok()) {
      ADD_FAILURE() << "llm forward: " << result.status();
      return at::Tensor();
    }
    // Backward runs on autograd's device thread: a sync there fails it (SyncsThrow).
    spans.Begin();
    const absl::Status llm_backward = (*lm)->Backward(result->loss);
    spans.End();
    if (!llm_backward.ok()) {
      ADD_FAILURE() << "llm backward: " << llm_backward;
      return at::Tensor();
    }
    spans.Begin();
    const absl::Status encoder_backward = (*encoder)->Backward(*rows, image_rows.grad());
    spans.End();
    if (!encoder_backward.ok()) {
      ADD_FAILURE() << "encoder backward: " << encoder_backward;
      return at::Tensor();
    }
    return result->loss.detach().to(at::kDouble).reshape({1});
  };
  // A first step outside the check: one-time set-up (cuBLAS handles, the pinned memory pool).
  nn::ComputeSpans warm_up_spans(gpu);
  ASSERT_TRUE(run_step(warm_up_spans).defined());
  const bool varlen = GetParam() == at::kBFloat16;
  if (varlen) {
    // The checked step must take the varlen kernel's path; a GPU without it fails here.
    ASSERT_FALSE((*lm)->varlen_attention_failed()) << "the varlen flash kernel failed (see log)";
  }
  const int64_t varlen_layers = (*lm)->varlen_attention_layers();

  at::Tensor loss;
  nn::ComputeSpans spans(gpu);
  {
    // No host sync in the step's compute, on this thread or autograd's: one throws, and the
    // step fails naming it.
    testing::SyncsThrow syncs_throw;
    loss = run_step(spans);
  }
  ASSERT_TRUE(loss.defined()) << "the step's compute made a host sync (above)";
  if (varlen) {
    // Both layers of the checked step ran the kernel (it may not fall back after its first run).
    EXPECT_GE((*lm)->varlen_attention_layers() - varlen_layers, 2);
    EXPECT_FALSE((*lm)->varlen_attention_failed());
  }
  testing::HostSyncCounter counter;
  // The step end: the loss and both models' gradient norm parts in one read.
  const at::Tensor parts = at::cat({loss, train::OwnedGradSumParts((*lm)->parameters()),
                                    train::OwnedGradSumParts((*encoder)->parameters())});
  const at::Tensor host = parts.cpu();
  EXPECT_EQ(counter.syncs(), 1) << "host syncs in the step end's read:" << Where(counter);
  // The compute's device time: Seconds never waits, so it reads only if that sync passed every
  // span's end (event queries and elapsed times are not syncs to libtorch's debug mode).
  const absl::StatusOr<double> compute_s = spans.Seconds();
  ASSERT_TRUE(compute_s.ok()) << compute_s.status();
  EXPECT_EQ(spans.spans(), 4);
  EXPECT_GT(*compute_s, 0.0);
  EXPECT_TRUE(std::isfinite(host[0].item<double>()));
  EXPECT_GT(host[0].item<double>(), 0.0);
#endif
}

INSTANTIATE_TEST_SUITE_P(Dtypes, HostSyncTest, ::testing::Values(at::kFloat, at::kBFloat16),
                         [](const ::testing::TestParamInfo<at::ScalarType>& info) {
                           return std::string(info.param == at::kFloat ? "float32" : "bfloat16");
                         });

}  // namespace
}  // namespace hetpar
