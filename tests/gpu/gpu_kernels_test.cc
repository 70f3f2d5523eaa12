// GPU checks: the kernels hetpar's training will run on a CUDA device, each against a float64
// CPU result computed independently here (from the definitions, not from the code under test):
//
//   at::scaled_dot_product_attention (causal, grouped-query, and with context parallelism's
//     boolean mask) in float32 and bfloat16, forward and backward: the LLM's attention;
//   hetpar's TP operators (common/nn/tp_ops.h) on a group of one, forward and backward;
//   bfloat16 parameters with float32 masters stepped by train::ModuleOptimizer on the device;
//   train::GradientReducer's float32 buckets on the device;
//   an NCCL group of two ranks (threads, one device each) when two devices are visible.
//
// Every test skips, saying why, where no CUDA device is visible (this file builds and runs on
// CPU-only machines: tools/gpu-check and `ctest -L gpu` run it on GPU machines). With
// HETPAR_GPU_TEST_ON_CPU=1 the single-device tests run on the CPU instead, which checks this
// file's references and tolerances (not CUDA) where there is no GPU.
//
// Errors are measured as max |got - reference| / max |reference| over a whole tensor (a norm
// that does not blow up at reference elements near zero); tolerances are next to each use.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/cuda.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <limits>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/nn/attention.h"
#include "common/nn/attention_reference.h"
#include "common/nn/communicator.h"
#include "common/nn/execution_context.h"
#include "common/nn/parameters.h"
#include "common/nn/sdp_backend.h"
#include "common/nn/test_ranks.h"
#include "common/nn/tp_ops.h"
#include "common/status.h"
#include "common/train/grad_reducer.h"
#include "common/train/optimizer.h"
#include "gtest/gtest.h"

#if HETPAR_GPU_HAS_C10_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>
#endif
#if HETPAR_GPU_HAS_C10_CUDA && defined(USE_C10D_NCCL)
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace hetpar {
namespace {

// HETPAR_GPU_TEST_ON_CPU=1 runs the single-device tests on the CPU instead: a check of this file's
// own references and tolerances on a machine without a GPU. It checks nothing about CUDA.
bool SelfCheckOnCpu() {
  const char* value = std::getenv("HETPAR_GPU_TEST_ON_CPU");
  return value != nullptr && std::string(value) == "1";
}

// Where the tests compute: CUDA device 0 (or the CPU under HETPAR_GPU_TEST_ON_CPU=1).
at::Device TestDevice() {
  return SelfCheckOnCpu() ? at::Device(at::kCPU) : at::Device(at::kCUDA, 0);
}

bool OnTestDevice(const at::Tensor& t) { return t.device() == TestDevice(); }

// Why CUDA tests cannot run here; empty when at least `devices` CUDA devices are visible.
std::string NoCudaReason(int devices = 1) {
  const int count = torch::cuda::is_available() ? torch::cuda::device_count() : 0;
  if (count >= devices) return "";
  std::string reason =
      count == 0 ? absl::StrCat(
                       "no CUDA device: torch::cuda::is_available() is false, "
                       "torch::cuda::device_count() = ",
                       static_cast<int>(torch::cuda::device_count()))
                 : absl::StrCat("this test needs ", devices, " CUDA devices; ", count, " visible");
  if (const char* visible = std::getenv("CUDA_VISIBLE_DEVICES")) {
    absl::StrAppend(&reason, " (CUDA_VISIBLE_DEVICES=\"", visible, "\")");
  }
#if !HETPAR_GPU_HAS_C10_CUDA
  absl::StrAppend(&reason, " (this build's libtorch has no CUDA: no torch_cuda target)");
#endif
  return reason;
}

// Every test starts by skipping where there is no CUDA device.
class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (SelfCheckOnCpu()) return;
    const std::string reason = NoCudaReason();
    if (!reason.empty()) GTEST_SKIP() << reason;
    // float32 in IEEE float32, as hetpar's CUDA contexts have it, whatever the environment says.
    nn::UseIeeeFloat32OnCuda();
  }
};

// Normal(0, 1) from a seeded CPU generator in float64, rounded to `dtype`: the exact values the
// device computes on, so the float64 reference starts from them too.
at::Tensor Random(std::vector<int64_t> shape, uint64_t seed, at::ScalarType dtype) {
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::normal(0.0, 1.0, shape, generator, at::TensorOptions().dtype(at::kDouble)).to(dtype);
}

// max |got - want| / max |want|, in float64 on the CPU.
double RelativeError(const at::Tensor& got, const at::Tensor& want) {
  const at::Tensor x = got.detach().to(at::kCPU).to(at::kDouble);
  const at::Tensor y = want.detach().to(at::kCPU).to(at::kDouble);
  EXPECT_EQ(x.sizes(), y.sizes());
  if (x.sizes() != y.sizes()) return std::numeric_limits<double>::infinity();
  const double scale = y.abs().max().item<double>();
  const double diff = (x - y).abs().max().item<double>();
  return scale == 0 ? diff : diff / scale;
}

