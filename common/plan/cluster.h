// A described cluster for the layout planner (`hetpar plan --estimate / --search`): the device,
// how many sit in a node, and the links between them. Presets carry published device figures;
// a YAML file describes any other machine, and `plan_calibrate` writes one for the machine it
// runs on (docs/planner.md lists every constant and its source).
//
//   name: h100-sxm                 # free text
//   devices_per_node: 8            # GPUs (or, on CPUs, cores) per node
//   nodes: 0                       # 0: as many as a layout needs
//   share_devices: false           # true: ranks beyond the devices share them (CPU runs)
//   concurrency: 0                 # ranks' worth of compute a node delivers with every device
//                                  # busy; 0: devices_per_node (CPUs with shared cores: less)
//   shared_collective_latency_s: 0 # TP collective latency when every rank computes at once and
//                                  # ranks outnumber the devices (share_devices); 0: intra_node's
//   loaded_collective_latency_s: 0 # the same for one module's TP group while the other module
//                                  # computes on the shared devices; 0: intra_node's
//   memory_gib: 80                 # per device
//   reserved_gib: 2                # per device, not available to the model (runtime, buffers)
//   memory_gbps: 3350              # device memory bandwidth (the optimizer step is bound by it)
//   peak_tflops: {bfloat16: 989}   # dense peak per device, by run.dtype
//   compute_efficiency: 0.5        # achieved share of the peak on the models' work at tp 1
//   tp_parallel_fraction: 0.98     # share of a module's compute that TP divides (Amdahl)
//   layer_overhead_s: 0            # per layer, microbatch or encoder job, forward + backward:
//                                  # operator dispatch beyond the FLOPs (CPUs; GPUs queue ahead)
//   encoder: {compute_efficiency: 0.4, layer_overhead_s: 0.001}  # optional, per module: these
//   llm: {compute_efficiency: 0.35, layer_overhead_s: 0.002,     # two for its work only; the
//         attention_call_overhead_s: 0.0005}                     # LLM's extra attention calls
//   intra_node: {collective_gbps: 370, collective_latency_s: 1e-5, p2p_gbps: 150, p2p_latency_s:
//   1e-5} inter_node: {collective_gbps: 45, collective_latency_s: 3e-5, p2p_gbps: 45,
//   p2p_latency_s: 1e-5} step_overhead_s: 0.002         # per step: the control plane's round trips
//
// Bandwidths are GB/s (1e9 bytes) per device: collective_gbps is the bus bandwidth of an
// all-reduce (a ring moves 2 (n-1)/n of the bytes per device), p2p_gbps one message's one-way
// rate.
#ifndef HETPAR_COMMON_PLAN_CLUSTER_H_
#define HETPAR_COMMON_PLAN_CLUSTER_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "hetpar/v1/run_spec.pb.h"

namespace hetpar::plan {

struct LinkSpec {
  double collective_gbps = 0;
  double collective_latency_s = 0;
  double p2p_gbps = 0;
  double p2p_latency_s = 0;
};

// A module's own compute constants, where they differ from the cluster's (plan_calibrate
// measures each module's; the models' shapes and operators differ).
struct ModuleCompute {
  std::optional<double> compute_efficiency;
  std::optional<double> layer_overhead_s;
  // The LLM's only: per layer, forward + backward, each attention call of a microbatch beyond
  // its first (one per run of consecutive samples of one length; one per sample under CP). 0
  // where one kernel takes all the packed samples (CUDA's variable-length kernel).
  double attention_call_overhead_s = 0;
};

// The constants one module's work is estimated with.
struct ComputeConstants {
  double compute_efficiency = 0;
  double layer_overhead_s = 0;
  double attention_call_overhead_s = 0;
};

struct ClusterSpec {
  std::string name;
  std::string description;
  std::string source;  // where the figures come from
  int64_t devices_per_node = 1;
  int64_t nodes = 0;  // 0: unbounded
  bool share_devices = false;
  double concurrency = 0;
  double shared_collective_latency_s = 0;
  double loaded_collective_latency_s = 0;
  double memory_gib = 0;
  double reserved_gib = 0;
  double memory_gbps = 0;
  std::map<std::string, double> peak_tflops;  // by dtype name: bfloat16, float32, float64
  double compute_efficiency = 0.5;
  double tp_parallel_fraction = 1.0;
  double layer_overhead_s = 0;
  ModuleCompute encoder_compute;  // the `encoder` section
  ModuleCompute llm_compute;      // the `llm` section
  LinkSpec intra_node;
  LinkSpec inter_node;
  double step_overhead_s = 0;

  // Peak FLOP/s per device for `dtype`, or InvalidArgument naming the missing peak_tflops entry.
  absl::StatusOr<double> PeakFlops(v1::Dtype dtype) const;
  // The encoder's and the LLM's compute constants: their sections' values, else the cluster's.
  ComputeConstants EncoderCompute() const { return Resolve(encoder_compute); }
  ComputeConstants LlmCompute() const { return Resolve(llm_compute); }
  ComputeConstants Resolve(const ModuleCompute& m) const {
    return {m.compute_efficiency.value_or(compute_efficiency),
            m.layer_overhead_s.value_or(layer_overhead_s), m.attention_call_overhead_s};
  }
  // Devices available, 0 when unbounded.
  int64_t devices() const { return nodes > 0 ? nodes * devices_per_node : 0; }
  // Ranks' worth of compute of the whole cluster when every device is busy (0: unbounded).
  double Concurrency() const {
    return static_cast<double>(nodes) *
           (concurrency > 0 ? concurrency : static_cast<double>(devices_per_node));
  }
};

// The preset names, in the order `hetpar plan --help` lists them.
std::vector<std::string> ClusterPresetNames();

// A preset by name (a100-80g, h100-sxm, h200-sxm, b200, l40s), or NotFound listing the presets.
absl::StatusOr<ClusterSpec> ClusterPreset(const std::string& name);

// A cluster file. InvalidArgument names the file, the line and the field for a bad or unknown
// field, a missing required one (devices_per_node, memory_gib, peak_tflops, intra_node), or a
// value out of range.
absl::StatusOr<ClusterSpec> LoadClusterFile(const std::string& path);
absl::StatusOr<ClusterSpec> ParseClusterYaml(const std::string& text, const std::string& origin);

// A preset name or else a file path.
absl::StatusOr<ClusterSpec> ResolveCluster(const std::string& name_or_path);

}  // namespace hetpar::plan

#endif  // HETPAR_COMMON_PLAN_CLUSTER_H_
