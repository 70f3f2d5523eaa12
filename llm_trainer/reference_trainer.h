// The reference trainer: both modules in one process at tp = 1, dp = 1, trained on the same
// global batches as a distributed run of the same RunSpec, microbatch by microbatch in the same
// wave order (wave-major, then LLM replica), with gradient accumulation over the step.
//
// Its metrics (per-step loss and grad norm, final parameter sums) are what a distributed run of
// any layout must reproduce: `hetpar compare` checks them (see docs/training.md).
#ifndef HETPAR_LLM_TRAINER_REFERENCE_TRAINER_H_
#define HETPAR_LLM_TRAINER_REFERENCE_TRAINER_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "hetpar/v1/run_spec.pb.h"

namespace hetpar::llm {

struct ReferenceOptions {
  std::string out_dir;    // run directory (config.yaml, metrics.jsonl, log/)
  bool progress = false;  // one progress line per step on stderr
};

// Trains spec.run().steps() steps and writes the run directory. `spec` has defaults applied.
absl::Status RunReference(const hetpar::v1::RunSpec& spec, const ReferenceOptions& options);

}  // namespace hetpar::llm

#endif  // HETPAR_LLM_TRAINER_REFERENCE_TRAINER_H_
