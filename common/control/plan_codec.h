// A rank's step plan (common/plan/step_plan.h) to and from its wire form (hetpar.v1.RankStepPlan
// in proto/hetpar/v1/plan.proto). The coordinator encodes; a worker decodes the StepPlan it
// receives. Decoding checks the enums and that every transfer and job names a sample the plan
// carries, so a worker never indexes past what it was sent.
#ifndef HETPAR_COMMON_CONTROL_PLAN_CODEC_H_
#define HETPAR_COMMON_CONTROL_PLAN_CODEC_H_

#include "absl/status/statusor.h"
#include "common/plan/step_plan.h"
#include "hetpar/v1/plan.pb.h"

namespace hetpar::coordinator {

v1::RankStepPlan RankStepPlanToProto(const plan::RankStepPlan& plan);
// InvalidArgument naming the field when the message is inconsistent.
absl::StatusOr<plan::RankStepPlan> RankStepPlanFromProto(const v1::RankStepPlan& proto);

}  // namespace hetpar::coordinator

#endif  // HETPAR_COMMON_CONTROL_PLAN_CODEC_H_
