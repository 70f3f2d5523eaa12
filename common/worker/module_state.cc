#include "common/worker/module_state.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <future>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/config/config.h"
#include "common/errno_status.h"
#include "common/logging.h"
#include "common/nn/torch_status.h"
#include "common/status.h"
#include "common/train/checkpoint.h"
#include "common/worker/outputs.h"
#include "nlohmann/json.hpp"

namespace hetpar::worker {

absl::StatusOr<ModuleState> ModuleState::Form(WorkerContext& context, v1::Module module) {
  ModuleState state;
  state.module_ = module;
  state.name_ = module == v1::MODULE_ENCODER ? "encoder" : "llm";
  const v1::RankCoordinates* coords = context.Coordinates(module);
  if (coords == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("world rank ", context.world_rank(), " holds no ", state.name_, " rank"));
  }
  state.coords_ = *coords;
  state.spec_ = context.spec();
  state.joining_ = context.joining();
  // Over the replicas training in the assignment's generation (a pool that started below
  // encoder.layout.dp, or that a joining worker enters).
  StepReplicas replicas;
  replicas.encoder = context.AssignedReplicas(v1::MODULE_ENCODER);
  replicas.llm = context.AssignedReplicas(v1::MODULE_LLM);
  HETPAR_RETURN_IF_ERROR(state.FormGroups(context, replicas));
  return state;
}

absl::Status ModuleState::FormGroups(WorkerContext& context, const StepReplicas& replicas) {
  const v1::Layout& layout =
      module_ == v1::MODULE_ENCODER ? spec_.encoder().layout() : spec_.llm().layout();
  const v1::RankCoordinates* coords = &coords_;
  const int64_t cp = std::max<int64_t>(1, layout.cp());
  const int64_t pp = std::max<int64_t>(1, layout.pp());
  // The DP replicas taking part may be fewer than the layout's (some left the
  // run); this rank's index among them is its DP rank.
  int64_t dp_rank = coords->dp();
  int64_t dp_size = std::max<int64_t>(1, layout.dp());
  const std::vector<int64_t>& taking_part =
      module_ == v1::MODULE_ENCODER ? replicas.encoder : replicas.llm;
  if (!taking_part.empty()) {
    auto it = std::find(taking_part.begin(), taking_part.end(), coords->dp());
    if (it == taking_part.end()) {
      return absl::FailedPreconditionError(
          absl::StrCat("the step's ", name_, " replicas [", absl::StrJoin(taking_part, ", "),
                       "] leave out this worker's replica ", coords->dp()));
    }
    dp_rank = it - taking_part.begin();
    dp_size = static_cast<int64_t>(taking_part.size());
  }
  const std::string cp_part = cp > 1 ? absl::StrCat("/cp", coords->cp()) : "";
  // Every pipeline stage has groups of its own.
  const std::string pp_part = pp > 1 ? absl::StrCat("/pp", coords->pp()) : "";
  HETPAR_ASSIGN_OR_RETURN(
      std::unique_ptr<nn::Communicator> tp,
      context.Group(absl::StrCat(name_, pp_part, "/dp", coords->dp(), cp_part, "/tp"), coords->tp(),
                    layout.tp()));
  const int64_t gradient_rank = dp_rank * cp + coords->cp();
  HETPAR_ASSIGN_OR_RETURN(std::unique_ptr<nn::Communicator> dp,
                          context.Group(absl::StrCat(name_, pp_part, "/tp", coords->tp(), "/dp"),
                                        gradient_rank, dp_size * cp));
  HETPAR_ASSIGN_OR_RETURN(
      std::unique_ptr<nn::Communicator> cp_group,
      context.Group(absl::StrCat(name_, pp_part, "/dp", coords->dp(), "/tp", coords->tp(), "/cp"),
                    coords->cp(), cp));
  HETPAR_ASSIGN_OR_RETURN(
      std::unique_ptr<nn::Communicator> pp_group,
      context.Group(absl::StrCat(name_, "/dp", coords->dp(), cp_part, "/tp", coords->tp(), "/pp"),
                    coords->pp(), pp));
  gradient_rank_ = gradient_rank;
  // Groups formed again (a new generation) replace the old ones in place: the model and the
  // runtimes hold them.
  auto place = [](std::unique_ptr<nn::Communicator>& slot, std::unique_ptr<nn::Communicator> g) {
    if (slot == nullptr) {
      slot = std::move(g);
    } else {
      slot->Adopt(*g);
    }
  };
  place(tp_, std::move(tp));
  place(dp_, std::move(dp));
  place(cp_, std::move(cp_group));
  place(pp_, std::move(pp_group));
  return absl::OkStatus();
}

