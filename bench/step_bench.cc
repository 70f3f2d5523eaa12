// step_bench: trains a config with `hetpar run` for a few steps per case and prints, per case, one
// JSON line with the median step time and its decomposition:
//
//   encoder_compute_s, llm_compute_s      forward + backward of the slowest rank of each module
//   encoder_bridge_wait_s                 the encoder waiting for gradients to come back
//   llm_bridge_wait_s                     the LLM waiting for image rows: bridge time not hidden
//                                         behind encoder compute
//   encoder_collective_s, llm_collective_s
//   bridge_transfer_s                     time the bridge spent moving this step's messages: per
//                                         receiving rank the union of its messages' transfer
//                                         intervals (both ends posted -> completed), added up
//   bridge_hidden_fraction                1 - llm_bridge_wait_s / bridge_transfer_s, clamped to
//                                         [0, 1]: at least this much of the transfer was hidden
//                                         (the LLM's wait also holds the encoder's first forward)
//   pipelining_efficiency                 step_time / max(encoder busy, LLM busy), busy =
//                                         compute + collectives (1.0 = perfect overlap)
//   bridge_gbps, bridge_message_bytes     bytes / transfer time over the measured steps (both
//                                         directions), and the mean message size
//   split_timing                          "device" on the CPU, where every time is the CPU's.
//                                         "device_compute" where run.device is cuda: compute is
//                                         the GPU's time in each forward and backward (CUDA
//                                         events), while the waits and collectives are the host's,
//                                         and the GPU may compute during a host wait, so the
//                                         parts may add up to more than the step and
//                                         pipelining_efficiency is approximate; step_time_s and
//                                         tokens_per_s are exact either way.
//
// Then, in the same run, `transport_bw` (hetpar's UCX transport between two processes) at each
// case's mean message size, once with its default window of 4 messages in flight and once with 1
// (isolated messages, as the bridge's mostly are), and one line per case:
//   {"bench":"step_bridge","case":...,"message_bytes":...,"bridge_gbps":...,
//    "transport_bw_gbps":...,"ratio":...,"transport_bw_window1_gbps":...,"ratio_window1":...}
//
// Cases: the config as given (tiny: 4 waves), the same with every step traced (`--trace`),
// followed by a step_trace line with its overhead, and with run.micro_batch=1 (8 waves):
//   {"bench":"step_trace","step_time_s_untraced":...,"step_time_s_traced":...,"overhead":...}
//
// Pipeline cases: the LLM at 4 layers, tp 1, in 1, 2 and 4 pipeline stages over 8 microbatches
// (run.micro_batch=1), fed by one encoder rank, each followed by one line
//   {"bench":"step_pipeline","case":...,"stages":S,"microbatches":M,"bubble":...,
//    "bubble_bound":(S-1)/(M+S-1),"ratio":bubble/bound,"step_time_s":...,
//    "step_time_vs_pp1":...}
// where a rank's bubble is its time waiting for the neighbouring stages over its compute plus
// that wait (what the bound counts: idle over busy plus idle), averaged over the LLM ranks and
// taken as the median over the measured steps. On a machine with fewer cores than processes the
// stages also wait for cores, which this does not separate.
//
// The first --warmup steps are excluded. Baseline for the efficiency: the busier module's own
// busy time in the same run.
//
// --set KEY=VALUE (repeatable) passes an override to every case's `hetpar run`, and --cases picks
// cases by name (default: all), e.g. the step split of a CUDA run, as tools/gpu-check takes it:
//   step_bench --cases as_configured,micro_batch_1 --no-bridge-baseline
//              --set run.device=cuda --set run.dtype=bfloat16 --set encoder.layout.dp=1 ...
// --no-bridge-baseline leaves out the step_bridge lines (transport_bw moves host memory: no
// baseline for a bridge that moves device memory).
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "bench/built_path.h"
#include "bench/hetpar_run_util.h"
#include "common/config/config.h"
#include "nlohmann/json.hpp"

using hetpar::bench::Median;
using hetpar::bench::Quote;

