// Renders what a cluster needs to run one RunSpec: Kubernetes manifests (`hetpar deploy k8s`) or
// Slurm batch scripts (`hetpar deploy slurm`). Pure text generation, no cluster access:
//
//   HETPAR_ASSIGN_OR_RETURN(config::LoadedRunSpec loaded, config::LoadRunSpecFile("run.yaml", {}));
//   deploy::DeployOptions options;
//   options.image = "registry.example/hetpar:0.4";
//   HETPAR_ASSIGN_OR_RETURN(std::vector<deploy::RenderedFile> files,
//                           deploy::RenderKubernetes(loaded, options));
//
// Every process the files start is one of the project's binaries with flags it takes; workers
// find their run through the HETPAR_* environment (docs/deploy.md). A RunSpec that cannot be
// placed (a replica needing more GPUs or CPUs than a node has) is refused with the field, its
// value and where it was written.
#ifndef HETPAR_COORDINATOR_DEPLOY_DEPLOY_H_
#define HETPAR_COORDINATOR_DEPLOY_DEPLOY_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/config/config.h"
#include "hetpar/v1/run_spec.pb.h"
#include "nlohmann/json.hpp"

namespace hetpar::deploy {

enum class Device { kCpu, kGpu };

struct DeployOptions {
  Device device = Device::kCpu;
  int64_t gpus_per_node = 8;  // checked when device is kGpu: a replica's ranks share a node
  int64_t cpus_per_rank = 2;  // CPU request of each rank (its intra-op threads)
  int64_t cpus_per_node = 0;  // checked when > 0
  int coordinator_port = 50051;
  std::string token;  // the run token (Kubernetes Secret); required for k8s

  // Kubernetes.
  std::string image = "hetpar:latest";
  std::string namespace_name;  // "" = kubectl's current namespace
  std::string storage_class;   // "" = the cluster's default
  std::string run_volume_size = "20Gi";
  std::string data_volume_size = "50Gi";
  int64_t grace_period_s = 300;  // terminationGracePeriodSeconds: time to finish a step
  std::string shm_size = "8Gi";  // each worker pod's /dev/shm (memory-backed)
  // Each rank's memory; "" = none. Kubernetes: each worker container's request and limit (a
  // quantity, 96Gi). Slurm: #SBATCH --mem-per-cpu of it over cpus_per_rank (96G, powers of 1024).
  std::string memory_per_rank;
  // PodDisruptionBudgets: drains evict neither the coordinator nor LLM (colocated) pods, and
  // encoder pods only while failure.min_encoder_replicas Ready ones remain
  // (manifests/disruption.yaml).
  bool disruption_budgets = true;

  // Slurm.
  std::string bin_dir;    // where the binaries are on the nodes (absolute)
  std::string run_dir;    // shared run directory on the nodes (absolute)
  std::string interface;  // network interface whose address workers advertise ("" = node name)
  std::string partition;  // "" = the cluster's default
  std::string time_limit = "1-00:00:00";
  // Seconds before the time limit at which the batch script's timer stops the run after a
  // checkpoint (SIGTERM to the coordinator's step).
  int64_t stop_before_limit_s = 600;
  // Ranks each node runs (--ranks-per-node): the job asks for whole nodes, and each module's
  // replicas tile them (as many whole replicas as fit in this many ranks per node), so that no
  // replica straddles two nodes. 0: Slurm places the tasks wherever it finds room. -1 (unset):
  // gpus_per_node with Device::kGpu, else 0.
  int64_t ranks_per_node = -1;
};

struct RenderedFile {
  std::string name;  // relative to the output directory
  std::string content;
  bool secret = false;  // holds the run token: written readable by its owner only
};

// Where the manifests mount things inside every container.
inline constexpr char kContainerRunDir[] = "/var/lib/hetpar/run";
inline constexpr char kContainerDataDir[] = "/var/lib/hetpar/data";
inline constexpr char kContainerConfigDir[] = "/etc/hetpar";
inline constexpr char kContainerTokenDir[] = "/var/run/secrets/hetpar";

// DeployOptions::ranks_per_node with its default applied: gpus_per_node on GPUs, else 0.
int64_t RanksPerNode(const DeployOptions& options);

// Problems that stop a RunSpec from being placed with `options`, as "field: =value ... (where)".
std::vector<std::string> PlacementProblems(const config::LoadedRunSpec& loaded,
                                           const DeployOptions& options);

// manifests/{secret,runspec,volumes,coordinator,workers,disruption}.yaml (plain objects for
// `kubectl apply -f DIR/manifests`: the token Secret, the RunSpec ConfigMap, the run and data
// volumes, the coordinator's Deployment and Service, the workers' headless Service and
// StatefulSets, the PodDisruptionBudgets unless options.disruption_budgets is false) and
// kustomization.yaml naming them (`kubectl apply -k DIR`, a base for overlays). The RunSpec in the
// ConfigMap has its data paths moved under kContainerDataDir (keeping their layout below the
// deepest directory holding them all), run.out_dir = kContainerRunDir and a checkpoint.dir moved to
// kContainerRunDir/checkpoints (with a checkpoint.resume_from below it).
absl::StatusOr<std::vector<RenderedFile>> RenderKubernetes(const config::LoadedRunSpec& loaded,
                                                           const DeployOptions& options);

// hetpar.sbatch (one allocation: coordinator, encoder pool and LLM ranks as job steps),
// hetpar-het.sbatch (a heterogeneous job: coordinator, encoder nodes, LLM nodes as its
// components) and run.yaml (the RunSpec with run.out_dir = options.run_dir).
absl::StatusOr<std::vector<RenderedFile>> RenderSlurm(const config::LoadedRunSpec& loaded,
                                                      const DeployOptions& options);

// JSON as block YAML: maps as "key: value" in their order, lists as "- ", multi-line strings as
// literal blocks, strings that would read as another type (numbers, booleans) quoted.
std::string JsonToYaml(const nlohmann::ordered_json& value);

// The pieces both renderers share.
struct ModuleShape {
  int64_t replicas = 0;           // DP size: pods / node groups
  int64_t ranks_per_replica = 0;  // TP x CP x PP: containers of a pod, tasks of a node
  int64_t pipeline_stages = 1;    // PP: a replica's ranks are this many stages' (see RankRequest)
};
ModuleShape EncoderShape(const v1::RunSpec& spec);
ModuleShape LlmShape(const v1::RunSpec& spec);
// A Kubernetes object name from the run name: lower case, [a-z0-9-], at most 40 characters.
std::string ObjectName(const std::string& run_name);
// The spec with its data paths moved from their deepest common directory to `data_dir` (and that
// directory, so the user knows what to copy), out_dir set and token_file cleared.
v1::RunSpec RelocatedSpec(const v1::RunSpec& spec, const std::string& data_dir,
                          const std::string& out_dir, std::string* data_root);

}  // namespace hetpar::deploy

#endif  // HETPAR_COORDINATOR_DEPLOY_DEPLOY_H_