absl::Status ModuleState::Regroup(WorkerContext& context, const StepReplicas& replicas) {
  HETPAR_RETURN_IF_ERROR(Annotate(
      FormGroups(context, replicas),
      absl::StrCat("forming the ", name_, " groups of generation ", context.store_generation())));
  const std::vector<int64_t>& taking_part =
      module_ == v1::MODULE_ENCODER ? replicas.encoder : replicas.llm;
  HETPAR_LOG(INFO) << name_ << " groups formed for generation " << context.store_generation()
                   << (taking_part.empty() ? std::string()
                                           : absl::StrCat(" over ", name_, " replicas [",
                                                          absl::StrJoin(taking_part, ", "), "]"));
  return absl::OkStatus();
}

absl::Status RegroupStates(WorkerContext& context, int64_t generation, const StepReplicas& replicas,
                           std::initializer_list<ModuleState*> states) {
  if (context.store_generation() != generation) {
    HETPAR_RETURN_IF_ERROR(
        Annotate(context.OpenStore(generation),
                 absl::StrCat("opening the rendezvous of generation ", generation)));
  }
  for (ModuleState* state : states) {
    HETPAR_RETURN_IF_ERROR(state->Regroup(context, replicas));
  }
  return absl::OkStatus();
}

absl::Status ModuleState::Train(nn::ParameterSet* params, const v1::Optimizer& optimizer) {
  params_ = params;
  HETPAR_ASSIGN_OR_RETURN(optimizer_, train::ModuleOptimizer::Create(params, optimizer));
  const std::string& resume = spec_.checkpoint().resume_from();
  if (!resume.empty() && !joining_) {
    HETPAR_RETURN_IF_ERROR(
        Annotate(train::LoadModuleState(resume, name_, *params_, optimizer_.get()),
                 absl::StrCat("resuming the ", name_, " from checkpoint.resume_from=", resume)));
    HETPAR_LOG(INFO) << name_ << " parameters and AdamW state from " << resume;
  }
  return absl::OkStatus();
}