// A float64 leaf on the CPU with the values of `t`.
at::Tensor Float64Leaf(const at::Tensor& t) {
  return t.detach().to(at::kCPU).to(at::kDouble).requires_grad_(true);
}

// A leaf on the device with the values of `t` (already in the dtype wanted).
at::Tensor CudaLeaf(const at::Tensor& t) {
  return t.detach().to(TestDevice()).requires_grad_(true);
}

// ---- scaled dot-product attention ----

struct AttentionCase {
  at::ScalarType dtype;
  int64_t kv_heads;  // of 8 query heads: 8 is plain multi-head attention, 2 is GQA (groups of 4)
  bool causal;
  // Context parallelism's call: a CP rank's queries (chunks 0 and 3 of a sample's 4, as
  // plan::LoadBalancedChunks gives rank 0 of 2) against all of the sample's keys, causality as
  // an explicit boolean mask (language_model.cc's cp_masks) rather than is_causal. The sample has
  // 192 positions: a length of 64 modulo 128, which a cuDNN attention backward with a mask is
  // reported to get wrong (NaN dq) on H100/H200 with torch 2.11 (pytorch/pytorch#196678).
  bool cp_mask = false;
};

void PrintTo(const AttentionCase& c, std::ostream* os) {
  *os << at::toString(c.dtype) << ", " << c.kv_heads << " KV heads of 8, "
      << (c.cp_mask  ? "CP mask"
          : c.causal ? "causal"
                     : "full");
}

std::string AttentionCaseName(const ::testing::TestParamInfo<AttentionCase>& info) {
  return absl::StrCat(info.param.dtype == at::kBFloat16 ? "Bfloat16" : "Float32", "Kv",
                      info.param.kv_heads,
                      info.param.cp_mask  ? "CpMask"
                      : info.param.causal ? "Causal"
                                          : "Full");
}

// The CP mask of a sample of `keys` positions for CP rank 0 of 2 (chunks 0 and 3 of 4): true where
// the key's position is at most the query's.
at::Tensor CpMask(int64_t keys) {
  const int64_t chunk = keys / 4;
  const at::Tensor query_pos =
      at::cat({at::arange(0, chunk, at::kLong), at::arange(3 * chunk, 4 * chunk, at::kLong)});
  return at::arange(keys, at::kLong).unsqueeze(0).le(query_pos.unsqueeze(1));
}

// The kernel hetpar's call (nn::GroupedQueryAttention) runs: with K and V read in place
// (enable_gqa), or expanded to every query head where no fused kernel takes grouped heads; and
// whether they are expanded.
std::pair<int64_t, bool> SdpChoice(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const std::optional<at::Tensor>& mask, bool is_causal,
                                   double scale) {
  const int64_t heads = q.size(1);
  const bool expands = nn::ExpandsKvHeads(q, k, v, mask, is_causal, scale);
  const int64_t choice =
      expands ? at::_fused_sdp_choice(q, nn::ExpandKvHeads(k, heads), nn::ExpandKvHeads(v, heads),
                                      mask, 0.0, is_causal, scale, /*enable_gqa=*/false)
              : at::_fused_sdp_choice(q, k, v, mask, 0.0, is_causal, scale, /*enable_gqa=*/true);
  return {choice, expands};
}

class ScaledDotProductAttentionTest : public GpuTest,
                                      public ::testing::WithParamInterface<AttentionCase> {};

