// `hetpar plan`: show the step plan of a config before launching it. The layouts, which ranks
// talk to which over the boundary, each rank's load and the imbalance, as text or JSON.
//
// The batch is synthetic and seeded: sample ids step x global_batch onwards (modulo --samples),
// each with a uniform number of images (--images-per-sample) of the config's tokens per image
// and a uniform text length (--text-tokens).
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/config/config.h"
#include "common/data/batch_source.h"
#include "common/plan/cluster.h"
#include "common/plan/estimate.h"
#include "common/plan/search.h"
#include "common/plan/sequence_sharding.h"
#include "common/plan/step_plan.h"
#include "common/plan/synthetic_batch.h"
#include "coordinator/cli/commands.h"
#include "nlohmann/json.hpp"

namespace hetpar::cli {
namespace {

using plan::Layout;
using plan::PlanStats;
using plan::StepPlan;

struct Range {
  int64_t lo = 0;
  int64_t hi = 0;
};

// "A-B" or "A" (A = B), non-negative, A <= B.
absl::StatusOr<Range> ParseRange(const std::string& flag, const std::string& text) {
  std::vector<std::string> parts = absl::StrSplit(text, '-');
  Range range;
  bool ok = (parts.size() == 1 || parts.size() == 2) && absl::SimpleAtoi(parts[0], &range.lo);
  range.hi = range.lo;
  if (ok && parts.size() == 2) ok = absl::SimpleAtoi(parts[1], &range.hi);
  if (!ok || range.lo < 0 || range.hi < range.lo) {
    return absl::InvalidArgumentError(absl::StrCat(
        flag, " ", text, " is not a range; expected MIN-MAX or N with 0 <= MIN <= MAX, e.g. 0-3"));
  }
  return range;
}

std::string Bytes(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024 && unit < 4) {
    value /= 1024;
    ++unit;
  }
  char text[32];
  std::snprintf(text, sizeof(text), unit == 0 ? "%.0f %s" : "%.1f %s", value, units[unit]);
  return text;
}

// Floating-point operations with a unit: "12.3 GFLOP".
std::string Flops(double flops) {
  const char* units[] = {"FLOP", "kFLOP", "MFLOP", "GFLOP", "TFLOP", "PFLOP", "EFLOP"};
  int unit = 0;
  while (flops >= 1000 && unit < 6) {
    flops /= 1000;
    ++unit;
  }
  char text[48];
  std::snprintf(text, sizeof(text), "%.1f %s", flops, units[unit]);
  return text;
}

std::string Fixed(double value, int digits) {
  char text[48];
  std::snprintf(text, sizeof(text), "%.*f", digits, value);
  return text;
}

// "32-47, 64, 66-67": sorted ranks as ranges.
std::string RankRanges(std::vector<int64_t> ranks) {
  std::sort(ranks.begin(), ranks.end());
  std::vector<std::string> parts;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    parts.push_back(j == i ? absl::StrCat(ranks[i]) : absl::StrCat(ranks[i], "-", ranks[j]));
    i = j + 1;
  }
  return absl::StrJoin(parts, ", ");
}

std::string EncoderCoords(const Layout& l, int64_t rank) {
  const plan::RankCoords c = l.CoordsOf(rank);
  return absl::StrCat("enc dp", c.dp, " tp", c.tp);
}

std::string LlmCoords(const Layout& l, int64_t rank) {
  const plan::RankCoords c = l.CoordsOf(rank);
  return absl::StrCat("llm dp", c.dp, " tp", c.tp, " cp", c.cp, " pp", c.pp);
}

std::string RoleText(const plan::Placement& p, int64_t rank) {
  std::vector<std::string> roles;
  if (p.encoder.Contains(rank)) roles.push_back(EncoderCoords(p.encoder, rank));
  if (p.llm.Contains(rank)) roles.push_back(LlmCoords(p.llm, rank));
  return absl::StrJoin(roles, " + ");
}

struct Options {
  std::string config;
  std::vector<std::string> overrides;
  int64_t step = 0;
  int64_t generation = 0;
  bool json = false;
  std::string images_per_sample = "0-3";
  std::string text_tokens;
  int64_t samples = 0;
  int64_t data_seed = -1;
  int64_t wave = -1;
  // The planner.
  bool estimate = false;
  bool search = false;
  std::string cluster = "h100-sxm";
  int64_t gpus = 0;
  int64_t top = 5;
  int64_t estimate_steps = 4;
  bool from_data = false;
  int64_t max_pp = 1;
  int64_t max_cp = 1;
  std::string placements = "all";
};

// Everything the printers need besides the plan.
struct Context {
  std::string config;
  Range images;
  Range text;
  int64_t dataset_size = 0;
  uint64_t data_seed = 0;
  int64_t tokens_per_image = 0;
  int64_t llm_layers = 0;
  std::string manifest;  // --from-data: the data set the batch comes from; empty: synthetic
};

// "[0, 32) + [96, 128)": the positions a CP rank holds.
std::string RangesText(const std::vector<plan::PositionRange>& ranges) {
  std::vector<std::string> parts;
  for (const plan::PositionRange& r : ranges)
    parts.push_back(absl::StrCat("[", r.begin, ", ", r.end, ")"));
  return absl::StrJoin(parts, " + ");
}

