// Test helper: attention from its definition, for checking hetpar's attention calls against.
#ifndef HETPAR_COMMON_NN_ATTENTION_REFERENCE_H_
#define HETPAR_COMMON_NN_ATTENTION_REFERENCE_H_

#include <ATen/ATen.h>

#include <cmath>
#include <limits>

namespace hetpar::nn::testing {

// softmax(q k^T / sqrt(d), masked) v for q [n, heads, L, d] and k, v [n, kv_heads, S, d], in
// the dtype of its inputs. Query head h reads KV head h / (heads / kv_heads): the keys and
// values repeated per group (repeat_interleave), which is what enable_gqa means and how
// hetpar's LLM lays out its heads (the q heads of one KV head are adjacent). Causal: query i sees
// keys 0..i. `allowed` (bool [L, S], when defined): the pairs that take part, as SDPA's boolean
// mask has them. Differentiable: gradients flow back to q, k and v.
inline at::Tensor ReferenceAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     bool causal, const at::Tensor& allowed = at::Tensor()) {
  const int64_t group = q.size(1) / k.size(1);
  const at::Tensor keys = k.repeat_interleave(group, 1);
  const at::Tensor values = v.repeat_interleave(group, 1);
  at::Tensor scores =
      at::matmul(q, keys.transpose(-2, -1)) / std::sqrt(static_cast<double>(q.size(-1)));
  if (causal) {
    const at::Tensor later =
        at::ones({q.size(2), k.size(2)}, at::TensorOptions().dtype(at::kBool)).triu(1);
    scores = scores.masked_fill(later, -std::numeric_limits<double>::infinity());
  }
  if (allowed.defined()) {
    scores = scores.masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity());
  }
  const at::Tensor shifted = scores - std::get<0>(scores.max(-1, /*keepdim=*/true)).detach();
  const at::Tensor weights = shifted.exp();
  return at::matmul(weights / weights.sum(-1, /*keepdim=*/true), values);
}

}  // namespace hetpar::nn::testing

#endif  // HETPAR_COMMON_NN_ATTENTION_REFERENCE_H_