TEST_P(ScaledDotProductAttentionTest, MatchesFloat64DefinitionForwardAndBackward) {
  const AttentionCase c = GetParam();
  // 77 positions: not a multiple of any kernel's tile, so the ragged last tile is checked too
  // (with the CP mask, 96 queries against 192 keys).
  const int64_t n = 2, heads = 8, head_dim = 64;
  const int64_t keys = c.cp_mask ? 192 : 77, chunk = keys / 4;
  const int64_t queries = c.cp_mask ? 2 * chunk : keys;
  const at::Tensor q = Random({n, heads, queries, head_dim}, 1, c.dtype);
  const at::Tensor k = Random({n, c.kv_heads, keys, head_dim}, 2, c.dtype);
  const at::Tensor v = Random({n, c.kv_heads, keys, head_dim}, 3, c.dtype);
  const at::Tensor grad_out = Random({n, heads, queries, head_dim}, 4, c.dtype);
  const at::Tensor allowed = c.cp_mask ? CpMask(keys) : at::Tensor();

  const bool is_causal = c.causal && !c.cp_mask;  // the CP mask holds the causality itself
  at::Tensor q64 = Float64Leaf(q), k64 = Float64Leaf(k), v64 = Float64Leaf(v);
  const at::Tensor want = nn::testing::ReferenceAttention(q64, k64, v64, is_causal, allowed);
  want.backward(grad_out.to(at::kDouble));

  at::Tensor qd = CudaLeaf(q), kd = CudaLeaf(k), vd = CudaLeaf(v);
  const std::optional<at::Tensor> mask =
      c.cp_mask ? std::optional<at::Tensor>(allowed.to(TestDevice())) : std::nullopt;
  // K and V are expanded where no fused kernel takes grouped heads (float32 on CUDA).
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  const auto [choice, expands] = SdpChoice(qd, kd, vd, mask, is_causal, scale);
  std::cout << "scaled_dot_product_attention backend: " << nn::SdpBackendName(choice)
            << (expands ? " (K and V expanded to every query head)" : "") << "\n";
  RecordProperty("sdp_backend", nn::SdpBackendName(choice));
  RecordProperty("kv_expanded", expands ? "true" : "false");
#if HETPAR_GPU_HAS_C10_CUDA
  if (!SelfCheckOnCpu() && at::cuda::getDeviceProperties(0)->major >= 8) {
    // A GPU with fused attention kernels (compute capability 8.0 or newer) runs every one of
    // these calls in one of them, never in the math path (materialised scores): bfloat16 with
    // K and V in place where a kernel takes grouped heads, float32 with them expanded.
    EXPECT_NE(std::string(nn::SdpBackendName(choice)), "math");
  }
#endif
  const at::Tensor got = nn::GroupedQueryAttention(qd, kd, vd, mask, is_causal, scale);
  ASSERT_TRUE(OnTestDevice(got));
  ASSERT_EQ(got.scalar_type(), c.dtype);
  got.backward(grad_out.to(TestDevice()));

  // float32: the kernels accumulate in float32 (TF32 off: GpuTest::SetUp, as hetpar's CUDA
  // contexts; with it on the error would be ~1e-3). Seen on CPU: <= 1e-6; 1e-4 leaves a wide margin
  // for other summation orders. bfloat16 keeps 8 significant bits (spacing 2^-8 ~ 4e-3 relative);
  // the output and gradients are rounded to it and the kernels round probabilities to it before
  // multiplying by V. Seen with libtorch's CPU bfloat16 kernel: forward <= 3e-3, gradients <= 1e-2
  // (dK and dV sum over the 4 query heads of a group). A wrong mask or head mapping gives ~1.
  const bool bf16 = c.dtype == at::kBFloat16;
  const double forward_tolerance = bf16 ? 2e-2 : 1e-4;
  const double grad_tolerance = bf16 ? 4e-2 : 2e-4;
  EXPECT_LT(RelativeError(got, want), forward_tolerance) << "output";
  ASSERT_TRUE(qd.grad().defined() && kd.grad().defined() && vd.grad().defined());
  EXPECT_LT(RelativeError(qd.grad(), q64.grad()), grad_tolerance) << "dq";
  EXPECT_LT(RelativeError(kd.grad(), k64.grad()), grad_tolerance) << "dk";
  EXPECT_LT(RelativeError(vd.grad(), v64.grad()), grad_tolerance) << "dv";
}

INSTANTIATE_TEST_SUITE_P(
    Cases, ScaledDotProductAttentionTest,
    ::testing::Values(AttentionCase{at::kFloat, 8, true}, AttentionCase{at::kFloat, 2, true},
                      AttentionCase{at::kFloat, 2, false}, AttentionCase{at::kBFloat16, 8, true},
                      AttentionCase{at::kBFloat16, 2, true}, AttentionCase{at::kBFloat16, 2, false},
                      AttentionCase{at::kFloat, 2, true, true},
                      AttentionCase{at::kBFloat16, 2, true, true}),
    AttentionCaseName);

