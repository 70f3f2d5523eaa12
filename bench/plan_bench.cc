// Step planning at cluster scale: an LLM of 2048 ranks (dp 32 x tp 8 x cp 2 x pp 4) fed by an
// encoder pool of 1024 ranks (dp 512 x tp 2), a global batch of 4096 samples with 0-8 images of
// 576 tokens each (336 px, patch 14), text 64-2048 tokens, seq_len 8192, micro_batch 1 (128
// waves), bfloat16 rows of hidden 8192. The goal is a full step plan in <= 50 ms on one core.
//
//   build/bench/plan_bench --benchmark_format=json
//
// Counters: the plan's size (transfers, pieces, share steps, approximate bytes in memory) and
// its balance (max / mean). BM_SortBaseline sorts as many 64-bit keys as the plan has pieces:
// a same-run yardstick for this machine's speed.
#include <algorithm>
#include <random>
#include <vector>

#include "benchmark/benchmark.h"
#include "common/plan/step_plan.h"
#include "common/plan/synthetic_batch.h"

namespace hetpar::plan {
namespace {

struct Setup {
  Placement placement;
  StepPlanOptions options;
  std::vector<SampleDescriptor> samples;
};

Setup MakeSetup(bool sequence_parallel) {
  Layout encoder;
  encoder.dp = 512;
  encoder.tp = 2;
  Layout llm;
  llm.dp = 32;
  llm.tp = 8;
  llm.cp = 2;
  llm.pp = 4;
  llm.sequence_parallel = sequence_parallel;
  Setup setup;
  setup.placement = *MakePlacement(PlacementKind::kNonColocated, encoder, llm);

  hetpar::v1::EncoderModel vit;  // ViT-L/14 at 336 px with a projector to 8192
  vit.set_hidden(1024);
  vit.set_layers(24);
  vit.set_heads(16);
  vit.set_mlp(4096);
  vit.set_out_hidden(8192);
  hetpar::v1::LlmModel lm;  // 70B class
  lm.set_hidden(8192);
  lm.set_layers(80);
  lm.set_heads(64);
  lm.set_kv_heads(8);
  lm.set_ffn(28672);
  lm.set_vocab(128256);

  StepPlanOptions& o = setup.options;
  o.step = 17;
  o.generation = 1;
  o.seed = 42;
  o.micro_batch = 1;
  o.waves = 4096 / (o.micro_batch * llm.dp);
  o.seq_len = 8192;
  o.row_bytes = 8192 * 2;
  o.encoder_cost = EncoderCostModel(vit);
  o.llm_cost = LlmCostModel(lm);

  SyntheticBatchOptions batch;
  batch.samples = 4096;
  batch.first_id = o.step * batch.samples;
  batch.min_images = 0;
  batch.max_images = 8;
  batch.tokens_per_image = 576;
  batch.min_text_tokens = 64;
  batch.max_text_tokens = 2048;
  batch.seq_len = o.seq_len;
  batch.seed = 7;
  setup.samples = *SyntheticBatch(batch);
  return setup;
}

template <typename T>
int64_t VectorBytes(const std::vector<T>& v) {
  return static_cast<int64_t>(v.capacity() * sizeof(T));
}

int64_t ApproximatePlanBytes(const StepPlan& plan) {
  int64_t bytes = sizeof(StepPlan) + VectorBytes(plan.samples);
  for (const SampleDescriptor& s : plan.samples) bytes += VectorBytes(s.image_starts);
  bytes += VectorBytes(plan.llm.microbatches) + VectorBytes(plan.llm.sample_replica) +
           VectorBytes(plan.llm.sample_wave) + VectorBytes(plan.llm.replica_cost);
  for (const LlmMicrobatch& mb : plan.llm.microbatches) bytes += VectorBytes(mb.samples);
  bytes += VectorBytes(plan.encoder.jobs) + VectorBytes(plan.encoder.image_base) +
           VectorBytes(plan.encoder.image_job) + VectorBytes(plan.encoder.image_row_offset);
  for (const EncoderJob& job : plan.encoder.jobs) {
    bytes += VectorBytes(job.images) + VectorBytes(job.row_offsets);
  }
  const BoundaryPlan& b = plan.boundary;
  for (const auto* transfers : {&b.forward, &b.backward}) {
    bytes += VectorBytes(*transfers);
    for (const Transfer& t : *transfers) bytes += VectorBytes(t.pieces);
  }
  bytes += VectorBytes(b.forward_by_dst) + VectorBytes(b.backward_by_dst) +
           VectorBytes(b.block_sender) + VectorBytes(b.llm_buffer_rows);
  for (const auto* shares : {&b.llm_shares, &b.encoder_shares}) {
    bytes += VectorBytes(*shares);
    for (const ShareStep& s : *shares) bytes += VectorBytes(s.ranks) + VectorBytes(s.segments);
  }
  return bytes;
}

void ReportPlan(benchmark::State& state, const StepPlan& plan) {
  const PlanStats stats = ComputePlanStats(plan);
  state.counters["samples"] = static_cast<double>(plan.samples.size());
  state.counters["images"] = static_cast<double>(stats.images);
  state.counters["transfers"] = static_cast<double>(plan.boundary.forward.size());
  state.counters["pieces"] = static_cast<double>(stats.pieces);
  state.counters["share_steps"] = static_cast<double>(stats.share_steps);
  state.counters["plan_MiB"] = static_cast<double>(ApproximatePlanBytes(plan)) / (1 << 20);
  state.counters["boundary_GiB"] = static_cast<double>(stats.boundary_bytes) / (1 << 30);
  state.counters["llm_imbalance"] = stats.llm_imbalance;
  state.counters["enc_step_imbalance"] = stats.encoder_step_imbalance;
  state.counters["enc_worst_wave_imbalance"] = stats.encoder_worst_wave_imbalance;
  state.counters["send_imbalance"] = stats.send_imbalance;
}

void BM_BuildStepPlan(benchmark::State& state) {
  const Setup setup = MakeSetup(state.range(0) != 0);
  StepPlan last;
  for (auto _ : state) {
    auto plan = BuildStepPlan(setup.placement, setup.samples, setup.options);
    if (!plan.ok()) {
      state.SkipWithError(std::string(plan.status().message()).c_str());
      return;
    }
    benchmark::DoNotOptimize(plan->boundary.forward.data());
    last = std::move(*plan);
  }
  ReportPlan(state, last);
}
BENCHMARK(BM_BuildStepPlan)->ArgName("sp")->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond);

// Every worker's part, as the coordinator cuts it after planning.
void BM_ExtractAllRankPlans(benchmark::State& state) {
  const Setup setup = MakeSetup(state.range(0) != 0);
  const StepPlan plan = *BuildStepPlan(setup.placement, setup.samples, setup.options);
  int64_t transfers = 0;
  for (auto _ : state) {
    transfers = 0;
    for (int64_t rank = 0; rank < plan.placement.world_size; ++rank) {
      auto part = ExtractRankPlan(plan, rank);
      transfers += static_cast<int64_t>(part->forward_sends.size() + part->forward_receives.size());
      benchmark::DoNotOptimize(part->samples.data());
    }
  }
  state.counters["ranks"] = static_cast<double>(plan.placement.world_size);
  state.counters["transfers_seen"] = static_cast<double>(transfers);
}
BENCHMARK(BM_ExtractAllRankPlans)->ArgName("sp")->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond);

void BM_PlanStats(benchmark::State& state) {
  const Setup setup = MakeSetup(false);
  const StepPlan plan = *BuildStepPlan(setup.placement, setup.samples, setup.options);
  for (auto _ : state) {
    PlanStats stats = ComputePlanStats(plan);
    benchmark::DoNotOptimize(stats.links.data());
  }
}
BENCHMARK(BM_PlanStats)->Unit(benchmark::kMillisecond);

// Yardstick: std::sort of 64-bit keys, as many as the sp=0 plan has pieces.
void BM_SortBaseline(benchmark::State& state) {
  const Setup setup = MakeSetup(false);
  const StepPlan plan = *BuildStepPlan(setup.placement, setup.samples, setup.options);
  const int64_t n = ComputePlanStats(plan).pieces;
  std::mt19937_64 rng(1);
  std::vector<uint64_t> keys(n);
  for (auto& k : keys) k = rng();
  std::vector<uint64_t> work;
  for (auto _ : state) {
    work = keys;
    std::sort(work.begin(), work.end());
    benchmark::DoNotOptimize(work.data());
  }
  state.counters["keys"] = static_cast<double>(n);
}
BENCHMARK(BM_SortBaseline)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace hetpar::plan

BENCHMARK_MAIN();
