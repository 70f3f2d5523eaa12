#include "common/nn/attention.h"

#include <ATen/SDPBackend.h>

namespace hetpar::nn {

at::Tensor ExpandKvHeads(const at::Tensor& kv, int64_t heads) {
  const int64_t n = kv.size(0), kv_heads = kv.size(1), length = kv.size(2), d = kv.size(3);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "ExpandKvHeads: ", heads,
              " query heads are not a multiple of ", kv_heads, " kv heads");
  return kv.unsqueeze(2)
      .expand({n, kv_heads, heads / kv_heads, length, d})
      .reshape({n, heads, length, d});
}

bool ExpandsKvHeads(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const std::optional<at::Tensor>& mask, bool is_causal, double scale) {
  if (!q.is_cuda() || k.size(1) == q.size(1)) return false;
  const int64_t choice = at::_fused_sdp_choice(q, k, v, mask, /*dropout_p=*/0.0, is_causal, scale,
                                               /*enable_gqa=*/true);
  return static_cast<at::SDPBackend>(choice) == at::SDPBackend::math;
}

at::Tensor GroupedQueryAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const std::optional<at::Tensor>& mask, bool is_causal,
                                 double scale) {
  if (ExpandsKvHeads(q, k, v, mask, is_causal, scale)) {
    const int64_t heads = q.size(1);
    return at::scaled_dot_product_attention(q, ExpandKvHeads(k, heads), ExpandKvHeads(v, heads),
                                            mask, /*dropout_p=*/0.0, is_causal, scale,
                                            /*enable_gqa=*/false);
  }
  return at::scaled_dot_product_attention(q, k, v, mask, /*dropout_p=*/0.0, is_causal, scale,
                                          /*enable_gqa=*/true);
}

}  // namespace hetpar::nn
