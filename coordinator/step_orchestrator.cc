#include "coordinator/step_orchestrator.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "coordinator/limits.h"

namespace hetpar::coordinator {

StepOrchestrator::StepOrchestrator(const Membership& membership, Options options)
    : encoder_grid_(membership.encoder_grid()),
      llm_grid_(membership.llm_grid()),
      options_(options) {}

void StepOrchestrator::Broadcast(const v1::CoordinatorMessage& message, Outbox* out) const {
  for (const auto& id : participants_) out->emplace_back(id, message);
}

bool StepOrchestrator::CountsLoss(const v1::RankCoordinates& rank) const {
  return rank.module() == v1::MODULE_LLM && rank.tp() == 0 && rank.pp() == llm_grid_.pp - 1;
}

void StepOrchestrator::Begin(int64_t step, int64_t generation, PlannedStep plan,
                             const std::vector<const WorkerRecord*>& participants, absl::Time now,
                             Outbox* out) {
  in_flight_ = true;
  ++attempt_;
  checkpoint_at_commit_ = false;
  step_ = step;
  generation_ = generation;
  started_ = now;
  global_loss_tokens_ = plan.global_loss_tokens;
  data_after_ = plan.data_after;
  tokens_ = plan.tokens;
  images_ = plan.images;
  model_flops_ = plan.model_flops;
  participants_.clear();
  expected_contributors_.clear();
  contributed_.clear();
  sum_squares_ = 0;
  non_finite_ = false;
  grad_norm_sent_ = false;
  grad_norm_ = 0;
  reported_.clear();
  splits_.clear();
  busiest_.clear();
  loss_sum_ = 0;
  loss_tokens_ = 0;
  any_loss_reported_ = false;
  last_abort_reason_.clear();
  // The first replica of each module taking part sends the module's partials.
  first_encoder_replica_ = plan.encoder_replicas.empty() ? 0 : plan.encoder_replicas.front();
  first_llm_replica_ = plan.llm_replicas.empty() ? 0 : plan.llm_replicas.front();
  for (const WorkerRecord* worker : participants) {
    participants_.push_back(worker->worker_id);
    for (const auto& rank : worker->ranks) {
      // One DP replica (CP rank 0) of each module holds its gradients whole (worker::ModuleState).
      const int64_t first =
          rank.module() == v1::MODULE_ENCODER ? first_encoder_replica_ : first_llm_replica_;
      if (rank.dp() == first && rank.cp() == 0) {
        expected_contributors_.insert({rank.module(), rank.rank()});
      }
    }
  }
  for (const WorkerRecord* worker : participants) {
    v1::CoordinatorMessage message;
    v1::StepPlan* step_plan = message.mutable_step_plan();
    step_plan->set_step(step);
    step_plan->set_generation(generation);
    step_plan->set_global_loss_tokens(plan.global_loss_tokens);
    step_plan->set_grad_norm_contributors(static_cast<int64_t>(expected_contributors_.size()));
    for (int64_t replica : plan.encoder_replicas) step_plan->add_encoder_replicas(replica);
    for (int64_t replica : plan.llm_replicas) step_plan->add_llm_replicas(replica);
    for (int64_t replica : plan.encoder_joining) step_plan->add_encoder_joining(replica);
    for (int64_t replica : plan.llm_joining) step_plan->add_llm_joining(replica);
    auto it = plan.worker_plans.find(worker->worker_id);
    if (it != plan.worker_plans.end()) {
      *step_plan->mutable_rank_plan() = std::move(it->second);
      step_plan->mutable_rank_plan()->set_attempt(attempt_);
    }
    out->emplace_back(worker->worker_id, std::move(message));
  }
}

StepOrchestrator::Outcome StepOrchestrator::OnGradNormPartial(const WorkerRecord& worker,
                                                              const v1::GradNormPartial& partial,
                                                              absl::Time now, Outbox* out) {
  if (!in_flight_ || partial.step() != step_ || partial.generation() != generation_) {
    return Outcome::kPending;
  }
  const v1::RankCoordinates* rank = nullptr;
  for (const auto& r : worker.ranks) {
    if (r.module() == partial.module()) rank = &r;
  }
  const int64_t first =
      partial.module() == v1::MODULE_ENCODER ? first_encoder_replica_ : first_llm_replica_;
  if (rank == nullptr || rank->dp() != first || rank->cp() != 0) {
    return DoAbort(
        absl::StrCat("worker ", worker.Describe(), " sent a grad-norm partial for module ",
                     ModuleName(partial.module()),
                     rank == nullptr
                         ? " it has no rank in"
                         : absl::StrCat(" from dp replica ", rank->dp(), ", cp rank ", rank->cp()),
                     "; expected partials only from ranks of dp replica ", first, ", cp rank 0"),
        now, out);
  }
  const ContributorKey key{rank->module(), rank->rank()};
  if (!contributed_.insert(key).second) {
    return DoAbort(absl::StrCat("worker ", worker.Describe(), " sent a second grad-norm partial ",
                                "for ", DescribeRank(*rank), " in step ", step_),
                   now, out);
  }
  if (partial.sum_squares() < 0) {
    return DoAbort(absl::StrCat("grad-norm partial of ", DescribeRank(*rank), " in step ", step_,
                                " is ", partial.sum_squares(), "; expected a sum of squares >= 0"),
                   now, out);
  }
  if (!std::isfinite(partial.sum_squares()) && !non_finite_) {
    non_finite_ = true;
    HETPAR_LOG(WARNING) << "step " << step_ << ": the grad-norm partial of " << DescribeRank(*rank)
                        << " is " << partial.sum_squares()
                        << "; the step is skipped (no update, its samples count as trained)";
  }
  sum_squares_ += partial.sum_squares();
  if (contributed_.size() < expected_contributors_.size()) return Outcome::kPending;
  grad_norm_ = std::sqrt(sum_squares_);
  grad_norm_sent_ = true;
  v1::CoordinatorMessage message;
  v1::GradNorm* norm = message.mutable_grad_norm();
  norm->set_step(step_);
  norm->set_generation(generation_);
  norm->set_norm(grad_norm_);
  norm->set_skip(non_finite_);
  norm->set_clip_coefficient(non_finite_ || options_.grad_clip <= 0
                                 ? 1.0
                                 : std::min(1.0, options_.grad_clip / (grad_norm_ + 1e-6)));
  Broadcast(message, out);
  return MaybeCommit(now, out);
}

StepOrchestrator::Outcome StepOrchestrator::OnReport(const WorkerRecord& worker,
                                                     const v1::StepReport& report, absl::Time now,
                                                     Outbox* out) {
  if (!in_flight_ || report.step() != step_ || report.generation() != generation_) {
    return Outcome::kPending;
  }
  if (!report.ok()) {
    return DoAbort(absl::StrCat("worker ", worker.Describe(), " failed step ", step_, ": ",
                                report.error().empty() ? "no reason given"
                                                       : Printable(report.error(), kMaxErrorBytes)),
                   now, out);
  }
  if (!reported_.insert(worker.worker_id).second) {
    return DoAbort(absl::StrCat("worker ", worker.Describe(), " reported step ", step_, " twice"),
                   now, out);
  }
  AddTimings(report);
  for (const auto& rank : worker.ranks) {
    if (!CountsLoss(rank)) continue;
    loss_sum_ += report.loss_sum();
    loss_tokens_ += report.loss_tokens();
    any_loss_reported_ = any_loss_reported_ || report.loss_tokens() != 0;
  }
  return MaybeCommit(now, out);
}

StepOrchestrator::Outcome StepOrchestrator::MaybeCommit(absl::Time now, Outbox* out) {
  if (reported_.size() < participants_.size()) return Outcome::kPending;
  if (!grad_norm_sent_ && !expected_contributors_.empty()) {
    return DoAbort(absl::StrCat("every worker reported step ", step_, " but only ",
                                contributed_.size(), " of ", expected_contributors_.size(),
                                " grad-norm partials arrived; the global grad norm is incomplete"),
                   now, out);
  }
  if (any_loss_reported_ && loss_tokens_ != global_loss_tokens_) {
    return DoAbort(absl::StrCat("step ", step_, " counted ", loss_tokens_,
                                " loss tokens over the last-stage tp-0 LLM ranks; the plan has ",
                                global_loss_tokens_, " (a sample was lost or trained twice)"),
                   now, out);
  }
  const double loss =
      global_loss_tokens_ > 0 ? loss_sum_ / static_cast<double>(global_loss_tokens_) : 0.0;
  v1::CoordinatorMessage message;
  v1::StepCommit* commit = message.mutable_commit();
  commit->set_step(step_);
  commit->set_generation(generation_);
  commit->set_loss(loss);
  commit->set_checkpoint(checkpoint_at_commit_);
  commit->set_commit_id(NewCommitId());
  *commit->mutable_data() = data_after_;
  Broadcast(message, out);
  in_flight_ = false;
  Record(true, loss, now, "");
  return Outcome::kCommitted;
}

uint64_t StepOrchestrator::NewCommitId() {
  uint64_t id = 0;
  while (id == 0) id = (uint64_t{random_()} << 32) | random_();  // 0 stands for none
  return id;
}

StepOrchestrator::Outcome StepOrchestrator::OnWorkerLost(const WorkerRecord& worker, absl::Time now,
                                                         Outbox* out) {
  if (!in_flight_) return Outcome::kPending;
  if (std::find(participants_.begin(), participants_.end(), worker.worker_id) ==
      participants_.end()) {
    return Outcome::kPending;
  }
  // The lost worker cannot receive the abort.
  participants_.erase(std::find(participants_.begin(), participants_.end(), worker.worker_id));
  return DoAbort(absl::StrCat("worker ", worker.Describe(), " was lost during step ", step_, ": ",
                              worker.dead_reason),
                 now, out);
}

StepOrchestrator::Outcome StepOrchestrator::CheckDeadline(absl::Time now, Outbox* out) {
  if (!in_flight_ || now < deadline()) return Outcome::kPending;
  std::vector<std::string> silent;
  for (const auto& id : participants_) {
    if (!reported_.contains(id)) silent.push_back(id);
  }
  return DoAbort(
      absl::StrCat(
          "step ", step_, " did not finish within ", absl::FormatDuration(options_.step_timeout),
          "; no report from ", silent.size(), " worker(s): ",
          absl::StrJoin(silent.begin(), silent.begin() + std::min<size_t>(8, silent.size()), ", "),
          silent.size() > 8 ? ", ..." : ""),
      now, out);
}

StepOrchestrator::Outcome StepOrchestrator::Abort(const std::string& reason, absl::Time now,
                                                  Outbox* out) {
  if (!in_flight_) return Outcome::kPending;
  return DoAbort(reason, now, out);
}

StepOrchestrator::Outcome StepOrchestrator::DoAbort(std::string reason, absl::Time now,
                                                    Outbox* out) {
  v1::CoordinatorMessage message;
  v1::StepAbort* abort = message.mutable_abort();
  abort->set_step(step_);
  abort->set_generation(generation_);
  abort->set_reason(reason);
  Broadcast(message, out);
  in_flight_ = false;
  last_abort_reason_ = reason;
  Record(false, 0, now, reason);
  return Outcome::kAborted;
}

void StepOrchestrator::AddTimings(const v1::StepReport& report) {
  // "<module>.<key>" -> value, by module.
  std::map<std::string, std::map<std::string, double>> by_module;
  for (const auto& [key, value] : report.timings_s()) {
    const size_t dot = key.find('.');
    if (dot == std::string::npos) continue;
    by_module[key.substr(0, dot)][key.substr(dot + 1)] = value;
  }
  for (const auto& [module, t] : by_module) {
    auto get = [&t = t](const char* key) {
      auto it = t.find(key);
      return it == t.end() ? 0.0 : it->second;
    };
    v1::ModuleStepSplit& split = splits_[module];
    split.set_ranks(split.ranks() + 1);
    const double busy = get("compute_s") + get("bridge_wait_s") + get("collective_s");
    auto [it, first] = busiest_.emplace(module, busy);
    if (first || busy > it->second) {
      it->second = busy;
      split.set_compute_s(get("compute_s"));
      split.set_bridge_wait_s(get("bridge_wait_s"));
      split.set_collective_s(get("collective_s"));
      split.set_data_s(get("data_s"));
      split.set_grad_norm_wait_s(get("grad_norm_wait_s"));
      split.set_optimizer_s(get("optimizer_s"));
    }
    split.set_bridge_messages(split.bridge_messages() +
                              static_cast<int64_t>(get("bridge_messages")));
    split.set_bridge_bytes(split.bridge_bytes() + static_cast<int64_t>(get("bridge_bytes")));
    split.set_bridge_transfer_s(split.bridge_transfer_s() + get("bridge_transfer_s"));
    split.set_peak_live_jobs(
        std::max(split.peak_live_jobs(), static_cast<int64_t>(get("peak_live_jobs"))));
    split.set_peak_live_output_bytes(std::max(split.peak_live_output_bytes(),
                                              static_cast<int64_t>(get("peak_live_output_bytes"))));
  }
}

std::vector<v1::StepTiming> StepOrchestrator::TakeCommitted() {
  std::vector<v1::StepTiming> taken;
  taken.swap(committed_untaken_);
  return taken;
}

void StepOrchestrator::Record(bool committed, double loss, absl::Time now,
                              const std::string& reason) {
  v1::StepTiming timing;
  timing.set_step(step_);
  timing.set_generation(generation_);
  timing.set_committed(committed);
  timing.set_duration_s(absl::ToDoubleSeconds(now - started_));
  timing.set_loss(loss);
  timing.set_grad_norm(grad_norm_);
  timing.set_abort_reason(reason);
  timing.set_tokens(tokens_);
  timing.set_images(images_);
  timing.set_skipped(committed && non_finite_);
  if (committed && non_finite_) ++skipped_steps_;
  if (committed) {
    tokens_total_ += tokens_;
    images_total_ += images_;
  } else {
    ++aborted_steps_;
  }
  if (committed) {
    for (auto& [module, split] : splits_) {
      split.set_idle_s(std::max(0.0, timing.duration_s() - busiest_[module]));
      if (auto f = model_flops_.find(module); f != model_flops_.end()) {
        split.set_model_flops(f->second);
      }
      (*timing.mutable_modules())[module] = std::move(split);
    }
  }
  splits_.clear();
  busiest_.clear();
  if (committed && options_.keep_committed) committed_untaken_.push_back(timing);
  recent_.push_front(std::move(timing));
  while (recent_.size() > options_.recent_steps) recent_.pop_back();
}

}  // namespace hetpar::coordinator
