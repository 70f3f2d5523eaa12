// `hetpar score`: the log-probability of each next token of token sequences under a model
// (hetpar-reference score; llm_trainer/hf/score.h).
#include "coordinator/cli/commands.h"

namespace hetpar::cli {
namespace {

void AddScoreCommand(CLI::App& app, int* exit_code) {
  AddForwardedCommand(app, exit_code, "score",
                      "Log-probability of each next token of token sequences under a model: "
                      "`score --model DIR --tokens FILE.jsonl` (see `hetpar score --help`)");
}

}  // namespace

HETPAR_REGISTER_COMMAND(46, AddScoreCommand);

}  // namespace hetpar::cli