// The LLM's sequence split over CP ranks and its layers over PP stages, when there are any.
void PrintShardsAndStages(const StepPlan& p, const Context& ctx) {
  const plan::Layout& llm = p.placement.llm;
  if (llm.cp > 1) {
    auto sharding = plan::SequenceSharding::Create(p.options.seq_len, llm.cp, 1, false);
    if (sharding.ok()) {
      std::vector<std::string> held;
      for (int64_t c = 0; c < llm.cp; ++c) {
        held.push_back(absl::StrCat("cp", c, " ", RangesText(sharding->Ranges(c, 0))));
      }
      std::cout << "cp shards  positions of each sequence (padded to " << p.options.seq_len
                << "): " << absl::StrJoin(held, "; ") << "\n";
    }
  }
  if (llm.pp > 1 && ctx.llm_layers > 0) {
    std::vector<std::string> stages;
    for (int64_t s = 0; s < llm.pp; ++s) {
      const auto [first, last] = plan::PipelineStageLayers(ctx.llm_layers, llm.pp, s);
      stages.push_back(absl::StrCat("pp", s, " layers [", first, ", ", last, ")"));
    }
    std::cout << "pp stages  " << absl::StrJoin(stages, "; ")
              << "; image rows land on stage 0, the loss on stage " << llm.pp - 1 << "\n";
  }
}

nlohmann::ordered_json LayoutJson(const Layout& l) {
  return {{"dp", l.dp},
          {"tp", l.tp},
          {"cp", l.cp},
          {"pp", l.pp},
          {"sequence_parallel", l.sequence_parallel},
          {"first_rank", l.rank_offset},
          {"ranks", l.size()}};
}

nlohmann::ordered_json TransferJson(const plan::Transfer& t, const StepPlan& p) {
  nlohmann::ordered_json pieces = nlohmann::ordered_json::array();
  for (const plan::BlockPiece& piece : t.pieces) {
    pieces.push_back({{"sample_id", p.samples[piece.sample].id},
                      {"image", piece.image},
                      {"row_begin", piece.row_begin},
                      {"rows", piece.rows},
                      {"src_offset", piece.src_offset},
                      {"dst_offset", piece.dst_offset}});
  }
  return {{"wave", t.wave},
          {"src_rank", t.src_rank},
          {"dst_rank", t.dst_rank},
          {"rows", t.rows},
          {"bytes", t.rows * p.options.row_bytes},
          {"pieces", pieces}};
}

void PrintJson(const StepPlan& p, const PlanStats& stats, const Context& ctx, int64_t wave) {
  nlohmann::ordered_json out;
  out["config"] = ctx.config;
  out["step"] = p.step;
  out["generation"] = p.generation;
  out["placement"] = std::string(plan::PlacementKindName(p.placement.kind));
  out["world_size"] = p.placement.world_size;
  out["encoder"] = LayoutJson(p.placement.encoder);
  out["llm"] = LayoutJson(p.placement.llm);
  out["batch"] = {{"samples", p.samples.size()},
                  {"images", stats.images},
                  {"image_rows", stats.image_rows},
                  {"n_global", p.n_global},
                  {"waves", p.llm.waves},
                  {"micro_batch", p.llm.micro_batch},
                  {"seq_len", p.options.seq_len},
                  {"row_bytes", p.options.row_bytes}};
  if (ctx.manifest.empty()) {
    out["batch"]["synthetic"] = {{"images_per_sample", {ctx.images.lo, ctx.images.hi}},
                                 {"text_tokens", {ctx.text.lo, ctx.text.hi}},
                                 {"tokens_per_image", ctx.tokens_per_image},
                                 {"dataset_size", ctx.dataset_size},
                                 {"seed", ctx.data_seed}};
  } else {
    out["batch"]["from_data"] = ctx.manifest;
  }
  out["boundary"] = {{"messages", stats.messages},
                     {"pieces", stats.pieces},
                     {"bytes", stats.boundary_bytes},
                     {"llm_share_steps", p.boundary.llm_shares.size()},
                     {"encoder_share_steps", p.boundary.encoder_shares.size()}};
  out["imbalance"] = {{"llm_replicas", stats.llm_imbalance},
                      {"encoder_replicas_step", stats.encoder_step_imbalance},
                      {"encoder_worst_wave", stats.encoder_worst_wave_imbalance},
                      {"encoder_mean_wave", stats.encoder_mean_wave_imbalance},
                      {"encoder_send_bytes", stats.send_imbalance},
                      {"llm_receive_bytes", stats.receive_imbalance}};
  nlohmann::ordered_json replicas = nlohmann::ordered_json::array();
  for (int64_t d = 0; d < p.llm.replicas; ++d) {
    nlohmann::ordered_json waves = nlohmann::ordered_json::array();
    int64_t tokens = 0;
    for (int64_t m = 0; m < p.llm.waves; ++m) {
      std::vector<int64_t> ids;
      for (int64_t s : p.llm.At(d, m).samples) ids.push_back(p.samples[s].id);
      waves.push_back(ids);
      tokens += p.llm.At(d, m).tokens;
    }
    replicas.push_back({{"replica", d},
                        {"cost_gflop", p.llm.replica_cost[d] / 1e9},
                        {"tokens", tokens},
                        {"sample_ids_by_wave", waves}});
  }
  out["llm_replicas"] = replicas;
  nlohmann::ordered_json encoders = nlohmann::ordered_json::array();
  for (int64_t e = 0; e < p.encoder.replicas; ++e) {
    const auto [begin, end] = p.encoder.JobsOf(e);
    nlohmann::ordered_json jobs = nlohmann::ordered_json::array();
    for (int64_t j = begin; j < end; ++j) {
      const plan::EncoderJob& job = p.encoder.jobs[j];
      nlohmann::ordered_json images = nlohmann::ordered_json::array();
      for (const plan::ImageRef& ref : job.images) {
        images.push_back({p.samples[ref.sample].id, ref.image});
      }
      jobs.push_back({{"wave", job.wave}, {"rows", job.rows}, {"images", images}});
    }
    encoders.push_back(
        {{"replica", e}, {"cost_gflop", p.encoder.replica_cost[e] / 1e9}, {"jobs", jobs}});
  }
  out["encoder_replicas"] = encoders;
  nlohmann::ordered_json ranks = nlohmann::ordered_json::array();
  for (const plan::RankLoad& r : stats.ranks) {
    ranks.push_back({{"rank", r.rank},
                     {"role", RoleText(p.placement, r.rank)},
                     {"encoder_gflop", r.encoder_cost / 1e9},
                     {"images", r.images},
                     {"llm_tokens", r.llm_tokens},
                     {"bytes_sent", r.bytes_sent},
                     {"bytes_received", r.bytes_received},
                     {"messages_sent", r.messages_sent},
                     {"messages_received", r.messages_received},
                     {"share_bytes_sent", r.share_bytes_sent}});
  }
  out["ranks"] = ranks;
  nlohmann::ordered_json links = nlohmann::ordered_json::array();
  for (const plan::Link& l : stats.links) {
    links.push_back({{"src_rank", l.src_rank},
                     {"dst_rank", l.dst_rank},
                     {"bytes", l.bytes},
                     {"messages", l.messages}});
  }
  out["links"] = links;
  if (wave >= 0) {
    nlohmann::ordered_json transfers = nlohmann::ordered_json::array();
    for (const plan::Transfer& t : p.boundary.forward) {
      if (t.wave == wave) transfers.push_back(TransferJson(t, p));
    }
    out["wave"] = {{"wave", wave}, {"forward_transfers", transfers}};
  }
  std::cout << out.dump(2) << "\n";
}

