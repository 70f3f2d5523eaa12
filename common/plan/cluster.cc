#include "common/plan/cluster.h"

#include <yaml-cpp/yaml.h>

#include <cmath>
#include <fstream>
#include <functional>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace hetpar::plan {
namespace {

// Published device figures (dense, without sparsity) and the links of the usual 8-GPU node.
// docs/planner.md gives the source of each number; compute_efficiency, tp_parallel_fraction,
// the latencies and step_overhead_s are assumptions stated there.
ClusterSpec Gpu(std::string name, std::string description, double bf16, double fp32, double fp64,
                double memory_gib, double memory_gbps, double nvlink_gbps, double nic_gbps,
                double efficiency) {
  ClusterSpec c;
  c.name = std::move(name);
  c.description = std::move(description);
  c.source = "vendor datasheets (docs/planner.md)";
  c.devices_per_node = 8;
  c.nodes = 0;
  c.memory_gib = memory_gib;
  c.reserved_gib = 4;
  c.memory_gbps = memory_gbps;
  c.peak_tflops = {{"bfloat16", bf16}, {"float32", fp32}, {"float64", fp64}};
  c.compute_efficiency = efficiency;
  c.tp_parallel_fraction = 0.97;
  c.intra_node = {nvlink_gbps, 10e-6, nvlink_gbps * 0.5, 8e-6};
  c.inter_node = {nic_gbps, 30e-6, nic_gbps, 10e-6};
  c.step_overhead_s = 0.005;
  return c;
}

const std::vector<ClusterSpec>& Presets() {
  static const auto* presets = new std::vector<ClusterSpec>{
      Gpu("a100-80g", "NVIDIA A100 SXM 80GB, 8 per node, NVLink 3, 200 Gb/s per GPU between nodes",
          312, 19.5, 19.5, 80, 2039, 230, 22, 0.55),
      Gpu("h100-sxm", "NVIDIA H100 SXM 80GB, 8 per node, NVLink 4, 400 Gb/s per GPU between nodes",
          989, 67, 67, 80, 3350, 370, 45, 0.5),
      Gpu("h200-sxm", "NVIDIA H200 SXM 141GB, 8 per node, NVLink 4, 400 Gb/s per GPU between nodes",
          989, 67, 67, 140, 4800, 370, 45, 0.5),
      Gpu("b200", "NVIDIA B200 180GB, 8 per node, NVLink 5, 400 Gb/s per GPU between nodes", 2250,
          75, 37, 179, 8000, 720, 45, 0.5),
      Gpu("l40s", "NVIDIA L40S 48GB, 8 per node over PCIe Gen4, 100 Gb/s per GPU between nodes",
          362, 91.6, 1.4, 45, 864, 25, 11, 0.5),
  };
  return *presets;
}

class Reader {
 public:
  explicit Reader(std::string origin) : origin_(std::move(origin)) {}

