// colocated_bench: homogeneous against heterogeneous parallelism on the same ranks.
//
// Both runs are colocated on --ranks processes with the LLM at dp 1 x tp R. The homogeneous run
// forces the encoder to the LLM's layout (dp 1 x tp R: every ViT layer all-reduces over R ranks);
// the heterogeneous run gives the encoder its own (dp R x tp 1: no encoder collectives, images
// spread over R replicas). One JSON line per layout with the median step time, tokens/s and the
// slowest rank's time split per module, then one line with the ratio heterogeneous / homogeneous
// (the same-run baseline). The TP all-reduces inside the layers are part of each module's
// compute_s; the *_share_and_dp_sum_s fields are the boundary shares and the DP gradient sums.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "bench/hetpar_run_util.h"
#include "nlohmann/json.hpp"

using hetpar::bench::Median;
using hetpar::bench::Quote;

int main(int argc, char** argv) {
  CLI::App app{"colocated_bench: homogeneous vs heterogeneous layouts on the same ranks"};
  std::string config = std::string(HETPAR_SOURCE_DIR) + "/configs/tiny-colocated.yaml";
  int ranks = 4;
  int steps = 12;
  int warmup = 2;
  app.add_option("--config", config, "Colocated RunSpec")->capture_default_str();
  app.add_option("--ranks", ranks, "Processes (the LLM's tp)")->capture_default_str();
  app.add_option("--steps", steps, "Steps per layout")->capture_default_str();
  app.add_option("--warmup", warmup, "Leading steps left out")->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  const std::string dir = (std::filesystem::temp_directory_path() /
                           ("hetpar_colocated_bench_" + std::to_string(::getpid())))
                              .string();
  std::filesystem::create_directories(dir);
  const std::string r = std::to_string(ranks);
  struct Layout {
    std::string name;
    std::string flags;
  };
  const std::vector<Layout> layouts = {
      {"homogeneous", " --set encoder.layout.dp=1 --set encoder.layout.tp=" + r},
      {"heterogeneous", " --set encoder.layout.dp=" + r + " --set encoder.layout.tp=1"},
  };
  double tokens_per_s[2] = {0, 0};
  for (size_t k = 0; k < layouts.size(); ++k) {
    const Layout& l = layouts[k];
    const std::string out = dir + "/" + l.name;
    if (!hetpar::bench::RunHetpar(
            HETPAR_BIN,
            "--config " + Quote(config) + " --steps " + std::to_string(steps) +
                " --threads 1 --set llm.layout.dp=1 --set llm.layout.tp=" + r +
                " --set llm.model.kv_heads=" + r + l.flags,
            out)) {
      return 1;
    }
    std::vector<double> step_time;
    std::vector<double> split[2][3];  // module x {compute, bridge_wait, collective}
    int64_t tokens = 0;
    double seconds = 0;
    for (const nlohmann::json& j : hetpar::bench::StepLines(out, warmup)) {
      step_time.push_back(j["step_time_s"].get<double>());
      tokens += j["tokens"].get<int64_t>();
      seconds += j["step_time_s"].get<double>();
      const char* modules[2] = {"encoder", "llm"};
      const char* keys[3] = {"compute_s", "bridge_wait_s", "collective_s"};
      for (int m = 0; m < 2; ++m) {
        for (int q = 0; q < 3; ++q) {
          if (j.contains(modules[m])) split[m][q].push_back(j[modules[m]][keys[q]].get<double>());
        }
      }
    }
    tokens_per_s[k] = seconds > 0 ? tokens / seconds : 0;
    nlohmann::json result = {{"bench", "colocated"},
                             {"layout", l.name},
                             {"ranks", ranks},
                             {"steps_measured", step_time.size()},
                             {"step_time_s", Median(step_time)},
                             {"tokens_per_s", tokens_per_s[k]},
                             {"encoder_compute_s", Median(split[0][0])},
                             {"encoder_bridge_wait_s", Median(split[0][1])},
                             {"encoder_grad_share_and_dp_sum_s", Median(split[0][2])},
                             {"llm_compute_s", Median(split[1][0])},
                             {"llm_bridge_wait_s", Median(split[1][1])},
                             {"llm_row_share_and_dp_sum_s", Median(split[1][2])}};
    std::printf("%s\n", result.dump().c_str());
    std::fflush(stdout);
  }
  nlohmann::json ratio = {{"bench", "colocated"},
                          {"ratio", "heterogeneous/homogeneous tokens_per_s"},
                          {"value", tokens_per_s[0] > 0 ? tokens_per_s[1] / tokens_per_s[0] : 0}};
  std::printf("%s\n", ratio.dump().c_str());
  std::filesystem::remove_all(dir);
  return 0;
}
