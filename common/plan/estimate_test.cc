// The planner's cost model and search: cluster files, each term of the estimate against numbers
// written out by hand for shapes where the other terms vanish, and the search's direction on a
// published model shape.
#include "common/plan/estimate.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "common/config/config.h"
#include "common/plan/cluster.h"
#include "common/plan/sample.h"
#include "common/plan/search.h"
#include "common/plan/step_plan.h"

namespace hetpar::plan {
namespace {

// configs/tiny.yaml's models: encoder h 64, 2 layers; LLM h 64, 2 layers, 4 heads, 2 kv heads,
// SwiGLU 128, vocabulary 256, 128 positions.
constexpr char kTiny[] = R"(
run: {name: t, steps: 1, global_batch: 4, micro_batch: 1, seed: 1, dtype: float32, max_inflight: 2}
placement: non_colocated
encoder:
  model: {image_size: 32, patch: 8, hidden: 64, layers: 2, heads: 4, mlp: 128, out_hidden: 64}
  layout: {dp: 1, tp: 1}
llm:
  model: {hidden: 64, layers: 2, heads: 4, kv_heads: 2, ffn: 128, vocab: 256, seq_len: 128}
  layout: {dp: 1, tp: 2, cp: 1, pp: 1}
data: {manifest: m.jsonl, tokenizer: t.model}
)";

v1::RunSpec Spec(const std::vector<std::string>& overrides) {
  config::LoadOptions options;
  options.check_files = false;
  options.overrides = overrides;
  auto loaded = config::LoadRunSpecFromString(kTiny, "tiny", options);
  EXPECT_TRUE(loaded.ok()) << loaded.status();
  return loaded->spec;
}

// One sample per 4 waves: 1 image of 16 rows and 40 text tokens (20 with a label) each.
std::vector<SampleDescriptor> Batch(int64_t samples) {
  std::vector<SampleDescriptor> batch;
  for (int64_t i = 0; i < samples; ++i) batch.push_back(MakeSample(i, 1, 16, 40, 20));
  return batch;
}

// A cluster where every term is free except those a test turns on: compute at 1e9 TFLOPS, links
// at 1e9 GB/s without latency, no overheads.
ClusterSpec FreeCluster() {
  ClusterSpec c;
  c.name = "free";
  c.devices_per_node = 64;
  c.memory_gib = 80;
  c.memory_gbps = 1e12;
  c.peak_tflops = {{"float32", 1e9}, {"bfloat16", 1e9}};
  c.compute_efficiency = 1;
  c.tp_parallel_fraction = 1;
  c.intra_node = {1e9, 0, 1e9, 0};
  c.inter_node = c.intra_node;
  return c;
}

absl::StatusOr<StepEstimate> Estimate(const v1::RunSpec& spec, const ClusterSpec& cluster,
                                      int64_t samples = 4) {
  return EstimateOverBatches(spec, {Batch(samples)}, cluster);
}

TEST(ClusterTest, ParsesEveryField) {
  auto c = ParseClusterYaml(R"(name: lab
description: two boxes
source: measured
devices_per_node: 4
nodes: 2
share_devices: false
concurrency: 3.5
shared_collective_latency_s: 0.002
loaded_collective_latency_s: 0.001
memory_gib: 40
reserved_gib: 1
memory_gbps: 1500
peak_tflops: {bfloat16: 300, float32: 20}
compute_efficiency: 0.4
tp_parallel_fraction: 0.9
layer_overhead_s: 0.0001
encoder: {compute_efficiency: 0.3}
llm: {layer_overhead_s: 0.0002, attention_call_overhead_s: 0.0003}
intra_node: {collective_gbps: 100, collective_latency_s: 1e-5, p2p_gbps: 50, p2p_latency_s: 2e-6}
inter_node: {collective_gbps: 10, p2p_gbps: 12}
step_overhead_s: 0.01
)",
                            "lab.yaml");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->name, "lab");
  EXPECT_EQ(c->devices(), 8);
  EXPECT_DOUBLE_EQ(c->Concurrency(), 7.0);
  EXPECT_DOUBLE_EQ(c->peak_tflops.at("bfloat16"), 300);
  EXPECT_DOUBLE_EQ(*c->PeakFlops(v1::DTYPE_FLOAT32), 20e12);
  EXPECT_DOUBLE_EQ(c->intra_node.p2p_latency_s, 2e-6);
  EXPECT_DOUBLE_EQ(c->inter_node.p2p_gbps, 12);
  EXPECT_DOUBLE_EQ(c->inter_node.collective_latency_s, 0);
  EXPECT_DOUBLE_EQ(c->layer_overhead_s, 0.0001);
  // A module's section overrides what it names; the rest is the cluster's.
  EXPECT_DOUBLE_EQ(c->EncoderCompute().compute_efficiency, 0.3);
  EXPECT_DOUBLE_EQ(c->EncoderCompute().layer_overhead_s, 0.0001);
  EXPECT_DOUBLE_EQ(c->EncoderCompute().attention_call_overhead_s, 0);
  EXPECT_DOUBLE_EQ(c->LlmCompute().compute_efficiency, 0.4);
  EXPECT_DOUBLE_EQ(c->LlmCompute().layer_overhead_s, 0.0002);
  EXPECT_DOUBLE_EQ(c->LlmCompute().attention_call_overhead_s, 0.0003);
  EXPECT_DOUBLE_EQ(c->step_overhead_s, 0.01);
  const auto missing = c->PeakFlops(v1::DTYPE_FLOAT64);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(missing.status().message().find("peak_tflops.float64"), std::string::npos);
}

