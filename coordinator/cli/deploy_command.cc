// `hetpar deploy k8s|slurm`: render what a cluster needs to run a RunSpec (coordinator/deploy).

#include <cctype>
#include <filesystem>
#include <iostream>
#include <memory>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "common/cli_checks.h"
#include "common/config/config.h"
#include "common/control/security.h"
#include "coordinator/cli/commands.h"
#include "coordinator/deploy/deploy.h"
#include "yaml-cpp/yaml.h"

namespace hetpar::cli {
namespace {

// The run token of a Secret `hetpar deploy k8s` rendered before ("" when there is no such file).
absl::StatusOr<std::string> TokenOfRenderedSecret(const std::string& path) {
  std::error_code error;
  if (!std::filesystem::exists(path, error)) return std::string();
  try {
    const YAML::Node secret = YAML::LoadFile(path);
    const YAML::Node data = secret.IsMap() ? secret["stringData"] : YAML::Node();
    const YAML::Node token = data && data.IsMap() ? data["token"] : YAML::Node();
    if (!token || !token.IsScalar()) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, " holds no stringData.token; delete it to render the run with a new token"));
    }
    const std::string value = token.as<std::string>();
    if (absl::Status valid = coordinator::ValidateToken(value, path); !valid.ok()) return valid;
    return value;
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, " is not the YAML of a Secret (", e.what(),
                     "); delete it to render the run with a new token"));
  }
}

struct DeployFlags {
  std::string config;
  std::vector<std::string> overrides;
  std::string out;
  std::string device;  // "cpu" or "gpu"; empty: the config's run.device
  std::string token_file;
  deploy::DeployOptions options;
};

int Deploy(DeployFlags flags, bool kubernetes) {
  const char* what = kubernetes ? "hetpar deploy k8s" : "hetpar deploy slurm";
  config::LoadOptions load;
  load.overrides = flags.overrides;
  // The data set lives on the cluster, not necessarily here.
  load.check_files = false;
  absl::StatusOr<config::LoadedRunSpec> loaded = config::LoadRunSpecFile(flags.config, load);
  if (!loaded.ok()) {
    std::cerr << "hetpar: invalid config " << flags.config << ":\n"
              << loaded.status().message() << "\n";
    return kExitInvalidInput;
  }
  deploy::DeployOptions& options = flags.options;
  // The ranks request GPUs exactly when the workers compute on them (run.device).
  const std::string& run_device = loaded->spec.run().device();
  const std::string wanted = run_device == "cuda" ? "gpu" : "cpu";
  if (!flags.device.empty() && flags.device != wanted) {
    std::cerr << what << ": --device " << flags.device << " contradicts the config's run.device \""
              << run_device << "\" (" << flags.config << "): the workers compute where run.device "
              << "says; set run.device: " << (flags.device == "gpu" ? "cuda" : "cpu")
              << " (--set run.device=" << (flags.device == "gpu" ? "cuda" : "cpu")
              << ") or leave --device out\n";
    return kExitInvalidInput;
  }
  options.device = wanted == "gpu" ? deploy::Device::kGpu : deploy::Device::kCpu;
  const std::string out = std::filesystem::absolute(flags.out).lexically_normal().string();
  absl::StatusOr<std::vector<deploy::RenderedFile>> files;
  if (kubernetes) {
    absl::StatusOr<coordinator::RunToken> token =
        flags.token_file.empty()
            ? absl::StatusOr<coordinator::RunToken>(coordinator::RunToken{"", "generated"})
            : coordinator::ReadTokenFile(flags.token_file);
    if (!token.ok()) {
      std::cerr << what << ": --token-file: " << token.status().message() << "\n";
      return kExitInvalidInput;
    }
    if (token->value.empty()) {
      // Rendered again into the same directory: the Secret keeps its token. A new one, applied
      // under a running run, would lock out every worker started after it (a rejoining replica,
      // an evicted pod) and `hetpar status`.
      absl::StatusOr<std::string> kept = TokenOfRenderedSecret(out + "/manifests/secret.yaml");
      if (!kept.ok()) {
        std::cerr << what << ": " << kept.status().message() << "\n";
        return kExitInvalidInput;
      }
      if (!kept->empty()) {
        token->value = *kept;
        std::cout << "keeping the run token of " << out
                  << "/manifests/secret.yaml (delete that file for a new one)\n";
      }
    }
    if (token->value.empty()) {
      absl::StatusOr<std::string> fresh = coordinator::GenerateToken();
      if (!fresh.ok()) {
        std::cerr << what << ": " << fresh.status().message() << "\n";
        return kExitFailure;
      }
      token->value = *fresh;
    }
    options.token = token->value;
    files = deploy::RenderKubernetes(*loaded, options);
  } else {
    // sbatch splits its #SBATCH --output directive at whitespace and takes quotes there as its
    // own, and sbatch and srun expand '%' in --output paths (%j, %t): a run directory with any of
    // them would send the logs elsewhere.
    if (const size_t bad = out.find_first_of(" \t\n\r\"'\\%"); bad != std::string::npos) {
      std::cerr << what << ": --out '" << out << "' has "
                << (out[bad] == '%'                                      ? "'%'"
                    : std::isspace(static_cast<unsigned char>(out[bad])) ? "whitespace"
                                                                         : "a quote or backslash")
                << ", which Slurm's #SBATCH --output and srun --output paths cannot carry; give "
                   "the run a directory without whitespace, quotes, backslashes or '%'\n";
      return kExitInvalidInput;
    }
    options.run_dir = out;
    if (options.bin_dir.empty()) {
      options.bin_dir = std::filesystem::canonical("/proc/self/exe").parent_path().string();
    }
    options.bin_dir = std::filesystem::absolute(options.bin_dir).lexically_normal().string();
    files = deploy::RenderSlurm(*loaded, options);
  }
  if (!files.ok()) {
    std::cerr << what << ": cannot place " << flags.config << ":\n"
              << files.status().message() << "\n";
    return absl::IsInvalidArgument(files.status()) ? kExitInvalidInput : kExitFailure;
  }
  for (const deploy::RenderedFile& file : *files) {
    const std::string path = out + "/" + file.name;
    if (absl::Status s =
            WriteFileAtomically(path, file.content, AtomicFileOptions{file.secret ? 0600 : 0644});
        !s.ok()) {
      std::cerr << what << ": " << s.message() << "\n";
      return kExitFailure;
    }
    std::cout << "wrote " << path << (file.secret ? " (holds the run token; mode 0600)" : "")
              << "\n";
  }
  if (kubernetes) {
    std::cout << "next: copy the data set into the volume "
              << deploy::ObjectName(loaded->spec.run().name()) << "-data, then `kubectl apply -k "
              << out << "` (or `kubectl apply -f " << out
              << "/manifests`); watch with `hetpar status` through the coordinator's Service\n";
  } else {
    std::cout << "next: sbatch " << out << "/hetpar.sbatch (one allocation)"
              << (loaded->spec.placement() == v1::PLACEMENT_COLOCATED
                      ? ""
                      : absl::StrCat(" or sbatch ", out,
                                     "/hetpar-het.sbatch (encoder and LLM nodes as components)"))
              << "; " << out << " must be on a file system every node sees\n";
  }
  return kExitOk;
}