// Context parallelism's masked call where every score of a row is very low (its logsumexp below
// ln(FLT_MIN), about -88.7): the case in which cuDNN's masked backward returns NaN query gradients
// on H100/H200 (pytorch/pytorch#196678). A CP run's CUDA context turns cuDNN attention off
// (nn::AvoidCudnnMaskedAttention), as this test does: the gradients stay finite and right.
TEST_F(GpuTest, MaskedAttentionWithVeryLowScoresKeepsFiniteGradients) {
  // Process-wide: the tests after this one get cuDNN attention back.
  const bool cudnn_was_on = at::globalContext().userEnabledCuDNNSDP();
  absl::Cleanup restore = [cudnn_was_on] { at::globalContext().setSDPUseCuDNN(cudnn_was_on); };
  nn::AvoidCudnnMaskedAttention();
  const int64_t n = 1, heads = 8, kv_heads = 2, head_dim = 64, keys = 192, chunk = keys / 4;
  const int64_t queries = 2 * chunk;
  const at::ScalarType dtype = at::kBFloat16;
  at::Tensor q = Random({n, heads, queries, head_dim}, 21, dtype) * 0.1;
  at::Tensor k = Random({n, kv_heads, keys, head_dim}, 22, dtype) * 0.1;
  const at::Tensor v = Random({n, kv_heads, keys, head_dim}, 23, dtype);
  const at::Tensor grad_out = Random({n, heads, queries, head_dim}, 24, dtype);
  // Every score about -120: q[..., 0] = 1, k[..., 0] = -120 sqrt(d) (both exact in bfloat16).
  q.select(3, 0).fill_(1.0);
  k.select(3, 0).fill_(-120.0 * std::sqrt(static_cast<double>(head_dim)));
  const at::Tensor allowed = CpMask(keys);
  at::Tensor q64 = Float64Leaf(q), k64 = Float64Leaf(k), v64 = Float64Leaf(v);
  const at::Tensor want = nn::testing::ReferenceAttention(q64, k64, v64, false, allowed);
  want.backward(grad_out.to(at::kDouble));

  at::Tensor qd = CudaLeaf(q), kd = CudaLeaf(k), vd = CudaLeaf(v);
  const std::optional<at::Tensor> mask = allowed.to(TestDevice());
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  const int64_t choice = SdpChoice(qd, kd, vd, mask, false, scale).first;
  std::cout << "scaled_dot_product_attention backend: " << nn::SdpBackendName(choice) << "\n";
  EXPECT_NE(std::string(nn::SdpBackendName(choice)), "cudnn_attention");
  const at::Tensor got = nn::GroupedQueryAttention(qd, kd, vd, mask, false, scale);
  got.backward(grad_out.to(TestDevice()));
  ASSERT_TRUE(qd.grad().defined() && kd.grad().defined() && vd.grad().defined());
  for (const at::Tensor& grad : {qd.grad(), kd.grad(), vd.grad()}) {
    EXPECT_TRUE(at::isfinite(grad).all().item<bool>());
  }
  // bfloat16 tolerances as above. dq's first column is left out: its true value is 0 (a row's
  // score gradients sum to 0), and the -960 in every key's first component multiplies the
  // rounding of that sum.
  EXPECT_LT(RelativeError(got, want), 2e-2) << "output";
  EXPECT_LT(
      RelativeError(qd.grad().narrow(3, 1, head_dim - 1), q64.grad().narrow(3, 1, head_dim - 1)),
      4e-2)
      << "dq";
  EXPECT_LT(RelativeError(kd.grad(), k64.grad()), 4e-2) << "dk";
  EXPECT_LT(RelativeError(vd.grad(), v64.grad()), 4e-2) << "dv";
}

// ---- TP operators on a group of one ----

