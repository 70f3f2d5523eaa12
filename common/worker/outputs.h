// What a worker leaves in the run directory.
//
// In its own `--out` (none when empty), apart from its log:
//   workers/rank-<world rank>.steps.jsonl   one line per applied step and module: its time split
//
// Through the coordinator (an OutputSender; the coordinator writes them into its run directory,
// so no disk needs to be shared):
//   workers/rank-<world rank>-<module>.json  the float64 sum and sum of squares of the parameter
//                                            elements this rank owns (DP replica 0 counts), from
//                                            which the coordinator forms the final parameter line
//   model/<module>.hpar                      the full parameters, saved by DP replica 0 (with
//                                            pipeline stages, each stage sends its part,
//                                            model/<module>.hpar.stage-<s>, and the coordinator
//                                            joins them)
//
// One thread calls these.
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

// The final outputs of one module on this rank, written to files in a scratch directory of its
// own under the system's temporary directory ($TMPDIR), handed to `send` and removed: its
// owned-parameter sums, and on DP replica 0 the full parameters (every TP rank of the replica
// takes part; TP rank 0 sends the file). With pipeline stages (`pp`, the rank's pipeline, larger
// than one) each stage's TP rank 0 sends its part, model/<module>.hpar.stage-<s>.
absl::Status WriteModuleOutputs(const OutputSender& send, int64_t world_rank,
                                const std::string& module, int64_t dp_rank,
                                const nn::ParameterSet& params, nn::Communicator& tp,
                                nn::Communicator& pp);

// Removes the scratch directories of outputs under way (each may hold a whole model file), for an
// exit that runs no destructor: a signal's, a restart's execve. Thread-safe.
void RemoveOutputScratch();
// Removes the output scratch directories in $TMPDIR that this process left before a restart
// (execve keeps the pid) or that a process now gone left (killed, crashed); returns how many.
int SweepStaleOutputScratch();

}  // namespace hetpar::worker

#endif  // HETPAR_COMMON_WORKER_OUTPUTS_H_