absl::Status ModuleState::ReceiveJoinedState(const StepReplicas& replicas,
                                             const StepReplicas& joining_replicas) {
  const bool encoder = module_ == v1::MODULE_ENCODER;
  const std::vector<int64_t>& joining = encoder ? joining_replicas.encoder : joining_replicas.llm;
  if (joining.empty()) return absl::OkStatus();
  std::vector<int64_t> taking_part = encoder ? replicas.encoder : replicas.llm;
  const v1::Layout& layout = encoder ? spec_.encoder().layout() : spec_.llm().layout();
  if (taking_part.empty()) {
    for (int64_t d = 0; d < std::max<int64_t>(1, layout.dp()); ++d) taking_part.push_back(d);
  }
  const int64_t cp = encoder ? 1 : std::max<int64_t>(1, layout.cp());
  // The gradient group's ranks are the replicas taking part, in order, each with its CP ranks.
  for (size_t i = 0; i < taking_part.size(); ++i) {
    if (std::find(joining.begin(), joining.end(), taking_part[i]) != joining.end()) continue;
    const absl::Time start = absl::Now();
    HETPAR_RETURN_IF_ERROR(
        Annotate(BroadcastState(static_cast<int64_t>(i) * cp),
                 absl::StrCat("sending the ", name_, "'s state from replica ", taking_part[i],
                              " to the joined replica(s) ", absl::StrJoin(joining, ", "))));
    // The sums let a reader check that a joined rank holds what its source holds.
    const train::OwnedSums sums = train::OwnedParamSums(*params_);
    HETPAR_LOG(INFO) << name_ << " state "
                     << (std::find(joining.begin(), joining.end(), coords_.dp()) != joining.end()
                             ? "received from"
                             : "sent by")
                     << " replica " << taking_part[i] << " for the joined replica(s) ["
                     << absl::StrJoin(joining, ", ") << "] in "
                     << absl::FormatDuration(
                            absl::Trunc(absl::Now() - start, absl::Milliseconds(1)))
                     << absl::StrFormat("; tp rank %d parameter sum %.17g, square sum %.17g",
                                        coords_.tp(), sums.sum, sums.square_sum);
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(
      absl::StrCat("every ", name_, " replica of the step [", absl::StrJoin(taking_part, ", "),
                   "] joined the run: none holds the ", name_, "'s state"));
}

absl::Status ModuleState::BroadcastState(int64_t root) {
  if (params_ == nullptr || optimizer_ == nullptr) {
    return absl::FailedPreconditionError("the module's parameters are not trained yet");
  }
  const std::vector<nn::NamedParameter>& list = params_->parameters();
  const bool source = gradient_rank_ == root;
  // The source's AdamW step of each parameter (0: no state yet, or frozen).
  at::Tensor steps = at::zeros({static_cast<int64_t>(list.size())}, at::kLong);
  if (source) {
    for (size_t i = 0; i < list.size(); ++i) {
      if (auto state = optimizer_->StateOf(list[i].name)) steps[i] = state->step;
    }
  }
  HETPAR_RETURN_IF_ERROR(dp_->Broadcast(steps, static_cast<int>(root)));
  // One buffer in the optimizer's state dtype: each parameter, then for those with state the
  // float32 master (bfloat16 parameters) and the moments.
  const at::ScalarType dtype = optimizer_->StateDtype();
  const bool masters = optimizer_->HasMasters();
  std::vector<at::Tensor> parts;
  for (size_t i = 0; i < list.size(); ++i) {
    const at::Tensor& p = list[i].tensor;
    parts.push_back(p.detach().to(dtype).reshape(-1));
    if (steps[i].item<int64_t>() <= 0) continue;
    std::optional<train::ModuleOptimizer::ParamState> state =
        source ? optimizer_->StateOf(list[i].name) : std::nullopt;
    if (source && !state.has_value()) {
      return absl::InternalError(absl::StrCat("parameter ", list[i].name, " lost its state"));
    }
    const auto part = [&](const at::Tensor& tensor) {
      return source ? tensor.detach().to(dtype).reshape(-1)
                    : at::zeros({p.numel()}, p.options().dtype(dtype).requires_grad(false));
    };
    if (masters) parts.push_back(part(source ? state->master : at::Tensor()));
    parts.push_back(part(source ? state->exp_avg : at::Tensor()));
    parts.push_back(part(source ? state->exp_avg_sq : at::Tensor()));
  }
  at::Tensor flat = at::cat(parts).contiguous();
  HETPAR_RETURN_IF_ERROR(dp_->Broadcast(flat, static_cast<int>(root)));
  if (source) return absl::OkStatus();
  int64_t offset = 0;
  auto take = [&](const at::Tensor& like) {
    at::Tensor part = flat.narrow(0, offset, like.numel()).view(like.sizes()).clone();
    offset += like.numel();
    return part;
  };
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < list.size(); ++i) {
    const at::Tensor& p = list[i].tensor;
    p.detach().copy_(take(p));
    const int64_t step = steps[i].item<int64_t>();
    if (step <= 0) {
      optimizer_->ClearState(list[i].name);
      continue;
    }
    train::ModuleOptimizer::ParamState state;
    if (masters) state.master = take(p);
    state.exp_avg = take(p);
    state.exp_avg_sq = take(p);
    state.step = step;
    HETPAR_RETURN_IF_ERROR(optimizer_->SetState(list[i].name, state));
  }
  return absl::OkStatus();
}

absl::StatusOr<double> ModuleState::EndStep(const at::Tensor& extra) {
  HETPAR_ASSIGN_OR_RETURN(const std::vector<double> values, EndSteps({{this, extra}}));
  return values[0];
}