// RmsNorm -> column-parallel linear -> LayerNorm -> row-parallel linear -> vocab-parallel cross
// entropy, on the device in float32, against the same chain written out in float64 on the CPU.
TEST_F(GpuTest, TpOperatorsOnAGroupOfOneMatchFloat64) {
  auto single = nn::Communicator::CreateSingle();
  const nn::TensorParallel tp{single->group(), /*sequence_parallel=*/false};
  const int64_t rows = 37, in = 48, mid = 96, vocab = 50;
  const double eps = 1e-5;
  // The inputs and parameters, rounded to float32 (the device's values).
  const std::vector<at::Tensor> values = {
      Random({rows, in}, 11, at::kFloat),          // x
      Random({in}, 12, at::kFloat) * 0.1 + 1,      // RmsNorm scale
      Random({mid, in}, 13, at::kFloat) * 0.2,     // column weight
      Random({mid}, 14, at::kFloat) * 0.1,         // column bias
      Random({mid}, 15, at::kFloat) * 0.1 + 1,     // LayerNorm scale
      Random({mid}, 16, at::kFloat) * 0.1,         // LayerNorm bias
      Random({vocab, mid}, 17, at::kFloat) * 0.2,  // row weight
      Random({vocab}, 18, at::kFloat) * 0.1,       // row bias
  };
  const char* names[] = {"x",        "rms_scale", "column_weight", "column_bias",
                         "ln_scale", "ln_bias",   "row_weight",    "row_bias"};
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(20);
  const at::Tensor targets =
      at::randint(vocab, {rows}, generator, at::TensorOptions().dtype(at::kLong));
  const at::Tensor row_weights = Random({rows}, 19, at::kFloat);

  // Reference, float64, from the definitions.
  std::vector<at::Tensor> ref;
  for (const at::Tensor& t : values) ref.push_back(Float64Leaf(t));
  const at::Tensor& x = ref[0];
  const at::Tensor h = x * (x.pow(2).mean(-1, true) + eps).rsqrt() * ref[1];
  const at::Tensor a = at::matmul(h, ref[2].t()) + ref[3];
  const at::Tensor centred = a - a.mean(-1, true);
  const at::Tensor l = centred * (centred.pow(2).mean(-1, true) + eps).rsqrt() * ref[4] + ref[5];
  const at::Tensor z = at::matmul(l, ref[6].t()) + ref[7];
  const at::Tensor z_max = std::get<0>(z.max(-1, true)).detach();
  const at::Tensor log_sum_exp = (z - z_max).exp().sum(-1).log() + z_max.squeeze(-1);
  const at::Tensor ref_loss = log_sum_exp - z.gather(1, targets.unsqueeze(1)).squeeze(1);
  (ref_loss * row_weights.to(at::kDouble)).sum().backward();

  // On the device.
  std::vector<at::Tensor> dev;
  for (const at::Tensor& t : values) dev.push_back(CudaLeaf(t));
  const at::Tensor dh = nn::RmsNorm(dev[0], dev[1], eps);
  const at::Tensor da =
      nn::ColumnParallelLinear(nn::EnterTensorParallel(dh, rows, tp), dev[2], dev[3]);
  const at::Tensor dl = nn::LayerNorm(da, dev[4], dev[5], eps);
  const at::Tensor dz = nn::RowParallelLinear(dl, dev[6], dev[7], tp);
  const at::Tensor loss =
      nn::VocabParallelCrossEntropy(dz, targets.to(TestDevice()), /*vocab_begin=*/0, tp.group);
  ASSERT_TRUE(OnTestDevice(loss));
  ASSERT_EQ(loss.scalar_type(), at::kFloat);
  (loss * row_weights.to(TestDevice())).sum().backward();

  // float32 throughout (no TF32: GpuTest::SetUp); the chain is shallow, so errors stay ~1e-6.
  const double tolerance = 1e-4;
  EXPECT_LT(RelativeError(dh, h), tolerance) << "RmsNorm";
  EXPECT_LT(RelativeError(da, a), tolerance) << "ColumnParallelLinear";
  EXPECT_LT(RelativeError(dl, l), tolerance) << "LayerNorm";
  EXPECT_LT(RelativeError(dz, z), tolerance) << "RowParallelLinear";
  EXPECT_LT(RelativeError(loss, ref_loss), tolerance) << "VocabParallelCrossEntropy";
  for (size_t i = 0; i < values.size(); ++i) {
    ASSERT_TRUE(dev[i].grad().defined()) << names[i];
    EXPECT_TRUE(OnTestDevice(dev[i].grad())) << names[i];
    EXPECT_LT(RelativeError(dev[i].grad(), ref[i].grad()), tolerance) << "gradient of " << names[i];
  }
}

// ---- mixed precision on the device ----

hetpar::v1::Optimizer Adam(double lr) {
  hetpar::v1::Optimizer o;
  o.set_lr(lr);
  o.set_weight_decay(0.0);
  o.set_beta1(0.9);
  o.set_beta2(0.999);
  o.set_eps(1e-8);
  o.set_warmup_steps(0);
  return o;
}

// Moves every parameter of `set` to the device in place: set_data keeps each autograd leaf (and
// its float32 grad dtype, and any hooks on it), so everything holding the tensor sees the move.
void MoveToTestDevice(const nn::ParameterSet& set) {
  at::NoGradGuard no_grad;
  for (const nn::NamedParameter& p : set.parameters()) {
    p.tensor.set_data(p.tensor.to(TestDevice(), p.tensor.scalar_type(), /*non_blocking=*/false,
                                  /*copy=*/true));
  }
}

