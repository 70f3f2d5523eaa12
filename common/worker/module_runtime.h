// What the step driver (step_driver.h) needs of the module(s) a worker runs: the seam between the
// one step protocol every role speaks with the coordinator and the module runtimes behind it
// (encoder_service/encoder_module.h, llm_trainer/llm_module.h, and the colocated pair).
//
// A ModuleRuntime runs this rank's part of one step and then waits for the coordinator's
// decision: Apply (the global gradient norm arrived: clip, optimizer step) or Discard (the step
// was aborted: drop its gradients). Parameters change only in Apply. One thread (the driver's)
// calls every method.
#ifndef HETPAR_COMMON_WORKER_MODULE_RUNTIME_H_
#define HETPAR_COMMON_WORKER_MODULE_RUNTIME_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/plan/step_plan.h"
#include "hetpar/v1/coordinator.pb.h"
#include "hetpar/v1/plan.pb.h"

namespace hetpar::worker {

// Delivers a finished local file into the run directory as `name` ("model/llm.hpar"): a worker
// sends it to the coordinator (WorkerContext::PutOutput), which writes it there.
using OutputSender =
    std::function<absl::Status(const std::string& name, const std::string& local_path)>;

// One module's time split and counters on this rank for one step ("compute_s", "bridge_wait_s",
// "collective_s", "data_s", "bridge_bytes", ...); the driver adds "step_s", "idle_s",
// "grad_norm_wait_s" and "optimizer_s", and reports each as "<module>.<key>".
struct ModuleTimings {
  std::string module;  // "encoder" or "llm"
  std::map<std::string, double> values;
};

// What one rank's part of a step produced, besides the gradients its modules now hold.
struct StepOutcome {
  std::vector<ModuleTimings> modules;  // one entry per module this rank holds, encoder first
  bool reports_loss = false;           // an LLM rank that reports its replica's loss (tp 0)
  double loss_sum = 0;                 // summed token losses of this replica's microbatches
  int64_t loss_tokens = 0;
};

// The DP replicas of each module taking part in a step (StepPlan.encoder_replicas,
// llm_replicas), increasing; empty: every replica of the layout.
struct StepReplicas {
  std::vector<int64_t> encoder;
  std::vector<int64_t> llm;
};

// One module's part of the squared global gradient norm (the elements this rank owns).
struct GradNormShare {
  v1::Module module = v1::MODULE_UNSPECIFIED;
  double sum_squares = 0;
};

class ModuleRuntime {
 public:
  virtual ~ModuleRuntime() = default;

  // Forward and backward of this rank's part of `plan`; on return the parameter gradients hold
  // the module's full gradient (summed over its DP group). Any failure fails the step.
  virtual absl::StatusOr<StepOutcome> RunStep(const plan::RankStepPlan& plan) = 0;
  // The gradient-norm shares this rank sends after RunStep: one per module where this rank is
  // in DP replica 0 (the partials of one replica add up to the module's squared norm).
  virtual std::vector<GradNormShare> GradNormShares() const = 0;
  // The coordinator's decision to commit: scale the gradients by `clip_coefficient`, take the
  // optimizer step of 0-based step `step`, drop the gradients; then write a checkpoint when the
  // step ends a checkpoint interval or `commit` asks for one (StepCommit.checkpoint), its shards
  // stamped with the commit's commit_id and its manifest recording the commit's data position.
  virtual absl::Status Apply(int64_t step, double clip_coefficient,
                             const v1::StepCommit& commit) = 0;
  // The coordinator aborted the step: drop its gradients; parameters stay as they were.
  virtual void Discard() = 0;
  // The coordinator committed step `step` without an update (a non-finite gradient norm): drop
  // its gradients, parameters stay as they were; then write the checkpoint Apply would have
  // written (the state after the step is the one before it).
  virtual absl::Status Skip(int64_t step, const v1::StepCommit& commit) = 0;
  // The step of `plan` failed on this rank before RunStep (its groups could not be formed, or a
  // joined replica's state did not arrive): the boundary messages live peers still send in it
  // are absorbed, as when RunStep fails. Left unmatched, a sender's large message would hold its
  // connection until the sender gives it up and tears the connection down.
  virtual void StepNotRun(const plan::RankStepPlan& plan) = 0;
  // Before the first step of generation `generation`: form the module groups anew in that
  // generation's rendezvous (the old ones may hold a collective a peer gave up), each module's
  // gradient group over the plan's replicas of it.
  virtual absl::Status Regroup(int64_t generation, const StepReplicas& replicas) = 0;
  // Before a step whose plan names replicas that joined the run (StepPlan.encoder_joining,
  // .llm_joining): every rank of a module with joining replicas takes part in the broadcast of
  // the module's parameters and AdamW state from the first replica of `replicas` not joining,
  // after which the joined replicas hold what the others hold.
  virtual absl::Status ReceiveJoinedState(const StepReplicas& replicas,
                                          const StepReplicas& joining) {
    (void)replicas;
    (void)joining;
    return absl::OkStatus();
  }

  // After the last step (the worker's main calls it, not the driver): the final outputs of the
  // module(s), handed to `send` (common/worker/outputs.h).
  virtual absl::Status WriteOutputs(const OutputSender& send, int64_t world_rank) = 0;
};

}  // namespace hetpar::worker

#endif  // HETPAR_COMMON_WORKER_MODULE_RUNTIME_H_