void PrintText(const StepPlan& p, const PlanStats& stats, const Context& ctx, int64_t wave) {
  const plan::Placement& pl = p.placement;
  const int64_t row_bytes = p.options.row_bytes;
  std::cout << "hetpar plan: " << ctx.config << ", step " << p.step << ", generation "
            << p.generation << "\n\n";
  std::cout << "placement  " << plan::PlacementKindName(pl.kind) << ", " << pl.world_size
            << " ranks\n";
  std::cout << "encoder    " << pl.encoder.ToString() << "; " << ctx.tokens_per_image
            << " tokens per image\n";
  std::cout << "llm        " << pl.llm.ToString() << "; seq_len " << p.options.seq_len
            << ", micro_batch " << p.llm.micro_batch << ", " << p.llm.waves << " waves\n";
  PrintShardsAndStages(p, ctx);
  if (ctx.manifest.empty()) {
    std::cout << "batch      " << p.samples.size() << " synthetic samples (" << ctx.images.lo
              << "-" << ctx.images.hi << " images, " << ctx.text.lo << "-" << ctx.text.hi
              << " text tokens, dataset of " << ctx.dataset_size << ", seed " << ctx.data_seed
              << "): ";
  } else {
    std::cout << "batch      " << p.samples.size() << " samples of step " << p.step << " from "
              << ctx.manifest << ": ";
  }
  std::cout << stats.images << " images, " << stats.image_rows << " image rows, N_global "
            << p.n_global << " loss tokens\n";
  if (p.options.image_gradients) {
    std::cout << "boundary   " << stats.messages << " messages forward and " << stats.messages
              << " backward, " << stats.pieces << " pieces, " << Bytes(stats.boundary_bytes)
              << " each way (";
  } else {
    std::cout << "boundary   " << stats.messages
              << " messages forward and none backward (the encoder is frozen), " << stats.pieces
              << " pieces, " << Bytes(stats.boundary_bytes) << " forward (";
  }
  std::cout << Bytes(row_bytes) << " per row); " << p.boundary.llm_shares.size() << " LLM and "
            << p.boundary.encoder_shares.size() << " encoder share steps\n";
  std::cout << "imbalance  (max / mean) LLM replicas " << Fixed(stats.llm_imbalance, 3)
            << "; encoder replicas " << Fixed(stats.encoder_step_imbalance, 3) << " over the step, "
            << Fixed(stats.encoder_mean_wave_imbalance, 3) << " per wave on average, "
            << Fixed(stats.encoder_worst_wave_imbalance, 3)
            << " in the worst wave; bytes sent per encoder rank " << Fixed(stats.send_imbalance, 3)
            << ", received per first-stage LLM rank " << Fixed(stats.receive_imbalance, 3) << "\n";

  std::cout << "\nLLM replicas\n";
  const bool small = p.llm.replicas * p.llm.waves <= 32;
  for (int64_t d = 0; d < p.llm.replicas; ++d) {
    int64_t tokens = 0;
    int64_t images = 0;
    size_t samples = 0;
    for (int64_t m = 0; m < p.llm.waves; ++m) {
      tokens += p.llm.At(d, m).tokens;
      samples += p.llm.At(d, m).samples.size();
      for (int64_t s : p.llm.At(d, m).samples) images += p.samples[s].image_count();
    }
    std::cout << "  replica " << d << ": " << samples << " samples, " << images << " images, "
              << tokens << " tokens, " << Flops(p.llm.replica_cost[d]) << " forward\n";
    if (!small) continue;
    for (int64_t m = 0; m < p.llm.waves; ++m) {
      if (p.llm.At(d, m).samples.empty()) continue;  // a replica taking one wave fewer
      std::vector<std::string> items;
      for (int64_t s : p.llm.At(d, m).samples) {
        items.push_back(absl::StrCat("sample ", p.samples[s].id, " (", p.samples[s].image_count(),
                                     " img, ", p.samples[s].sequence_length(), " tok)"));
      }
      std::cout << "    wave " << m << ": " << absl::StrJoin(items, ", ") << "\n";
    }
  }

  std::cout << "\nEncoder replicas\n";
  for (int64_t e = 0; e < p.encoder.replicas; ++e) {
    const auto [begin, end] = p.encoder.JobsOf(e);
    int64_t images = 0;
    int64_t rows = 0;
    for (int64_t j = begin; j < end; ++j) {
      images += static_cast<int64_t>(p.encoder.jobs[j].images.size());
      rows += p.encoder.jobs[j].rows;
    }
    std::cout << "  replica " << e << ": " << images << " images in " << end - begin << " of "
              << p.encoder.waves << " waves, " << rows << " rows, "
              << Flops(p.encoder.replica_cost[e]) << " forward\n";
  }

  std::cout << (p.options.image_gradients
                    ? "\nRoutes (forward over all waves; gradients take each route back)\n"
                    : "\nRoutes (forward over all waves; no gradients come back)\n");
  for (int64_t src = pl.encoder.rank_offset; src < pl.encoder.end_rank(); ++src) {
    std::vector<int64_t> destinations;
    int64_t bytes = 0;
    int64_t messages = 0;
    for (const plan::Link& l : stats.links) {
      if (l.src_rank != src) continue;
      destinations.push_back(l.dst_rank);
      bytes += l.bytes;
      messages += l.messages;
    }
    std::cout << "  rank " << src << " (" << EncoderCoords(pl.encoder, src) << ") -> ";
    if (destinations.empty()) {
      std::cout << "nothing\n";
    } else {
      std::cout << (destinations.size() == 1 ? "rank " : "ranks ") << RankRanges(destinations)
                << ": " << messages << " messages, " << Bytes(bytes) << "\n";
    }
  }

  std::cout << "\nPer-rank load (encoder work is the replica's forward FLOP / tp; tokens are the "
               "LLM replica's)\n";
  char line[256];
  std::snprintf(line, sizeof(line), "  %6s  %-36s %12s %7s %9s %11s %11s %11s\n", "rank", "role",
                "enc work", "images", "tokens", "sent", "received", "shared");
  std::cout << line;
  for (const plan::RankLoad& r : stats.ranks) {
    std::snprintf(line, sizeof(line), "  %6lld  %-36s %12s %7s %9s %11s %11s %11s\n",
                  static_cast<long long>(r.rank), RoleText(pl, r.rank).c_str(),
                  r.encoder_role ? Flops(r.encoder_cost).c_str() : "-",
                  r.encoder_role ? std::to_string(r.images).c_str() : "-",
                  r.llm_role ? std::to_string(r.llm_tokens).c_str() : "-",
                  r.bytes_sent > 0 ? Bytes(r.bytes_sent).c_str() : "-",
                  r.bytes_received > 0 ? Bytes(r.bytes_received).c_str() : "-",
                  r.share_bytes_sent > 0 ? Bytes(r.share_bytes_sent).c_str() : "-");
    std::cout << line;
  }

  if (wave >= 0) {
    std::cout << "\nWave " << wave << " transfers (forward; offsets are rows in the sender's job "
              << "buffer and the receiver's image-row buffer)\n";
    for (const plan::Transfer& t : p.boundary.forward) {
      if (t.wave != wave) continue;
      std::cout << "  rank " << t.src_rank << " -> " << t.dst_rank << ": " << t.rows << " rows\n";
      for (const plan::BlockPiece& piece : t.pieces) {
        std::cout << "    sample " << p.samples[piece.sample].id << " image " << piece.image
                  << " rows [" << piece.row_begin << ", " << piece.row_begin + piece.rows
                  << ") from row " << piece.src_offset << " to row " << piece.dst_offset << "\n";
      }
    }
    for (const plan::ShareStep& s : p.boundary.llm_shares) {
      if (s.wave != wave) continue;
      std::vector<std::string> segments;
      for (const plan::ShareSegment& seg : s.segments) {
        segments.push_back(absl::StrCat("rank ", seg.holder_rank, " rows [", seg.offset, ", ",
                                        seg.offset + seg.rows, ")"));
      }
      std::cout << "  share in llm replica " << s.replica << " cp " << s.cp_rank << " (ranks "
                << RankRanges(s.ranks) << "): " << absl::StrJoin(segments, "; ") << "\n";
    }
  }
}

