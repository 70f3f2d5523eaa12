// Attention over [n, heads, L, d] queries and [n, kv_heads, Lk, d] keys and values with grouped
// query heads (query head h reads kv head h / (heads / kv_heads)), through
// at::scaled_dot_product_attention.
//
//   at::Tensor out = nn::GroupedQueryAttention(q, k, v, mask, /*is_causal=*/true, scale);
//
// With enable_gqa ATen reads K and V in place where its kernel takes grouped heads (flash, cuDNN,
// the CPU's flash). On CUDA, where none of its fused kernels takes the call (float32: flash and
// cuDNN take 16-bit types only, the memory-efficient kernel equal head counts), it would run the
// math kernel, which copies K and V to every query head anyway and also keeps the L x Lk scores
// of every head for backward: there K and V are expanded here instead, so that the
// memory-efficient kernel takes the call.
#ifndef HETPAR_COMMON_NN_ATTENTION_H_
#define HETPAR_COMMON_NN_ATTENTION_H_

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

namespace hetpar::nn {

// [n, kv_heads, L, d] -> [n, heads, L, d], head h a copy of kv head h / (heads / kv_heads).
// heads must be a multiple of kv_heads.
at::Tensor ExpandKvHeads(const at::Tensor& kv, int64_t heads);

// Whether GroupedQueryAttention expands K and V for this call (see above): on CUDA, with fewer kv
// heads than query heads, where ATen's choice with enable_gqa is its math kernel.
bool ExpandsKvHeads(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const std::optional<at::Tensor>& mask, bool is_causal, double scale);

at::Tensor GroupedQueryAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const std::optional<at::Tensor>& mask, bool is_causal,
                                 double scale);

}  // namespace hetpar::nn

#endif  // HETPAR_COMMON_NN_ATTENTION_H_