  std::string Where(const YAML::Node& node) const {
    return node.Mark().line >= 0 ? absl::StrCat(origin_, ":", node.Mark().line + 1) : origin_;
  }
  void Fail(const YAML::Node& at, const std::string& field, const std::string& message) {
    errors_.push_back(absl::StrCat(Where(at), ": ", field, message));
  }
  double Number(const YAML::Node& node, const std::string& field, double min, bool inclusive) {
    double value = 0;
    try {
      value = node.as<double>();
    } catch (const YAML::Exception&) {
      Fail(node, field,
           absl::StrCat("='", node.IsScalar() ? node.Scalar() : "(not a scalar)",
                        "' is not a number"));
      return 0;
    }
    if (!(inclusive ? value >= min : value > min) || !std::isfinite(value)) {
      Fail(node, field,
           absl::StrCat("=", node.Scalar(), " must be ", inclusive ? ">= " : "> ", min));
    }
    return value;
  }
  int64_t Integer(const YAML::Node& node, const std::string& field, int64_t min) {
    int64_t value = 0;
    try {
      value = node.as<int64_t>();
    } catch (const YAML::Exception&) {
      Fail(node, field,
           absl::StrCat("='", node.IsScalar() ? node.Scalar() : "(not a scalar)",
                        "' is not an integer"));
      return 0;
    }
    if (value < min) Fail(node, field, absl::StrCat("=", value, " must be >= ", min));
    return value;
  }
  void Link(const YAML::Node& node, const std::string& field, LinkSpec* link) {
    if (!node.IsMap()) {
      Fail(node, field,
           " must be a map of collective_gbps, collective_latency_s, p2p_gbps, "
           "p2p_latency_s");
      return;
    }
    std::map<std::string, bool> seen;
    for (const auto& item : node) {
      const std::string key = item.first.as<std::string>();
      const std::string name = absl::StrCat(field, ".", key);
      seen[key] = true;
      if (key == "collective_gbps") {
        link->collective_gbps = Number(item.second, name, 0, false);
      } else if (key == "collective_latency_s") {
        link->collective_latency_s = Number(item.second, name, 0, true);
      } else if (key == "p2p_gbps") {
        link->p2p_gbps = Number(item.second, name, 0, false);
      } else if (key == "p2p_latency_s") {
        link->p2p_latency_s = Number(item.second, name, 0, true);
      } else {
        Fail(item.first, name,
             " is not a field; expected collective_gbps, collective_latency_s, "
             "p2p_gbps or p2p_latency_s");
      }
    }
    for (const char* required : {"collective_gbps", "p2p_gbps"}) {
      if (!seen[required]) Fail(node, absl::StrCat(field, ".", required), " is required");
    }
  }
  // A module's section: its own compute_efficiency and layer_overhead_s, both optional.
  void Compute(const YAML::Node& node, const std::string& field, ModuleCompute* m) {
    if (!node.IsMap()) {
      Fail(node, field,
           field == "llm"
               ? " must be a map of compute_efficiency, layer_overhead_s, attention_call_overhead_s"
               : " must be a map of compute_efficiency, layer_overhead_s");
      return;
    }
    for (const auto& item : node) {
      const std::string key = item.first.as<std::string>();
      const std::string name = absl::StrCat(field, ".", key);
      if (key == "compute_efficiency") {
        m->compute_efficiency = Number(item.second, name, 0, false);
        if (*m->compute_efficiency > 1) {
          Fail(item.second, name, absl::StrCat("=", item.second.Scalar(), " must be <= 1"));
        }
      } else if (key == "layer_overhead_s") {
        m->layer_overhead_s = Number(item.second, name, 0, true);
      } else if (key == "attention_call_overhead_s" && field == "llm") {
        m->attention_call_overhead_s = Number(item.second, name, 0, true);
      } else {
        Fail(item.first, name,
             field == "llm" ? " is not a field; expected compute_efficiency, layer_overhead_s or "
                              "attention_call_overhead_s"
                            : " is not a field; expected compute_efficiency or layer_overhead_s");
      }
    }
  }
  const std::vector<std::string>& errors() const { return errors_; }

 private:
  std::string origin_;
  std::vector<std::string> errors_;
};

}  // namespace

absl::StatusOr<double> ClusterSpec::PeakFlops(v1::Dtype dtype) const {
  const char* name = dtype == v1::DTYPE_BFLOAT16  ? "bfloat16"
                     : dtype == v1::DTYPE_FLOAT64 ? "float64"
                                                  : "float32";
  auto it = peak_tflops.find(name);
  if (it == peak_tflops.end() || !(it->second > 0)) {
    std::vector<std::string> have;
    for (const auto& [k, v] : peak_tflops) have.push_back(k);
    return absl::InvalidArgumentError(
        absl::StrCat("cluster ", this->name, " has no peak_tflops.", name, " for run.dtype=", name,
                     " (it has: ", have.empty() ? "none" : absl::StrJoin(have, ", "), ")"));
  }
  return it->second * 1e12;
}

std::vector<std::string> ClusterPresetNames() {
  std::vector<std::string> names;
  for (const ClusterSpec& c : Presets()) names.push_back(c.name);
  return names;
}

absl::StatusOr<ClusterSpec> ClusterPreset(const std::string& name) {
  for (const ClusterSpec& c : Presets()) {
    if (c.name == name) return c;
  }
  return absl::NotFoundError(absl::StrCat(
      "no cluster preset '", name, "'; presets: ", absl::StrJoin(ClusterPresetNames(), ", ")));
}