absl::StatusOr<std::vector<double>> ModuleState::EndSteps(
    const std::vector<std::pair<ModuleState*, at::Tensor>>& states) {
  // Each state's parts: its extra (if any), then its gradient partials (if it holds a share).
  struct Offsets {
    int64_t extra = -1;  // offset of the extra's value, -1 without one
    int64_t grads = -1;  // offset of the gradient partials, -1 without a share
    int64_t grads_count = 0;
  };
  std::vector<Offsets> spans(states.size());
  std::vector<at::Tensor> parts;
  int64_t offset = 0;
  std::string names;
  for (size_t i = 0; i < states.size(); ++i) {
    ModuleState& state = *states[i].first;
    const at::Tensor& extra = states[i].second;
    state.grad_square_sum_.reset();
    absl::StrAppend(&names, names.empty() ? "" : " and ", state.name_);
    if (extra.defined()) {
      parts.push_back(extra.detach().to(at::kDouble).reshape({1}));
      spans[i].extra = offset++;
    }
    // The partials of DP replica 0 (CP rank 0) add up to the module's squared norm.
    if (state.gradient_rank_ != 0) continue;
    at::Tensor grads = train::OwnedGradSumParts(*state.params_);
    if (!grads.defined()) continue;
    spans[i].grads = offset;
    spans[i].grads_count = grads.numel();
    offset += grads.numel();
    parts.push_back(std::move(grads));
  }
  // A rank with nothing to read (a DP replica other than 0 off the LLM's last stage, a frozen
  // encoder) still waits for its GPU here, once: its compute spans (nn::ComputeSpans) are read
  // after this, and its report then means that the step's work is done on every rank alike.
  if (parts.empty()) {
    for (const auto& [state, extra] : states) {
      const auto& params = state->params_->parameters();
      if (params.empty() || !params.front().tensor.is_cuda()) continue;
      HETPAR_RETURN_IF_ERROR(nn::RunTorch("marking the step's end on the device", [&] {
        parts.push_back(at::zeros({1}, params.front().tensor.options().dtype(at::kDouble)));
      }));
      break;
    }
  }
  at::Tensor host;
  if (!parts.empty()) {
    HETPAR_RETURN_IF_ERROR(nn::RunTorch(
        absl::StrCat("reading the ", names, " step's loss and gradient norm to the host"),
        [&] { host = at::cat(parts).cpu().contiguous(); }));
  }
  const double* values = host.defined() ? host.const_data_ptr<double>() : nullptr;
  std::vector<double> extras(states.size(), 0.0);
  for (size_t i = 0; i < states.size(); ++i) {
    ModuleState& state = *states[i].first;
    if (spans[i].extra >= 0) extras[i] = values[spans[i].extra];
    if (state.gradient_rank_ != 0) continue;
    state.grad_square_sum_ =
        spans[i].grads >= 0
            ? train::AddSumParts(values + spans[i].grads, spans[i].grads_count).square_sum
            : 0.0;
  }
  return extras;
}

std::vector<GradNormShare> ModuleState::GradNormShares() const {
  if (gradient_rank_ != 0) return {};
  return {{module_, grad_square_sum_.has_value() ? *grad_square_sum_
                                                 : train::OwnedGradSums(*params_).square_sum}};
}

absl::Status ModuleState::Apply(int64_t step, double clip_coefficient,
                                const v1::StepCommit& commit) {
  grad_square_sum_.reset();
  HETPAR_RETURN_IF_ERROR(optimizer_->Step(step, clip_coefficient));
  return CheckpointIfDue(step, commit);
}

absl::Status ModuleState::Skip(int64_t step, const v1::StepCommit& commit) {
  Discard();
  return CheckpointIfDue(step, commit);
}

