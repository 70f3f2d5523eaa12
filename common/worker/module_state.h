// What every module runtime holds for its module on this rank, and the step end they share:
// the rank's coordinates in the module's grid, its TP and DP groups, the model's parameters and
// their optimizer; the gradient-norm share, Apply, Discard and the final outputs of
// ModuleRuntime (module_runtime.h). EncoderModule and LlmModule are SingleModuleRuntimes over one.
//
//   HETPAR_ASSIGN_OR_RETURN(worker::ModuleState state,
//                           worker::ModuleState::Form(context, v1::MODULE_LLM));
//   ... build the model over state.tp() ...
//   HETPAR_RETURN_IF_ERROR(state.Train(&model->parameters(), spec.llm().optimizer()));
//
// One thread uses it.
#ifndef HETPAR_COMMON_WORKER_MODULE_STATE_H_
#define HETPAR_COMMON_WORKER_MODULE_STATE_H_

#include <cstdint>
#include <future>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/nn/communicator.h"
#include "common/nn/compute_spans.h"
#include "common/nn/parameters.h"
#include "common/train/optimizer.h"
#include "common/worker/bootstrap.h"
#include "common/worker/module_runtime.h"

namespace hetpar::worker {

class ModuleState {
 public:
  // This worker's coordinates in `module`'s grid and the module's groups, formed through the
  // run's rendezvous store: "<module>/dp<d>/tp" and "<module>/tp<t>/dp". With context
  // parallelism (the LLM's cp > 1) the TP group is "<module>/dp<d>/cp<c>/tp", the gradient
  // group dp() spans the DP replicas and the CP ranks (index dp * cp + c, as Megatron sums
  // gradients over DP x CP) and cp() is "<module>/dp<d>/tp<t>/cp". With pipeline parallelism
  // (the LLM's pp > 1) each stage has its own: "/pp<p>" follows the module name, and pp() is
  // "<module>/dp<d>[/cp<c>]/tp<t>/pp", the rank's pipeline (index: its stage). FailedPrecondition
  // when the worker holds no rank of `module`.
  static absl::StatusOr<ModuleState> Form(WorkerContext& context, v1::Module module);

  // Forms the groups again through the context's current store (a new generation: a step was
  // aborted, or replicas left the run), the gradient group over the step's replicas of this
  // module. The communicators keep their identity.
  absl::Status Regroup(WorkerContext& context, const StepReplicas& replicas);

  // Takes the model's parameters (borrowed: they must outlive this) and creates their optimizer.
  // A resumed run (checkpoint.resume_from) then loads this rank's slices of the parameters and
  // of their AdamW state from the checkpoint, whatever layout wrote it (train/checkpoint.h);
  // a worker joining a running run does not (its state comes from a live replica).
  absl::Status Train(nn::ParameterSet* params, const v1::Optimizer& optimizer);

  // ModuleRuntime::ReceiveJoinedState for this module (after Train, in the step's groups): the
  // gradient group broadcasts the parameters and AdamW state of the first of this module's
  // `replicas` not in `joining` (its CP rank 0: CP ranks hold the same state). No-op without
  // joining replicas of this module.
  absl::Status ReceiveJoinedState(const StepReplicas& replicas, const StepReplicas& joining);

  const std::string& name() const { return name_; }  // "encoder" or "llm"
  const v1::RankCoordinates& coords() const { return coords_; }
  nn::Communicator& tp() const { return *tp_; }
  // The group gradients are summed over: the DP replicas (and CP ranks).
  nn::Communicator& dp() const { return *dp_; }
  nn::Communicator& cp() const { return *cp_; }  // a group of one without CP
  nn::Communicator& pp() const { return *pp_; }  // a group of one without PP
  // This rank's index in dp(): 0 on exactly one rank per TP rank.
  int64_t gradient_rank() const { return gradient_rank_; }

  // ModuleRuntime's step end for this module (after Train). When the step ends a checkpoint
  // interval (checkpoint.every, and the last step when checkpoint.dir is set) or `checkpoint`
  // asks for one (the coordinator's stop with a checkpoint), Apply also copies
  // this rank's checkpoint shard and starts writing it in the background: the rank of DP replica
  // 0 (CP rank 0) of each TP rank and stage writes, and the last writer completes the manifest.
  //
  // EndStep is the step's one read of the device, after the runtime has queued all of the
  // step's work: this rank's gradient norm share (where GradNormShares sends one) and `extra`
  // (a scalar on the module's device, such as the LLM's loss; undefined: none) come to the host
  // in one copy. Returns `extra`'s value (0 without it); GradNormShares then sends what it read
  // (and reads the gradients itself without an EndStep first). Apply and Discard drop it. On a
  // GPU it waits for the device even where there is nothing to read, so that every rank's
  // compute spans (nn::ComputeSpans) can be read after it.
  absl::StatusOr<double> EndStep(const at::Tensor& extra);
  // EndStep for the module states of one worker (colocated: the encoder's and the LLM's), in one
  // copy for all of them. Returns each state's `extra` value, in order.
  static absl::StatusOr<std::vector<double>> EndSteps(
      const std::vector<std::pair<ModuleState*, at::Tensor>>& states);
  std::vector<GradNormShare> GradNormShares() const;
  absl::Status Apply(int64_t step, double clip_coefficient, const v1::StepCommit& commit);
  void Discard();
  // A step committed without an update: Discard, then the checkpoint Apply would write.
  absl::Status Skip(int64_t step, const v1::StepCommit& commit);
  // Waits for a checkpoint still being written first.
  absl::Status WriteOutputs(const OutputSender& send, int64_t world_rank);