namespace {

// hetpar's one-way rate from `transport_bw --sizes <size>` with `window` messages in flight;
// negative when it fails.
double TransportGbps(int64_t size, int window) {
  const std::string command = hetpar::bench::BuiltPath("TRANSPORT_BW_BIN", TRANSPORT_BW_BIN) +
                              " --sizes " + std::to_string(size) +
                              " --skip ucx_raw,gloo,memcpy --reps 3 --window " +
                              std::to_string(window) + " 2>/dev/null";
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return -1;
  double gbps = -1;
  char line[4096];
  while (std::fgets(line, sizeof(line), pipe) != nullptr) {
    nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_discarded() && j.contains("hetpar_gbps")) gbps = j["hetpar_gbps"].get<double>();
  }
  if (::pclose(pipe) != 0) return -1;
  return gbps;
}

// The median over steps >= warmup of the LLM ranks' mean pipeline bubble: per rank,
// pipeline_wait_s / (compute_s + pipeline_wait_s) from workers/rank-<r>.steps.jsonl. 0 without
// pipeline stages.
double PipelineBubble(const std::string& out, int warmup) {
  std::map<int64_t, std::vector<double>> by_step;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(out + "/workers", ec)) {
    const std::string name = entry.path().filename().string();
    if (name.size() < 12 || name.substr(name.size() - 12) != ".steps.jsonl") continue;
    std::ifstream in(entry.path());
    std::string text;
    while (std::getline(in, text)) {
      const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
      if (j.is_discarded() || j.value("module", "") != "llm" || j["step"].get<int>() < warmup) {
        continue;
      }
      const double wait = j.value("pipeline_wait_s", 0.0);
      const double busy = j.value("compute_s", 0.0);
      by_step[j["step"].get<int64_t>()].push_back(wait + busy > 0 ? wait / (wait + busy) : 0);
    }
  }
  std::vector<double> per_step;
  for (const auto& [step, ranks] : by_step) {
    double sum = 0;
    for (double b : ranks) sum += b;
    per_step.push_back(sum / static_cast<double>(ranks.size()));
  }
  return Median(per_step);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"step_bench: decomposed step time of hetpar run"};
  std::string config =
      hetpar::bench::BuiltPath("HETPAR_SOURCE_DIR", HETPAR_SOURCE_DIR) + "/configs/tiny.yaml";
  int steps = 12;
  int warmup = 2;
  int threads = 1;
  app.add_option("--config", config, "RunSpec to train")->capture_default_str();
  app.add_option("--steps", steps, "Steps per case")->capture_default_str();
  app.add_option("--warmup", warmup, "Leading steps left out")->capture_default_str();
  app.add_option("--threads", threads, "Intra-op threads per worker")->capture_default_str();
  std::vector<std::string> overrides;
  app.add_option("--set", overrides, "KEY=VALUE override passed to every case (repeatable)");
  std::vector<std::string> only;
  app.add_option("--cases", only, "Cases to run, comma-separated (default: all)")->delimiter(',');
  bool bridge_baseline = true;
  app.add_flag("!--no-bridge-baseline", bridge_baseline,
               "Leave out the step_bridge lines (transport_bw at the bridge's message sizes)");
  CLI11_PARSE(app, argc, argv);
  std::string common_extra;
  for (const std::string& o : overrides) common_extra += " --set " + Quote(o);

  const std::string dir =
      (std::filesystem::temp_directory_path() / ("hetpar_step_bench_" + std::to_string(::getpid())))
          .string();
  struct Case {
    std::string name;
    std::string extra;
  };
  // "traced" repeats the first case with every step's timeline recorded (--trace): its step
  // time against the first case's is the cost of tracing (a step_trace line).
  // It runs right after the first case, so both see the machine in the same state.
  // A non-colocated encoder keeps as many jobs in flight as there are stages (4 at most here); a
  // colocated run has no such window and refuses the field, and its encoder covers the LLM's
  // ranks (one encoder replica per stage).
  hetpar::config::LoadOptions load;
  load.overrides = overrides;
  load.check_files = false;
  load.require_runnable = false;
  const auto loaded = hetpar::config::LoadRunSpecFile(config, load);
  if (!loaded.ok()) {
    std::fprintf(stderr, "step_bench: --config %s: %s\n", config.c_str(),
                 std::string(loaded.status().message()).c_str());
    return 2;
  }
  const bool colocated = loaded->spec.placement() == hetpar::v1::PLACEMENT_COLOCATED;
  // On CUDA the workers' compute is the GPU's time (CUDA events) and their waits the host's.
  const std::string timing = loaded->spec.run().device() == "cuda" ? "device_compute" : "device";
  const auto pipeline = [&](int stages) {
    return " --set run.micro_batch=1" +
           (colocated ? std::string() : std::string(" --set run.max_inflight=4")) +
           " --set encoder.layout.dp=" + std::to_string(colocated ? stages : 1) +
           " --set encoder.layout.tp=1 --set llm.model.layers=4 --set llm.layout.dp=1"
           " --set llm.layout.tp=1 --set llm.layout.pp=" +
           std::to_string(stages);
  };
  const std::vector<Case> cases = {{"as_configured", ""},
                                   {"traced", " --trace 0:" + std::to_string(steps)},
                                   {"micro_batch_1", " --set run.micro_batch=1"},
                                   {"pipeline_pp1", pipeline(1)},
                                   {"pipeline_pp2", pipeline(2)},
                                   {"pipeline_pp4", pipeline(4)}};
  for (const std::string& name : only) {
    if (std::none_of(cases.begin(), cases.end(), [&](const Case& c) { return c.name == name; })) {
      std::string known;
      for (const Case& c : cases) known += (known.empty() ? "" : ", ") + c.name;
      std::fprintf(stderr, "step_bench: --cases: '%s' is not a case; expected some of %s\n",
                   name.c_str(), known.c_str());
      return 2;
    }
  }
  const auto selected = [&](const std::string& name) {
    return only.empty() || std::find(only.begin(), only.end(), name) != only.end();
  };
  std::map<std::string, double> median_step_time;
  struct Bridge {
    std::string name;
    int64_t message_bytes;
    double gbps;
  };
  std::vector<Bridge> bridges;
  for (const Case& c : cases) {
    if (!selected(c.name)) continue;
    const std::string out = dir + "/" + c.name;
    std::filesystem::create_directories(dir);
    if (!hetpar::bench::RunHetpar(hetpar::bench::BuiltPath("HETPAR_BIN", HETPAR_BIN),
                                  "--config " + Quote(config) + " --steps " +
                                      std::to_string(steps) + " --threads " +
                                      std::to_string(threads) + common_extra + c.extra,
                                  out)) {
      return 1;
    }
    std::vector<double> step_time, enc_compute, llm_compute, enc_wait, llm_wait, enc_coll, llm_coll,
        efficiency, transfer, hidden;
    int64_t tokens = 0;
    double tokens_time = 0;
    double bridge_bytes = 0, bridge_messages = 0, bridge_time = 0;
    for (const nlohmann::json& j : hetpar::bench::StepLines(out, warmup)) {
      const double t = j["step_time_s"].get<double>();
      const auto& e = j["encoder"];
      const auto& l = j["llm"];
      step_time.push_back(t);
      enc_compute.push_back(e["compute_s"].get<double>());
      llm_compute.push_back(l["compute_s"].get<double>());
      enc_wait.push_back(e["bridge_wait_s"].get<double>());
      llm_wait.push_back(l["bridge_wait_s"].get<double>());
      enc_coll.push_back(e["collective_s"].get<double>());
      llm_coll.push_back(l["collective_s"].get<double>());
      const double busy =
          std::max(enc_compute.back() + enc_coll.back(), llm_compute.back() + llm_coll.back());
      efficiency.push_back(busy > 0 ? t / busy : 0);
      const double moved = e.value("bridge_transfer_s", 0.0) + l.value("bridge_transfer_s", 0.0);
      transfer.push_back(moved);
      hidden.push_back(moved > 0 ? std::clamp(1 - llm_wait.back() / moved, 0.0, 1.0) : 0);
      bridge_bytes += e.value("bridge_bytes", 0.0) + l.value("bridge_bytes", 0.0);
      bridge_messages += e.value("bridge_messages", 0.0) + l.value("bridge_messages", 0.0);
      bridge_time += moved;
      tokens += j["tokens"].get<int64_t>();
      tokens_time += t;
    }
    if (step_time.empty()) {
      std::fprintf(stderr,
                   "step_bench: case %s: %s/metrics.jsonl has no step line past the %d warm-up "
                   "steps with both modules' split\n",
                   c.name.c_str(), out.c_str(), warmup);
      return 1;
    }
    nlohmann::json result = {
        {"bench", "step"},
        {"case", c.name},
        {"steps_measured", step_time.size()},
        {"split_timing", timing},
        {"step_time_s", Median(step_time)},
        {"encoder_compute_s", Median(enc_compute)},
        {"llm_compute_s", Median(llm_compute)},
        {"encoder_bridge_wait_s", Median(enc_wait)},
        {"llm_bridge_wait_s", Median(llm_wait)},
        {"encoder_collective_s", Median(enc_coll)},
        {"llm_collective_s", Median(llm_coll)},
        {"bridge_transfer_s", Median(transfer)},
        {"bridge_hidden_fraction", Median(hidden)},
        {"pipelining_efficiency", Median(efficiency)},
        {"bridge_gbps", bridge_time > 0 ? bridge_bytes / bridge_time / 1e9 : 0},
        {"bridge_message_bytes", bridge_messages > 0 ? bridge_bytes / bridge_messages : 0},
        {"tokens_per_s", tokens_time > 0 ? tokens / tokens_time : 0}};
    std::printf("%s\n", result.dump().c_str());
    std::fflush(stdout);
    median_step_time[c.name] = Median(step_time);
    if (c.name.rfind("pipeline_pp", 0) == 0) {
      const int stages = std::stoi(c.name.substr(std::string("pipeline_pp").size()));
      const int microbatches = 8;  // global batch 8, micro batch 1, LLM dp 1
      const double bubble = PipelineBubble(out, warmup);
      const double bound = static_cast<double>(stages - 1) / (microbatches + stages - 1);
      const double pp1 = median_step_time["pipeline_pp1"];
      const nlohmann::json line = {
          {"bench", "step_pipeline"},
          {"case", c.name},
          {"stages", stages},
          {"microbatches", microbatches},
          {"bubble", bubble},
          {"bubble_bound", bound},
          {"ratio", bound > 0 ? bubble / bound : 0},
          {"step_time_s", median_step_time[c.name]},
          {"step_time_vs_pp1", pp1 > 0 ? median_step_time[c.name] / pp1 : 0}};
      std::printf("%s\n", line.dump().c_str());
      std::fflush(stdout);
    }
    if (c.name == "traced" && median_step_time.count("as_configured") > 0) {
      const double off = median_step_time["as_configured"];
      const nlohmann::json line = {
          {"bench", "step_trace"},
          {"step_time_s_untraced", off},
          {"step_time_s_traced", median_step_time["traced"]},
          {"overhead", off > 0 ? median_step_time["traced"] / off - 1 : 0}};
      std::printf("%s\n", line.dump().c_str());
      std::fflush(stdout);
      continue;  // the same bridge as the first case
    }
    // The pipeline cases move the same image rows as micro_batch_1: no bridge line of their own.
    if (bridge_baseline && bridge_messages > 0 && bridge_time > 0 && c.name != "traced" &&
        c.name.rfind("pipeline_pp", 0) != 0) {
      bridges.push_back({c.name, static_cast<int64_t>(bridge_bytes / bridge_messages),
                         bridge_bytes / bridge_time / 1e9});
    }
  }
  std::filesystem::remove_all(dir);
  // The transport on its own at the bridge's message sizes, after the steps (so the two never
  // share the machine).
  for (const Bridge& b : bridges) {
    const double streamed = TransportGbps(b.message_bytes, 4);
    const double isolated = TransportGbps(b.message_bytes, 1);
    if (streamed <= 0 || isolated <= 0) {
      std::fprintf(stderr, "transport_bw failed at %lld bytes\n",
                   static_cast<long long>(b.message_bytes));
      return 1;
    }
    const nlohmann::json line = {{"bench", "step_bridge"},
                                 {"case", b.name},
                                 {"message_bytes", b.message_bytes},
                                 {"bridge_gbps", b.gbps},
                                 {"transport_bw_gbps", streamed},
                                 {"ratio", b.gbps / streamed},
                                 {"transport_bw_window1_gbps", isolated},
                                 {"ratio_window1", b.gbps / isolated}};
    std::printf("%s\n", line.dump().c_str());
    std::fflush(stdout);
  }
  return 0;
}
