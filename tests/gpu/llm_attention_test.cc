// The LLM's attention on CUDA in bfloat16 (label gpu): one varlen flash kernel over a
// microbatch's packed samples (LlmOptions::varlen_attention) against the same model's per-run
// path (one SDPA call per run of equal-length samples), both against a float64 CPU model of the
// same parameters (the tiny decoder with head_dim 8, which the flash kernels need; the test
// checks that both layers ran the kernel). Samples of lengths 9, 14, 5 and 14 (the two 14s apart:
// four calls on the per-run path), the second with an image's 4 rows. A sample attending to its
// neighbours, or a wrong causal boundary, moves the loss and the gradients far beyond bfloat16's
// rounding.
//
// Skips, saying why, where no CUDA device is visible, this libtorch has no CUDA, or the GPU is
// older than the flash kernels (compute capability 8.0).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "common/nn/communicator.h"
#include "llm_trainer/language_model.h"
#include "tests/util/tiny_llm.h"

#if HETPAR_GPU_HAS_C10_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

namespace hetpar {
namespace {

constexpr int64_t kVocab = 64;

// max |got - want| / max |want| over a whole tensor, in float64 on the CPU.
double RelativeError(const at::Tensor& got, const at::Tensor& want) {
  const at::Tensor g = got.detach().to(at::kCPU).to(at::kDouble);
  const at::Tensor w = want.detach().to(at::kCPU).to(at::kDouble);
  return (g - w).abs().max().item<double>() / std::max(w.abs().max().item<double>(), 1e-30);
}

struct TrainedModel {
  std::unique_ptr<llm::LanguageModel> model;
  at::Tensor image_rows;  // the leaf the model took
  double loss = 0;
};

// Trains one microbatch into `run`; a failure is a fatal test failure (ASSERT_NO_FATAL_FAILURE).
void Train(const c10::Device& device, at::ScalarType dtype, bool varlen,
           const std::vector<llm::LlmSample>& samples, const at::Tensor& image_rows,
           TrainedModel* run) {
  static auto single = nn::Communicator::CreateSingle();
  llm::LlmOptions options;
  options.device = device;
  options.dtype = dtype;
  options.seed = 11;
  options.varlen_attention = varlen;
  auto model = llm::LanguageModel::Create(testing::TinyLlmForFlash(kVocab), options, *single);
  ASSERT_TRUE(model.ok()) << model.status();
  run->model = *std::move(model);
  run->image_rows = image_rows.to(device, dtype).detach().requires_grad_(true);
  auto result = run->model->ForwardStage(samples, run->image_rows, at::Tensor(),
                                         static_cast<int64_t>(samples.size()));
  ASSERT_TRUE(result.ok()) << result.status();
  const absl::Status backward = run->model->Backward(result->loss);
  ASSERT_TRUE(backward.ok()) << backward;
  run->loss = result->loss.detach().to(at::kCPU).to(at::kDouble).item<double>();
}

TEST(LlmAttentionTest, VarlenFlashMatchesThePerRunPathAndTheFloat64Reference) {
#if !HETPAR_GPU_HAS_C10_CUDA
  GTEST_SKIP() << "this libtorch has no CUDA (built without c10_cuda)";
#else
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device: torch::cuda::is_available() is false";
  }
  const cudaDeviceProp* props = at::cuda::getDeviceProperties(0);
  if (props->major < 8) {
    GTEST_SKIP() << "compute capability " << props->major << "." << props->minor
                 << " has no flash attention kernels (8.0 or newer)";
  }
  const c10::Device gpu(c10::kCUDA, 0);
  const std::vector<llm::LlmSample> samples = {
      testing::TinyLlmSample(9, 1, kVocab), testing::TinyLlmSample(14, 2, kVocab, {2, 3, 4, 5}),
      testing::TinyLlmSample(5, 3, kVocab), testing::TinyLlmSample(14, 4, kVocab)};
  const at::Tensor image_rows =
      at::randn({4, testing::kTinyLlmHidden}, at::TensorOptions().dtype(at::kDouble));

  TrainedModel reference, varlen, per_run;
  ASSERT_NO_FATAL_FAILURE(
      Train(c10::kCPU, at::kDouble, /*varlen=*/false, samples, image_rows, &reference));
  ASSERT_NO_FATAL_FAILURE(Train(gpu, at::kBFloat16, /*varlen=*/true, samples, image_rows, &varlen));
  ASSERT_NO_FATAL_FAILURE(
      Train(gpu, at::kBFloat16, /*varlen=*/false, samples, image_rows, &per_run));
  ASSERT_FALSE(varlen.model->varlen_attention_failed())
      << "the varlen flash kernel failed on a GPU that has flash attention (see the log)";
  // Each of the two layers through the kernel; the per-run model never.
  ASSERT_GE(varlen.model->varlen_attention_layers(), 2);
  ASSERT_EQ(per_run.model->varlen_attention_layers(), 0);

  // The bfloat16 losses are within bfloat16's rounding of the float64 one, and of each other.
  ASSERT_GT(reference.loss, 0.0);
  EXPECT_LT(std::abs(varlen.loss - reference.loss) / reference.loss, 2e-2)
      << "varlen " << varlen.loss << ", float64 " << reference.loss;
  EXPECT_LT(std::abs(per_run.loss - reference.loss) / reference.loss, 2e-2)
      << "per-run " << per_run.loss << ", float64 " << reference.loss;
  EXPECT_LT(std::abs(varlen.loss - per_run.loss) / reference.loss, 1e-2)
      << "varlen " << varlen.loss << ", per-run " << per_run.loss;

  // Every gradient is as close to the float64 one as the per-run path's (both round the same
  // bfloat16 parameters and activations; only the attention kernel differs).
  std::vector<std::pair<std::string, double> > worst;
  const auto& reference_params = reference.model->parameters().parameters();
  const auto& varlen_params = varlen.model->parameters().parameters();
  const auto& per_run_params = per_run.model->parameters().parameters();
  ASSERT_EQ(reference_params.size(), varlen_params.size());
  ASSERT_EQ(reference_params.size(), per_run_params.size());
  for (size_t i = 0; i < reference_params.size(); ++i) {
    const std::string& name = reference_params[i].name;
    ASSERT_EQ(varlen_params[i].name, name);
    const at::Tensor& want = reference_params[i].tensor.grad();
    ASSERT_TRUE(want.defined()) << name;
    ASSERT_TRUE(varlen_params[i].tensor.grad().defined()) << name;
    const double varlen_error = RelativeError(varlen_params[i].tensor.grad(), want);
    const double per_run_error = RelativeError(per_run_params[i].tensor.grad(), want);
    EXPECT_LT(varlen_error, 1.5 * per_run_error + 5e-3)
        << name << ": varlen " << varlen_error << ", per-run " << per_run_error;
    EXPECT_LT(varlen_error, 0.1) << name;
  }
  const double rows_error = RelativeError(varlen.image_rows.grad(), reference.image_rows.grad());
  const double rows_per_run = RelativeError(per_run.image_rows.grad(), reference.image_rows.grad());
  EXPECT_LT(rows_error, 1.5 * rows_per_run + 5e-3)
      << "image rows: varlen " << rows_error << ", per-run " << rows_per_run;
#endif
}

}  // namespace
}  // namespace hetpar