// "dp 2 x tp 1" without the rank span: the layout of a candidate.
std::string LayoutText(const Layout& l) {
  std::string text = absl::StrCat("dp", l.dp, " tp", l.tp);
  if (l.cp != 1) absl::StrAppend(&text, " cp", l.cp);
  if (l.pp != 1) absl::StrAppend(&text, " pp", l.pp);
  if (l.sequence_parallel && l.tp > 1) absl::StrAppend(&text, " sp");
  return text;
}

nlohmann::ordered_json ModuleJson(const plan::ModuleEstimate& m) {
  return {{"ranks", m.ranks},
          {"parameters", m.parameters},
          {"model_tflop", m.flops / 1e12},
          {"compute_s", m.compute_s},
          {"tp_collective_s", m.tp_collective_s},
          {"cp_collective_s", m.cp_collective_s},
          {"pp_p2p_s", m.pp_p2p_s},
          {"bubble_s", m.bubble_s},
          {"dp_collective_s", m.dp_collective_s},
          {"optimizer_s", m.optimizer_s},
          {"imbalance_s", m.imbalance_s},
          {"busy_s", m.busy_s},
          {"state_gib", m.state_gib},
          {"activation_gib", m.activation_gib}};
}

nlohmann::ordered_json EstimateJson(const plan::StepEstimate& e, const std::string& kind) {
  nlohmann::ordered_json j;
  j["placement"] = kind.empty() ? e.placement : kind;
  j["encoder_layout"] = LayoutText(e.encoder);
  j["llm_layout"] = LayoutText(e.llm);
  j["gpus"] = e.devices;
  j["step_time_s"] = e.step_time_s;
  j["tflops_per_gpu"] = e.tflops_per_device;
  j["tokens_per_s_per_gpu"] = e.tokens_per_s_per_device;
  j["memory_gib_per_gpu"] = e.memory_gib_per_device;
  j["fits_memory"] = e.fits_memory;
  j["tokens_per_step"] = e.tokens;
  j["images_per_step"] = e.images;
  j["boundary_s"] = e.boundary_s;
  j["control_s"] = e.overhead_s;
  j["shared_devices_bound_s"] = e.shared_bound_s;
  j["encoder"] = ModuleJson(e.encoder_module);
  j["llm"] = ModuleJson(e.llm_module);
  j["notes"] = e.notes;
  return j;
}

