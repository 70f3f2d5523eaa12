// Where and how a rank computes: the device, the precision policy and the collective backend.
//
// One ExecutionContext per worker, built from the RunSpec (run.device, run.dtype) and the rank's
// local GPU; every model, process group and the boundary take it, so that nothing else decides
// where a tensor lives:
//
//   HETPAR_ASSIGN_OR_RETURN(nn::ExecutionContext execution,
//                           nn::ExecutionContext::FromSpec(spec, /*cuda_index=*/local_rank));
//   execution.device();               // cpu, or cuda:<local_rank>
//   execution.collective_backend();   // Gloo for CPU tensors, NCCL for CUDA tensors
//   execution.compute_dtype();        // run.dtype: parameters and activations
//   execution.grad_dtype();           // float32 under bfloat16 (with float32 master weights)
//
// Parameters are drawn on the host (the layout-independent initialisation is a CPU generator's)
// and then moved to device(); inputs are built on the host and moved once per wave. On CUDA the
// work runs on each device's current stream; NCCL orders its own streams against it.
#ifndef HETPAR_COMMON_NN_EXECUTION_CONTEXT_H_
#define HETPAR_COMMON_NN_EXECUTION_CONTEXT_H_

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <string>

#include "absl/status/statusor.h"
#include "common/nn/communicator.h"
#include "hetpar/v1/run_spec.pb.h"

namespace hetpar::nn {

// Float32 matrix products and convolutions in IEEE float32 on CUDA: turns TF32 off in cuBLAS and
// cuDNN for the whole process, even where the environment turned it on
// (TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1, which some PyTorch container images set), so that a float32
// run keeps float32's agreement with the float64 reference. bfloat16 and float16 compute are not
// affected. ExecutionContext::FromSpec calls it for every CUDA context.
void UseIeeeFloat32OnCuda();

// Turns cuDNN's fused attention off for the whole process, so that scaled_dot_product_attention
// with an explicit mask (context parallelism's causal masks) runs in the memory-efficient kernel:
// cuDNN's masked backward returns NaN query gradients on H100/H200 when the key length is 64
// modulo 128 and a row's scores are very low (pytorch/pytorch#196678, seen with torch 2.11 to
// 2.13). ExecutionContext::FromSpec calls it for a CUDA context of a run with llm.layout.cp > 1,
// the only one that passes masks.
void AvoidCudnnMaskedAttention();

class ExecutionContext {
 public:
  // run.device and run.dtype of `spec`; `cuda_index` is the GPU a "cuda" run uses (the worker's
  // local rank). FailedPrecondition, naming run.device, when the run asks for CUDA and this
  // libtorch has no CUDA, the machine shows no GPU, or `cuda_index` is beyond its GPUs;
  // InvalidArgument for a device or dtype the RunSpec does not know.
  static absl::StatusOr<ExecutionContext> FromSpec(const hetpar::v1::RunSpec& spec, int cuda_index);
  // A CPU context in `dtype` (tests, tools and the single-process reference).
  static ExecutionContext Cpu(at::ScalarType dtype = at::kFloat);

  const c10::Device& device() const { return device_; }
  bool is_cuda() const { return device_.is_cuda(); }
  // Parameters and activations.
  at::ScalarType compute_dtype() const { return compute_dtype_; }
  // Gradient accumulation across waves and the optimizer's state: float32 for bfloat16 and
  // float16 compute (which then keep float32 master weights), else compute_dtype().
  at::ScalarType grad_dtype() const;
  bool master_weights() const { return grad_dtype() != compute_dtype_; }
  // Gloo for a CPU device, NCCL for a CUDA device.
  Backend collective_backend() const { return is_cuda() ? Backend::kNccl : Backend::kGloo; }

  // "cpu, float32, gloo" or "cuda:0, bfloat16 with float32 master weights, nccl".
  std::string Describe() const;

 private:
  ExecutionContext(c10::Device device, at::ScalarType dtype)
      : device_(device), compute_dtype_(dtype) {}

  c10::Device device_;
  at::ScalarType compute_dtype_;
};

// The rank's local GPU index as launchers give it: HETPAR_CUDA_DEVICE, else LOCAL_RANK
// (torchrun), else 0 (a Kubernetes container given one GPU sees it as 0);
// InvalidArgument naming the variable when it is not an index.
absl::StatusOr<int> LocalCudaIndexFromEnvironment();

}  // namespace hetpar::nn

#endif  // HETPAR_COMMON_NN_EXECUTION_CONTEXT_H_
