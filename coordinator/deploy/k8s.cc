// `hetpar deploy k8s`: the manifests of one run (see deploy.h and docs/deploy.md).
#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/control/security.h"
#include "coordinator/deploy/deploy.h"

namespace hetpar::deploy {
namespace {

using Json = nlohmann::ordered_json;

constexpr char kTokenKey[] = "token";
constexpr char kRunSpecKey[] = "run.yaml";
constexpr char kPodIndexLabel[] = "apps.kubernetes.io/pod-index";
constexpr int kImageUid = 10001;
constexpr char kReadyFile[] = "/tmp/hetpar-ready";  // a worker container's --ready-file

Json Metadata(const std::string& name, const std::string& run, const std::string& component,
              const DeployOptions& options) {
  Json m = {{"name", name}};
  if (!options.namespace_name.empty()) m["namespace"] = options.namespace_name;
  m["labels"] = {{"app.kubernetes.io/name", "hetpar"},
                 {"app.kubernetes.io/instance", run},
                 {"app.kubernetes.io/component", component}};
  return m;
}

Json Selector(const std::string& run, const std::string& component) {
  return {{"app.kubernetes.io/name", "hetpar"},
          {"app.kubernetes.io/instance", run},
          {"app.kubernetes.io/component", component}};
}

Json EnvValue(const std::string& name, const std::string& value) {
  return {{"name", name}, {"value", value}};
}

Json EnvField(const std::string& name, const std::string& field_path) {
  return {{"name", name}, {"valueFrom", {{"fieldRef", {{"fieldPath", field_path}}}}}};
}

struct Names {
  std::string run;  // object name prefix
  std::string token_secret, runspec, run_volume, data_volume, coordinator, workers_service;
  explicit Names(const std::string& run_name) : run(ObjectName(run_name)) {
    token_secret = run + "-token";
    runspec = run + "-runspec";
    run_volume = run + "-run";
    data_volume = run + "-data";
    coordinator = run + "-coordinator";
    workers_service = run + "-workers";
  }
};

// The pod's volumes; only the coordinator reads the RunSpec (workers get it when they register).
Json Volumes(const Names& n, bool with_runspec) {
  Json volumes = Json::array(
      {{{"name", "token"}, {"secret", {{"secretName", n.token_secret}, {"defaultMode", 0440}}}}});
  if (with_runspec) volumes.push_back({{"name", "runspec"}, {"configMap", {{"name", n.runspec}}}});
  volumes.push_back({{"name", "run"}, {"persistentVolumeClaim", {{"claimName", n.run_volume}}}});
  volumes.push_back({{"name", "data"}, {"persistentVolumeClaim", {{"claimName", n.data_volume}}}});
  return volumes;
}

// Shared memory for the workers: UCX's and NCCL's shared-memory transports map their segments
// in /dev/shm, which a container gets 64 MiB of by default.
Json ShmVolume(const DeployOptions& options) {
  return {{"name", "shm"}, {"emptyDir", {{"medium", "Memory"}, {"sizeLimit", options.shm_size}}}};
}

// The image's user (deploy/docker/Dockerfile); fsGroup lets it read the token and write the
// volumes.
Json PodSecurity() {
  return {{"runAsNonRoot", true},
          {"runAsUser", kImageUid},
          {"runAsGroup", kImageUid},
          {"fsGroup", kImageUid},
          // The volumes' files are handed to fsGroup only when their root is not already:
          // otherwise every pod start walks the whole data set.
          {"fsGroupChangePolicy", "OnRootMismatch"}};
}

Json VolumeMounts(bool with_runspec) {
  Json mounts =
      Json::array({{{"name", "token"}, {"mountPath", kContainerTokenDir}, {"readOnly", true}}});
  if (with_runspec) {
    mounts.push_back({{"name", "runspec"}, {"mountPath", kContainerConfigDir}, {"readOnly", true}});
  }
  mounts.push_back({{"name", "run"}, {"mountPath", kContainerRunDir}});
  mounts.push_back({{"name", "data"}, {"mountPath", kContainerDataDir}});
  return mounts;
}

Json WorkerMounts() {
  Json mounts = VolumeMounts(/*with_runspec=*/false);
  mounts.push_back({{"name", "shm"}, {"mountPath", "/dev/shm"}});
  return mounts;
}

Json WorkerVolumes(const Names& n, const DeployOptions& options) {
  Json volumes = Volumes(n, /*with_runspec=*/false);
  volumes.push_back(ShmVolume(options));
  return volumes;
}

Json Resources(const DeployOptions& options, int64_t ranks) {
  Json requests = {{"cpu", std::to_string(options.cpus_per_rank * ranks)}};
  Json limits = Json::object();
  // Requested and limited alike: a pod holding tens of GB with no request is the first evicted
  // under memory pressure. (One rank per container.)
  if (!options.memory_per_rank.empty()) {
    requests["memory"] = options.memory_per_rank;
    limits["memory"] = options.memory_per_rank;
  }
  if (options.device == Device::kGpu) {
    limits["nvidia.com/gpu"] = std::to_string(ranks);
  }
  Json r = {{"requests", requests}};
  if (!limits.empty()) r["limits"] = limits;
  return r;
}

std::string TokenPath() { return absl::StrCat(kContainerTokenDir, "/", kTokenKey); }

// The port of coordinator.metrics_listen, or 0 when metrics are off.
int MetricsPort(const v1::RunSpec& spec) {
  return std::max(0, coordinator::PortOf(spec.coordinator().metrics_listen()));
}

Json CoordinatorObjects(const v1::RunSpec& spec, const Names& n, const DeployOptions& options) {
  const std::string port = std::to_string(options.coordinator_port);
  const int metrics_port = MetricsPort(spec);
  Json container = {
      {"name", "coordinator"},
      {"image", options.image},
      {"command", Json::array({"hetpar", "coordinator"})},
      {"args", Json::array({"--linger"})},
      {"env",
       Json::array({EnvValue("HETPAR_CONFIG", absl::StrCat(kContainerConfigDir, "/", kRunSpecKey)),
                    EnvValue("HETPAR_LISTEN", absl::StrCat("0.0.0.0:", port)),
                    EnvValue("HETPAR_OUT", kContainerRunDir),
                    EnvValue("HETPAR_TOKEN_FILE", TokenPath())})},
      {"ports", Json::array({{{"name", "grpc"}, {"containerPort", options.coordinator_port}}})},
      // The standard gRPC health service (SERVING while the coordinator runs).
      {"readinessProbe", {{"grpc", {{"port", options.coordinator_port}}}, {"periodSeconds", 5}}},
      {"livenessProbe",
       {{"grpc", {{"port", options.coordinator_port}}},
        {"periodSeconds", 10},
        {"failureThreshold", 6}}},
      {"resources", {{"requests", {{"cpu", "1"}}}}},
      {"volumeMounts", VolumeMounts(/*with_runspec=*/true)}};
  Json pod_metadata = {{"labels", Selector(n.run, "coordinator")}};
  Json service_ports =
      Json::array({{{"name", "grpc"}, {"port", options.coordinator_port}, {"targetPort", "grpc"}}});
  if (metrics_port > 0) {
    // Prometheus scrapes the coordinator only: the workers' figures reach it in their reports.
    container["ports"].push_back({{"name", "metrics"}, {"containerPort", metrics_port}});
    container["env"].push_back(
        EnvValue("HETPAR_METRICS_LISTEN", absl::StrCat("0.0.0.0:", metrics_port)));
    service_ports.push_back(
        {{"name", "metrics"}, {"port", metrics_port}, {"targetPort", "metrics"}});
    pod_metadata["annotations"] = {{"prometheus.io/scrape", "true"},
                                   {"prometheus.io/port", std::to_string(metrics_port)},
                                   {"prometheus.io/path", "/metrics"}};
  }
  Json deployment = {{"apiVersion", "apps/v1"},
                     {"kind", "Deployment"},
                     {"metadata", Metadata(n.coordinator, n.run, "coordinator", options)},
                     {"spec",
                      {{"replicas", 1},
                       {"strategy", {{"type", "Recreate"}}},
                       {"selector", {{"matchLabels", Selector(n.run, "coordinator")}}},
                       {"template",
                        {{"metadata", pod_metadata},
                         {"spec",
                          {{"terminationGracePeriodSeconds", options.grace_period_s},
                           {"securityContext", PodSecurity()},
                           {"containers", Json::array({container})},
                           {"volumes", Volumes(n, /*with_runspec=*/true)}}}}}}}};
  Json service = {
      {"apiVersion", "v1"},
      {"kind", "Service"},
      {"metadata", Metadata(n.coordinator, n.run, "coordinator", options)},
      {"spec", {{"selector", Selector(n.run, "coordinator")}, {"ports", service_ports}}}};
  return Json::array({deployment, service});
}

// One StatefulSet per module: a pod per replica, a container per rank of the replica.
Json WorkerStatefulSet(const Names& n, const std::string& component, const std::string& binary,
                       bool colocated, const ModuleShape& shape, const DeployOptions& options) {
  const std::string name = absl::StrCat(n.run, "-", component);
  Json containers = Json::array();
  for (int64_t local = 0; local < shape.ranks_per_replica; ++local) {
    Json args = Json::array({"--ranks-per-replica", std::to_string(shape.ranks_per_replica),
                             "--local-rank", std::to_string(local)});
    // Not colocated: a colocated rank's loss fails the run anyway, and its encoder TP groups,
    // consecutive ranks, would be split over pods.
    if (!colocated && shape.pipeline_stages > 1) {
      // The pod still holds one DP replica: its containers are that replica's ranks of every
      // stage (worker::RankRequest).
      for (const std::string& a :
           {std::string("--replicas"), std::to_string(shape.replicas),
            std::string("--pipeline-stages"), std::to_string(shape.pipeline_stages)}) {
        args.push_back(a);
      }
    }
    if (colocated) args.push_back("--colocated");
    args.push_back("--linger");
    Json env = Json::array(
        {EnvValue("HETPAR_COORDINATOR", absl::StrCat(n.coordinator, ":", options.coordinator_port)),
         EnvValue("HETPAR_TOKEN_FILE", TokenPath()),
         // The pod's index in its StatefulSet is the module replica it hosts.
         EnvField("HETPAR_REPLICA", absl::StrCat("metadata.labels['", kPodIndexLabel, "']")),
         EnvField("HETPAR_HOST", "status.podIP"), EnvValue("HETPAR_OUT", kContainerRunDir),
         EnvValue("HETPAR_THREADS", std::to_string(options.cpus_per_rank))});
    // Ready while the worker trains with the run (from its first committed step until it
    // stops, leaves or fails): a pod is Ready once every rank it hosts has joined, which the
    // encoder pods' disruption budget counts on. In the container's own /tmp, not in a volume
    // of the pod: a container restarted after a crash must not find its predecessor's file and
    // be Ready before its worker has removed it. Probed every 2 s, and unready at the first
    // miss, so that a worker that stopped training is not counted for long; an exec that a
    // loaded node runs slowly has 5 s (the default, 1 s, would count it as a miss).
    const std::string name = absl::StrCat("rank-", local);
    env.push_back(EnvValue("HETPAR_READY_FILE", kReadyFile));
    containers.push_back({{"name", name},
                          {"image", options.image},
                          {"command", Json::array({binary})},
                          {"args", args},
                          {"env", env},
                          {"readinessProbe",
                           {{"exec", {{"command", Json::array({"test", "-e", kReadyFile})}}},
                            {"periodSeconds", 2},
                            {"timeoutSeconds", 5},
                            {"failureThreshold", 1}}},
                          {"resources", Resources(options, 1)},
                          {"volumeMounts", WorkerMounts()}});
  }
  return {{"apiVersion", "apps/v1"},
          {"kind", "StatefulSet"},
          {"metadata", Metadata(name, n.run, component, options)},
          {"spec",
           {{"serviceName", n.workers_service},
            {"replicas", shape.replicas},
            // Every replica starts at once: the run needs all of them.
            {"podManagementPolicy", "Parallel"},
            // A changed template replaces no pod by itself: a rolling update would delete a pod
            // of a training run and then wait for its successor to be Ready, which it is only
            // once the run trains with every replica again (docs/deploy.md).
            {"updateStrategy", {{"type", "OnDelete"}}},
            {"selector", {{"matchLabels", Selector(n.run, component)}}},
            {"template",
             {{"metadata", {{"labels", Selector(n.run, component)}}},
              {"spec",
               {{"terminationGracePeriodSeconds", options.grace_period_s},
                {"securityContext", PodSecurity()},
                {"containers", containers},
                {"volumes", WorkerVolumes(n, options)}}}}}}}};
}

std::string Document(const Json& objects) {
  std::vector<std::string> docs;
  for (const Json& object : objects) docs.push_back(JsonToYaml(object));
  return absl::StrJoin(docs, "---\n");
}

// The run's PodDisruptionBudgets, which a voluntary disruption (a node drain, an eviction) must
// respect. An evicted LLM or colocated worker stops the whole run (its SIGTERM asks to leave, and
// its state is held by no other worker), and so does the coordinator (its Deployment's next pod
// continues the run after every worker restarted): `<run>` lets none of them go. An evicted
// encoder pod leaves the pool after the step in flight and its replacement rejoins, so `<run>-
// encoder` lets them go while failure.min_encoder_replicas Ready pods (pods whose ranks train
// with the run, --ready-file) would remain; a pod being replaced is not Ready until it has
// rejoined. A pod may be in one budget only, so `<run>` leaves the encoder pods out.
Json DisruptionBudgets(const v1::RunSpec& spec, const Names& n, const DeployOptions& options) {
  const bool colocated = spec.placement() == v1::PLACEMENT_COLOCATED;
  Json selector = {{"matchLabels",
                    {{"app.kubernetes.io/name", "hetpar"}, {"app.kubernetes.io/instance", n.run}}}};
  if (!colocated) {
    selector["matchExpressions"] = Json::array({{{"key", "app.kubernetes.io/component"},
                                                 {"operator", "NotIn"},
                                                 {"values", Json::array({"encoder"})}}});
  }
  Json budgets = Json::array({{{"apiVersion", "policy/v1"},
                               {"kind", "PodDisruptionBudget"},
                               {"metadata", Metadata(n.run, n.run, "run", options)},
                               {"spec", {{"maxUnavailable", 0}, {"selector", selector}}}}});
  if (!colocated) {
    budgets.push_back(
        {{"apiVersion", "policy/v1"},
         {"kind", "PodDisruptionBudget"},
         {"metadata", Metadata(n.run + "-encoder", n.run, "encoder", options)},
         {"spec",
          {{"minAvailable", std::max<int64_t>(1, spec.failure().min_encoder_replicas())},
           {"selector", {{"matchLabels", Selector(n.run, "encoder")}}}}}});
  }
  return budgets;
}

std::string Pvc(const Names& n, const std::string& name, const std::string& component,
                const std::string& size, const DeployOptions& options) {
  Json spec = {{"accessModes", Json::array({"ReadWriteMany"})},
               {"resources", {{"requests", {{"storage", size}}}}}};
  if (!options.storage_class.empty()) spec["storageClassName"] = options.storage_class;
  return JsonToYaml({{"apiVersion", "v1"},
                     {"kind", "PersistentVolumeClaim"},
                     {"metadata", Metadata(name, n.run, component, options)},
                     {"spec", spec}});
}

}  // namespace

absl::StatusOr<std::vector<RenderedFile>> RenderKubernetes(const config::LoadedRunSpec& loaded,
                                                           const DeployOptions& options) {
  if (std::vector<std::string> problems = PlacementProblems(loaded, options); !problems.empty()) {
    return absl::InvalidArgumentError(absl::StrJoin(problems, "\n"));
  }
  if (options.token.empty()) return absl::InvalidArgumentError("no run token to put in the Secret");
  const v1::RunSpec& spec = loaded.spec;
  if (const std::string& metrics = spec.coordinator().metrics_listen(); !metrics.empty()) {
    // The pod publishes the metrics port and Prometheus scrapes it: it must be fixed, and not
    // the coordinator's own.
    const int port = coordinator::PortOf(metrics);
    if (port == 0 || port == options.coordinator_port) {
      return absl::InvalidArgumentError(absl::StrCat(
          "coordinator.metrics_listen: ='", metrics, "' ",
          port == 0 ? "picks a free port, which no Service or scrape annotation can name"
                    : absl::StrCat("is the coordinator's gRPC port (--port ",
                                   options.coordinator_port, ")"),
          "; expected a fixed port of its own, e.g. 0.0.0.0:9464 (",
          loaded.source.Where("coordinator.metrics_listen"), ")"));
    }
  }
  const Names n(spec.run().name());
  std::string data_root;
  const v1::RunSpec container_spec =
      RelocatedSpec(spec, kContainerDataDir, kContainerRunDir, &data_root);
  const std::string header = absl::StrCat(
      "# hetpar run '", spec.run().name(), "', rendered by `hetpar deploy k8s`. Copy the data set ",
      "(", data_root, ") into the volume ", n.data_volume, " before the workers start.",
      spec.checkpoint().dir().empty()
          ? std::string()
          : absl::StrCat(" Checkpoints go to ", container_spec.checkpoint().dir(), " on the volume ",
                         n.run_volume, ": size it for them (--run-volume-size)."),
      "\n");

  std::vector<RenderedFile> files;
  files.push_back(
      {"manifests/secret.yaml",
       absl::StrCat(header,
                    JsonToYaml({{"apiVersion", "v1"},
                                {"kind", "Secret"},
                                {"metadata", Metadata(n.token_secret, n.run, "token", options)},
                                {"type", "Opaque"},
                                {"stringData", {{kTokenKey, options.token}}}})),
       /*secret=*/true});
  files.push_back(
      {"manifests/runspec.yaml",
       absl::StrCat(
           header,
           JsonToYaml({{"apiVersion", "v1"},
                       {"kind", "ConfigMap"},
                       {"metadata", Metadata(n.runspec, n.run, "runspec", options)},
                       {"data", {{kRunSpecKey, config::RunSpecToYaml(container_spec)}}}}))});
  files.push_back(
      {"manifests/volumes.yaml",
       absl::StrCat(header, Pvc(n, n.run_volume, "run", options.run_volume_size, options), "---\n",
                    Pvc(n, n.data_volume, "data", options.data_volume_size, options))});
  files.push_back({"manifests/coordinator.yaml",
                   absl::StrCat(header, Document(CoordinatorObjects(spec, n, options)))});

  Json workers = Json::array();
  // Stable pod names and DNS for the workers (a StatefulSet's governing Service).
  workers.push_back(
      {{"apiVersion", "v1"},
       {"kind", "Service"},
       {"metadata", Metadata(n.workers_service, n.run, "workers", options)},
       {"spec",
        {{"clusterIP", "None"},
         {"selector",
          {{"app.kubernetes.io/name", "hetpar"}, {"app.kubernetes.io/instance", n.run}}},
         {"publishNotReadyAddresses", true}}}});
  if (spec.placement() == v1::PLACEMENT_COLOCATED) {
    workers.push_back(
        WorkerStatefulSet(n, "colocated", "hetpar-llm", true, LlmShape(spec), options));
  } else {
    workers.push_back(
        WorkerStatefulSet(n, "encoder", "hetpar-encoder", false, EncoderShape(spec), options));
    workers.push_back(WorkerStatefulSet(n, "llm", "hetpar-llm", false, LlmShape(spec), options));
  }
  files.push_back({"manifests/workers.yaml", absl::StrCat(header, Document(workers))});

  std::vector<std::string> resources = {"manifests/secret.yaml", "manifests/runspec.yaml",
                                        "manifests/volumes.yaml", "manifests/coordinator.yaml",
                                        "manifests/workers.yaml"};
  if (options.disruption_budgets) {
    files.push_back({"manifests/disruption.yaml",
                     absl::StrCat(header, Document(DisruptionBudgets(spec, n, options)))});
    resources.push_back("manifests/disruption.yaml");
  }

  Json kustomization = {{"apiVersion", "kustomize.config.k8s.io/v1beta1"},
                        {"kind", "Kustomization"}};
  if (!options.namespace_name.empty()) kustomization["namespace"] = options.namespace_name;
  kustomization["resources"] = resources;
  files.push_back({"kustomization.yaml", absl::StrCat(header, JsonToYaml(kustomization))});
  return files;
}

}  // namespace hetpar::deploy