std::string Gib(double gib) { return Fixed(gib, gib < 10 ? 2 : 1) + " GiB"; }

// Seconds with three significant digits and a unit that fits.
std::string Time(double s) {
  if (s == 0) return "0";
  if (s < 1e-3) return Fixed(s * 1e6, 1) + " us";
  if (s < 1) return Fixed(s * 1e3, 1) + " ms";
  return Fixed(s, 3) + " s";
}

void PrintEstimateText(const plan::StepEstimate& e, const plan::ClusterSpec& cluster,
                       const std::string& config, int64_t steps, bool from_data) {
  std::cout << "hetpar plan --estimate: " << config << " on " << cluster.name
            << (cluster.description.empty() ? "" : " (" + cluster.description + ")") << ", mean of "
            << steps << (steps == 1 ? " step" : " steps") << " ("
            << (from_data ? "batches from the data set" : "synthetic batches") << ")\n\n";
  std::cout << "placement   " << e.placement << ", " << e.devices << " devices\n";
  std::cout << "encoder     " << LayoutText(e.encoder) << "\n";
  std::cout << "llm         " << LayoutText(e.llm) << "\n";
  std::cout << "step time   " << Time(e.step_time_s) << "\n";
  std::cout << "per device  " << Fixed(e.tflops_per_device, e.tflops_per_device < 1 ? 4 : 1)
            << " TFLOPS, " << Fixed(e.tokens_per_s_per_device, 1) << " tokens/s, "
            << Gib(e.memory_gib_per_device) << " of " << Gib(cluster.memory_gib)
            << (e.fits_memory ? "" : " (does not fit)") << "\n";
  std::cout << "step        " << Fixed(e.tokens, 0) << " tokens, " << Fixed(e.images, 0)
            << " images, " << Flops(e.encoder_module.flops) << " encoder + "
            << Flops(e.llm_module.flops) << " LLM (forward + backward)\n";
  std::cout << "\nBreakdown (per step; the busiest replica of each module)\n";
  char line[256];
  std::snprintf(line, sizeof(line), "  %-8s %10s %10s %10s %10s %10s %10s %10s %10s\n", "",
                "compute", "tp", "cp", "pp send", "bubble", "dp", "optimizer", "imbalance");
  std::cout << line;
  for (const auto& [name, m] :
       {std::pair<const char*, const plan::ModuleEstimate*>{"encoder", &e.encoder_module},
        std::pair<const char*, const plan::ModuleEstimate*>{"llm", &e.llm_module}}) {
    std::snprintf(line, sizeof(line), "  %-8s %10s %10s %10s %10s %10s %10s %10s %10s\n", name,
                  Time(m->compute_s).c_str(), Time(m->tp_collective_s).c_str(),
                  Time(m->cp_collective_s).c_str(), Time(m->pp_p2p_s).c_str(),
                  Time(m->bubble_s).c_str(), Time(m->dp_collective_s).c_str(),
                  Time(m->optimizer_s).c_str(), Time(m->imbalance_s).c_str());
    std::cout << line;
  }
  std::cout << "  boundary " << Time(e.boundary_s)
            << " (the busiest LLM rank's transfers, both ways; overlapped with compute where "
               "the schedule allows)\n";
  std::cout << "  control  " << Time(e.overhead_s) << " (the control plane's round trips)\n";
  if (e.shared_bound_s > 0) {
    std::cout << "  shared   " << Time(e.shared_bound_s)
              << " (the ranks' busy time over the devices they share: a lower bound)\n";
  }
  std::cout << "\nMemory per device: encoder " << Gib(e.encoder_module.state_gib) << " state + "
            << Gib(e.encoder_module.activation_gib) << " activations; LLM "
            << Gib(e.llm_module.state_gib) << " state + " << Gib(e.llm_module.activation_gib)
            << " activations; " << Gib(cluster.reserved_gib) << " reserved\n";
  for (const std::string& note : e.notes) std::cout << "note: " << note << "\n";
}

