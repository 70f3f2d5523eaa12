// step_bench: trains a config with `hetpar run` for a few steps per case and prints, per case, one
// JSON line with the median step time and its decomposition:
//
//   encoder_compute_s, llm_compute_s      forward + backward of the slowest rank of each module
//   encoder_bridge_wait_s                 the encoder waiting for gradients to come back
//   llm_bridge_wait_s                     the LLM waiting for image rows: bridge time not hidden
//                                         behind encoder compute
//   encoder_collective_s, llm_collective_s
//   pipelining_efficiency                 step_time / max(encoder busy, LLM busy), busy =
//                                         compute + collectives (1.0 = perfect overlap)
//
// Cases: the config as given (tiny: 4 waves), and with run.micro_batch=1 (8 waves). The first
// --warmup steps are excluded. Baseline for the ratio: the busier module's own busy time in the
// same run.
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
  CLI::App app{"step_bench: decomposed step time of hetpar run"};
  std::string config = std::string(HETPAR_SOURCE_DIR) + "/configs/tiny.yaml";
  int steps = 12;
  int warmup = 2;
  int threads = 1;
  app.add_option("--config", config, "RunSpec to train")->capture_default_str();
  app.add_option("--steps", steps, "Steps per case")->capture_default_str();
  app.add_option("--warmup", warmup, "Leading steps left out")->capture_default_str();
  app.add_option("--threads", threads, "Intra-op threads per worker")->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  const std::string dir =
      (std::filesystem::temp_directory_path() / ("hetpar_step_bench_" + std::to_string(::getpid())))
          .string();
  struct Case {
    std::string name;
    std::string extra;
  };
  const std::vector<Case> cases = {{"as_configured", ""},
                                   {"micro_batch_1", " --set run.micro_batch=1"}};
  for (const Case& c : cases) {
    const std::string out = dir + "/" + c.name;
    std::filesystem::create_directories(dir);
    if (!hetpar::bench::RunHetpar(HETPAR_BIN,
                                  "--config " + Quote(config) + " --steps " +
                                      std::to_string(steps) + " --threads " +
                                      std::to_string(threads) + c.extra,
                                  out)) {
      return 1;
    }
    std::vector<double> step_time, enc_compute, llm_compute, enc_wait, llm_wait, enc_coll, llm_coll,
        efficiency;
    int64_t tokens = 0;
    double tokens_time = 0;
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
      tokens += j["tokens"].get<int64_t>();
      tokens_time += t;
    }
    nlohmann::json result = {{"bench", "step"},
                             {"case", c.name},
                             {"steps_measured", step_time.size()},
                             {"step_time_s", Median(step_time)},
                             {"encoder_compute_s", Median(enc_compute)},
                             {"llm_compute_s", Median(llm_compute)},
                             {"encoder_bridge_wait_s", Median(enc_wait)},
                             {"llm_bridge_wait_s", Median(llm_wait)},
                             {"encoder_collective_s", Median(enc_coll)},
                             {"llm_collective_s", Median(llm_coll)},
                             {"pipelining_efficiency", Median(efficiency)},
                             {"tokens_per_s", tokens_time > 0 ? tokens / tokens_time : 0}};
    std::printf("%s\n", result.dump().c_str());
    std::fflush(stdout);
  }
  std::filesystem::remove_all(dir);
  return 0;
}