void AddCommonFlags(CLI::App* command, DeployFlags* flags) {
  command->add_option("-c,--config", flags->config, "RunSpec YAML file")->required();
  command->add_option("--set", flags->overrides,
                      "Override a field, e.g. --set llm.layout.tp=2 (repeatable)");
  command
      ->add_option("--device", flags->device,
                   "What each rank computes on: gpu (requests one GPU per rank) or cpu; "
                   "default: the config's run.device (cuda: gpu), which it must agree with")
      ->check(CLI::IsMember({"cpu", "gpu"}));
  command
      ->add_option("--gpus-per-node", flags->options.gpus_per_node,
                   "GPUs of a node; a replica's ranks must fit on one (with --device gpu)")
      ->check(hetpar::kPositiveNumber)
      ->capture_default_str();
  command
      ->add_option("--cpus-per-rank", flags->options.cpus_per_rank,
                   "CPU cores each rank requests (its intra-op threads)")
      ->check(hetpar::kPositiveNumber)
      ->capture_default_str();
  command
      ->add_option("--cpus-per-node", flags->options.cpus_per_node,
                   "CPU cores of a node; a replica's ranks must fit on one (0: unchecked)")
      ->check(hetpar::kNonNegativeNumber)
      ->capture_default_str();
  command->add_option("--port", flags->options.coordinator_port, "The coordinator's port")
      ->check(CLI::Range(1, 65535))
      ->capture_default_str();
}