void PrintSearchText(const plan::SearchResult& r, const plan::ClusterSpec& cluster,
                     const Options& o) {
  std::cout << "hetpar plan --search: " << o.config << " on " << o.gpus << " x " << cluster.name
            << ": " << r.considered << " candidates estimated, " << r.over_memory
            << " over memory\n\n";
  if (r.ranked.empty()) {
    std::cout << "No layout of " << o.gpus << " devices fits: " << r.over_memory
              << " exceed the devices' memory and the rest fail the validator. Try more devices, "
                 "a smaller micro_batch or seq_len, or --max-pp.\n";
    return;
  }
  char line[256];
  std::snprintf(line, sizeof(line), "  %-4s %-24s %-16s %-16s %10s %10s %12s %9s %8s\n", "#",
                "placement", "encoder", "llm", "step", "TFLOPS/gpu", "tokens/s/gpu", "GiB/gpu",
                "gain");
  std::cout << line;
  const double base =
      r.best_homogeneous >= 0 ? r.ranked[r.best_homogeneous].estimate.tokens_per_s_per_device : 0;
  const int64_t shown = std::min<int64_t>(o.top, static_cast<int64_t>(r.ranked.size()));
  auto print = [&](int64_t i) {
    const plan::Candidate& c = r.ranked[i];
    const plan::StepEstimate& e = c.estimate;
    const std::string gain =
        base > 0 ? absl::StrCat(e.tokens_per_s_per_device >= base ? "+" : "",
                                Fixed(100 * (e.tokens_per_s_per_device / base - 1), 1), "%")
                 : "-";
    std::snprintf(line, sizeof(line), "  %-4lld %-24s %-16s %-16s %10s %10s %12s %9s %8s%s\n",
                  static_cast<long long>(i + 1), c.kind.c_str(), LayoutText(e.encoder).c_str(),
                  LayoutText(e.llm).c_str(), Time(e.step_time_s).c_str(),
                  Fixed(e.tflops_per_device, e.tflops_per_device < 1 ? 4 : 1).c_str(),
                  Fixed(e.tokens_per_s_per_device, 1).c_str(),
                  Fixed(e.memory_gib_per_device, 1).c_str(), gain.c_str(),
                  c.runnable ? "" : "  (not runnable yet)");
    std::cout << line;
  };
  for (int64_t i = 0; i < shown; ++i) print(i);
  if (r.best_homogeneous >= shown) {
    std::cout << "  ...\n";
    print(r.best_homogeneous);
  }
  if (r.best_homogeneous < 0) {
    std::cout << "\nNo homogeneous layout fits; gains are not shown.\n";
  } else {
    std::cout << "\ngain: tokens/s per device over the best homogeneous layout (the encoder "
                 "inheriting the LLM's layout, colocated)\n";
  }
}

// Prints the problem; exit 2 for bad input (a bad value, a missing cluster file), else 1.
int Fail(const absl::Status& status) {
  std::cerr << "hetpar plan: " << status.message() << "\n";
  return status.code() == absl::StatusCode::kInvalidArgument ||
                 status.code() == absl::StatusCode::kNotFound
             ? kExitInvalidInput
             : kExitFailure;
}

// The batches of steps [first, first + count): synthetic (ctx, batch) or from the data set.
absl::StatusOr<std::vector<std::vector<plan::SampleDescriptor>>> PlannerBatches(
    const hetpar::v1::RunSpec& spec, const plan::SyntheticBatchOptions& synthetic, int64_t first,
    int64_t count, bool from_data) {
  std::vector<std::vector<plan::SampleDescriptor>> batches;
  const int64_t global_batch = spec.run().global_batch();
  if (from_data) {
    auto source = data::BatchSource::Create(spec);
    if (!source.ok()) return source.status();
    data::SamplerCursor cursor;
    for (int64_t step = 0; step < first + count; ++step) {
      auto batch = (*source)->Take(cursor, global_batch);
      if (!batch.ok()) return batch.status();
      cursor = batch->next;
      if (step >= first) batches.push_back(std::move(batch->samples));
    }
    return batches;
  }
  for (int64_t step = first; step < first + count; ++step) {
    plan::SyntheticBatchOptions b = synthetic;
    b.first_id = (step * global_batch) % b.dataset_size;
    auto samples = plan::SyntheticBatch(b);
    if (!samples.ok()) return samples.status();
    batches.push_back(std::move(*samples));
  }
  return batches;
}

