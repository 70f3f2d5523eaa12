// What a worker leaves in the run directory (`--out`), apart from its log:
//
//   workers/rank-<world rank>.steps.jsonl   one line per applied step and module: its time split
//   workers/rank-<world rank>-<module>.json  the float64 sum and sum of squares of the parameter
//                                            elements this rank owns (DP replica 0 counts), from
//                                            which `hetpar run` forms the final parameter line
//   model/<module>.hpar                      the full parameters, saved by DP replica 0
//
// An empty out_dir writes nothing. One thread calls these.
#ifndef HETPAR_COMMON_WORKER_OUTPUTS_H_
#define HETPAR_COMMON_WORKER_OUTPUTS_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "common/nn/communicator.h"
#include "common/nn/parameters.h"
#include "common/plan/step_plan.h"
#include "common/train/boundary.h"
#include "common/worker/module_runtime.h"

namespace hetpar::worker {

// Appends one line {"step", "module", <timings>...} to workers/rank-<world_rank>.steps.jsonl.
absl::Status AppendStepTimings(const std::string& out_dir, int64_t world_rank, int64_t step,
                               const ModuleTimings& timings);

// Adds what the bridge delivered to this rank in `direction` this step (image rows to the LLM,
// their gradients to the encoder) to `timings`: bridge_messages, bridge_bytes, bridge_transfer_s
// (the union of the transfer intervals) and bridge_transfer_sum_s.
void AddBridgeStats(const train::BoundaryCommunicator& boundary, plan::Direction direction,
                    ModuleTimings* timings);

// The final outputs of one module on this rank: its owned-parameter sums, and on DP replica 0
// the full parameters (every TP rank of the replica takes part; TP rank 0 writes the file).
// With pipeline stages (`pp`, the rank's pipeline, larger than one) each stage writes its part
// and the first stage joins the parts into the one file; every rank of the pipeline calls it.
absl::Status WriteModuleOutputs(const std::string& out_dir, int64_t world_rank,
                                const std::string& module, int64_t dp_rank,
                                const nn::ParameterSet& params, nn::Communicator& tp,
                                nn::Communicator& pp);

}  // namespace hetpar::worker

#endif  // HETPAR_COMMON_WORKER_OUTPUTS_H_
