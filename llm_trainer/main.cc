// `hetpar-llm`: one rank of the LLM cluster, driven by the coordinator (normally started by
// `hetpar run`, or by a cluster's pod or job step). With --colocated (the RunSpec's placement:
// colocated) it also hosts the encoder's layout on the same rank.
#include "common/worker/worker_main.h"
#include "llm_trainer/colocated_modules.h"
#include "llm_trainer/llm_module.h"

int main(int argc, char** argv) {
  using hetpar::worker::ModuleRuntime;
  using hetpar::worker::WorkerContext;
  const hetpar::worker::WorkerBinary binary{
      "hetpar-llm",
      "hetpar-llm: one rank of a hetpar run's LLM cluster (colocated: of both modules)",
      hetpar::worker::Role::kLlm, /*offers_colocated=*/true};
  return hetpar::worker::WorkerMain(
      argc, argv, binary,
      [](WorkerContext& context) -> absl::StatusOr<std::unique_ptr<ModuleRuntime>> {
        if (context.options().role == hetpar::worker::Role::kColocated) {
          return hetpar::llm::ColocatedModules::Create(context);
        }
        return hetpar::llm::LlmModule::Create(context, /*colocated=*/false);
      });
}