int RunPlanner(const Options& o, const hetpar::v1::RunSpec& spec,
               const plan::SyntheticBatchOptions& synthetic) {
  if (o.estimate_steps < 1) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("--estimate-steps ", o.estimate_steps, " must be >= 1")));
  }
  auto cluster = plan::ResolveCluster(o.cluster);
  if (!cluster.ok()) return Fail(cluster.status());
  auto batches = PlannerBatches(spec, synthetic, o.step, o.estimate_steps, o.from_data);
  if (!batches.ok()) return Fail(batches.status());
  if (o.estimate) {
    auto estimate = plan::EstimateOverBatches(spec, *batches, *cluster);
    if (!estimate.ok()) return Fail(estimate.status());
    if (o.json) {
      nlohmann::ordered_json j = EstimateJson(*estimate, "");
      j["config"] = o.config;
      j["cluster"] = cluster->name;
      j["steps"] = o.estimate_steps;
      std::cout << j.dump() << "\n";
    } else {
      PrintEstimateText(*estimate, *cluster, o.config, o.estimate_steps, o.from_data);
    }
    return kExitOk;
  }
  if (o.gpus < 1) {
    return Fail(absl::InvalidArgumentError("--search needs --gpus N, the budget of devices"));
  }
  plan::SearchOptions search;
  search.devices = o.gpus;
  search.max_pp = o.max_pp;
  search.max_cp = o.max_cp;
  search.colocated = o.placements != "non_colocated";
  search.non_colocated = o.placements != "colocated";
  std::cerr << "hetpar plan: searching the layouts of " << o.gpus << " devices on " << cluster->name
            << "...\n";
  auto result = plan::SearchLayouts(spec, *batches, *cluster, search);
  if (!result.ok()) return Fail(result.status());
  if (o.json) {
    const double base =
        result->best_homogeneous >= 0
            ? result->ranked[result->best_homogeneous].estimate.tokens_per_s_per_device
            : 0;
    const int64_t shown = std::min<int64_t>(o.top, static_cast<int64_t>(result->ranked.size()));
    for (int64_t i = 0; i < static_cast<int64_t>(result->ranked.size()); ++i) {
      const plan::Candidate& c = result->ranked[i];
      if (i >= shown && i != result->best_homogeneous) continue;
      nlohmann::ordered_json j = EstimateJson(c.estimate, c.kind);
      j["rank"] = i + 1;
      j["runnable"] = c.runnable;
      if (!c.runnable) j["why_not_runnable"] = c.why;
      j["gain_vs_best_homogeneous"] =
          base > 0 ? nlohmann::ordered_json(c.estimate.tokens_per_s_per_device / base - 1)
                   : nlohmann::ordered_json();
      std::cout << j.dump() << "\n";
    }
  } else {
    PrintSearchText(*result, *cluster, o);
  }
  return result->ranked.empty() ? kExitFailure : kExitOk;
}

int RunPlan(const Options& o) {
  config::LoadOptions load;
  load.overrides = o.overrides;
  load.check_files = false;       // planning reads no data files
  load.require_runnable = false;  // routing for layouts a run does not take yet is shown too
  auto loaded = config::LoadRunSpecFile(o.config, load);
  if (!loaded.ok()) {
    std::cerr << "hetpar: invalid config " << o.config << ":\n"
              << loaded.status().message() << "\n";
    return kExitInvalidInput;
  }
  const hetpar::v1::RunSpec& spec = loaded->spec;
  for (const config::ConfigIssue& issue :
       config::Validate(*loaded, /*check_files=*/false, /*require_runnable=*/true)) {
    std::cerr << "hetpar plan: note: `hetpar run` refuses this config for now: " << issue.ToString()
              << "\n";
  }
  if (o.step < 0 || o.generation < 0) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("--step ", o.step, " and --generation ", o.generation, " must be >= 0")));
  }
  auto images = ParseRange("--images-per-sample", o.images_per_sample);
  if (!images.ok()) return Fail(images.status());
  auto placement = plan::PlacementFromRunSpec(spec);
  if (!placement.ok()) return Fail(placement.status());
  auto options = plan::StepPlanOptionsFromRunSpec(spec, o.step, o.generation);
  if (!options.ok()) return Fail(options.status());
  if (o.wave >= options->waves) {
    return Fail(absl::InvalidArgumentError(absl::StrCat("--wave ", o.wave, " is past the step's ",
                                                        options->waves, " waves (0-",
                                                        options->waves - 1, ")")));
  }

  Context ctx;
  ctx.config = o.config;
  ctx.images = *images;
  ctx.tokens_per_image = config::TokensPerImage(spec.encoder().model());
  ctx.llm_layers = spec.llm().model().layers();
  const int64_t seq_len = options->seq_len;
  if (o.text_tokens.empty()) {
    ctx.text.lo = std::min<int64_t>(8, seq_len);
    ctx.text.hi = std::max(ctx.text.lo, seq_len - ctx.images.hi * ctx.tokens_per_image);
  } else {
    auto text = ParseRange("--text-tokens", o.text_tokens);
    if (!text.ok()) return Fail(text.status());
    ctx.text = *text;
  }
  const int64_t global_batch = spec.run().global_batch();
  ctx.dataset_size = o.samples > 0                       ? o.samples
                     : spec.data().synth().samples() > 0 ? spec.data().synth().samples()
                                                         : global_batch;
  if (!o.from_data && ctx.dataset_size < global_batch) {
    return Fail(absl::InvalidArgumentError(absl::StrCat(
        "--samples ", ctx.dataset_size, " is smaller than run.global_batch=", global_batch,
        ": a synthetic batch holds that many distinct samples (--from-data plans a data set of "
        "any size)")));
  }
  ctx.data_seed =
      static_cast<uint64_t>(o.data_seed >= 0 ? o.data_seed : spec.data().synth().seed());
  plan::SyntheticBatchOptions batch;
  batch.samples = global_batch;
  batch.first_id = (o.step * global_batch) % ctx.dataset_size;
  batch.dataset_size = ctx.dataset_size;
  batch.min_images = ctx.images.lo;
  batch.max_images = ctx.images.hi;
  batch.min_text_tokens = ctx.text.lo;
  batch.max_text_tokens = ctx.text.hi;
  batch.tokens_per_image = ctx.tokens_per_image;
  batch.seq_len = seq_len;
  batch.seed = ctx.data_seed;
  if (o.estimate || o.search) return RunPlanner(o, spec, batch);
  auto batches = PlannerBatches(spec, batch, o.step, 1, o.from_data);
  if (!batches.ok()) return Fail(batches.status());
  if (o.from_data) ctx.manifest = spec.data().manifest();
  auto step_plan = plan::BuildStepPlan(*placement, std::move(batches->front()), *options);
  if (!step_plan.ok()) return Fail(step_plan.status());
  const PlanStats stats = plan::ComputePlanStats(*step_plan);
  if (o.json) {
    PrintJson(*step_plan, stats, ctx, o.wave);
  } else {
    PrintText(*step_plan, stats, ctx, o.wave);
  }
  return kExitOk;
}

