// A distributed worker, driven by the coordinator: one rank of the encoder pool or of the LLM
// cluster (non-colocated), or one rank of both modules (colocated: the three-phase schedule of
// encoder forwards, LLM waves, encoder backwards, each module with its own layout and groups).
//
//   1. Opens its data plane (UCX) and registers with the coordinator (role, host, data address).
//   2. Waits until every rank has registered, then connects to its boundary peers (encoder ranks
//      to the LLM's first-stage ranks and back) and forms its TP and DP process groups through
//      the coordinator's rendezvous store.
//   3. For each step plan: runs its module's step (encoder_service/encoder_runtime.h,
//      llm_trainer/llm_runtime.h), sends its gradient-norm partial (DP replica 0 only), waits for
//      the global norm, clips, takes the AdamW step and reports; the coordinator commits.
//   4. On StopRun, exits cleanly; on an abort, a dead peer or any error, reports and fails.
//
// At the end it writes `<out>/workers/rank-<world rank>.json` with the sums of the parameter
// elements it owns (DP replica 0), from which `hetpar run` forms the final parameter line, and
// replica 0 of each module saves the full parameters under `<out>/model/` for evaluation.
#ifndef HETPAR_LLM_TRAINER_WORKER_H_
#define HETPAR_LLM_TRAINER_WORKER_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace hetpar::worker {

enum class Role { kEncoder, kLlm, kColocated };

struct WorkerOptions {
  Role role = Role::kEncoder;
  std::string coordinator = "127.0.0.1:50051";
  std::string token;            // the run token
  int64_t requested_rank = -1;  // -1: the coordinator picks
  std::string out_dir;          // run directory for the worker's files ("" = none)
  std::string host = "127.0.0.1";
  absl::Duration timeout = absl::Seconds(300);  // bound of every wait for peers and messages
};

absl::Status RunWorker(const WorkerOptions& options);

}  // namespace hetpar::worker

#endif  // HETPAR_LLM_TRAINER_WORKER_H_