absl::StatusOr<ClusterSpec> ParseClusterYaml(const std::string& text, const std::string& origin) {
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(origin, ":", e.mark.line + 1, ": not YAML: ", e.msg));
  }
  if (!root.IsMap()) {
    return absl::InvalidArgumentError(absl::StrCat(origin, ": a cluster file is a YAML map"));
  }
  Reader r(origin);
  ClusterSpec c;
  c.name = origin;
  std::map<std::string, bool> seen;
  for (const auto& item : root) {
    const std::string key = item.first.as<std::string>();
    const YAML::Node& v = item.second;
    seen[key] = true;
    if (key == "name") {
      c.name = v.as<std::string>();
    } else if (key == "description") {
      c.description = v.as<std::string>();
    } else if (key == "source") {
      c.source = v.as<std::string>();
    } else if (key == "devices_per_node") {
      c.devices_per_node = r.Integer(v, key, 1);
    } else if (key == "nodes") {
      c.nodes = r.Integer(v, key, 0);
    } else if (key == "share_devices") {
      try {
        c.share_devices = v.as<bool>();
      } catch (const YAML::Exception&) {
        r.Fail(v, key, absl::StrCat("='", v.Scalar(), "' is not true or false"));
      }
    } else if (key == "concurrency") {
      c.concurrency = r.Number(v, key, 0, true);
    } else if (key == "shared_collective_latency_s") {
      c.shared_collective_latency_s = r.Number(v, key, 0, true);
    } else if (key == "loaded_collective_latency_s") {
      c.loaded_collective_latency_s = r.Number(v, key, 0, true);
    } else if (key == "memory_gib") {
      c.memory_gib = r.Number(v, key, 0, false);
    } else if (key == "reserved_gib") {
      c.reserved_gib = r.Number(v, key, 0, true);
    } else if (key == "memory_gbps") {
      c.memory_gbps = r.Number(v, key, 0, false);
    } else if (key == "peak_tflops") {
      if (!v.IsMap() || v.size() == 0) {
        r.Fail(v, key, " must be a map from dtype (bfloat16, float32, float64) to TFLOPS");
        continue;
      }
      for (const auto& p : v) {
        const std::string dtype = p.first.as<std::string>();
        if (dtype != "bfloat16" && dtype != "float32" && dtype != "float64") {
          r.Fail(p.first, absl::StrCat(key, ".", dtype),
                 " is not a dtype; expected bfloat16, float32 or float64");
          continue;
        }
        c.peak_tflops[dtype] = r.Number(p.second, absl::StrCat(key, ".", dtype), 0, false);
      }
    } else if (key == "compute_efficiency") {
      c.compute_efficiency = r.Number(v, key, 0, false);
      if (c.compute_efficiency > 1) r.Fail(v, key, absl::StrCat("=", v.Scalar(), " must be <= 1"));
    } else if (key == "tp_parallel_fraction") {
      c.tp_parallel_fraction = r.Number(v, key, 0, true);
      if (c.tp_parallel_fraction > 1) {
        r.Fail(v, key, absl::StrCat("=", v.Scalar(), " must be <= 1"));
      }
    } else if (key == "layer_overhead_s") {
      c.layer_overhead_s = r.Number(v, key, 0, true);
    } else if (key == "encoder" || key == "llm") {
      r.Compute(v, key, key == "encoder" ? &c.encoder_compute : &c.llm_compute);
    } else if (key == "intra_node") {
      r.Link(v, key, &c.intra_node);
    } else if (key == "inter_node") {
      r.Link(v, key, &c.inter_node);
    } else if (key == "step_overhead_s") {
      c.step_overhead_s = r.Number(v, key, 0, true);
    } else {
      r.Fail(item.first, key,
             " is not a cluster field; expected name, description, source, devices_per_node, "
             "nodes, share_devices, concurrency, shared_collective_latency_s, "
             "loaded_collective_latency_s, memory_gib, reserved_gib, memory_gbps, peak_tflops, "
             "compute_efficiency, tp_parallel_fraction, layer_overhead_s, encoder, llm, "
             "intra_node, inter_node, step_overhead_s");
    }
  }
  std::vector<std::string> errors = r.errors();
  for (const char* required : {"devices_per_node", "memory_gib", "memory_gbps", "peak_tflops",
                               "compute_efficiency", "intra_node"}) {
    if (!seen[required]) errors.push_back(absl::StrCat(origin, ": ", required, " is required"));
  }
  if (!errors.empty()) return absl::InvalidArgumentError(absl::StrJoin(errors, "\n"));
  if (!seen["inter_node"]) c.inter_node = c.intra_node;
  return c;
}

absl::StatusOr<ClusterSpec> LoadClusterFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read cluster file ", path));
  std::stringstream text;
  text << in.rdbuf();
  return ParseClusterYaml(text.str(), path);
}

absl::StatusOr<ClusterSpec> ResolveCluster(const std::string& name_or_path) {
  auto preset = ClusterPreset(name_or_path);
  if (preset.ok()) return preset;
  std::ifstream probe(name_or_path);
  if (!probe) {
    return absl::NotFoundError(absl::StrCat("--cluster ", name_or_path, " is neither a preset (",
                                            absl::StrJoin(ClusterPresetNames(), ", "),
                                            ") nor a readable cluster file"));
  }
  return LoadClusterFile(name_or_path);
}

}  // namespace hetpar::plan
