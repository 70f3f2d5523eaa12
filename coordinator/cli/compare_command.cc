// `hetpar compare RUN_A RUN_B`: do two runs agree? Reads both run directories (config.yaml and
// metrics.jsonl), prints the largest relative difference of the per-step loss and grad norm and
// of the final parameter sums, and exits 1 when one exceeds the tolerance of the runs' dtype.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/cli_checks.h"
#include "coordinator/cli/commands.h"
#include "nlohmann/json.hpp"
#include "yaml-cpp/yaml.h"

namespace hetpar::cli {
namespace {

struct RunMetrics {
  std::string dir;
  std::string dtype;
  std::map<int64_t, nlohmann::json> steps;  // step -> its metrics line
  nlohmann::json final_params;              // null when the run did not finish
};

absl::StatusOr<RunMetrics> ReadRun(const std::string& dir) {
  RunMetrics run;
  run.dir = dir;
  try {
    YAML::Node config = YAML::LoadFile(dir + "/config.yaml");
    run.dtype = config["run"]["dtype"].as<std::string>();
  } catch (const YAML::Exception& e) {
    return absl::NotFoundError(
        absl::StrCat("cannot read '", dir, "/config.yaml' (is it a run directory?): ", e.what()));
  }
  std::ifstream in(dir + "/metrics.jsonl");
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read '", dir, "/metrics.jsonl'"));
  std::string line;
  int line_number = 0;
  while (std::getline(in, line)) {
    ++line_number;
    if (line.empty()) continue;
    nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object()) {
      return absl::DataLossError(
          absl::StrCat(dir, "/metrics.jsonl:", line_number, ": not a JSON object"));
    }
    if (j.contains("step") && j.contains("loss")) {
      run.steps[j["step"].get<int64_t>()] = j;
    } else if (j.contains("final_params")) {
      run.final_params = j["final_params"];
    }
  }
  return run;
}

double RelativeDifference(double a, double b) {
  const double scale = std::max({std::fabs(a), std::fabs(b), 1e-300});
  return std::fabs(a - b) / scale;
}

double DefaultTolerance(const std::string& dtype) {
  if (dtype == "float64") return 1e-9;
  if (dtype == "float32") return 1e-4;
  return 2e-2;  // bfloat16
}

struct Worst {
  double value = 0;
  std::string where = "-";
  void Update(double diff, const std::string& at) {
    if (diff > value || where == "-") {
      value = std::max(value, diff);
      if (diff >= value) where = at;
    }
  }
};

int Compare(const std::string& a_dir, const std::string& b_dir, double tolerance_flag,
            double grad_norm_tolerance_flag) {
  auto a = ReadRun(a_dir);
  auto b = ReadRun(b_dir);
  for (const auto* run : {&a, &b}) {
    if (!run->ok()) {
      std::cerr << "hetpar compare: " << run->status().message() << "\n";
      return kExitInvalidInput;
    }
  }
  // Runs in two dtypes (a float32 GPU run against the float64 reference) are held to the looser
  // dtype's tolerance.
  const std::string& looser =
      DefaultTolerance(a->dtype) >= DefaultTolerance(b->dtype) ? a->dtype : b->dtype;
  if (a->steps.empty() || a->steps.size() != b->steps.size()) {
    std::cerr << "hetpar compare: " << a_dir << " has " << a->steps.size() << " steps and " << b_dir
              << " has " << b->steps.size() << "; expected the same, at least one\n";
    return kExitInvalidInput;
  }
  const double tolerance = tolerance_flag > 0 ? tolerance_flag : DefaultTolerance(looser);
  const double grad_norm_tolerance =
      grad_norm_tolerance_flag > 0 ? grad_norm_tolerance_flag : tolerance;
  Worst loss, grad_norm, params;
  for (const auto& [step, line] : a->steps) {
    auto other = b->steps.find(step);
    if (other == b->steps.end()) {
      std::cerr << "hetpar compare: step " << step << " is in " << a_dir << " but not in " << b_dir
                << "\n";
      return kExitInvalidInput;
    }
    const std::string at = absl::StrCat("step ", step);
    loss.Update(RelativeDifference(line["loss"].get<double>(), other->second["loss"].get<double>()),
                at);
    if (line.contains("grad_norm") && other->second.contains("grad_norm")) {
      grad_norm.Update(RelativeDifference(line["grad_norm"].get<double>(),
                                          other->second["grad_norm"].get<double>()),
                       at);
    }
  }
  const bool have_params = !a->final_params.is_null() && !b->final_params.is_null();
  if (have_params) {
    for (const char* module : {"encoder", "llm"}) {
      for (const char* stat : {"sum", "l2"}) {
        params.Update(RelativeDifference(a->final_params[module][stat].get<double>(),
                                         b->final_params[module][stat].get<double>()),
                      absl::StrCat(module, " ", stat));
      }
    }
  }
  std::printf("compared %zu steps (%s, tolerance %.3g relative)\n", a->steps.size(),
              a->dtype == b->dtype ? a->dtype.c_str() : (a->dtype + " against " + b->dtype).c_str(),
              tolerance);
  std::printf("  loss          max relative difference %.3e at %s\n", loss.value,
              loss.where.c_str());
  std::printf("  grad_norm     max relative difference %.3e at %s", grad_norm.value,
              grad_norm.where.c_str());
  if (grad_norm_tolerance != tolerance) std::printf(" (tolerance %.3g)", grad_norm_tolerance);
  std::printf("\n");
  if (have_params) {
    std::printf("  final params  max relative difference %.3e (%s)\n", params.value,
                params.where.c_str());
  } else {
    std::printf("  final params  missing in one run (did it finish?)\n");
  }
  const bool agree = loss.value <= tolerance && grad_norm.value <= grad_norm_tolerance &&
                     params.value <= tolerance && have_params;
  std::printf("%s\n", agree ? "runs agree" : "runs DIFFER beyond the tolerance");
  return agree ? kExitOk : kExitFailure;
}

void AddCompareCommand(CLI::App& app, int* exit_code) {
  struct Options {
    std::string a, b;
    double tolerance = 0;
    double grad_norm_tolerance = 0;
  };
  auto options = std::make_shared<Options>();
  CLI::App* command = app.add_subcommand(
      "compare",
      "Compare two run directories: per-step loss and grad norm, final parameters; "
      "exit 1 when they differ beyond the tolerance of the runs' dtype (float64 1e-9, "
      "float32 1e-4, bfloat16 2e-2, relative; the looser one for runs in two dtypes)");
  command->add_option("RUN_A", options->a, "First run directory")->required();
  command->add_option("RUN_B", options->b, "Second run directory")->required();
  command
      ->add_option("--tolerance", options->tolerance,
                   "Relative tolerance instead of the dtype's default")
      ->check(hetpar::kPositiveNumber);
  command
      ->add_option("--grad-norm-tolerance", options->grad_norm_tolerance,
                   "Relative tolerance of the gradient norm, the figure that drifts most (the "
                   "clipped steps amplify rounding), instead of the loss and parameters' one")
      ->check(hetpar::kPositiveNumber);
  command->callback([options, exit_code] {
    *exit_code = Compare(options->a, options->b, options->tolerance, options->grad_norm_tolerance);
  });
}

}  // namespace

HETPAR_REGISTER_COMMAND(60, AddCompareCommand);

}  // namespace hetpar::cli
