#include "common/nn/execution_context.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <cstdlib>
#include <string>

#include "common/nn/parameters.h"
#include "tests/util/scoped_env.h"

namespace hetpar::nn {
namespace {

using ::hetpar::testing::ScopedEnv;

hetpar::v1::RunSpec Spec(const std::string& device, hetpar::v1::Dtype dtype) {
  hetpar::v1::RunSpec spec;
  spec.mutable_run()->set_device(device);
  spec.mutable_run()->set_dtype(dtype);
  return spec;
}

TEST(ExecutionContextTest, CpuFloat32RunsOnGlooWithoutMasters) {
  for (const std::string device : {"", "cpu"}) {
    auto context = ExecutionContext::FromSpec(Spec(device, hetpar::v1::DTYPE_FLOAT32), 3);
    ASSERT_TRUE(context.ok()) << context.status();
    EXPECT_TRUE(context->device().is_cpu());
    EXPECT_FALSE(context->is_cuda());
    EXPECT_EQ(context->compute_dtype(), at::kFloat);
    EXPECT_EQ(context->grad_dtype(), at::kFloat);
    EXPECT_FALSE(context->master_weights());
    EXPECT_EQ(context->collective_backend(), Backend::kGloo);
    EXPECT_EQ(context->Describe(), "cpu, float32, gloo");
  }
}

TEST(ExecutionContextTest, Bfloat16KeepsFloat32MastersAndGradients) {
  auto context = ExecutionContext::FromSpec(Spec("cpu", hetpar::v1::DTYPE_BFLOAT16), 0);
  ASSERT_TRUE(context.ok()) << context.status();
  EXPECT_EQ(context->compute_dtype(), at::kBFloat16);
  EXPECT_EQ(context->grad_dtype(), at::kFloat);
  EXPECT_TRUE(context->master_weights());
  EXPECT_EQ(context->Describe(), "cpu, bfloat16 with float32 master weights, gloo");
}

// As when TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1 turned TF32 on: a CUDA context turns it off again.
TEST(ExecutionContextTest, Float32OnCudaIsIeeeEvenWhereTf32WasTurnedOn) {
  at::globalContext().setAllowTF32CuBLAS(true);
  at::globalContext().setAllowTF32CuDNN(true);
  ASSERT_TRUE(at::globalContext().allowTF32CuBLAS());
  UseIeeeFloat32OnCuda();
  EXPECT_FALSE(at::globalContext().allowTF32CuBLAS());
  EXPECT_EQ(at::globalContext().float32MatmulPrecision(), at::Float32MatmulPrecision::HIGHEST);
  EXPECT_FALSE(at::globalContext().allowTF32CuDNN());
}

TEST(ExecutionContextTest, UnknownDeviceIsRefused) {
  auto tpu = ExecutionContext::FromSpec(Spec("tpu", hetpar::v1::DTYPE_FLOAT32), 0);
  ASSERT_FALSE(tpu.ok());
  EXPECT_EQ(tpu.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(tpu.status().message().find("run.device=\"tpu\""), std::string::npos) << tpu.status();
  // A dtype left out is the RunSpec's default, float32.
  auto unspecified = ExecutionContext::FromSpec(Spec("cpu", hetpar::v1::DTYPE_UNSPECIFIED), 0);
  ASSERT_TRUE(unspecified.ok()) << unspecified.status();
  EXPECT_EQ(unspecified->compute_dtype(), at::kFloat);
}

TEST(ExecutionContextTest, CudaIsTheLocalGpuOnNcclOrRefusedWithoutOne) {
  auto context = ExecutionContext::FromSpec(Spec("cuda", hetpar::v1::DTYPE_BFLOAT16), 0);
  if (!torch::cuda::is_available()) {
    ASSERT_FALSE(context.ok());
    EXPECT_EQ(context.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(context.status().message().find("run.device=\"cuda\""), std::string::npos)
        << context.status();
    return;
  }
  ASSERT_TRUE(context.ok()) << context.status();
  EXPECT_EQ(context->device(), c10::Device(c10::kCUDA, 0));
  EXPECT_EQ(context->collective_backend(), Backend::kNccl);
  EXPECT_EQ(context->Describe(), "cuda:0, bfloat16 with float32 master weights, nccl");
  // An index beyond the visible GPUs is refused, naming how the index is chosen.
  auto beyond = ExecutionContext::FromSpec(Spec("cuda", hetpar::v1::DTYPE_FLOAT32),
                                           static_cast<int>(torch::cuda::device_count()));
  ASSERT_FALSE(beyond.ok());
  EXPECT_NE(beyond.status().message().find("LOCAL_RANK"), std::string::npos) << beyond.status();
}

TEST(ExecutionContextTest, LocalGpuIndexFollowsTheLaunchersVariablesInOrder) {
  ScopedEnv hetpar("HETPAR_CUDA_DEVICE", nullptr);
  ScopedEnv local("LOCAL_RANK", nullptr);
  EXPECT_EQ(*LocalCudaIndexFromEnvironment(), 0);
  setenv("LOCAL_RANK", "2", 1);
  EXPECT_EQ(*LocalCudaIndexFromEnvironment(), 2);
  setenv("HETPAR_CUDA_DEVICE", "7", 1);
  EXPECT_EQ(*LocalCudaIndexFromEnvironment(), 7);
  setenv("HETPAR_CUDA_DEVICE", "gpu1", 1);
  auto bad = LocalCudaIndexFromEnvironment();
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("HETPAR_CUDA_DEVICE=\"gpu1\""), std::string::npos)
      << bad.status();
}

TEST(ExecutionContextTest, MovingParametersToTheirOwnDeviceKeepsValuesAndDropsGradients) {
  ParameterSet params(/*run_seed=*/11, at::kFloat, /*tp_rank=*/0, /*tp_size=*/1,
                      InitStyle::kTraining);
  auto weight = params.Add("w", {4, 3}, -1, InitRule::Normal(0.02));
  ASSERT_TRUE(weight.ok()) << weight.status();
  const at::Tensor held = *weight;  // as a model's layer holds it
  const at::Tensor before = held.detach().clone();
  held.sum().backward();
  ASSERT_TRUE(held.grad().defined());
  params.MoveTo(c10::Device(c10::kCPU));
  EXPECT_TRUE(params.parameters()[0].tensor.is_same(held));
  EXPECT_TRUE(held.is_cpu());
  EXPECT_TRUE(held.requires_grad());
  EXPECT_FALSE(held.grad().defined());
  EXPECT_TRUE(at::equal(held.detach(), before));
}

TEST(ExecutionContextTest, MovingParametersToAGpuReachesEveryHolderOfTheirTensors) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device: torch::cuda::is_available() is false";
  }
  ParameterSet params(/*run_seed=*/11, at::kBFloat16, 0, 1, InitStyle::kTraining);
  auto weight = params.Add("w", {4, 3}, -1, InitRule::Normal(0.02));
  ASSERT_TRUE(weight.ok()) << weight.status();
  const at::Tensor held = *weight;
  const at::Tensor before = held.detach().clone();
  params.MoveTo(c10::Device(c10::kCUDA, 0));
  EXPECT_TRUE(held.is_cuda());
  EXPECT_TRUE(params.parameters()[0].tensor.is_same(held));
  EXPECT_TRUE(held.requires_grad());
  EXPECT_TRUE(at::equal(held.detach().cpu(), before));
  // Gradients then accumulate on the device, in float32 under bfloat16.
  held.to(at::kFloat).sum().backward();
  ASSERT_TRUE(held.grad().defined());
  EXPECT_TRUE(held.grad().is_cuda());
  EXPECT_EQ(held.grad().scalar_type(), at::kFloat);
}

}  // namespace
}  // namespace hetpar::nn
