#include "common/nn/execution_context.h"

#include <ATen/ATen.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/cuda.h>

#include <cstdlib>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/nn/parameters.h"
#include "common/status.h"

namespace hetpar::nn {

absl::StatusOr<ExecutionContext> ExecutionContext::FromSpec(const hetpar::v1::RunSpec& spec,
                                                            int cuda_index) {
  // run.dtype left out is its documented default, float32.
  HETPAR_ASSIGN_OR_RETURN(const at::ScalarType dtype,
                          spec.run().dtype() == hetpar::v1::DTYPE_UNSPECIFIED
                              ? absl::StatusOr<at::ScalarType>(at::kFloat)
                              : TorchDtype(spec.run().dtype()));
  const std::string& device = spec.run().device();
  if (device.empty() || device == "cpu") return Cpu(dtype);
  if (device != "cuda") {
    return absl::InvalidArgumentError(
        absl::StrCat("run.device=\"", device, "\" is not a device; expected \"cpu\" or \"cuda\""));
  }
  if (!torch::cuda::is_available()) {
    return absl::FailedPreconditionError(
        "run.device=\"cuda\", but this worker sees no CUDA device (no GPU or no driver, or a "
        "libtorch built without CUDA); run on a GPU machine or set run.device: cpu");
  }
  const int count = static_cast<int>(torch::cuda::device_count());
  if (cuda_index < 0 || cuda_index >= count) {
    return absl::FailedPreconditionError(absl::StrCat(
        "run.device=\"cuda\": this worker's GPU index ", cuda_index, " is not below the ", count,
        " visible GPU(s) (--cuda-device, HETPAR_CUDA_DEVICE or LOCAL_RANK pick it; "
        "CUDA_VISIBLE_DEVICES limits what is visible)"));
  }
  const c10::Device gpu(c10::kCUDA, static_cast<c10::DeviceIndex>(cuda_index));
  // The worker's current device from now on: NCCL's communicators, the host tensors NCCL groups
  // move and every tensor without an explicit device index land there.
  c10::impl::getDeviceGuardImpl(c10::kCUDA)->setDevice(gpu);
  UseIeeeFloat32OnCuda();
  if (spec.llm().layout().cp() > 1) {
    AvoidCudnnMaskedAttention();
    HETPAR_LOG(INFO) << "cuDNN attention off for this context-parallel run: its masked backward "
                        "can return NaN query gradients (pytorch/pytorch#196678); masked "
                        "attention runs in the memory-efficient kernel";
  }
  return ExecutionContext(gpu, dtype);
}

void AvoidCudnnMaskedAttention() { at::globalContext().setSDPUseCuDNN(false); }

void UseIeeeFloat32OnCuda() {
  // The legacy setters keep libtorch's old and new precision settings in step.
  at::globalContext().setAllowTF32CuBLAS(false);
  at::globalContext().setAllowTF32CuDNN(false);
}

ExecutionContext ExecutionContext::Cpu(at::ScalarType dtype) {
  return ExecutionContext(c10::Device(c10::kCPU), dtype);
}

at::ScalarType ExecutionContext::grad_dtype() const {
  return ParameterSet::GradDtypeOf(compute_dtype_);
}

std::string ExecutionContext::Describe() const {
  std::string precision = DtypeName(compute_dtype_);
  if (master_weights()) {
    absl::StrAppend(&precision, " with ", DtypeName(grad_dtype()), " master weights");
  }
  return absl::StrCat(device_.str(), ", ", precision, ", ",
                      collective_backend() == Backend::kNccl ? "nccl" : "gloo");
}

absl::StatusOr<int> LocalCudaIndexFromEnvironment() {
  for (const char* name : {"HETPAR_CUDA_DEVICE", "LOCAL_RANK"}) {
    const char* value = std::getenv(name);
    if (value == nullptr || *value == '\0') continue;
    int index = 0;
    if (!absl::SimpleAtoi(value, &index) || index < 0) {
      return absl::InvalidArgumentError(absl::StrCat("environment variable ", name, "=\"", value,
                                                     "\" is not a GPU index (an integer >= 0)"));
    }
    return index;
  }
  return 0;
}

}  // namespace hetpar::nn
