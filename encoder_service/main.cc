// `hetpar-encoder`: one rank of the encoder pool, driven by the coordinator (normally started by
// `hetpar run`, or by a cluster's pod or job step). Links no LLM code.
#include "common/worker/worker_main.h"
#include "encoder_service/encoder_module.h"

int main(int argc, char** argv) {
  const hetpar::worker::WorkerBinary binary{
      "hetpar-encoder", "hetpar-encoder: one rank of a hetpar run's encoder pool",
      hetpar::worker::Role::kEncoder, /*offers_colocated=*/false};
  return hetpar::worker::WorkerMain(
      argc, argv, binary,
      [](hetpar::worker::WorkerContext& context)
          -> absl::StatusOr<std::unique_ptr<hetpar::worker::ModuleRuntime>> {
        return hetpar::encoder::EncoderModule::Create(context);
      });
}
