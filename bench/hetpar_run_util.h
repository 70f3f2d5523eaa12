// What the system benches share: run `hetpar run` as a user would and read its metrics.jsonl.
#ifndef HETPAR_BENCH_HETPAR_RUN_UTIL_H_
#define HETPAR_BENCH_HETPAR_RUN_UTIL_H_

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"

namespace hetpar::bench {

inline double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

inline std::string Quote(const std::string& s) { return "'" + s + "'"; }

// Runs `hetpar run <args> --out <out>` with its output in <out>.log. False (and a message naming
// the log) when it fails.
inline bool RunHetpar(const std::string& hetpar, const std::string& args, const std::string& out) {
  const std::string command =
      hetpar + " run " + args + " --out " + Quote(out) + " > " + Quote(out + ".log") + " 2>&1";
  if (std::system(command.c_str()) != 0) {
    std::fprintf(stderr, "'%s' failed; see %s.log\n", command.c_str(), out.c_str());
    return false;
  }
  return true;
}

// The per-step lines of <out>/metrics.jsonl from step `warmup` on.
inline std::vector<nlohmann::json> StepLines(const std::string& out, int warmup) {
  std::vector<nlohmann::json> lines;
  std::ifstream in(out + "/metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) {
    nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.contains("step") || j["step"].get<int>() < warmup) continue;
    if (!j.contains("encoder") || !j.contains("llm")) continue;
    lines.push_back(std::move(j));
  }
  return lines;
}

}  // namespace hetpar::bench

#endif  // HETPAR_BENCH_HETPAR_RUN_UTIL_H_
