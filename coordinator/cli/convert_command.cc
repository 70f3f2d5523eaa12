// `hetpar convert from-hf|to-hf`: Hugging Face checkpoints in and out (hetpar-reference convert;
// llm_trainer/hf/hf_convert.h, docs/models.md).
#include "coordinator/cli/commands.h"

namespace hetpar::cli {
namespace {

void AddConvertCommand(CLI::App& app, int* exit_code) {
  AddForwardedCommand(
      app, exit_code, "convert",
      "Hugging Face checkpoints in and out: `convert from-hf --llm DIR [--encoder DIR] --out "
      "DIR`, `convert to-hf --model DIR --out DIR` (see `hetpar convert --help`)");
}

}  // namespace

HETPAR_REGISTER_COMMAND(45, AddConvertCommand);

}  // namespace hetpar::cli
