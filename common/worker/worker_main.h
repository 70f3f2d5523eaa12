// The `main` of every worker binary (hetpar-encoder, hetpar-llm): flags, token, intra-op threads,
// then bootstrap (bootstrap.h), the role's module runtime from `factory`, the step driver
// (step_driver.h) until the coordinator stops the run, the final outputs (outputs.h) and a clean
// goodbye. A binary's own main is one call:
//
//   int main(int argc, char** argv) {
//     return hetpar::worker::WorkerMain(argc, argv, kBinary, &encoder::CreateEncoderModule);
//   }
//
// Exit codes: 0 after a clean stop, 1 when the run fails, 2 for bad flags or a missing token.
#ifndef HETPAR_COMMON_WORKER_WORKER_MAIN_H_
#define HETPAR_COMMON_WORKER_WORKER_MAIN_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/worker/bootstrap.h"
#include "common/worker/module_runtime.h"

namespace hetpar::worker {

struct WorkerBinary {
  std::string name;         // "hetpar-encoder"
  std::string description;  // the first line of --help
  Role role = Role::kEncoder;
  // Offers --colocated: the worker registers as a rank of both modules (placement: colocated).
  bool offers_colocated = false;
};

using ModuleFactory =
    std::function<absl::StatusOr<std::unique_ptr<ModuleRuntime>>(WorkerContext& context)>;

int WorkerMain(int argc, char** argv, const WorkerBinary& binary, const ModuleFactory& factory);

}  // namespace hetpar::worker

#endif  // HETPAR_COMMON_WORKER_WORKER_MAIN_H_