void AddDeployCommand(CLI::App& app, int* exit_code) {
  CLI::App* deploy = app.add_subcommand(
      "deploy",
      "Render what a cluster needs to run a RunSpec: Kubernetes manifests or Slurm "
      "batch scripts (see docs/deploy.md)");
  deploy->require_subcommand(1);

  auto k8s = std::make_shared<DeployFlags>();
  CLI::App* k = deploy->add_subcommand(
      "k8s",
      "Kubernetes: a Secret with the run token, a ConfigMap with the RunSpec, run and "
      "data volumes, the coordinator (Deployment + Service), the encoder pool and the LLM "
      "ranks (StatefulSets, one pod per replica) and a kustomization");
  AddCommonFlags(k, k8s.get());
  k->add_option("--image", k8s->options.image, "Container image with the hetpar binaries")
      ->required();
  k->add_option("-o,--out", k8s->out, "Directory to write the manifests to")->required();
  k->add_option("--namespace", k8s->options.namespace_name, "Namespace (default: kubectl's)");
  k->add_option("--token-file", k8s->token_file,
                "Put this file's run token in the Secret (default: a fresh one)");
  k->add_option("--storage-class", k8s->options.storage_class,
                "StorageClass of the volumes, which need ReadWriteMany (default: the cluster's)");
  // A Kubernetes quantity of bytes: 20Gi, 500M, 1.5Ti.
  const CLI::Validator quantity(
      [](std::string& value) -> std::string {
        static const std::regex kQuantity(R"(^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$)");
        return std::regex_match(value, kQuantity)
                   ? std::string()
                   : "'" + value + "' is not a Kubernetes quantity of bytes (e.g. 20Gi, 500Mi)";
      },
      "QUANTITY");
  k->add_option("--run-volume-size", k8s->options.run_volume_size,
                "Size of the run volume (the run directory and checkpoint.dir's checkpoints)")
      ->check(quantity)
      ->capture_default_str();
  k->add_option("--data-volume-size", k8s->options.data_volume_size, "Size of the data volume")
      ->check(quantity)
      ->capture_default_str();
  k->add_option("--memory-per-rank", k8s->options.memory_per_rank,
                "Memory each worker container requests and is limited to (e.g. 96Gi; default: "
                "none, which leaves its pod the first evicted under memory pressure)")
      ->check(quantity);
  k->add_option("--shm-size", k8s->options.shm_size,
                "Size of each worker pod's /dev/shm (memory-backed; UCX's and NCCL's shared "
                "memory)")
      ->check(quantity)
      ->capture_default_str();
  k->add_flag("!--no-disruption-budgets,!--no-disruption-budget", k8s->options.disruption_budgets,
              "Render no PodDisruptionBudgets (by default a node drain evicts neither the "
              "coordinator nor an LLM pod, which would stop the run, and evicts encoder pods "
              "only while failure.min_encoder_replicas rejoined ones remain)");
  k->add_option("--grace-period", k8s->options.grace_period_s,
                "Seconds a terminated pod gets to finish its step")
      ->check(hetpar::kPositiveNumber)
      ->capture_default_str();
  k->callback([k8s, exit_code] { *exit_code = Deploy(*k8s, /*kubernetes=*/true); });

  auto slurm = std::make_shared<DeployFlags>();
  CLI::App* s = deploy->add_subcommand(
      "slurm",
      "Slurm: hetpar.sbatch (one allocation; the coordinator, encoder pool and LLM "
      "ranks as job steps) and hetpar-het.sbatch (a heterogeneous job: encoder nodes "
      "and LLM nodes as components), with run.yaml, in the run directory");
  AddCommonFlags(s, slurm.get());
  s->add_option("-o,--out", slurm->out,
                "Run directory, on a file system every node sees: the scripts go there and the "
                "run writes there")
      ->required();
  s->add_option("--bin-dir", slurm->options.bin_dir,
                "Directory of the hetpar binaries on the nodes (default: this binary's)");
  s->add_option("--interface", slurm->options.interface,
                "Network interface whose address workers advertise (default: the node's name)");
  s->add_option("--partition", slurm->options.partition, "Partition (default: the cluster's)");
  s->add_option("--time", slurm->options.time_limit, "Time limit of the job")
      ->capture_default_str();
  s->add_option("--stop-before-limit", slurm->options.stop_before_limit_s,
                "Seconds before the time limit at which the run stops after a checkpoint of the "
                "step in flight (submitting the script again continues it); 60 to 65535")
      ->check(CLI::Range(60, 65535))
      ->capture_default_str();
  s->add_option("--memory-per-rank", slurm->options.memory_per_rank,
                "Memory each rank requests, in Slurm's units (K, M, G, T: powers of 1024; M when "
                "none), e.g. 96G: #SBATCH --mem-per-cpu of it over --cpus-per-rank (default: "
                "none, the cluster's DefMemPerCPU)");
  s->add_option("--ranks-per-node", slurm->options.ranks_per_node,
                "Ranks each node runs: the job asks for whole nodes, and each module's replicas "
                "tile them (as many whole replicas per node as fit), so that no replica straddles "
                "two nodes; 0: Slurm places the tasks wherever it finds room (default: "
                "--gpus-per-node with --device gpu, else 0)")
      ->check(hetpar::kNonNegativeNumber);
  s->callback([slurm, exit_code] { *exit_code = Deploy(*slurm, /*kubernetes=*/false); });
}

}  // namespace

HETPAR_REGISTER_COMMAND(25, AddDeployCommand);

}  // namespace hetpar::cli
