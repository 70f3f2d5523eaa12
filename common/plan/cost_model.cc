#include "common/plan/cost_model.h"

namespace hetpar::plan {

bool operator==(const CostModel& a, const CostModel& b) {
  return a.per_token == b.per_token && a.per_token_squared == b.per_token_squared;
}

CostModel EncoderCostModel(const hetpar::v1::EncoderModel& model) {
  const double h = static_cast<double>(model.hidden());
  const double mlp = static_cast<double>(model.mlp());
  const double layers = static_cast<double>(model.layers());
  const double out = static_cast<double>(model.out_hidden());
  CostModel cost;
  cost.per_token = layers * 2.0 * (4.0 * h * h + 2.0 * h * mlp) + 2.0 * h * out;
  cost.per_token_squared = layers * 4.0 * h;
  return cost;
}

CostModel LlmCostModel(const hetpar::v1::LlmModel& model) {
  const double h = static_cast<double>(model.hidden());
  const double layers = static_cast<double>(model.layers());
  const double heads = static_cast<double>(model.heads() > 0 ? model.heads() : 1);
  const double kv_heads = static_cast<double>(model.kv_heads() > 0 ? model.kv_heads() : heads);
  const double kv_dim = h * kv_heads / heads;
  const double ffn = static_cast<double>(model.ffn());
  const double vocab = static_cast<double>(model.vocab());
  CostModel cost;
  cost.per_token =
      layers * 2.0 * (2.0 * h * h + 2.0 * h * kv_dim + 3.0 * h * ffn) + 2.0 * h * vocab;
  cost.per_token_squared = layers * 2.0 * h;
  return cost;
}

}  // namespace hetpar::plan
