// nn::ExpandKvHeads copies each kv head to the query heads that read it (h reads h / group), and
// attention over the expanded K and V equals grouped-query attention written out from its
// definition (nn::testing::ReferenceAttention), forward and backward (the gradients of the kv heads
// sum over their query heads). nn::GroupedQueryAttention never expands on the CPU, whose flash
// kernel takes grouped heads; on CUDA its choice is checked by gpu_kernels_test.
#include "common/nn/attention.h"

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <optional>

#include "common/nn/attention_reference.h"
#include "gtest/gtest.h"

namespace hetpar::nn {
namespace {

at::Tensor Random(at::IntArrayRef shape, int64_t seed) {
  at::manual_seed(seed);
  return at::randn(shape, at::TensorOptions().dtype(at::kDouble));
}

TEST(ExpandKvHeadsTest, EachQueryHeadGetsTheKvHeadItReads) {
  // kv head j holds the value 100 * j + position everywhere.
  const at::Tensor kv = (at::arange(3, at::kDouble).view({1, 3, 1, 1}) * 100 +
                         at::arange(5, at::kDouble).view({1, 1, 5, 1}))
                            .expand({2, 3, 5, 4})
                            .contiguous();
  const at::Tensor expanded = ExpandKvHeads(kv, 12);
  ASSERT_EQ(expanded.sizes(), (std::vector<int64_t>{2, 12, 5, 4}));
  for (int64_t h = 0; h < 12; ++h) {
    EXPECT_TRUE(at::equal(expanded.select(1, h), kv.select(1, h / 4))) << "query head " << h;
  }
  EXPECT_TRUE(at::equal(ExpandKvHeads(kv, 3), kv));  // one query head per kv head: unchanged
  EXPECT_THROW(ExpandKvHeads(kv, 8), c10::Error);    // 8 query heads do not group 3 kv heads
}

TEST(ExpandKvHeadsTest, AttentionOverExpandedHeadsIsGroupedQueryAttention) {
  const int64_t n = 2, heads = 8, kv_heads = 2, queries = 6, keys = 9, d = 16;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  // Causal over one sample, and a CP rank's call: 6 queries against 9 keys under a mask.
  const at::Tensor allowed = at::arange(keys, at::kLong)
                                 .unsqueeze(0)
                                 .le(at::arange(3, 3 + queries, at::kLong).unsqueeze(1));
  for (const bool masked : {false, true}) {
    SCOPED_TRACE(masked ? "mask" : "causal");
    const int64_t length = masked ? keys : queries;
    const at::Tensor q0 = Random({n, heads, queries, d}, 1);
    const at::Tensor k0 = Random({n, kv_heads, length, d}, 2);
    const at::Tensor v0 = Random({n, kv_heads, length, d}, 3);
    const at::Tensor grad_out = Random({n, heads, queries, d}, 4);
    const at::Tensor mask = masked ? allowed : at::Tensor();

    at::Tensor q = q0.clone().requires_grad_(), k = k0.clone().requires_grad_(),
               v = v0.clone().requires_grad_();
    const at::Tensor want = testing::ReferenceAttention(q, k, v, !masked, mask);
    want.backward(grad_out);

    at::Tensor qe = q0.clone().requires_grad_(), ke = k0.clone().requires_grad_(),
               ve = v0.clone().requires_grad_();
    const at::Tensor got = at::scaled_dot_product_attention(
        qe, ExpandKvHeads(ke, heads), ExpandKvHeads(ve, heads),
        masked ? std::optional<at::Tensor>(mask) : std::nullopt, 0.0, !masked, scale,
        /*enable_gqa=*/false);
    got.backward(grad_out);
    EXPECT_TRUE(at::allclose(got, want, 1e-12, 1e-12));
    EXPECT_TRUE(at::allclose(qe.grad(), q.grad(), 1e-12, 1e-12)) << "dq";
    EXPECT_TRUE(at::allclose(ke.grad(), k.grad(), 1e-12, 1e-12)) << "dk";
    EXPECT_TRUE(at::allclose(ve.grad(), v.grad(), 1e-12, 1e-12)) << "dv";

    // On the CPU hetpar's call reads K and V in place, and gives the same.
    EXPECT_FALSE(ExpandsKvHeads(q0, k0, v0, masked ? std::optional<at::Tensor>(mask) : std::nullopt,
                                !masked, scale));
    const at::Tensor in_place = GroupedQueryAttention(
        q0, k0, v0, masked ? std::optional<at::Tensor>(mask) : std::nullopt, !masked, scale);
    EXPECT_TRUE(at::allclose(in_place, want.detach(), 1e-12, 1e-12));
  }
}

}  // namespace
}  // namespace hetpar::nn