absl::Status ModuleState::CheckpointIfDue(int64_t step, const v1::StepCommit& commit) {
  const v1::CheckpointSpec& checkpoint = spec_.checkpoint();
  const int64_t committed = step + 1;
  const bool due =
      !checkpoint.dir().empty() &&
      (commit.checkpoint() || (checkpoint.every() > 0 && committed % checkpoint.every() == 0) ||
       committed == spec_.run().steps());
  if (!due || gradient_rank_ != 0) {
    // A save that ended since is taken in now: its failure is told at the first commit after
    // it, not only at the next save (checkpoint.every steps later) or the run's end.
    if (pending_checkpoint_.valid() &&
        pending_checkpoint_.wait_for(std::chrono::seconds(0)) == std::future_status::ready) {
      return FinishCheckpoint();
    }
    return absl::OkStatus();
  }
  return WriteCheckpoint(committed, commit);
}

namespace {
// Set once any save of this process is given up as hung: the file system under checkpoint.dir
// stopped answering, and no other save (a colocated worker's other module) is waited for again.
std::atomic<bool> g_checkpoint_hung{false};
// A wait longer than this (about 31 years; failure.step_timeout_s may be .inf) has no bound: in
// nanoseconds it would overflow.
constexpr double kMaxCheckpointWaitS = 1e9;

// The checkpoint writes of this process still running, and the latest time one of them may still
// be waited for: what a worker that restarts itself waits for first (AwaitCheckpointWrites). A
// write's bound is its start plus the smaller of half of failure.step_timeout_s (what
// FinishCheckpoint waits) and half of coordinator.register_timeout_s: a restarted coordinator
// waits that long for this worker to register again.
absl::Mutex g_writes_mu;
int g_writes_running ABSL_GUARDED_BY(g_writes_mu) = 0;
absl::Time g_writes_bound ABSL_GUARDED_BY(g_writes_mu) = absl::InfinitePast();

absl::Duration HalfStepTimeout(const v1::RunSpec& spec) {
  const double seconds = spec.failure().step_timeout_s() / 2;
  return seconds < kMaxCheckpointWaitS ? absl::Seconds(seconds) : absl::InfiniteDuration();
}
}  // namespace

double ComputeSeconds(const nn::ComputeSpans& spans, std::string_view module) {
  absl::StatusOr<double> seconds = spans.Seconds();
  if (seconds.ok()) return *seconds;
  static std::atomic<bool> warned{false};
  if (!warned.exchange(true)) {
    HETPAR_LOG(WARNING) << module << " compute time: " << StatusText(seconds.status())
                        << "; reporting the host's time between the same marks instead (not "
                           "said again)";
  }
  return spans.host_seconds();
}

RunningCheckpointWrites CheckpointWritesRunning() {
  absl::MutexLock lock(&g_writes_mu);
  // A save given up as hung is not waited for again.
  if (g_checkpoint_hung.load()) return {};
  return {g_writes_running, g_writes_bound};
}

int AwaitCheckpointWrites() {
  absl::MutexLock lock(&g_writes_mu);
  // A save given up as hung is not waited for again.
  if (g_writes_running > 0 && !g_checkpoint_hung.load()) {
    HETPAR_LOG(INFO) << "waiting for the checkpoint being written to finish";
    g_writes_mu.AwaitWithDeadline(
        absl::Condition(+[](int* running) { return *running == 0; }, &g_writes_running),
        g_writes_bound);
  }
  return g_writes_running;
}

absl::Status ModuleState::WriteCheckpoint(int64_t committed, const v1::StepCommit& commit) {
  // One save at a time: the previous one must have finished (and succeeded) first.
  HETPAR_RETURN_IF_ERROR(FinishCheckpoint());
  return Annotate(StartCheckpoint(committed, commit),
                  absl::StrCat("writing the ", name_, " checkpoint of step ", committed));
}

