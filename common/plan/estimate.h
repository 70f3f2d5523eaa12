// The layout planner's cost model: the predicted time of one training step for a RunSpec's
// layouts and placement on a described cluster (cluster.h), with its breakdown, the TFLOPS and
// tokens/s per device, and the peak memory per device (`hetpar plan --estimate`; docs/planner.md).
//
// Per piece of work, from the step plan (the same assignment and boundary plan a run uses):
//
//   compute     each matrix product of flops.h as the rank runs it (TP shards, CP's share of the
//               rows, PP's layers), forward and backward, on a roofline: the longer of its FLOPs
//               at peak x compute_efficiency and its operands' and result's bytes at memory_gbps;
//               plus the work TP does not divide, (1 - f)(1 - 1/tp) of the FLOPs at that rate
//               (f = tp_parallel_fraction), and layer_overhead_s per layer for each microbatch
//               and encoder job
//   TP          Megatron's all-reduces per microbatch: the LLM 4 per layer + 7 (embedding, loss,
//               image rows, their gradient, final norm), the encoder 4 per layer + 4; each
//               latency + 2 (tp-1)/tp x bytes / bus bandwidth; under sequence parallelism an
//               all-gather and a reduce-scatter in place of each, half the bytes each
//   CP          per layer and microbatch a K/V all-gather forward and a reduce-scatter backward
//   PP          per microbatch and stage an activation send forward and a gradient send back;
//               the 1F1B bubble (pp - 1) x the mean stage time per microbatch
//   DP          one all-reduce of the rank's gradients per step
//   boundary    per wave and LLM rank, its messages' latency + bytes / p2p bandwidth, each way
//   optimizer   AdamW reads and writes 7 values per parameter at memory_gbps
//
// Non-colocated, the step is simulated wave by wave: an encoder replica runs its jobs' forwards
// and, max_inflight jobs ahead, the backward of its oldest job once that job's gradients are
// back; an LLM replica runs wave m once every encoder job feeding it has arrived. Colocated, the
// three phases run one after the other on every rank (encoder forwards, LLM waves, encoder
// backwards). Then the DP all-reduces, the control plane's round trips (step_overhead_s) and the
// optimizer. Where ranks share devices (share_devices, more ranks than the cluster's
// concurrency), the step lasts at least as long as every rank's compute under processor sharing,
// and TP collectives pay the shared latency (colocated: every rank computes at once) or, in
// proportion to the share of the step the other module computes, the loaded latency
// (non-colocated).
//
// Memory per device: parameters, gradients and AdamW state (fp32 moments, and an fp32 master copy
// under bfloat16), activations by Korthikanti et al. 2022 (per layer s b h (34 + 5 a s / h) bytes
// at 16 bits, divided by TP as Megatron does with and without sequence parallelism) for the
// microbatches alive at once, the LLM's fp32 logits and their gradient, and reserved_gib.
#ifndef HETPAR_COMMON_PLAN_ESTIMATE_H_
#define HETPAR_COMMON_PLAN_ESTIMATE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/plan/cluster.h"
#include "common/plan/step_plan.h"
#include "hetpar/v1/run_spec.pb.h"

namespace hetpar::plan {

// Tensor-parallel collectives one microbatch (forward and backward) costs each rank.
struct CollectiveCount {
  int64_t all_reduces = 0;
  double all_reduce_bytes = 0;  // summed over the all-reduces
};
CollectiveCount LlmTpCollectives(const v1::LlmModel& model, int64_t layers, int64_t tokens,
                                 int64_t image_rows, int64_t loss_tokens, int64_t dtype_bytes);
CollectiveCount EncoderTpCollectives(const v1::EncoderModel& model, int64_t images,
                                     int64_t dtype_bytes);

// Seconds of one all-reduce of `bytes` over `ranks` on `link` (0 for one rank).
double AllReduceSeconds(const LinkSpec& link, int64_t ranks, double bytes);

// Parameters of each module (the planner's memory and DP terms; matches the models' shapes).
double EncoderParameters(const v1::EncoderModel& model);
double EncoderProjectorParameters(const v1::EncoderModel& model);  // part of EncoderParameters
double LlmParameters(const v1::LlmModel& model);

struct ModuleEstimate {
  int64_t ranks = 0;
  double flops = 0;            // the module's model FLOPs in the step
  double compute_s = 0;        // the busiest replica's forward + backward compute
  double tp_collective_s = 0;  // on that replica
  double cp_collective_s = 0;
  double pp_p2p_s = 0;
  double bubble_s = 0;
  double dp_collective_s = 0;
  double optimizer_s = 0;
  double imbalance_s = 0;     // busiest replica's compute minus the mean replica's
  double busy_s = 0;          // everything the busiest rank does in the step
  double rank_compute_s = 0;  // compute summed over all the module's ranks
  double parameters = 0;      // of the whole module
  double state_gib = 0;       // per rank: parameters, gradients, optimizer state
  double activation_gib = 0;  // per rank, peak
};

struct StepEstimate {
  std::string placement;  // colocated | non_colocated
  Layout encoder;
  Layout llm;
  int64_t devices = 0;  // devices used: the world size
  double step_time_s = 0;
  double boundary_s = 0;      // the busiest LLM rank's transfers in the step, both ways
  double overhead_s = 0;      // control plane
  double shared_bound_s = 0;  // summed busy time over the devices when ranks share them, else 0
  ModuleEstimate encoder_module;
  ModuleEstimate llm_module;
  double tokens = 0;  // sequence positions in the global batch
  double images = 0;
  double tflops_per_device = 0;
  double tokens_per_s_per_device = 0;
  double memory_gib_per_device = 0;  // the fullest device
  bool fits_memory = true;
  std::vector<std::string> notes;
};

// The estimate of `plan`'s step for `spec` (its models, dtype, max_inflight and layouts) on
// `cluster`. InvalidArgument when the cluster cannot hold the placement (more ranks than devices
// without share_devices, TP groups larger than a node) or lacks a peak for the dtype.
absl::StatusOr<StepEstimate> EstimateStep(const v1::RunSpec& spec, const StepPlan& plan,
                                          const ClusterSpec& cluster);

}  // namespace hetpar::plan

#endif  // HETPAR_COMMON_PLAN_ESTIMATE_H_