// As common/train/optimizer_test.cc's Bfloat16ParametersStepOnFloat32Masters, with the parameters
// on the device and the gradients from backward there.
TEST_F(GpuTest, Bfloat16ParametersStepOnFloat32MastersOnTheDevice) {
  nn::ParameterSet set(1, at::kBFloat16, 0, 1, nn::InitStyle::kTraining);
  ASSERT_TRUE(set.Add("w", {64, 64}, -1, nn::InitRule::Constant(1.0)).ok());
  ASSERT_TRUE(set.Add("b", {64}, -1, nn::InitRule::Constant(1.0)).ok());
  MoveToTestDevice(set);
  const at::Tensor& w = set.Find("w")->tensor;
  const at::Tensor& b = set.Find("b")->tensor;
  ASSERT_TRUE(OnTestDevice(w) && OnTestDevice(b));
  ASSERT_TRUE(w.is_leaf() && w.requires_grad());
  auto opt = train::ModuleOptimizer::Create(&set, Adam(1e-4));
  ASSERT_TRUE(opt.ok()) << opt.status();
  EXPECT_TRUE((*opt)->HasMasters());
  // A constant gradient (d/dp of sum(p * 1) is 1): every bias-corrected Adam update is lr. One
  // update, 1e-4, is far below bfloat16's spacing below 1.0 (2^-8): bfloat16 weights updated in
  // place would never move.
  const at::Tensor ones_w =
      at::ones({64, 64}, at::TensorOptions().dtype(at::kBFloat16).device(TestDevice()));
  const at::Tensor ones_b =
      at::ones({64}, at::TensorOptions().dtype(at::kBFloat16).device(TestDevice()));
  for (int step = 0; step < 40; ++step) {
    ((w * ones_w).sum() + (b * ones_b).sum()).backward();
    if (step == 0) {
      ASSERT_TRUE(w.grad().defined());
      EXPECT_TRUE(OnTestDevice(w.grad()));
      EXPECT_EQ(w.grad().scalar_type(), at::kFloat);  // ParameterSet's grad dtype survives set_data
    }
    ASSERT_TRUE((*opt)->Step(step, 1.0).ok());
  }
  for (const char* name : {"w", "b"}) {
    std::optional<train::ModuleOptimizer::ParamState> state = (*opt)->StateOf(name);
    ASSERT_TRUE(state.has_value()) << name;
    ASSERT_TRUE(state->master.defined()) << name;
    EXPECT_TRUE(OnTestDevice(state->master)) << name;
    EXPECT_EQ(state->master.scalar_type(), at::kFloat) << name;
    EXPECT_TRUE(OnTestDevice(state->exp_avg)) << name;
    EXPECT_EQ(state->exp_avg.scalar_type(), at::kFloat) << name;
    // 40 float32 subtractions of 1e-4 from ~1 round by at most 2^-25 each: <= 1.2e-6 in all.
    const at::Tensor master = state->master.to(at::kCPU).to(at::kDouble);
    EXPECT_LT((master - (1.0 - 40 * 1e-4)).abs().max().item<double>(), 2e-6) << name;
    // The parameter is the master rounded to bfloat16 once: 0.996 is nearest to 1 - 2^-8.
    const at::Tensor& p = set.Find(name)->tensor;
    EXPECT_TRUE(OnTestDevice(p)) << name;
    EXPECT_EQ(p.scalar_type(), at::kBFloat16) << name;
    EXPECT_TRUE(at::equal(p.to(at::kCPU), state->master.to(at::kBFloat16).to(at::kCPU))) << name;
    EXPECT_EQ(p.to(at::kCPU).to(at::kDouble).max().item<double>(), 1.0 - std::ldexp(1.0, -8))
        << name;
    EXPECT_EQ(p.to(at::kCPU).to(at::kDouble).min().item<double>(), 1.0 - std::ldexp(1.0, -8))
        << name;
  }
}

// ---- DP gradient buckets on the device ----

// What multiplies parameter `name` in `wave`: bfloat16 values (exact in float64). Element 0 is 1
// in wave 0 and 2^-9 in wave 1: their float32 sum 1 + 2^-9 is exact, while a bfloat16 sum (8
// significant bits) would round it back to 1.
at::Tensor WaveInput(const std::string& name, int wave, at::IntArrayRef shape) {
  at::Tensor x = at::arange(c10::multiply_integers(shape), at::kDouble)
                     .mul(0.37 + 0.11 * wave + static_cast<double>(name[0]))
                     .sin()
                     .to(at::kBFloat16);
  x[0] = wave == 0 ? 1.0 : std::ldexp(1.0, -9);
  return x.reshape(shape);
}

