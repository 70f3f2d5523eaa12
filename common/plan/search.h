// `hetpar plan --search`: the layouts and placements of a RunSpec's two models on a budget of
// devices, each estimated (estimate.h) on the same batches, ranked by tokens/s per device.
//
// Candidates, for every (tp, dp) of each module that the validator accepts (tp within a node):
//   homogeneous             colocated, the encoder inheriting the LLM's layout (Megatron's MIMO
//                           default): both tp x dp = the budget
//   colocated_heterogeneous colocated, each module its own tp x dp = the budget
//   non_colocated           an encoder pool of E devices and the LLM on the other budget - E
// The LLM may also take cp > 1 up to max_cp (context parallelism, within a node with its TP
// group) and pp > 1 up to max_pp (a non-colocated candidate with pp stages keeps at least pp
// encoder jobs in flight, run.max_inflight, as runs require). Candidates that do not fit the
// devices' memory are dropped.
#ifndef HETPAR_COMMON_PLAN_SEARCH_H_
#define HETPAR_COMMON_PLAN_SEARCH_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/plan/cluster.h"
#include "common/plan/estimate.h"
#include "common/plan/sample.h"
#include "hetpar/v1/run_spec.pb.h"

namespace hetpar::plan {

struct SearchOptions {
  int64_t devices = 0;  // the budget
  int64_t max_pp = 1;
  int64_t max_cp = 1;
  bool non_colocated = true;
  bool colocated = true;
};

struct Candidate {
  std::string kind;       // homogeneous | colocated_heterogeneous | non_colocated
  v1::RunSpec spec;       // the base spec with this placement and these layouts
  StepEstimate estimate;  // means over the batches
  bool runnable = true;   // false: `hetpar run` refuses it for now (the reason in `why`)
  std::string why;
};

struct SearchResult {
  std::vector<Candidate> ranked;  // fitting candidates, best tokens/s per device first
  int64_t considered = 0;         // valid candidates estimated
  int64_t over_memory = 0;        // of those, dropped for memory
  int64_t best_homogeneous = -1;  // index into ranked, -1 when none fits
};

// Estimates every candidate on `batches` (one global batch per step) and ranks them.
absl::StatusOr<SearchResult> SearchLayouts(
    const v1::RunSpec& base, const std::vector<std::vector<SampleDescriptor>>& batches,
    const ClusterSpec& cluster, const SearchOptions& options);

// The mean estimate of `spec` over `batches` (one step plan per batch, steps 0, 1, ...).
absl::StatusOr<StepEstimate> EstimateOverBatches(
    const v1::RunSpec& spec, const std::vector<std::vector<SampleDescriptor>>& batches,
    const ClusterSpec& cluster);

}  // namespace hetpar::plan

#endif  // HETPAR_COMMON_PLAN_SEARCH_H_
