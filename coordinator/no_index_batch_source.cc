// MakeIndexBatchSource for a build without the data pipeline (hetpar_data).
#include "coordinator/step_planner.h"

namespace hetpar::coordinator {

absl::StatusOr<std::unique_ptr<BatchSource>> MakeIndexBatchSource(const v1::RunSpec& spec) {
  (void)spec;
  return absl::UnimplementedError(
      "this build has no data pipeline (hetpar_data), so steps cannot be planned from the data "
      "index; pass --synthetic-batches");
}

}  // namespace hetpar::coordinator