TEST(ClusterTest, ErrorsNameTheFileTheLineAndTheField) {
  auto c = ParseClusterYaml(R"(devices_per_node: 8
memory_gib: 80
memroy_gbps: 3000
peak_tflops: {fp8: 2000}
compute_efficiency: 1.5
intra_node: {collective_gbps: fast, p2p_gbps: 10}
encoder: {attention_call_overhead_s: 0.001}
llm: {compute_efficiency: 2}
)",
                            "my.yaml");
  ASSERT_FALSE(c.ok());
  const std::string m(c.status().message());
  EXPECT_NE(m.find("my.yaml:3: memroy_gbps is not a cluster field"), std::string::npos) << m;
  EXPECT_NE(m.find("my.yaml:4: peak_tflops.fp8 is not a dtype"), std::string::npos) << m;
  EXPECT_NE(m.find("my.yaml:5: compute_efficiency=1.5 must be <= 1"), std::string::npos) << m;
  EXPECT_NE(m.find("my.yaml:6: intra_node.collective_gbps='fast' is not a number"),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("my.yaml: memory_gbps is required"), std::string::npos) << m;
  EXPECT_NE(m.find("my.yaml:7: encoder.attention_call_overhead_s is not a field; expected "
                   "compute_efficiency or layer_overhead_s"),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("my.yaml:8: llm.compute_efficiency=2 must be <= 1"), std::string::npos) << m;
}