  ModuleState(ModuleState&&) = default;
  // No move assignment: it would have to finish the save in progress of the state it replaces.
  ModuleState& operator=(ModuleState&&) = delete;
  // Waits for a checkpoint still being written, as FinishCheckpoint does (and logs its error).
  ~ModuleState();

 private:
  ModuleState() = default;

  v1::Module module_ = v1::MODULE_UNSPECIFIED;
  std::string name_;
  v1::RankCoordinates coords_;
  std::unique_ptr<nn::Communicator> tp_;
  std::unique_ptr<nn::Communicator> dp_;
  std::unique_ptr<nn::Communicator> cp_;
  std::unique_ptr<nn::Communicator> pp_;
  int64_t gradient_rank_ = 0;
  bool joining_ = false;  // the worker joined a running run (WorkerContext::joining)
  // Every rank of dp() ends with the parameters and AdamW state of its rank `root`.
  absl::Status BroadcastState(int64_t root);
  absl::Status FormGroups(WorkerContext& context, const StepReplicas& replicas);
  // Copies this rank's shard of the checkpoint after `committed` steps and starts writing it on
  // a thread of its own (and, if it is the last shard, the manifest), after the previous save.
  absl::Status WriteCheckpoint(int64_t committed, const v1::StepCommit& commit);
  // WriteCheckpoint's copy and thread, once the previous save is finished.
  absl::Status StartCheckpoint(int64_t committed, const v1::StepCommit& commit);
  // Waits for the save in progress, at most half of failure.step_timeout_s; its error, or
  // DEADLINE_EXCEEDED (then the save is given up, and so is every other save of this process
  // still running when a later call asks). Both name the save's step; a full, read-only or
  // forbidden checkpoint.dir is marked EndsRun.
  absl::Status FinishCheckpoint();
  // After step `step` committed: the checkpoint its interval or the commit asks for, if any;
  // else the result of a save that has ended since the last call.
  absl::Status CheckpointIfDue(int64_t step, const v1::StepCommit& commit);

  nn::ParameterSet* params_ = nullptr;
  std::optional<double> grad_square_sum_;  // EndStep's read of this step's share
  std::unique_ptr<train::ModuleOptimizer> optimizer_;
  v1::RunSpec spec_;  // the checkpoint section, the run's steps and batch, both layouts
  std::future<absl::Status> pending_checkpoint_;  // the save in progress
  std::thread writer_;                              // its thread (detached once given up)
  int64_t pending_step_ = 0;                        // its step
};

// Waits until no checkpoint write of this process is running, at most until each write's bound
// (after its start, the smaller of half of failure.step_timeout_s and half of
// coordinator.register_timeout_s), and not at all once a save was given up as hung; logs that it
// waits. Returns the number of writes still running. A worker that replaces its process (a lost
// coordinator) calls it first, so that the checkpoint of the step it just committed is not cut
// off halfway.
int AwaitCheckpointWrites();

// The checkpoint writes of this process still running (none once a save was given up as hung),
// and the latest time one of them may still be waited for (see AwaitCheckpointWrites).
struct RunningCheckpointWrites {
  int running = 0;
  absl::Time bound = absl::InfinitePast();
};
RunningCheckpointWrites CheckpointWritesRunning();

// A module's "compute_s" for its step line: the runtime's spans (nn::ComputeSpans), read after
// the step's EndStep(s), which on a GPU is the device's time. Where that cannot be read, the
// host's time between the same marks, with a warning naming `module` and why (once per process).
double ComputeSeconds(const nn::ComputeSpans& spans, std::string_view module);

// ModuleRuntime::Regroup for the module states of one worker: opens the rendezvous store of
// `generation` (once), then forms each state's groups in it.
absl::Status RegroupStates(WorkerContext& context, int64_t generation, const StepReplicas& replicas,
                           std::initializer_list<ModuleState*> states);

// A ModuleRuntime of one module, whose step end is its ModuleState's; the subclass runs the step.
class SingleModuleRuntime : public ModuleRuntime {
 public:
  std::vector<GradNormShare> GradNormShares() const override { return state_.GradNormShares(); }
  absl::Status Apply(int64_t step, double clip_coefficient, const v1::StepCommit& commit) override {
    return state_.Apply(step, clip_coefficient, commit);
  }
  void Discard() override { state_.Discard(); }
  absl::Status Skip(int64_t step, const v1::StepCommit& commit) override {
    return state_.Skip(step, commit);
  }
  void StepNotRun(const plan::RankStepPlan& plan) override {
    context_->boundary().AbandonUnrun(plan);
  }
  absl::Status Regroup(int64_t generation, const StepReplicas& replicas) override {
    return RegroupStates(*context_, generation, replicas, {&state_});
  }
  absl::Status WriteOutputs(const OutputSender& send, int64_t world_rank) override {
    return state_.WriteOutputs(send, world_rank);
  }
  absl::Status ReceiveJoinedState(const StepReplicas& replicas,
                                  const StepReplicas& joining) override {
    return state_.ReceiveJoinedState(replicas, joining);
  }

 protected:
  SingleModuleRuntime(WorkerContext* context, ModuleState state)
      : context_(context), state_(std::move(state)) {}

  WorkerContext* context_;
  ModuleState state_;
};

}  // namespace hetpar::worker

#endif  // HETPAR_COMMON_WORKER_MODULE_STATE_H_