TEST_F(GpuTest, GradientReducerAccumulatesBfloat16GradientsInFloat32BucketsOnTheDevice) {
  nn::ParameterSet set(5, at::kBFloat16, 0, 1, nn::InitStyle::kTraining);
  ASSERT_TRUE(set.Add("a", {2, 2}, -1, nn::InitRule::Normal(1.0)).ok());
  ASSERT_TRUE(set.Add("b", {3, 5}, -1, nn::InitRule::Normal(1.0)).ok());
  ASSERT_TRUE(set.Add("c", {4, 4}, -1, nn::InitRule::Normal(1.0)).ok());
  // Before the reducer: its buckets are allocated where the parameters are.
  MoveToTestDevice(set);
  // 20 float32 elements a bucket: "c" (16) alone, then "b" (15) and "a" (4) together.
  train::GradientReducer reducer(&set, 20 * 4);
  EXPECT_EQ(reducer.buckets(), 2);
  auto single = nn::Communicator::CreateSingle();
  for (int step = 0; step < 2; ++step) {  // the second step starts from zeroed buckets
    ASSERT_TRUE(reducer.BeginStep(single.get()).ok());
    std::vector<const void*> bucket_views;
    for (const nn::NamedParameter& p : set.parameters()) {
      ASSERT_TRUE(p.tensor.grad().defined()) << p.name;
      EXPECT_TRUE(OnTestDevice(p.tensor.grad())) << p.name;
      EXPECT_EQ(p.tensor.grad().scalar_type(), at::kFloat) << p.name;
      EXPECT_EQ(p.tensor.grad().abs().sum().item<double>(), 0.0) << p.name;
      bucket_views.push_back(p.tensor.grad().data_ptr());
    }
    for (int wave = 0; wave < 2; ++wave) {
      if (wave == 1) reducer.ArmLastBackward();
      at::Tensor loss = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(TestDevice()));
      for (const nn::NamedParameter& p : set.parameters()) {
        loss = loss + (p.tensor * WaveInput(p.name, wave, p.tensor.sizes()).to(TestDevice())).sum();
      }
      loss.backward();
    }
    ASSERT_TRUE(reducer.Finish().ok());
    // Both buckets were complete within the last backward and started from its hooks.
    EXPECT_EQ(reducer.started_during_backward(), 2);
    for (size_t i = 0; i < set.parameters().size(); ++i) {
      const nn::NamedParameter& p = set.parameters()[i];
      const at::Tensor& grad = p.tensor.grad();
      ASSERT_TRUE(grad.defined()) << p.name;
      // Accumulated in place in the bucket, on the device, in float32.
      EXPECT_EQ(grad.data_ptr(), bucket_views[i]) << p.name;
      EXPECT_TRUE(OnTestDevice(grad)) << p.name;
      EXPECT_EQ(grad.scalar_type(), at::kFloat) << p.name;
      const at::Tensor want = WaveInput(p.name, 0, p.tensor.sizes()).to(at::kDouble) +
                              WaveInput(p.name, 1, p.tensor.sizes()).to(at::kDouble);
      const at::Tensor got = grad.to(at::kCPU).to(at::kDouble);
      // One float32 addition of two bfloat16 values: within 2^-24 relative.
      EXPECT_LT((got - want).abs().max().item<double>(), 1e-6) << p.name << " step " << step;
      EXPECT_EQ(got.reshape({-1})[0].item<double>(), 1.0 + std::ldexp(1.0, -9)) << p.name;
    }
    set.ZeroGrad();  // as the optimizer step does
  }
}

// ---- NCCL between two devices ----

#if HETPAR_GPU_HAS_C10_CUDA
// OK when `got` (on any device) equals `want` element for element; else the first mismatch.
absl::Status ExpectExact(int rank, const std::string& what, const at::Tensor& got,
                         const at::Tensor& want) {
  const at::Tensor g = got.to(at::kCPU).to(at::kDouble);
  const at::Tensor w = want.to(at::kDouble);
  if (g.sizes() != w.sizes()) {
    return absl::InternalError(absl::StrCat("rank ", rank, ": ", what, ": shape ",
                                            c10::str(g.sizes()), ", expected ",
                                            c10::str(w.sizes())));
  }
  const at::Tensor bad = g.reshape({-1}).ne(w.reshape({-1})).nonzero();
  if (bad.size(0) == 0) return absl::OkStatus();
  const int64_t i = bad[0][0].item<int64_t>();
  return absl::InternalError(absl::StrCat("rank ", rank, ": ", what, ": mismatch at index ", i,
                                          ": ", g.reshape({-1})[i].item<double>(), ", expected ",
                                          w.reshape({-1})[i].item<double>(), " (", bad.size(0),
                                          " of ", g.numel(), " elements differ)"));
}

// One rank's checks: every collective hetpar's TP, CP and DP groups use, on device `rank`, with
// small integers so that every result is exact.
absl::Status CheckNcclCollectives(int rank, nn::Communicator& comm) {
  const auto on = [rank](at::ScalarType dtype) {
    return at::TensorOptions().dtype(dtype).device(at::Device(at::kCUDA, rank));
  };
  {  // Sum, float32: rank r holds (r + 1) * i.
    at::Tensor x = at::arange(1000, on(at::kFloat)) * (rank + 1);
    HETPAR_RETURN_IF_ERROR(comm.AllReduce(x));
    if (!x.is_cuda() || x.get_device() != rank) {
      return absl::InternalError(
          absl::StrCat("rank ", rank, ": all-reduce moved the tensor to ", x.device().str()));
    }
    HETPAR_RETURN_IF_ERROR(ExpectExact(rank, "float32 sum", x, at::arange(1000, at::kDouble) * 3));
  }
  {  // Sum, bfloat16 (NCCL reduces it natively).
    at::Tensor x = at::full({256}, rank + 1, on(at::kBFloat16));
    HETPAR_RETURN_IF_ERROR(comm.AllReduce(x));
    HETPAR_RETURN_IF_ERROR(ExpectExact(rank, "bfloat16 sum", x, at::full({256}, 3.0, at::kDouble)));
  }
  {  // Max.
    at::Tensor x = at::full({8}, static_cast<double>(rank), on(at::kFloat));
    HETPAR_RETURN_IF_ERROR(comm.AllReduce(x, nn::ReduceOp::kMax));
    HETPAR_RETURN_IF_ERROR(ExpectExact(rank, "max", x, at::ones({8}, at::kDouble)));
  }
  {  // All-gather of rows, in rank order.
    at::Tensor x = at::arange(12, on(at::kFloat)).reshape({3, 4}) + 100 * rank;
    HETPAR_ASSIGN_OR_RETURN(at::Tensor gathered, comm.AllGatherRows(x));
    const at::Tensor base = at::arange(12, at::kDouble).reshape({3, 4});
    HETPAR_RETURN_IF_ERROR(ExpectExact(rank, "all-gather", gathered, at::cat({base, base + 100})));
  }
  {  // Reduce-scatter of rows: rank r gets rows [2r, 2r + 2) of the sum.
    at::Tensor x = at::arange(20, on(at::kFloat)).reshape({4, 5}) * (rank + 1);
    HETPAR_ASSIGN_OR_RETURN(at::Tensor shard, comm.ReduceScatterRows(x));
    const at::Tensor sum = at::arange(20, at::kDouble).reshape({4, 5}) * 3;
    HETPAR_RETURN_IF_ERROR(ExpectExact(rank, "reduce-scatter", shard, sum.narrow(0, 2 * rank, 2)));
  }
  return absl::OkStatus();
}
#endif  // HETPAR_GPU_HAS_C10_CUDA