absl::Status ModuleState::StartCheckpoint(int64_t committed, const v1::StepCommit& commit) {
  const uint64_t commit_id = commit.commit_id();
  const v1::CheckpointSpec& checkpoint = spec_.checkpoint();
  const std::string dir =
      (std::filesystem::path(checkpoint.dir()) / train::CheckpointDirName(committed)).string();
  const v1::Layout& layout =
      module_ == v1::MODULE_ENCODER ? spec_.encoder().layout() : spec_.llm().layout();
  train::ShardId id;
  id.module = name_;
  id.tp = coords_.tp();
  id.tp_size = std::max<int64_t>(1, layout.tp());
  id.pp = coords_.pp();
  id.pp_size = std::max<int64_t>(1, layout.pp());
  // The step waits only for this copy; the write runs beside the next steps.
  const absl::Time copy_start = absl::Now();
  HETPAR_ASSIGN_OR_RETURN(train::ShardSnapshot snapshot,
                          train::SnapshotShard(id, committed, *params_, optimizer_.get()));
  const double copy_s = absl::ToDoubleSeconds(absl::Now() - copy_start);
  snapshot.write_id = commit_id;
  // Every module's writers: each TP rank of each stage of one replica.
  std::vector<train::ShardId> expected;
  for (const auto& [module, l] :
       {std::pair<std::string, const v1::Layout*>{"encoder", &spec_.encoder().layout()},
        {"llm", &spec_.llm().layout()}}) {
    const int64_t tp = std::max<int64_t>(1, l->tp());
    const int64_t pp = std::max<int64_t>(1, l->pp());
    for (int64_t s = 0; s < pp; ++s) {
      for (int64_t t = 0; t < tp; ++t) expected.push_back({module, t, tp, s, pp});
    }
  }
  // The manifest also records the RunSpec the checkpoint was written under (normalised YAML).
  nlohmann::json extra = {{"run", spec_.run().name()},
                          {"samples_trained", committed * spec_.run().global_batch()},
                          {"seed", spec_.run().seed()},
                          {"runspec", config::RunSpecToYaml(spec_)}};
  // Where the data order stood, for a resume to check that it continues the same order
  // (config::CheckpointDataPosition; not known with synthetic batches).
  if (const v1::DataPosition& data = commit.data(); data.index_samples() > 0) {
    extra["data"] = {{"index_samples", data.index_samples()},
                     {"epoch", data.epoch()},
                     {"offset", data.offset()}};
    if (data.index_digest() != 0) extra["data"]["index_digest"] = data.index_digest();
  }
  // A thread of its own, not std::async, whose future would block its destructor: a write hung
  // on the file system is given up after the deadline (FinishCheckpoint) instead of holding the
  // worker forever. The thread owns everything it touches.
  std::packaged_task<absl::Status()> write(
      [dir, snapshot = std::move(snapshot), expected = std::move(expected),
       extra = std::move(extra), parent = checkpoint.dir(), keep = checkpoint.keep(), committed,
       copy_s, commit_id]() -> absl::Status {
        struct Done {
          ~Done() {
            absl::MutexLock lock(&g_writes_mu);
            --g_writes_running;
          }
        } done;
        const absl::Time start = absl::Now();
        HETPAR_RETURN_IF_ERROR(train::WriteShardSnapshot(dir, snapshot));
        HETPAR_ASSIGN_OR_RETURN(bool complete,
                                train::CompleteIfAllWritten(dir, expected, committed, extra,
                                                            commit_id));
        HETPAR_LOG(INFO) << "checkpoint shard " << train::ShardName(snapshot.id) << " of step "
                         << committed << ": " << snapshot.bytes() << " bytes copied in "
                         << absl::StrFormat("%.3f", copy_s) << " s (the step's wait), written in "
                         << absl::StrFormat("%.3f", absl::ToDoubleSeconds(absl::Now() - start))
                         << " s";
        if (!complete) return absl::OkStatus();
        HETPAR_LOG(INFO) << "checkpoint of step " << committed << " complete: " << dir;
        // The checkpoint is written: older ones left in place (another user's files, a file
        // system refusing a removal) cost space, not the save. A later save tries again.
        if (absl::Status pruned = train::PruneCheckpoints(parent, keep, committed); !pruned.ok()) {
          HETPAR_LOG(WARNING) << "the checkpoint of step " << committed
                              << " is complete, but older ones are not pruned (checkpoint.keep "
                              << keep << "): " << pruned.message()
                              << "; a later checkpoint tries again";
        }
        return absl::OkStatus();
      });
  pending_checkpoint_ = write.get_future();
  pending_step_ = committed;
  {
    absl::MutexLock lock(&g_writes_mu);
    ++g_writes_running;
    const double register_s = spec_.coordinator().register_timeout_s();
    const absl::Duration bound =
        register_s > 0 ? std::min(HalfStepTimeout(spec_), absl::Seconds(register_s / 2))
                       : HalfStepTimeout(spec_);
    g_writes_bound = std::max(g_writes_bound, absl::Now() + bound);
  }
  try {
    writer_ = std::thread(std::move(write));
  } catch (const std::system_error& e) {
    {
      absl::MutexLock lock(&g_writes_mu);
      --g_writes_running;
    }
    pending_checkpoint_ = {};
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot start the checkpoint writer thread: ", e.what()));
  }
  return absl::OkStatus();
}