TEST(ClusterTest, PresetsAndFiles) {
  auto h100 = ResolveCluster("h100-sxm");
  ASSERT_TRUE(h100.ok());
  EXPECT_DOUBLE_EQ(h100->peak_tflops.at("bfloat16"), 989);
  EXPECT_EQ(h100->devices_per_node, 8);
  auto none = ResolveCluster("/nonexistent/cluster.yaml");
  EXPECT_EQ(none.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(none.status().message().find("h100-sxm"), std::string::npos);
}

TEST(EstimateTest, AllReduceByHand) {
  // Ring: latency + 2 (n-1)/n x bytes / bus bandwidth = 1e-5 + 2 * 7/8 * 1e9 / 1e11.
  EXPECT_NEAR(AllReduceSeconds({100, 1e-5, 0, 0}, 8, 1e9), 0.01751, 1e-12);
  EXPECT_EQ(AllReduceSeconds({100, 1e-5, 0, 0}, 1, 1e9), 0);
}

TEST(EstimateTest, LlmTensorParallelLatencyPerWave) {
  // Compute, bytes and everything else free; 1 ms per collective. Per microbatch: 4 per layer
  // (2 layers) + embedding, final norm, image rows, their gradient + 3 for the loss = 15. Four
  // waves of one sample: 60 ms.
  ClusterSpec c = FreeCluster();
  c.intra_node.collective_latency_s = 1e-3;
  auto e = Estimate(Spec({}), c);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_NEAR(e->step_time_s, 0.060, 1e-6);
  EXPECT_NEAR(e->llm_module.tp_collective_s, 0.060, 1e-6);
  // Sequence parallelism: an all-gather and a reduce-scatter for each: twice the latencies.
  auto sp = Estimate(Spec({"llm.layout.sequence_parallel=true"}), c);
  ASSERT_TRUE(sp.ok()) << sp.status();
  EXPECT_NEAR(sp->step_time_s, 0.120, 1e-6);
}

TEST(EstimateTest, DataParallelGradientAllReduce) {
  // LLM dp 2 x tp 1, bus bandwidth 1 GB/s, no latency. Parameters of the tiny LLM by hand:
  //   per layer qkv 64 x (64 + 2 x 2 x 16) = 8192, out 64 x 64 = 4096, SwiGLU 3 x 64 x 128 =
  //   24576, two norms 128: 36992; two layers 73984; embedding and head 2 x 256 x 64 = 32768;
  //   final norm 64. Total 106816, 4 bytes each: 2 x 1/2 x 427264 bytes / 1e9 B/s.
  EXPECT_DOUBLE_EQ(LlmParameters(Spec({}).llm().model()), 106816);
  ClusterSpec c = FreeCluster();
  c.intra_node.collective_gbps = 1;
  auto e = Estimate(Spec({"llm.layout.dp=2", "llm.layout.tp=1", "run.global_batch=4"}), c);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_NEAR(e->llm_module.dp_collective_s, 427264e-9, 1e-12);
  EXPECT_NEAR(e->step_time_s, 427264e-9, 1e-9);
}

TEST(EstimateTest, BoundaryLatencyPerMessageEachWay) {
  // Colocated dp 1 x tp 1 for both: one message per wave to the one LLM rank, each way; 1 ms of
  // p2p latency each. Four waves: forward and backward transfers of 4 ms each on the critical
  // path.
  ClusterSpec c = FreeCluster();
  c.intra_node.p2p_latency_s = 1e-3;
  auto e = Estimate(Spec({"placement=colocated", "llm.layout.tp=1"}), c);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_NEAR(e->boundary_s, 0.008, 1e-9);
  EXPECT_NEAR(e->step_time_s, 0.008, 1e-6);
}

TEST(EstimateTest, NonColocatedOverlapsTheModules) {
  // Compute at 1 GFLOP/s, everything else free. The encoder and the LLM run concurrently: the
  // step is at least the busier module's compute and less than the two in sequence.
  ClusterSpec c = FreeCluster();
  c.peak_tflops = {{"float32", 1e-3}};
  auto e = Estimate(Spec({"llm.layout.tp=1"}), c);
  ASSERT_TRUE(e.ok()) << e.status();
  const double enc = e->encoder_module.compute_s, llm = e->llm_module.compute_s;
  EXPECT_GT(enc, 0);
  EXPECT_GE(e->step_time_s, std::max(enc, llm) - 1e-12);
  EXPECT_LT(e->step_time_s, enc + llm);
  // Colocated, the same ranks run both in turn: exactly the sum.
  auto co = Estimate(Spec({"placement=colocated", "llm.layout.tp=1"}), c);
  ASSERT_TRUE(co.ok()) << co.status();
  EXPECT_NEAR(co->step_time_s, co->encoder_module.compute_s + co->llm_module.compute_s, 1e-9);
  // Half the rate, twice the time.
  c.peak_tflops = {{"float32", 0.5e-3}};
  auto slow = Estimate(Spec({"placement=colocated", "llm.layout.tp=1"}), c);
  ASSERT_TRUE(slow.ok());
  EXPECT_NEAR(slow->step_time_s, 2 * co->step_time_s, 1e-9);
}

TEST(EstimateTest, EachModuleTakesItsOwnComputeConstants) {
  // Colocated, tp 1, four waves of one sample and four encoder jobs of one image; compute free
  // but for the overheads: the encoder's 1 ms and the LLM's 2 ms per layer (2 layers each) and
  // call: 4 x 2 x 1 ms and 4 x 2 x 2 ms, the step their sum.
  ClusterSpec c = FreeCluster();
  c.layer_overhead_s = 5e-3;  // neither module uses the cluster's
  c.encoder_compute.layer_overhead_s = 1e-3;
  c.llm_compute.layer_overhead_s = 2e-3;
  auto e = Estimate(Spec({"placement=colocated", "llm.layout.tp=1"}), c);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_NEAR(e->encoder_module.compute_s, 0.008, 1e-9);
  EXPECT_NEAR(e->llm_module.compute_s, 0.016, 1e-9);
  EXPECT_NEAR(e->step_time_s, 0.024, 1e-9);

  // At 1 GFLOP/s without overheads, the LLM's half efficiency doubles its compute only.
  ClusterSpec rate = FreeCluster();
  rate.peak_tflops = {{"float32", 1e-3}};
  auto full = Estimate(Spec({"placement=colocated", "llm.layout.tp=1"}), rate);
  rate.llm_compute.compute_efficiency = 0.5;
  auto half = Estimate(Spec({"placement=colocated", "llm.layout.tp=1"}), rate);
  ASSERT_TRUE(full.ok() && half.ok());
  EXPECT_GT(full->llm_module.compute_s, 0);
  EXPECT_NEAR(half->llm_module.compute_s, 2 * full->llm_module.compute_s, 1e-12);
  EXPECT_NEAR(half->encoder_module.compute_s, full->encoder_module.compute_s, 1e-12);
}

TEST(EstimateTest, AttentionCallOverheadPerExtraRunOfLengths) {
  // Two waves of two samples; 1 ms per layer (2 layers) for each attention call of a microbatch
  // beyond its first, compute otherwise free.
  ClusterSpec c = FreeCluster();
  c.llm_compute.attention_call_overhead_s = 1e-3;
  const v1::RunSpec spec = Spec({"placement=colocated", "llm.layout.tp=1", "run.micro_batch=2"});
  // Samples of one length: one call per layer, nothing added.
  auto equal = EstimateOverBatches(spec, {Batch(4)}, c);
  ASSERT_TRUE(equal.ok()) << equal.status();
  EXPECT_NEAR(equal->llm_module.compute_s, 0, 1e-9);
  // Four lengths: two calls per layer and wave, 2 waves x 2 layers x 1 ms.
  std::vector<SampleDescriptor> distinct;
  for (int64_t i = 0; i < 4; ++i) distinct.push_back(MakeSample(i, 1, 16, 40 + i, 20));
  auto mixed = EstimateOverBatches(spec, {distinct}, c);
  ASSERT_TRUE(mixed.ok()) << mixed.status();
  EXPECT_NEAR(mixed->llm_module.compute_s, 0.004, 1e-9);
  // Under context parallelism each sample is its own call, equal lengths too.
  auto cp = EstimateOverBatches(
      Spec({"placement=non_colocated", "llm.layout.tp=1", "llm.layout.cp=2", "run.micro_batch=2"}),
      {Batch(4)}, c);
  ASSERT_TRUE(cp.ok()) << cp.status();
  EXPECT_NEAR(cp->llm_module.compute_s, 0.004, 1e-9);
}

TEST(EstimateTest, FrozenEncoderDropsItsBackward) {
  // As BoundaryLatencyPerMessageEachWay, with the encoder frozen: the gradients stay on the LLM,
  // so only the four forward messages of 1 ms remain.
  ClusterSpec c = FreeCluster();
  c.intra_node.p2p_latency_s = 1e-3;
  auto e = Estimate(Spec({"placement=colocated", "llm.layout.tp=1", "encoder.frozen=true"}), c);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_NEAR(e->boundary_s, 0.004, 1e-9);
  EXPECT_NEAR(e->step_time_s, 0.004, 1e-6);

  // State: a frozen parameter holds its value only (4 bytes), a trained one value, gradient and
  // two moments (16). The tiny encoder has 88768 parameters (EncoderTest checks the count
  // against the model); its projector 64 x 64 + 64 + 64 x 64 + 64 = 8320.
  const ClusterSpec free = FreeCluster();
  const double gib = 1 << 30;
  auto trained = Estimate(Spec({"llm.layout.tp=1"}), free);
  auto frozen = Estimate(Spec({"llm.layout.tp=1", "encoder.frozen=true"}), free);
  auto projector = Estimate(
      Spec({"llm.layout.tp=1", "encoder.frozen=true", "encoder.train_projector=true"}), free);
  ASSERT_TRUE(trained.ok() && frozen.ok() && projector.ok());
  EXPECT_NEAR(trained->encoder_module.state_gib, 88768.0 * 16 / gib, 1e-12);
  EXPECT_NEAR(frozen->encoder_module.state_gib, 88768.0 * 4 / gib, 1e-12);
  EXPECT_NEAR(projector->encoder_module.state_gib, (8320.0 * 16 + 80448.0 * 4) / gib, 1e-12);
  // Activations: a frozen job keeps its output rows only (16 patches x 64 x 4 bytes per image).
  EXPECT_NEAR(frozen->encoder_module.activation_gib, 2 * 16.0 * 64 * 4 / gib, 1e-12);
  EXPECT_LT(frozen->encoder_module.activation_gib, projector->encoder_module.activation_gib);
  EXPECT_LT(projector->encoder_module.activation_gib, trained->encoder_module.activation_gib);

  // Compute at 1 GFLOP/s: the frozen encoder runs its forward FLOPs only, the projector variant
  // adds the projector's backward. No DP all-reduce for the frozen encoder at dp 2.
  ClusterSpec slow = FreeCluster();
  slow.peak_tflops = {{"float32", 1e-3}};
  slow.intra_node.collective_gbps = 1;
  slow.intra_node.collective_latency_s = 1e-3;
  auto t = Estimate(Spec({"llm.layout.tp=1", "encoder.layout.dp=2"}), slow);
  auto f = Estimate(Spec({"llm.layout.tp=1", "encoder.layout.dp=2", "encoder.frozen=true"}), slow);
  ASSERT_TRUE(t.ok() && f.ok());
  // Per image (16 patches, h 64, MLP 128): patch embedding 2 x 16 x 192 x 64 = 393216; a layer
  // 393216 + 2 x 32768 + 131072 + 524288 = 1114112, two 2228224; projector 262144. Forward
  // 2883584; trained backward 393216 + 2 x 2490368. Four images.
  EXPECT_DOUBLE_EQ(f->encoder_module.flops, 4 * 2883584.0);
  EXPECT_DOUBLE_EQ(t->encoder_module.flops, 4 * (2883584.0 + 393216.0 + 2 * 2490368.0));
  EXPECT_LT(f->encoder_module.compute_s, 0.5 * t->encoder_module.compute_s);
  EXPECT_GT(t->encoder_module.dp_collective_s, 0);
  EXPECT_EQ(f->encoder_module.dp_collective_s, 0);
  EXPECT_EQ(f->encoder_module.optimizer_s, 0);
}

TEST(EstimateTest, ActivationMemoryByHand) {
  // LLM tp 1, one microbatch of 1 x 128 positions at float32 (Korthikanti et al.: per layer
  // s b h 34 bytes at 16 bits, doubled for 32, with no s x s scores kept by flash attention):
  // 128 x 64 x 34 x 2 = 557056 bytes a layer, two layers; logits and their gradient in fp32:
  // 2 x 128 x 256 x 4 = 262144.
  auto e = Estimate(Spec({"llm.layout.tp=1"}), FreeCluster());
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_NEAR(e->llm_module.activation_gib, (2 * 557056.0 + 262144.0) / (1 << 30), 1e-12);
  // Weights, gradients and two fp32 moments: 4 values of 4 bytes per parameter.
  EXPECT_NEAR(e->llm_module.state_gib, 106816.0 * 16 / (1 << 30), 1e-12);
}

TEST(EstimateTest, RefusesWhatTheClusterCannotHold) {
  ClusterSpec c = FreeCluster();
  c.devices_per_node = 2;
  c.nodes = 1;
  auto e = Estimate(Spec({}), c);  // 3 ranks on 2 devices
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(e.status().message().find("needs 3 devices"), std::string::npos) << e.status();
  c.share_devices = true;  // a CPU: ranks share the cores
  EXPECT_TRUE(Estimate(Spec({}), c).ok());
}

// A small encoder against a large LLM: a 0.6B-class ViT (hidden 1280, 32 layers, 16 heads, MLP
// 5120, 14-pixel patches of 448-pixel images: 1024 patches, the size of Qwen2-VL's ViT) and a
// Llama-2-7B-class LLM (hidden 4096, 32 layers, 32 heads, SwiGLU 11008, vocabulary 32000) at
// 8192 positions, bfloat16; four images per sample.
v1::RunSpec SmallVitLargeLlm() {
  return Spec({"encoder.model.image_size=448",
               "encoder.model.patch=14",
               "encoder.model.hidden=1280",
               "encoder.model.layers=32",
               "encoder.model.heads=16",
               "encoder.model.mlp=5120",
               "encoder.model.out_hidden=4096",
               "llm.model.hidden=4096",
               "llm.model.layers=32",
               "llm.model.heads=32",
               "llm.model.kv_heads=32",
               "llm.model.ffn=11008",
               "llm.model.vocab=32000",
               "llm.model.seq_len=8192",
               "run.dtype=bfloat16",
               "run.global_batch=32",
               "run.micro_batch=1",
               "llm.layout.tp=8",
               "llm.layout.dp=2",
               "encoder.layout.tp=8",
               "encoder.layout.dp=2",
               "placement=colocated"});
}

TEST(SearchTest, PrefersASmallerEncoderTpWhenTheEncoderIsSmall) {
  const v1::RunSpec spec = SmallVitLargeLlm();
  std::vector<SampleDescriptor> batch;
  for (int64_t i = 0; i < 32; ++i) {
    batch.push_back(MakeSample(i, 4, 1024, 1000 + 60 * i, 800));
  }
  // 80 GiB devices: the LLM needs TP 4 or more, which the small encoder does not.
  auto cluster = ClusterPreset("h100-sxm");
  ASSERT_TRUE(cluster.ok());
  SearchOptions options;
  options.devices = 16;
  auto result = SearchLayouts(spec, {batch}, *cluster, options);
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_FALSE(result->ranked.empty());
  ASSERT_GE(result->best_homogeneous, 0);
  const Candidate& best = result->ranked.front();
  EXPECT_LT(best.estimate.encoder.tp, best.estimate.llm.tp)
      << best.kind << " encoder " << best.estimate.encoder.ToString() << " llm "
      << best.estimate.llm.ToString();
  EXPECT_NE(best.kind, "homogeneous");
  const StepEstimate& homogeneous = result->ranked[result->best_homogeneous].estimate;
  EXPECT_EQ(homogeneous.encoder.tp, homogeneous.llm.tp);
  EXPECT_EQ(homogeneous.encoder.dp, homogeneous.llm.dp);
  EXPECT_GT(best.estimate.tokens_per_s_per_device, homogeneous.tokens_per_s_per_device);
  for (const Candidate& c : result->ranked) {
    EXPECT_EQ(c.estimate.devices, 16);
    EXPECT_TRUE(c.estimate.fits_memory);
    EXPECT_LE(c.estimate.memory_gib_per_device, cluster->memory_gib);
    // The 7B LLM's weights, gradients and AdamW state (18 bytes a parameter at bfloat16, about
    // 113 GiB) do not fit one 80 GiB device: no candidate leaves it unsharded.
    EXPECT_GT(c.estimate.llm.tp * c.estimate.llm.pp, 1);
  }
  EXPECT_GT(result->over_memory, 0);
  // Ranked by tokens/s per device, best first.
  for (size_t i = 1; i < result->ranked.size(); ++i) {
    EXPECT_GE(result->ranked[i - 1].estimate.tokens_per_s_per_device,
              result->ranked[i].estimate.tokens_per_s_per_device);
  }
}

// With --max-cp 2 the LLM's context-parallel layouts are candidates too, and runnable.
TEST(SearchTest, ContextParallelCandidatesWithMaxCp) {
  const v1::RunSpec spec = SmallVitLargeLlm();
  std::vector<SampleDescriptor> batch;
  for (int64_t i = 0; i < 32; ++i) batch.push_back(MakeSample(i, 4, 1024, 1000 + 60 * i, 800));
  auto cluster = ClusterPreset("h200-sxm");
  ASSERT_TRUE(cluster.ok());
  SearchOptions options;
  options.devices = 16;
  auto plain = SearchLayouts(spec, {batch}, *cluster, options);
  options.max_cp = 2;
  auto with_cp = SearchLayouts(spec, {batch}, *cluster, options);
  ASSERT_TRUE(plain.ok() && with_cp.ok());
  int64_t cp2 = 0;
  for (const Candidate& c : plain->ranked) EXPECT_EQ(c.estimate.llm.cp, 1);
  for (const Candidate& c : with_cp->ranked) {
    EXPECT_EQ(c.estimate.devices, 16);
    if (c.estimate.llm.cp == 2) {
      ++cp2;
      EXPECT_TRUE(c.runnable) << c.why;
      EXPECT_EQ(c.estimate.llm.size(), c.estimate.llm.dp * c.estimate.llm.tp * 2);
    }
  }
  EXPECT_GT(cp2, 0);
  EXPECT_GT(with_cp->considered, plain->considered);
}

}  // namespace
}  // namespace hetpar::plan
