// Cost models the step scheduler balances with: forward FLOPs of one image in the encoder and of
// one sample in the LLM, as a linear term plus an attention term in the token count.
//
//   cost(tokens) = per_token * tokens + per_token_squared * tokens^2
//
// Only ratios matter to the scheduler; the FromSpec models use forward FLOPs so `hetpar plan`
// can print them in GFLOP.
#ifndef HETPAR_COMMON_PLAN_COST_MODEL_H_
#define HETPAR_COMMON_PLAN_COST_MODEL_H_

#include <cstdint>

#include "hetpar/v1/run_spec.pb.h"

namespace hetpar::plan {

struct CostModel {
  double per_token = 1.0;
  double per_token_squared = 0.0;

  double Cost(int64_t tokens) const {
    const double t = static_cast<double>(tokens);
    return per_token * t + per_token_squared * t * t;
  }
};

bool operator==(const CostModel& a, const CostModel& b);

// Encoder forward FLOPs per image of T tokens: per layer 2*T*(4h^2 + 2*h*mlp) for the
// projections and MLP, 4*T^2*h for attention scores and values; plus the projector 2*T*h*out.
CostModel EncoderCostModel(const hetpar::v1::EncoderModel& model);

// LLM forward FLOPs per sample of L tokens: per layer 2*L*(2h^2 + 2*h*kv_dim + 3*h*ffn) for the
// attention projections (grouped-query: kv_dim = h * kv_heads / heads) and SwiGLU MLP, 2*L^2*h
// for causal attention (half of 4*L^2*h); plus the output head 2*L*h*vocab.
CostModel LlmCostModel(const hetpar::v1::LlmModel& model);

}  // namespace hetpar::plan

#endif  // HETPAR_COMMON_PLAN_COST_MODEL_H_