void AddPlanCommand(CLI::App& app, int* exit_code) {
  auto options = std::make_shared<Options>();
  CLI::App* command = app.add_subcommand(
      "plan",
      "Show one step's plan for a config: layouts, which encoder ranks send image embeddings to "
      "which LLM ranks, per-rank load and imbalance; check routing before launching. With "
      "--estimate, predict its step time, TFLOPS, tokens/s and memory per device on a cluster; "
      "with --search, rank the layouts of a device budget (docs/planner.md)");
  command->add_option("-c,--config", options->config, "RunSpec YAML file")->required();
  command->add_option("--set", options->overrides,
                      "Override a config field, e.g. --set llm.layout.cp=2 (repeatable)");
  command->add_option("--step", options->step, "Step to plan (default 0)");
  command->add_option("--generation", options->generation, "Membership generation (default 0)");
  command->add_flag("--json", options->json, "Print the plan as one JSON object");
  command->add_option("--images-per-sample", options->images_per_sample,
                      "Images per synthetic sample, MIN-MAX (default 0-3)");
  command->add_option("--text-tokens", options->text_tokens,
                      "Text tokens per synthetic sample, MIN-MAX (default 8 to what fits beside "
                      "the most images in llm.model.seq_len)");
  command->add_option("--samples", options->samples,
                      "Synthetic dataset size; step N plans ids N x global_batch onwards, modulo "
                      "this (default data.synth.samples, else run.global_batch)");
  command->add_option("--data-seed", options->data_seed,
                      "Seed of the synthetic samples (default data.synth.seed)");
  command->add_option("--wave", options->wave,
                      "Also list every transfer and share step of this wave");
  command->add_flag("--estimate", options->estimate,
                    "Predict the step time, TFLOPS and tokens/s per device and the memory per "
                    "device of this config on --cluster, with a breakdown (docs/planner.md)");
  command->add_flag(
      "--search", options->search,
      "Estimate every homogeneous, colocated and non-colocated layout of --gpus "
      "devices and print the best --top, with the gain over the best homogeneous one");
  command->add_option(
      "--cluster", options->cluster,
      absl::StrCat("Cluster preset (", absl::StrJoin(plan::ClusterPresetNames(), ", "),
                   ") or a cluster YAML file, e.g. one plan_calibrate wrote "
                   "(default h100-sxm)"));
  command->add_option("--gpus", options->gpus, "Devices to spend (--search)");
  command->add_option("--top", options->top, "Candidates to print (--search; default 5)");
  command->add_option("--estimate-steps", options->estimate_steps,
                      "Steps from --step whose batches the estimate averages over (default 4)");
  command->add_flag("--from-data", options->from_data,
                    "Plan the batches a run draws from the config's data set (generated when "
                    "synthetic and absent) instead of synthetic batches");
  command->add_option("--max-pp", options->max_pp,
                      "Largest LLM pipeline size --search tries (default 1: pipeline stages are "
                      "tried only when asked)");
  command->add_option("--max-cp", options->max_cp,
                      "Largest LLM context-parallel size --search tries (default 1)");
  command
      ->add_option("--placements", options->placements,
                   "Placements --search tries: all, colocated or non_colocated (default all)")
      ->check(CLI::IsMember({"all", "colocated", "non_colocated"}));
  command->callback([options, exit_code, command] {
    if (options->estimate && options->search) {
      std::cerr << "hetpar plan: --estimate and --search are alternatives; pass one\n";
      *exit_code = kExitInvalidInput;
      return;
    }
    // A flag given where it does nothing is refused, not ignored.
    const auto refuse = [&](const std::string& flag, const std::string& why) {
      if (command->count(flag) == 0) return false;
      std::cerr << "hetpar plan: " << flag << " " << why << "\n";
      *exit_code = kExitInvalidInput;
      return true;
    };
    for (const char* flag : {"--gpus", "--top", "--max-pp", "--max-cp", "--placements"}) {
      if (!options->search && refuse(flag, "applies to --search only")) return;
    }
    if (!options->estimate && !options->search) {
      for (const char* flag : {"--estimate-steps", "--cluster"}) {
        if (refuse(flag, "applies to --estimate and --search only")) return;
      }
    } else {
      for (const char* flag : {"--wave", "--generation"}) {
        if (refuse(flag, "applies to a plain plan only (not --estimate or --search)")) return;
      }
    }
    for (const char* flag : {"--images-per-sample", "--text-tokens", "--samples", "--data-seed"}) {
      if (options->from_data && refuse(flag, "describes synthetic batches; --from-data plans "
                                             "the data set's")) {
        return;
      }
    }
    if (options->samples < 0 || (command->count("--samples") > 0 && options->samples == 0)) {
      std::cerr << "hetpar plan: --samples " << options->samples << " must be >= 1\n";
      *exit_code = kExitInvalidInput;
      return;
    }
    if (options->search && command->count("--top") > 0 && options->top < 1) {
      std::cerr << "hetpar plan: --top " << options->top << " must be >= 1\n";
      *exit_code = kExitInvalidInput;
      return;
    }
    *exit_code = RunPlan(*options);
  });
}

}  // namespace

HETPAR_REGISTER_COMMAND(30, AddPlanCommand);

}  // namespace hetpar::cli