// One rank's NCCL group on one GPU (NCCL takes a single-rank communicator; hetpar's own groups
// of one skip c10d), so that a machine with a single GPU runs the calls hetpar's NCCL groups rely
// on: an all-reduce waited for on the stream (Work::wait without a timeout, as CommGroup::Wait
// does on NCCL) hands its result to the next kernel; the backend reports no error
// (getError, which the step driver asks after each step); and abort (what CollectiveAborter
// calls) returns.
TEST_F(GpuTest, NcclSingleRankGroupWaitsOnTheStreamReportsNoErrorAndAborts) {
  if (SelfCheckOnCpu()) GTEST_SKIP() << "HETPAR_GPU_TEST_ON_CPU=1: NCCL needs a CUDA device";
  const std::string reason = NoCudaReason(1);
  if (!reason.empty()) GTEST_SKIP() << "NCCL on one rank: " << reason;
#if !HETPAR_GPU_HAS_C10_CUDA || !defined(USE_C10D_NCCL)
  GTEST_SKIP() << "NCCL on one rank: this build has no c10_cuda or no c10d NCCL";
#else
  c10::cuda::set_device(0);
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = std::chrono::seconds(60);
  auto group = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, 0, 1, options);
  const at::Tensor values = at::arange(4096, at::TensorOptions().dtype(at::kFloat));
  std::vector<at::Tensor> tensors = {values.to(at::Device(at::kCUDA, 0))};
  group->allreduce(tensors)->wait();  // the stream waits; the host goes on
  const at::Tensor doubled = tensors[0] * 2;
  // A sum over one rank leaves the values as they were.
  EXPECT_TRUE(at::equal(doubled.cpu(), values * 2));
  EXPECT_EQ(group->getError(), c10d::ErrorType::SUCCESS);
  group->abort();
#endif
}

TEST_F(GpuTest, NcclCollectivesBetweenTwoDevices) {
  if (SelfCheckOnCpu()) GTEST_SKIP() << "HETPAR_GPU_TEST_ON_CPU=1: NCCL needs CUDA devices";
  const std::string reason = NoCudaReason(2);
  if (!reason.empty()) GTEST_SKIP() << "NCCL between two ranks: " << reason;
#if !HETPAR_GPU_HAS_C10_CUDA
  GTEST_SKIP() << "NCCL between two ranks: this build has no c10_cuda (HETPAR_TORCH_HAS_CUDA off)";
#else
  constexpr int kRanks = 2;
  const auto store = nn::OpenHashStore();
  std::vector<absl::Status> results(kRanks);
  nn::testing::ThreadLatch formed(kRanks);
  nn::testing::ThreadLatch done(kRanks);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < kRanks; ++rank) {
    threads.emplace_back([&, rank] {
      // Each rank's thread works on its own device (NCCL's streams and communicator follow the
      // current device and the tensors' device).
      c10::cuda::set_device(static_cast<c10::DeviceIndex>(rank));
      nn::CommunicatorOptions options;
      options.prefix = "gpu-kernels-test/nccl";
      options.rank = rank;
      options.size = kRanks;
      options.backend = nn::Backend::kNccl;
      options.timeout = absl::Seconds(120);
      auto comm = nn::Communicator::Create(store, options);
      if (!comm.ok()) results[rank] = comm.status();
      formed.ArriveAndWait();
      if (comm.ok()) results[rank] = CheckNcclCollectives(rank, **comm);
      // No group is torn down while the other rank may still use it.
      done.ArriveAndWait();
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int rank = 0; rank < kRanks; ++rank) {
    EXPECT_TRUE(results[rank].ok()) << "rank " << rank << ": " << results[rank];
  }
#endif
}

}  // namespace
}  // namespace hetpar
