#include "common/plan/search.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/config/config.h"
#include "common/plan/layout.h"
#include "common/plan/step_plan.h"

namespace hetpar::plan {
namespace {

std::vector<int64_t> Divisors(int64_t n) {
  std::vector<int64_t> out;
  for (int64_t d = 1; d <= n; ++d) {
    if (n % d == 0) out.push_back(d);
  }
  return out;
}

void Accumulate(StepEstimate* sum, const StepEstimate& e, double w) {
  auto add_module = [w](ModuleEstimate* a, const ModuleEstimate& b) {
    a->ranks = b.ranks;
    a->parameters = b.parameters;
    a->flops += w * b.flops;
    a->compute_s += w * b.compute_s;
    a->tp_collective_s += w * b.tp_collective_s;
    a->cp_collective_s += w * b.cp_collective_s;
    a->pp_p2p_s += w * b.pp_p2p_s;
    a->bubble_s += w * b.bubble_s;
    a->dp_collective_s += w * b.dp_collective_s;
    a->optimizer_s += w * b.optimizer_s;
    a->imbalance_s += w * b.imbalance_s;
    a->busy_s += w * b.busy_s;
    a->state_gib = std::max(a->state_gib, b.state_gib);
    a->activation_gib = std::max(a->activation_gib, b.activation_gib);
  };
  sum->placement = e.placement;
  sum->encoder = e.encoder;
  sum->llm = e.llm;
  sum->devices = e.devices;
  sum->step_time_s += w * e.step_time_s;
  sum->boundary_s += w * e.boundary_s;
  sum->overhead_s += w * e.overhead_s;
  sum->shared_bound_s += w * e.shared_bound_s;
  add_module(&sum->encoder_module, e.encoder_module);
  add_module(&sum->llm_module, e.llm_module);
  sum->tokens += w * e.tokens;
  sum->images += w * e.images;
  sum->memory_gib_per_device = std::max(sum->memory_gib_per_device, e.memory_gib_per_device);
  sum->fits_memory = sum->fits_memory && e.fits_memory;
  for (const std::string& note : e.notes) {
    if (std::find(sum->notes.begin(), sum->notes.end(), note) == sum->notes.end()) {
      sum->notes.push_back(note);
    }
  }
}

}  // namespace

absl::StatusOr<StepEstimate> EstimateOverBatches(
    const v1::RunSpec& spec, const std::vector<std::vector<SampleDescriptor>>& batches,
    const ClusterSpec& cluster) {
  if (batches.empty()) return absl::InvalidArgumentError("no batches to estimate");
  auto placement = PlacementFromRunSpec(spec);
  if (!placement.ok()) return placement.status();
  StepEstimate sum;
  const double w = 1.0 / static_cast<double>(batches.size());
  for (size_t step = 0; step < batches.size(); ++step) {
    auto options = StepPlanOptionsFromRunSpec(spec, static_cast<int64_t>(step), 0);
    if (!options.ok()) return options.status();
    auto step_plan = BuildStepPlan(*placement, batches[step], *options);
    if (!step_plan.ok()) return step_plan.status();
    auto estimate = EstimateStep(spec, *step_plan, cluster);
    if (!estimate.ok()) return estimate.status();
    Accumulate(&sum, *estimate, w);
  }
  const double devices = static_cast<double>(sum.devices);
  if (sum.step_time_s > 0) {
    sum.tflops_per_device =
        (sum.encoder_module.flops + sum.llm_module.flops) / sum.step_time_s / devices / 1e12;
    sum.tokens_per_s_per_device = sum.tokens / sum.step_time_s / devices;
  }
  return sum;
}

absl::StatusOr<SearchResult> SearchLayouts(
    const v1::RunSpec& base, const std::vector<std::vector<SampleDescriptor>>& batches,
    const ClusterSpec& cluster, const SearchOptions& options) {
  if (options.devices < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--gpus ", options.devices, ": the budget must be at least 1 device"));
  }
  if (cluster.devices() > 0 && options.devices > cluster.devices() && !cluster.share_devices) {
    return absl::InvalidArgumentError(absl::StrCat("--gpus ", options.devices, " is more than ",
                                                   cluster.name, "'s ", cluster.devices(),
                                                   " devices"));
  }
  SearchResult result;
  std::vector<Candidate> fitting;
  auto consider = [&](const std::string& kind, v1::Placement placement, int64_t etp, int64_t edp,
                      int64_t ltp, int64_t ldp, int64_t lcp, int64_t lpp) -> absl::Status {
    if (etp > cluster.devices_per_node || ltp > cluster.devices_per_node) return absl::OkStatus();
    Candidate c;
    c.kind = kind;
    c.spec = base;
    c.spec.set_placement(placement);
    auto* el = c.spec.mutable_encoder()->mutable_layout();
    el->set_tp(etp);
    el->set_dp(edp);
    auto* ll = c.spec.mutable_llm()->mutable_layout();
    ll->set_tp(ltp);
    ll->set_dp(ldp);
    ll->set_cp(lcp);
    ll->set_pp(lpp);
    // A pipelined LLM needs the encoder to keep pp jobs in flight (the validator's rule); the
    // candidate takes that many, and the estimate counts their activations.
    if (placement == v1::PLACEMENT_NON_COLOCATED && c.spec.run().max_inflight() < lpp &&
        ImageGradientsCross(c.spec)) {
      c.spec.mutable_run()->set_max_inflight(lpp);
    }
    // A colocated run has no job window: the field takes its default, whatever the base says.
    if (placement == v1::PLACEMENT_COLOCATED) {
      c.spec.mutable_run()->set_max_inflight(config::kDefaultMaxInflight);
    }
    config::LoadedRunSpec loaded;
    loaded.spec = c.spec;
    if (!config::Validate(loaded, /*check_files=*/false, /*require_runnable=*/false).empty()) {
      return absl::OkStatus();
    }
    const auto refused = config::Validate(loaded, false, /*require_runnable=*/true);
    if (!refused.empty()) {
      c.runnable = false;
      c.why = refused.front().ToString();
    }
    auto estimate = EstimateOverBatches(c.spec, batches, cluster);
    if (!estimate.ok()) {
      if (estimate.status().code() == absl::StatusCode::kInvalidArgument) return absl::OkStatus();
      return estimate.status();
    }
    ++result.considered;
    c.estimate = *std::move(estimate);
    if (!c.estimate.fits_memory) {
      ++result.over_memory;
      return absl::OkStatus();
    }
    fitting.push_back(std::move(c));
    return absl::OkStatus();
  };
  const int64_t n = options.devices;
  std::vector<int64_t> pps;
  for (int64_t pp = 1; pp <= std::max<int64_t>(1, options.max_pp); ++pp) pps.push_back(pp);
  // (cp, pp) pairs of the LLM, each with cp x pp ranks per TP rank of a replica.
  std::vector<std::pair<int64_t, int64_t>> grids;
  for (int64_t cp = 1; cp <= std::max<int64_t>(1, options.max_cp); ++cp) {
    for (int64_t pp : pps) grids.emplace_back(cp, pp);
  }
  if (options.colocated) {
    for (int64_t ltp : Divisors(n)) {
      for (const auto& [lcp, lpp] : grids) {
        if ((n / ltp) % (lcp * lpp) != 0) continue;
        const int64_t ldp = n / ltp / lcp / lpp;
        for (int64_t etp : Divisors(n)) {
          const bool same = etp == ltp && lcp == 1 && lpp == 1;
          absl::Status s = consider(same ? "homogeneous" : "colocated_heterogeneous",
                                    v1::PLACEMENT_COLOCATED, etp, n / etp, ltp, ldp, lcp, lpp);
          if (!s.ok()) return s;
        }
      }
    }
  }
  if (options.non_colocated) {
    for (int64_t e = 1; e < n; ++e) {
      const int64_t l = n - e;
      for (int64_t etp : Divisors(e)) {
        for (int64_t ltp : Divisors(l)) {
          for (const auto& [lcp, lpp] : grids) {
            if ((l / ltp) % (lcp * lpp) != 0) continue;
            absl::Status s = consider("non_colocated", v1::PLACEMENT_NON_COLOCATED, etp, e / etp,
                                      ltp, l / ltp / lcp / lpp, lcp, lpp);
            if (!s.ok()) return s;
          }
        }
      }
    }
  }
  std::stable_sort(fitting.begin(), fitting.end(), [](const Candidate& a, const Candidate& b) {
    return a.estimate.tokens_per_s_per_device > b.estimate.tokens_per_s_per_device;
  });
  for (size_t i = 0; i < fitting.size(); ++i) {
    if (fitting[i].kind == "homogeneous" && result.best_homogeneous < 0) {
      result.best_homogeneous = static_cast<int64_t>(i);
    }
  }
  result.ranked = std::move(fitting);
  return result;
}

}  // namespace hetpar::plan