absl::Status ModuleState::FinishCheckpoint() {
  if (!pending_checkpoint_.valid()) return absl::OkStatus();
  // Half the step timeout: the coordinator's clock for the next step started with this step's
  // commit, and this error, not its "did not finish", should say what went wrong.
  const absl::Duration wait = HalfStepTimeout(spec_);
  const bool ready =
      g_checkpoint_hung.load()
          ? pending_checkpoint_.wait_for(std::chrono::seconds(0)) == std::future_status::ready
      : wait == absl::InfiniteDuration()
          ? (pending_checkpoint_.wait(), true)
          : pending_checkpoint_.wait_for(absl::ToChronoNanoseconds(wait)) ==
                std::future_status::ready;
  if (!ready) {
    const bool first = !g_checkpoint_hung.exchange(true);
    // The thread holds its own copy of everything it writes; the process's end takes it.
    if (writer_.joinable()) writer_.detach();
    // A hang may be this node's alone (its NFS client): the replica is lost, not the run.
    return absl::DeadlineExceededError(
        first ? absl::StrCat("the ", name_, " checkpoint of step ", pending_step_,
                             " is still being written after ",
                             config::FormatDouble(absl::ToDoubleSeconds(wait)),
                             " s (half of failure.step_timeout_s): is checkpoint.dir (",
                             spec_.checkpoint().dir(), ") on a file system that stopped answering?")
              : absl::StrCat("the ", name_, " checkpoint of step ", pending_step_,
                             " is not written, and another save of this process was given up as "
                             "hung"));
  }
  // Done: the thread has set its result; join it, so that what it owns is freed here, not
  // while the process exits.
  if (writer_.joinable()) writer_.join();
  const absl::Status written = Annotate(
      pending_checkpoint_.get(), absl::StrCat("writing the ", name_, " checkpoint of step ",
                                              pending_step_, " into ", spec_.checkpoint().dir()));
  // A full or read-only checkpoint.dir, or one this run may not write, is every replica's: the
  // next replica's writers would meet it in turn, so the run ends with it instead of losing one
  // replica after another. Other errors (EIO, ESTALE, a hang, this host out of memory) may be
  // this node's alone.
  const std::optional<int> err = ErrnoOf(written);
  const bool directory_wide = err.has_value() && (*err == ENOSPC || *err == EDQUOT ||
                                                  *err == EROFS || *err == EACCES || *err == EPERM);
  return directory_wide ? EndsRun(written) : written;
}

ModuleState::~ModuleState() {
  if (!pending_checkpoint_.valid()) {
    if (writer_.joinable()) writer_.detach();  // given up as hung
    return;
  }
  const absl::Status status = FinishCheckpoint();
  // A save given up as hung was reported where it was, and its thread is left to the process's
  // end.
  if (!status.ok() && !absl::IsDeadlineExceeded(status)) {
    HETPAR_LOG(ERROR) << status.message();
  }
}

void ModuleState::Discard() {
  grad_square_sum_.reset();
  params_->ZeroGrad();
}

absl::Status ModuleState::WriteOutputs(const OutputSender& send, int64_t world_rank) {
  const absl::Status saved = FinishCheckpoint();
  // The outputs gather over the TP group: take part even when the save failed, so that the
  // other ranks are not left waiting, then report the save's error first.
  const absl::Status written =
      WriteModuleOutputs(send, world_rank, name_, gradient_rank_, *params_, *tp_, *pp_);
  HETPAR_RETURN_IF_ERROR(saved);
  return written;
}

}  // namespace hetpar::worker
