// `hetpar deploy k8s|slurm` on the example configs: the objects follow the layouts, every
// container runs a real binary with flags and environment variables it takes, the token comes
// from the Secret, and a config that cannot be placed is refused with field, value and file:line.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "coordinator/deploy/deploy.h"
#include "tests/coordinator/coordinator_test_util.h"
#include "tests/deploy/k8s_util.h"
#include "tests/util/subprocess.h"

namespace hetpar::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

const std::string kBinDir = std::filesystem::path(kHetparBin).parent_path().string();

CommandResult RunOk(const std::vector<std::string>& argv) {
  auto r = RunCommand(argv, 60);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *r : CommandResult{};
}

struct Rendered {
  TempDir dir;
  std::vector<YAML::Node> objects;
};

void RenderK8s(const std::string& config, Rendered* out, std::vector<std::string> extra = {}) {
  std::vector<std::string> argv = {kHetparBin,
                                   "deploy",
                                   "k8s",
                                   "--config",
                                   kSourceDir + "/configs/" + config,
                                   "--image",
                                   "registry.example/hetpar:test",
                                   "--out",
                                   out->dir.path()};
  argv.insert(argv.end(), extra.begin(), extra.end());
  const CommandResult r = RunOk(argv);
  ASSERT_EQ(r.exit_code, 0) << r.stderr_text;
  out->objects = LoadObjects(out->dir.path());
}

// Whether a label selector (matchLabels and matchExpressions, as Kubernetes reads them) selects
// a pod with `labels`.
bool Selects(const YAML::Node& selector, const YAML::Node& labels) {
  for (const auto& l : selector["matchLabels"]) {
    const YAML::Node value = labels[l.first.as<std::string>()];
    if (!value || value.as<std::string>() != l.second.as<std::string>()) return false;
  }
  for (const YAML::Node& e : selector["matchExpressions"]) {
    const YAML::Node value = labels[e["key"].as<std::string>()];
    const std::string op = e["operator"].as<std::string>();
    std::set<std::string> values;
    for (const YAML::Node& v : e["values"]) values.insert(v.as<std::string>());
    const bool in = value && values.count(value.as<std::string>()) > 0;
    if (op == "In" && !in) return false;
    if (op == "NotIn" && in) return false;
    if (op == "Exists" && !value) return false;
    if (op == "DoesNotExist" && value) return false;
  }
  return true;
}

// The PodDisruptionBudgets that select the pods of `workload` (a StatefulSet or Deployment).
std::vector<YAML::Node> BudgetsOf(const std::vector<YAML::Node>& objects,
                                  const YAML::Node& workload) {
  std::vector<YAML::Node> budgets;
  for (const YAML::Node& pdb : OfKind(objects, "PodDisruptionBudget")) {
    if (Selects(pdb["spec"]["selector"], workload["spec"]["template"]["metadata"]["labels"])) {
      budgets.push_back(pdb);
    }
  }
  return budgets;
}

// Checks every container of `pod_spec`: a real binary, flags and HETPAR_* variables it documents,
// the token file inside a mount of the Secret `secret`; a worker's readiness probe tests for
// its --ready-file, outside the pod's volumes.
void CheckContainers(const YAML::Node& pod_spec, const std::string& secret) {
  std::map<std::string, std::string> volume_secret;  // volume name -> secret name
  for (const YAML::Node& v : pod_spec["volumes"]) {
    if (v["secret"])
      volume_secret[v["name"].as<std::string>()] = v["secret"]["secretName"].as<std::string>();
  }
  for (const YAML::Node& c : pod_spec["containers"]) {
    const std::vector<std::string> command = c["command"].as<std::vector<std::string>>();
    ASSERT_FALSE(command.empty());
    const std::string binary = command[0];
    ASSERT_TRUE(std::filesystem::exists(kBinDir + "/" + binary))
        << c["name"] << " runs '" << binary << "', not a hetpar binary";
    // `hetpar coordinator --help` documents the subcommand's flags.
    std::vector<std::string> help_argv = command;
    help_argv[0] = kBinDir + "/" + binary;
    help_argv.push_back("--help");
    const CommandResult help = RunOk(help_argv);
    ASSERT_EQ(help.exit_code, 0) << help.stderr_text;
    std::vector<std::string> args;
    if (c["args"]) args = c["args"].as<std::vector<std::string>>();
    for (const std::string& a : args) {
      if (a.rfind("--", 0) == 0) {
        EXPECT_THAT(help.stdout_text, HasSubstr(a + " ")) << binary << " has no flag " << a;
      }
    }
    std::string token_file;
    for (const YAML::Node& e : c["env"]) {
      const std::string name = e["name"].as<std::string>();
      EXPECT_THAT(help.stdout_text, HasSubstr("Env:" + name))
          << binary << " reads no environment variable " << name;
      if (name == "HETPAR_TOKEN_FILE") token_file = e["value"].as<std::string>();
      EXPECT_NE(name, "HETPAR_TOKEN") << "the token must come from the Secret's file";
    }
    ASSERT_FALSE(token_file.empty()) << c["name"] << " gets no token file";
    bool from_secret = false;
    for (const YAML::Node& m : c["volumeMounts"]) {
      const std::string mount = m["mountPath"].as<std::string>();
      if (token_file.rfind(mount + "/", 0) == 0 &&
          volume_secret[m["name"].as<std::string>()] == secret) {
        from_secret = true;
      }
    }
    EXPECT_TRUE(from_secret) << token_file << " is not in a mount of the Secret " << secret;
    if (binary == "hetpar") continue;  // the coordinator's probe is gRPC health
    std::string ready_file;
    for (const YAML::Node& e : c["env"]) {
      if (e["name"].as<std::string>() == "HETPAR_READY_FILE")
        ready_file = e["value"].as<std::string>();
    }
    ASSERT_FALSE(ready_file.empty()) << c["name"] << " has no ready file";
    EXPECT_EQ(c["readinessProbe"]["exec"]["command"].as<std::vector<std::string>>(),
              (std::vector<std::string>{"test", "-e", ready_file}));
    // Unready at the first miss: a worker that stopped training is not counted for long.
    EXPECT_EQ(c["readinessProbe"]["failureThreshold"].as<int>(), 1);
    // A slow exec on a loaded node is not a miss.
    EXPECT_EQ(c["readinessProbe"]["timeoutSeconds"].as<int>(), 5);
    // In the container's own file system, which a restart after a crash replaces: in a volume
    // (which lasts as long as the pod), the file a crashed worker left would make its successor
    // Ready before it had joined.
    for (const YAML::Node& m : c["volumeMounts"]) {
      EXPECT_NE(ready_file.rfind(m["mountPath"].as<std::string>() + "/", 0), 0u)
          << ready_file << " is in the volume " << m["name"];
    }
  }
}

TEST(DeployK8sTest, TinyObjectsFollowTheLayoutsAndRunRealBinaries) {
  Rendered r;
  RenderK8s("tiny.yaml", &r);
  ASSERT_FALSE(r.objects.empty());
  // configs/tiny.yaml: encoder dp 2 tp 1, LLM dp 1 tp 2.
  const YAML::Node encoder = Named(r.objects, "StatefulSet", "tiny-encoder");
  const YAML::Node llm = Named(r.objects, "StatefulSet", "tiny-llm");
  ASSERT_TRUE(encoder && llm);
  EXPECT_EQ(encoder["spec"]["replicas"].as<int>(), 2);
  EXPECT_EQ(encoder["spec"]["template"]["spec"]["containers"].size(), 1u);
  EXPECT_EQ(llm["spec"]["replicas"].as<int>(), 1);
  EXPECT_EQ(llm["spec"]["template"]["spec"]["containers"].size(), 2u);
  // A changed template replaces no training pod by itself.
  for (const YAML::Node& set : {encoder, llm}) {
    EXPECT_EQ(set["spec"]["updateStrategy"]["type"].as<std::string>(), "OnDelete");
  }
  const YAML::Node secret = Named(r.objects, "Secret", "tiny-token");
  ASSERT_TRUE(secret);
  EXPECT_EQ(secret["stringData"]["token"].as<std::string>().size(), 64u);
  struct stat st = {};
  ASSERT_EQ(::stat((r.dir.path() + "/manifests/secret.yaml").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  for (const YAML::Node& set : {encoder, llm}) {
    CheckContainers(set["spec"]["template"]["spec"], "tiny-token");
  }
  const YAML::Node coordinator = Named(r.objects, "Deployment", "tiny-coordinator");
  ASSERT_TRUE(coordinator);
  CheckContainers(coordinator["spec"]["template"]["spec"], "tiny-token");
  EXPECT_EQ(coordinator["spec"]["replicas"].as<int>(), 1);
  EXPECT_TRUE(Named(r.objects, "Service", "tiny-coordinator"));
  // The RunSpec in the ConfigMap loads and keeps the layouts; paths point into the mounts.
  const YAML::Node runspec = Named(r.objects, "ConfigMap", "tiny-runspec");
  ASSERT_TRUE(runspec);
  const YAML::Node spec = YAML::Load(runspec["data"]["run.yaml"].as<std::string>());
  EXPECT_EQ(spec["encoder"]["layout"]["dp"].as<int>(), 2);
  EXPECT_EQ(spec["run"]["out_dir"].as<std::string>(), "/var/lib/hetpar/run");
  EXPECT_EQ(spec["data"]["manifest"].as<std::string>(), "/var/lib/hetpar/data/train.jsonl");
  EXPECT_EQ(spec["data"]["tokenizer"].as<std::string>(), "/var/lib/hetpar/data/tokenizer.model");
  // The kustomization names every manifest file.
  const YAML::Node k = YAML::LoadFile(r.dir.path() + "/kustomization.yaml");
  for (const YAML::Node& file : k["resources"]) {
    EXPECT_TRUE(std::filesystem::exists(r.dir.path() + "/" + file.as<std::string>())) << file;
  }
  EXPECT_EQ(k["resources"].size(), 6u);
  // Every pod of the run is in one disruption budget (Kubernetes refuses to evict a pod in two):
  // a drain may evict neither the coordinator nor an LLM pod, and encoder pods only while
  // failure.min_encoder_replicas (default 1) Ready ones remain.
  for (const YAML::Node& owner : {coordinator, llm}) {
    const std::vector<YAML::Node> budgets = BudgetsOf(r.objects, owner);
    ASSERT_EQ(budgets.size(), 1u) << owner["metadata"]["name"];
    EXPECT_EQ(budgets[0]["metadata"]["name"].as<std::string>(), "tiny");
    EXPECT_EQ(budgets[0]["apiVersion"].as<std::string>(), "policy/v1");
    EXPECT_EQ(budgets[0]["spec"]["maxUnavailable"].as<int>(), 0);
  }
  std::vector<YAML::Node> encoder_budgets = BudgetsOf(r.objects, encoder);
  ASSERT_EQ(encoder_budgets.size(), 1u);
  EXPECT_EQ(encoder_budgets[0]["metadata"]["name"].as<std::string>(), "tiny-encoder");
  EXPECT_EQ(encoder_budgets[0]["spec"]["minAvailable"].as<int>(), 1);
  EXPECT_FALSE(encoder_budgets[0]["spec"]["maxUnavailable"]);
  EXPECT_EQ(OfKind(r.objects, "PodDisruptionBudget").size(), 2u);
  // Nothing of another run's: each budget names this run's instance label.
  for (const YAML::Node& pdb : OfKind(r.objects, "PodDisruptionBudget")) {
    EXPECT_EQ(
        pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/instance"].as<std::string>(),
        "tiny");
  }
  Rendered two;
  RenderK8s("tiny.yaml", &two, {"--set", "failure.min_encoder_replicas=2"});
  encoder_budgets = BudgetsOf(two.objects, Named(two.objects, "StatefulSet", "tiny-encoder"));
  ASSERT_EQ(encoder_budgets.size(), 1u);
  EXPECT_EQ(encoder_budgets[0]["spec"]["minAvailable"].as<int>(), 2);
  // Colocated: any pod's loss stops the run; one budget, every pod in it.
  Rendered colocated;
  RenderK8s("tiny-colocated.yaml", &colocated);
  ASSERT_EQ(OfKind(colocated.objects, "PodDisruptionBudget").size(), 1u);
  for (const YAML::Node& owner :
       {Named(colocated.objects, "StatefulSet", "tiny-colocated-colocated"),
        Named(colocated.objects, "Deployment", "tiny-colocated-coordinator")}) {
    ASSERT_TRUE(owner);
    const std::vector<YAML::Node> budgets = BudgetsOf(colocated.objects, owner);
    ASSERT_EQ(budgets.size(), 1u) << owner["metadata"]["name"];
    EXPECT_EQ(budgets[0]["spec"]["maxUnavailable"].as<int>(), 0);
  }
  // Without budgets (the flag's singular spelling, of an earlier release, too).
  for (const char* flag : {"--no-disruption-budgets", "--no-disruption-budget"}) {
    Rendered none;
    RenderK8s("tiny.yaml", &none, {flag});
    for (const YAML::Node& object : none.objects) {
      EXPECT_NE(object["kind"].as<std::string>(), "PodDisruptionBudget") << flag;
    }
    EXPECT_FALSE(std::filesystem::exists(none.dir.path() + "/manifests/disruption.yaml")) << flag;
    EXPECT_EQ(YAML::LoadFile(none.dir.path() + "/kustomization.yaml")["resources"].size(), 5u)
        << flag;
  }
}

TEST(DeployK8sTest, LargeExampleRequestsOneGpuPerRankAndAPodPerReplica) {
  Rendered r;
  RenderK8s("large-example.yaml", &r,
            {"--set", "run.device=cuda", "--device", "gpu", "--gpus-per-node", "8"});
  // configs/large-example.yaml: encoder dp 16 tp 1; LLM dp 8 tp 4.
  const YAML::Node encoder = Named(r.objects, "StatefulSet", "vit400m-llm8b-encoder");
  const YAML::Node llm = Named(r.objects, "StatefulSet", "vit400m-llm8b-llm");
  ASSERT_TRUE(encoder && llm);
  EXPECT_EQ(encoder["spec"]["replicas"].as<int>(), 16);
  EXPECT_EQ(llm["spec"]["replicas"].as<int>(), 8);
  const YAML::Node containers = llm["spec"]["template"]["spec"]["containers"];
  ASSERT_EQ(containers.size(), 4u);
  std::set<std::string> local_ranks;
  for (const YAML::Node& c : containers) {
    EXPECT_EQ(c["resources"]["limits"]["nvidia.com/gpu"].as<std::string>(), "1");
    const auto args = c["args"].as<std::vector<std::string>>();
    for (size_t i = 0; i + 1 < args.size(); ++i) {
      if (args[i] == "--ranks-per-replica") {
        EXPECT_EQ(args[i + 1], "4");
      }
      if (args[i] == "--local-rank") local_ranks.insert(args[i + 1]);
    }
  }
  EXPECT_EQ(local_ranks, (std::set<std::string>{"0", "1", "2", "3"}));
  CheckContainers(llm["spec"]["template"]["spec"], "vit400m-llm8b-token");
}

// The config's checkpoint.dir is a path of the machine that rendered it: the checkpoints go on
// the run volume instead, which every pod mounts, and a checkpoint to resume from below it moves
// with it. Worker pods get a memory-backed /dev/shm of --shm-size and --memory-per-rank as their
// containers' memory request and limit; a size that is not a quantity is refused.
TEST(DeployK8sTest, CheckpointsGoOnTheRunVolumeAndWorkersGetSharedMemory) {
  Rendered r;
  RenderK8s("tiny.yaml", &r,
            {"--set", "checkpoint.dir=/somewhere/ckpt", "--set",
             "checkpoint.resume_from=/somewhere/ckpt/step-000004", "--set", "run.steps=20",
             "--shm-size", "2Gi", "--memory-per-rank", "3Gi"});
  const YAML::Node runspec = Named(r.objects, "ConfigMap", "tiny-runspec");
  ASSERT_TRUE(runspec);
  const YAML::Node spec = YAML::Load(runspec["data"]["run.yaml"].as<std::string>());
  EXPECT_EQ(spec["checkpoint"]["dir"].as<std::string>(), "/var/lib/hetpar/run/checkpoints");
  EXPECT_EQ(spec["checkpoint"]["resume_from"].as<std::string>(),
            "/var/lib/hetpar/run/checkpoints/step-000004");
  for (const char* name : {"tiny-encoder", "tiny-llm"}) {
    const YAML::Node pod = Named(r.objects, "StatefulSet", name)["spec"]["template"]["spec"];
    EXPECT_EQ(pod["securityContext"]["fsGroupChangePolicy"].as<std::string>(), "OnRootMismatch");
    bool shm_volume = false;
    for (const YAML::Node& v : pod["volumes"]) {
      if (v["name"].as<std::string>() != "shm") continue;
      shm_volume = true;
      EXPECT_EQ(v["emptyDir"]["medium"].as<std::string>(), "Memory");
      EXPECT_EQ(v["emptyDir"]["sizeLimit"].as<std::string>(), "2Gi");
    }
    EXPECT_TRUE(shm_volume) << name;
    for (const YAML::Node& c : pod["containers"]) {
      EXPECT_EQ(c["resources"]["requests"]["memory"].as<std::string>(), "3Gi");
      EXPECT_EQ(c["resources"]["limits"]["memory"].as<std::string>(), "3Gi");
      bool mounted = false;
      for (const YAML::Node& m : c["volumeMounts"]) {
        mounted |= m["name"].as<std::string>() == "shm" &&
                   m["mountPath"].as<std::string>() == "/dev/shm";
      }
      EXPECT_TRUE(mounted) << name << " " << c["name"];
    }
  }
  TempDir dir;
  const CommandResult refused =
      RunOk({kHetparBin, "deploy", "k8s", "--config", kSourceDir + "/configs/tiny.yaml", "--image",
             "registry.example/hetpar:test", "--out", dir.path(), "--shm-size", "lots"});
  EXPECT_EQ(refused.exit_code, 2);
  EXPECT_THAT(refused.stderr_text, HasSubstr("'lots' is not a Kubernetes quantity of bytes"));
}

// Rendered again into the same directory (other options for a running run), the Secret keeps its
// token: a new one would lock out every worker started after `kubectl apply`. Without the file a
// new token is made; a damaged file is refused, naming it.
TEST(DeployK8sTest, RenderingAgainKeepsTheRunToken) {
  Rendered first;
  RenderK8s("tiny.yaml", &first);
  const std::string token =
      Named(first.objects, "Secret", "tiny-token")["stringData"]["token"].as<std::string>();
  Rendered again;
  std::filesystem::copy(first.dir.path() + "/manifests", again.dir.path() + "/manifests");
  RenderK8s("tiny.yaml", &again, {"--shm-size", "2Gi"});
  EXPECT_EQ(Named(again.objects, "Secret", "tiny-token")["stringData"]["token"].as<std::string>(),
            token);
  Rendered fresh;
  RenderK8s("tiny.yaml", &fresh);
  EXPECT_NE(Named(fresh.objects, "Secret", "tiny-token")["stringData"]["token"].as<std::string>(),
            token);
  std::ofstream(fresh.dir.path() + "/manifests/secret.yaml") << "kind: Secret\n";
  const CommandResult damaged =
      RunOk({kHetparBin, "deploy", "k8s", "--config", kSourceDir + "/configs/tiny.yaml", "--image",
             "registry.example/hetpar:test", "--out", fresh.dir.path()});
  EXPECT_EQ(damaged.exit_code, 2);
  EXPECT_THAT(damaged.stderr_text, HasSubstr(fresh.dir.path() + "/manifests/secret.yaml holds no "
                                                                "stringData.token; delete it"));
}

// With pipeline stages a pod still holds one DP replica, its containers that replica's ranks of
// every stage: the workers get the layout's DP size and stage count to find their ranks
// (worker::RankRequest).
TEST(DeployK8sTest, WithPipelineStagesEachContainerIsToldTheReplicasAndStages) {
  Rendered r;
  RenderK8s("tiny.yaml", &r,
            {"--set", "llm.layout.dp=2", "--set", "llm.layout.tp=1", "--set", "llm.layout.pp=2"});
  const YAML::Node llm = Named(r.objects, "StatefulSet", "tiny-llm");
  const YAML::Node encoder = Named(r.objects, "StatefulSet", "tiny-encoder");
  ASSERT_TRUE(llm && encoder);
  EXPECT_EQ(llm["spec"]["replicas"].as<int>(), 2);
  const YAML::Node containers = llm["spec"]["template"]["spec"]["containers"];
  ASSERT_EQ(containers.size(), 2u);
  for (const YAML::Node& c : containers) {
    const auto args = c["args"].as<std::vector<std::string>>();
    std::map<std::string, std::string> flags;
    for (size_t i = 0; i + 1 < args.size(); ++i) flags[args[i]] = args[i + 1];
    EXPECT_EQ(flags["--ranks-per-replica"], "2");
    EXPECT_EQ(flags["--replicas"], "2");
    EXPECT_EQ(flags["--pipeline-stages"], "2");
  }
  // The encoder has no stages.
  for (const YAML::Node& c : encoder["spec"]["template"]["spec"]["containers"]) {
    const auto args = c["args"].as<std::vector<std::string>>();
    EXPECT_EQ(std::count(args.begin(), args.end(), "--pipeline-stages"), 0);
  }
}

TEST(DeployK8sTest, GpusFollowTheConfigsDeviceAndAContradictionIsRefused) {
  // run.device cuda alone requests the GPUs.
  Rendered gpu;
  RenderK8s("tiny.yaml", &gpu, {"--set", "run.device=cuda"});
  const YAML::Node llm = Named(gpu.objects, "StatefulSet", "tiny-llm");
  ASSERT_TRUE(llm);
  for (const YAML::Node& c : llm["spec"]["template"]["spec"]["containers"]) {
    EXPECT_EQ(c["resources"]["limits"]["nvidia.com/gpu"].as<std::string>(), "1");
  }
  // GPUs the workers would not use (run.device cpu) are refused, and so is the reverse.
  TempDir dir;
  for (const auto& [flags, says] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--device", "gpu"}, "--device gpu contradicts the config's run.device \"cpu\""},
           {{"--device", "cpu", "--set", "run.device=cuda"},
            "--device cpu contradicts the config's run.device \"cuda\""}}) {
    std::vector<std::string> argv = {
        kHetparBin, "deploy", "k8s",   "--config",     kSourceDir + "/configs/tiny.yaml",
        "--image",  "x",      "--out", dir.File("out")};
    argv.insert(argv.end(), flags.begin(), flags.end());
    const CommandResult r = RunOk(argv);
    EXPECT_EQ(r.exit_code, 2) << r.stderr_text;
    EXPECT_THAT(r.stderr_text, HasSubstr(says));
    EXPECT_FALSE(std::filesystem::exists(dir.File("out")));
  }
}

TEST(DeployK8sTest, MetricsPortIsServedAndAnnotatedForPrometheus) {
  Rendered r;
  RenderK8s("tiny.yaml", &r, {"--set", "coordinator.metrics_listen=127.0.0.1:9464"});
  const YAML::Node deployment = Named(r.objects, "Deployment", "tiny-coordinator");
  ASSERT_TRUE(deployment);
  const YAML::Node pod = deployment["spec"]["template"];
  EXPECT_EQ(pod["metadata"]["annotations"]["prometheus.io/scrape"].as<std::string>(), "true");
  EXPECT_EQ(pod["metadata"]["annotations"]["prometheus.io/port"].as<std::string>(), "9464");
  bool env = false;
  for (const YAML::Node& e : pod["spec"]["containers"][0]["env"]) {
    if (e["name"].as<std::string>() == "HETPAR_METRICS_LISTEN") {
      // Inside the pod it listens on every interface, not the loopback the RunSpec names.
      EXPECT_EQ(e["value"].as<std::string>(), "0.0.0.0:9464");
      env = true;
    }
  }
  EXPECT_TRUE(env);
  CheckContainers(pod["spec"], "tiny-token");
  bool service_port = false;
  for (const YAML::Node& p : Named(r.objects, "Service", "tiny-coordinator")["spec"]["ports"]) {
    if (p["name"].as<std::string>() == "metrics") service_port = p["port"].as<int>() == 9464;
  }
  EXPECT_TRUE(service_port);
}

TEST(DeployK8sTest, AMetricsPortNoServiceCouldNameIsRefused) {
  TempDir dir;
  for (const auto& [metrics, says] : std::vector<std::pair<std::string, std::string>>{
           {"0.0.0.0:0", "picks a free port, which no Service or scrape annotation can name"},
           {"0.0.0.0:50051", "is the coordinator's gRPC port (--port 50051)"}}) {
    const CommandResult r = RunOk({kHetparBin, "deploy", "k8s", "--config",
                                   kSourceDir + "/configs/tiny.yaml", "--image", "x", "--out",
                                   dir.File("out"), "--set", "coordinator.metrics_listen=" + metrics});
    EXPECT_EQ(r.exit_code, 2) << r.stderr_text;
    EXPECT_THAT(r.stderr_text, HasSubstr("coordinator.metrics_listen: ='" + metrics + "' " + says));
    EXPECT_FALSE(std::filesystem::exists(dir.File("out")));
  }
}

TEST(DeployK8sTest, AReplicaLargerThanANodeIsRefusedWithFieldValueAndLine) {
  TempDir dir;
  std::ifstream in(kSourceDir + "/configs/tiny.yaml");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string from = "layout: {dp: 2, tp: 1}";
  ASSERT_NE(text.find(from), std::string::npos);
  text.replace(text.find(from), from.size(), "layout: {dp: 2, tp: 4}");
  // deploy does not need the data files (they live on the cluster).
  const std::string config = dir.File("run.yaml");
  { std::ofstream(config) << text; }
  const CommandResult r =
      RunOk({kHetparBin, "deploy", "k8s", "--config", config, "--image", "x", "--out",
             dir.File("out"), "--set", "run.device=cuda", "--gpus-per-node", "2"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.stderr_text, HasSubstr("encoder.layout.tp: =4 puts 4 GPUs in one encoder replica"));
  EXPECT_THAT(r.stderr_text, HasSubstr("--gpus-per-node 2"));
  EXPECT_THAT(r.stderr_text, HasSubstr(config + ":25"));
  EXPECT_FALSE(std::filesystem::exists(dir.File("out")));
}

// How every worker task starts: it says which node it runs on, then becomes the worker.
const std::string kTaskStart =
    "bash -c 'echo \"hetpar: task $SLURM_PROCID of step $SLURM_STEP_ID on node $SLURMD_NODENAME\" "
    ">&2; exec \"$0\" ";

TEST(DeploySlurmTest, ScriptsAreValidBashAndStartEveryRankWithARealBinary) {
  TempDir dir;
  const CommandResult r =
      RunOk({kHetparBin, "deploy", "slurm", "--config", kSourceDir + "/configs/tiny.yaml", "--out",
             dir.File("run"), "--interface", "lo"});
  ASSERT_EQ(r.exit_code, 0) << r.stderr_text;
  for (const char* script : {"hetpar.sbatch", "hetpar-het.sbatch"}) {
    const std::string path = dir.File("run") + "/" + script;
    const CommandResult syntax = RunOk({"bash", "-n", path});
    EXPECT_EQ(syntax.exit_code, 0) << script << ": " << syntax.stderr_text;
    const std::string text = ReadFile(path);
    EXPECT_THAT(text, HasSubstr("BIN='" + kBinDir + "'"));
    EXPECT_THAT(text, HasSubstr("\"$BIN/hetpar\" coordinator --config \"$CONFIG\""));
    EXPECT_THAT(text, HasSubstr("--ntasks=2 " + kTaskStart +
                                "--rank \"$SLURM_PROCID\" \"$@\"' "
                                "\"$BIN/hetpar-encoder\""));
    EXPECT_THAT(text, HasSubstr("--ntasks=2 " + kTaskStart +
                                "--rank \"$SLURM_PROCID\" \"$@\"' "
                                "\"$BIN/hetpar-llm\""));
    EXPECT_THAT(text, HasSubstr("export HETPAR_INTERFACE='lo'"));
  }
  EXPECT_THAT(ReadFile(dir.File("run") + "/hetpar.sbatch"), HasSubstr("#SBATCH --ntasks=5"));
  const std::string het = ReadFile(dir.File("run") + "/hetpar-het.sbatch");
  EXPECT_THAT(het, HasSubstr("#SBATCH hetjob"));
  EXPECT_THAT(het, HasSubstr("--het-group=0"));
  const YAML::Node spec = YAML::LoadFile(dir.File("run") + "/run.yaml");
  EXPECT_EQ(spec["run"]["out_dir"].as<std::string>(), dir.File("run"));
}

// With pipeline stages, consecutive LLM tasks (a node's) are one DP replica's ranks of every
// stage, as a Kubernetes pod's are.
TEST(DeploySlurmTest, WithPipelineStagesTheLlmTasksAreToldTheReplicasAndStages) {
  TempDir dir;
  const CommandResult r =
      RunOk({kHetparBin, "deploy", "slurm", "--config", kSourceDir + "/configs/tiny.yaml", "--out",
             dir.File("run"), "--interface", "lo", "--set", "llm.layout.dp=2", "--set",
             "llm.layout.tp=1", "--set", "llm.layout.pp=2"});
  ASSERT_EQ(r.exit_code, 0) << r.stderr_text;
  for (const char* script : {"hetpar.sbatch", "hetpar-het.sbatch"}) {
    const std::string path = dir.File("run") + "/" + script;
    const CommandResult syntax = RunOk({"bash", "-n", path});
    EXPECT_EQ(syntax.exit_code, 0) << script << ": " << syntax.stderr_text;
    const std::string text = ReadFile(path);
    EXPECT_THAT(text, HasSubstr("--ntasks=4 " + kTaskStart +
                                "--replica $((SLURM_PROCID / 2)) "
                                "--ranks-per-replica 2 --local-rank $((SLURM_PROCID % 2)) "
                                "--replicas 2 --pipeline-stages 2 \"$@\"' \"$BIN/hetpar-llm\""));
    // The encoder has no stages.
    EXPECT_THAT(text, HasSubstr("--ntasks=2 " + kTaskStart +
                                "--rank \"$SLURM_PROCID\" \"$@\"' "
                                "\"$BIN/hetpar-encoder\""));
  }
}

// On GPUs each worker task takes one, and the coordinator's step asks for none: a step that
// asks for nothing would be given every GPU of the job on its node.
TEST(DeploySlurmTest, OnGpusTheCoordinatorStepTakesNoGpu) {
  TempDir dir;
  const CommandResult r =
      RunOk({kHetparBin, "deploy", "slurm", "--config", kSourceDir + "/configs/tiny.yaml", "--out",
             dir.File("run"), "--interface", "lo", "--device", "gpu", "--set", "run.device=cuda"});
  ASSERT_EQ(r.exit_code, 0) << r.stderr_text;
  for (const char* script : {"hetpar.sbatch", "hetpar-het.sbatch"}) {
    const std::string text = ReadFile(dir.File("run") + "/" + script);
    EXPECT_THAT(text, ::testing::MatchesRegex(
                          "(.|\n)*start_step coordinator [^\n]*--gres=none [^\n]*coordinator "
                          "--config(.|\n)*"))
        << script;
    EXPECT_THAT(text, ::testing::MatchesRegex(
                          "(.|\n)*start_step encoder [^\n]*--gpus-per-task=1 (.|\n)*"))
        << script;
  }
  // Placed by task counts (--ranks-per-node 0), the heterogeneous job's LLM component holds the
  // coordinator's task too, which takes no GPU: one GPU per worker rank (2 encoder, 2 LLM ranks),
  // not per task.
  ASSERT_EQ(RunOk({kHetparBin, "deploy", "slurm", "--config", kSourceDir + "/configs/tiny.yaml",
                   "--out", dir.File("counts"), "--interface", "lo", "--device", "gpu", "--set",
                   "run.device=cuda", "--ranks-per-node", "0"})
                .exit_code,
            0);
  const std::string het = ReadFile(dir.File("counts") + "/hetpar-het.sbatch");
  EXPECT_THAT(het, ::testing::MatchesRegex("(.|\n)*#SBATCH --ntasks=3\n(.|\n)*"));
  EXPECT_THAT(het,
              ::testing::MatchesRegex("(.|\n)*--gpus=2\n#SBATCH hetjob\n(.|\n)*--gpus=2\n(.|\n)*"));
  EXPECT_THAT(het, ::testing::Not(HasSubstr("--gpus=3")));
  // A metrics port that is the coordinator's own is refused here too.
  const CommandResult same_port =
      RunOk({kHetparBin, "deploy", "slurm", "--config", kSourceDir + "/configs/tiny.yaml",
             "--out", dir.File("other"), "--set", "coordinator.metrics_listen=0.0.0.0:50051"});
  EXPECT_EQ(same_port.exit_code, 2) << same_port.stderr_text;
  EXPECT_THAT(same_port.stderr_text, HasSubstr("is the coordinator's gRPC port (--port 50051)"));
  // On CPUs nothing asks for GRES.
  TempDir cpu;
  ASSERT_EQ(RunOk({kHetparBin, "deploy", "slurm", "--config", kSourceDir + "/configs/tiny.yaml",
                   "--out", cpu.File("run"), "--interface", "lo"})
                .exit_code,
            0);
  EXPECT_THAT(ReadFile(cpu.File("run") + "/hetpar.sbatch"),
              ::testing::Not(HasSubstr("--gres")));
}

// A run directory that #SBATCH --output and srun --output patterns cannot carry is refused when
// rendered, not found out when the job's log goes elsewhere.
TEST(DeploySlurmTest, ARunDirectoryWithWhitespaceOrPercentIsRefused) {
  TempDir dir;
  for (const std::string name : {"my runs", "run-%j", "it's"}) {
    const CommandResult r =
        RunOk({kHetparBin, "deploy", "slurm", "--config", kSourceDir + "/configs/tiny.yaml",
               "--out", dir.File(name), "--interface", "lo"});
    EXPECT_EQ(r.exit_code, 2) << name << ": " << r.stderr_text;
    EXPECT_THAT(r.stderr_text, HasSubstr("--out '" + dir.File(name) + "' has ")) << name;
    EXPECT_THAT(r.stderr_text, HasSubstr("Slurm's #SBATCH --output")) << name;
    EXPECT_FALSE(std::filesystem::exists(dir.File(name))) << name;
  }
}

// --ranks-per-node: whole nodes, each holding as many whole replicas as fit, the encoder's
// first; every worker task is placed by a host file (srun --distribution=arbitrary), and the
// coordinator shares a node (--overlap). slurm_run_test runs such a job.
TEST(DeploySlurmTest, OnWholeNodesEachNodeHoldsWholeReplicas) {
  TempDir dir;
  // 3 encoder replicas of 1 rank on nodes of 2 ranks: 2 nodes (2 + 1 tasks); 1 LLM replica of
  // 2 ranks: 1 node.
  const CommandResult r =
      RunOk({kHetparBin, "deploy", "slurm", "--config", kSourceDir + "/configs/tiny.yaml", "--out",
             dir.File("run"), "--interface", "lo", "--ranks-per-node", "2", "--set",
             "encoder.layout.dp=3"});
  ASSERT_EQ(r.exit_code, 0) << r.stderr_text;
  const std::string single = ReadFile(dir.File("run") + "/hetpar.sbatch");
  EXPECT_THAT(single, HasSubstr("#SBATCH --nodes=3\n#SBATCH --ntasks-per-node=2\n"));
  EXPECT_THAT(single, Not(HasSubstr("#SBATCH --ntasks=")));
  EXPECT_THAT(single, HasSubstr("encoder_nodes=$(IFS=,; echo \"${job_nodes[*]:0:2}\")"));
  EXPECT_THAT(single, HasSubstr("llm_nodes=$(IFS=,; echo \"${job_nodes[*]:2:1}\")"));
  EXPECT_THAT(single,
              HasSubstr("write_hosts \"$RUN_DIR/hosts-encoder\" \"$encoder_nodes\" 2 3\n"
                        "SLURM_HOSTFILE=\"$RUN_DIR/hosts-encoder\" start_step encoder "
                        "--exact --kill-on-bad-exit=0 --distribution=arbitrary --ntasks=3 "));
  // One worker task's failure does not end its step's other tasks (a lost DP replica is the
  // coordinator's to judge); the coordinator's step has no such flag.
  EXPECT_THAT(single, HasSubstr("start_step llm --exact --kill-on-bad-exit=0 "));
  EXPECT_THAT(
      single,
      Not(::testing::MatchesRegex("(.|\n)*start_step coordinator [^\n]*kill-on-bad-exit(.|\n)*")));
  EXPECT_THAT(single, HasSubstr("write_hosts \"$RUN_DIR/hosts-llm\" \"$llm_nodes\" 2 2\n"));
  EXPECT_THAT(single, ::testing::MatchesRegex(
                          "(.|\n)*start_step coordinator [^\n]*--overlap [^\n]*(.|\n)*"));
  const std::string het = ReadFile(dir.File("run") + "/hetpar-het.sbatch");
  EXPECT_THAT(het, HasSubstr("#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=2\n"
                             "#SBATCH --cpus-per-task=2\n#SBATCH hetjob\n"
                             "#SBATCH --nodes=1\n#SBATCH --ntasks-per-node=2\n"));
  for (const std::string& text : {single, het}) {
    EXPECT_THAT(text, HasSubstr("write_hosts() {"));
  }
  for (const char* script : {"hetpar.sbatch", "hetpar-het.sbatch"}) {
    const CommandResult syntax = RunOk({"bash", "-n", dir.File("run") + "/" + script});
    EXPECT_EQ(syntax.exit_code, 0) << script << ": " << syntax.stderr_text;
  }
  // The write_hosts function, run: one line per task, a node's tasks together, the last node
  // partly used.
  TempDir hosts;
  const std::string function = single.substr(
      single.find("write_hosts() {"),
      single.find("\n}\n", single.find("write_hosts() {")) - single.find("write_hosts() {") + 3);
  const CommandResult written =
      RunOk({"bash", "-c",
             function + "scontrol() { shift 2; tr ',' '\\n' <<< \"$1\"; }\nwrite_hosts \"" +
                 hosts.File("h") + "\" a,b 2 3"});
  ASSERT_EQ(written.exit_code, 0) << written.stderr_text;
  EXPECT_EQ(ReadFile(hosts.File("h")), "a\na\nb\n");
  const CommandResult short_of_nodes =
      RunOk({"bash", "-c",
             function + "scontrol() { shift 2; tr ',' '\\n' <<< \"$1\"; }\nwrite_hosts \"" +
                 hosts.File("h") + "\" a 2 3"});
  EXPECT_EQ(short_of_nodes.exit_code, 1);
  EXPECT_THAT(short_of_nodes.stderr_text, HasSubstr("the job's nodes (a) hold 2 of the 3 tasks"));

  // On GPUs whole nodes are the default (--gpus-per-node ranks each), asked for by GPUs per
  // node; --ranks-per-node 0 leaves the placement to Slurm.
  TempDir gpu;
  ASSERT_EQ(RunOk({kHetparBin, "deploy", "slurm", "--config", kSourceDir + "/configs/tiny.yaml",
                   "--out", gpu.File("run"), "--device", "gpu", "--set", "run.device=cuda",
                   "--gpus-per-node", "4"})
                .exit_code,
            0);
  EXPECT_THAT(ReadFile(gpu.File("run") + "/hetpar.sbatch"),
              HasSubstr("#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=2\n"
                        "#SBATCH --cpus-per-task=2\n#SBATCH --gpus-per-node=2\n"));
  TempDir free;
  ASSERT_EQ(RunOk({kHetparBin, "deploy", "slurm", "--config", kSourceDir + "/configs/tiny.yaml",
                   "--out", free.File("run"), "--device", "gpu", "--set", "run.device=cuda",
                   "--ranks-per-node", "0"})
                .exit_code,
            0);
  const std::string placed_by_slurm = ReadFile(free.File("run") + "/hetpar.sbatch");
  EXPECT_THAT(placed_by_slurm, HasSubstr("#SBATCH --ntasks=5\n"));
  EXPECT_THAT(placed_by_slurm, Not(HasSubstr("--distribution=arbitrary")));

  // A replica larger than a node, and more ranks than a node's GPUs, are refused.
  const CommandResult too_small =
      RunOk({kHetparBin, "deploy", "slurm", "--config", kSourceDir + "/configs/tiny.yaml", "--out",
             dir.File("refused"), "--ranks-per-node", "1"});
  EXPECT_EQ(too_small.exit_code, 2);
  EXPECT_THAT(too_small.stderr_text,
              HasSubstr("llm.layout.tp: =2 puts 2 ranks in one LLM replica, more than a node runs "
                        "(--ranks-per-node 1)"));
  const CommandResult too_many =
      RunOk({kHetparBin, "deploy", "slurm", "--config", kSourceDir + "/configs/tiny.yaml", "--out",
             dir.File("refused"), "--device", "gpu", "--set", "run.device=cuda", "--ranks-per-node",
             "16"});
  EXPECT_EQ(too_many.exit_code, 2);
  EXPECT_THAT(too_many.stderr_text,
              HasSubstr("--ranks-per-node 16 is more than a node's GPUs (--gpus-per-node 8)"));
  // Tiles whose CPUs a node does not have (2 replicas of 1 rank x 2 CPUs on 3-CPU nodes).
  const CommandResult cpus =
      RunOk({kHetparBin, "deploy", "slurm", "--config", kSourceDir + "/configs/tiny.yaml", "--out",
             dir.File("refused"), "--ranks-per-node", "2", "--cpus-per-node", "3", "--set",
             "llm.layout.tp=1", "--set", "llm.layout.dp=2"});
  EXPECT_EQ(cpus.exit_code, 2);
  EXPECT_THAT(cpus.stderr_text, HasSubstr("2 ranks per node (whole replicas, --ranks-per-node 2) "
                                          "x 2 CPUs (--cpus-per-rank) is more than a node's CPUs "
                                          "(--cpus-per-node 3)"));
  EXPECT_FALSE(std::filesystem::exists(dir.File("refused")));

  // Colocated ranks (pp outermost) keep the LLM's TP x CP groups on a node: tiny-colocated's
  // 4 ranks of tp 4 on one node of 4.
  TempDir colocated;
  ASSERT_EQ(RunOk({kHetparBin, "deploy", "slurm", "--config",
                   kSourceDir + "/configs/tiny-colocated.yaml", "--out", colocated.File("run"),
                   "--ranks-per-node", "4"})
                .exit_code,
            0);
  const std::string shared = ReadFile(colocated.File("run") + "/hetpar.sbatch");
  EXPECT_THAT(shared, HasSubstr("#SBATCH --nodes=1\n#SBATCH --ntasks-per-node=4\n"));
  EXPECT_THAT(shared, HasSubstr("write_hosts \"$RUN_DIR/hosts-colocated\" \"$llm_nodes\" 4 4\n"));
  // With pipeline stages a colocated replica's ranks are not consecutive: the unit is a TP group
  // (2 ranks), 3 to a node of 6, not one replica of 4 (tp 2 x pp 2) per node.
  TempDir staged;
  ASSERT_EQ(RunOk({kHetparBin, "deploy", "slurm", "--config",
                   kSourceDir + "/configs/tiny-colocated.yaml", "--out", staged.File("run"),
                   "--ranks-per-node", "6", "--set", "llm.layout.tp=2", "--set", "llm.layout.pp=2",
                   "--set", "llm.layout.dp=2", "--set", "encoder.layout.dp=8"})
                .exit_code,
            0);
  const std::string pipelined = ReadFile(staged.File("run") + "/hetpar.sbatch");
  EXPECT_THAT(pipelined, HasSubstr("#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=6\n"));
  EXPECT_THAT(pipelined,
              HasSubstr("write_hosts \"$RUN_DIR/hosts-colocated\" \"$llm_nodes\" 6 8\n"));
}

// --memory-per-rank: each rank's memory over its CPUs, for every component; Slurm's units only.
TEST(DeploySlurmTest, MemoryPerRankIsAskedForPerCpu) {
  TempDir dir;
  const CommandResult r =
      RunOk({kHetparBin, "deploy", "slurm", "--config", kSourceDir + "/configs/tiny.yaml", "--out",
             dir.File("run"), "--memory-per-rank", "96G", "--cpus-per-rank", "4"});
  ASSERT_EQ(r.exit_code, 0) << r.stderr_text;
  EXPECT_THAT(ReadFile(dir.File("run") + "/hetpar.sbatch"),
              HasSubstr("#SBATCH --cpus-per-task=4\n#SBATCH --mem-per-cpu=24576M\n"));
  const std::string het = ReadFile(dir.File("run") + "/hetpar-het.sbatch");
  const size_t first = het.find("#SBATCH --mem-per-cpu=24576M\n");
  ASSERT_NE(first, std::string::npos) << het;
  EXPECT_NE(het.find("#SBATCH --mem-per-cpu=24576M\n", first + 1), std::string::npos)
      << "both components ask for it: " << het;
  // Rounded up to whole MiB per CPU: 1000M over 3 CPUs.
  TempDir odd;
  ASSERT_EQ(RunOk({kHetparBin, "deploy", "slurm", "--config", kSourceDir + "/configs/tiny.yaml",
                   "--out", odd.File("run"), "--memory-per-rank", "1000", "--cpus-per-rank", "3"})
                .exit_code,
            0);
  EXPECT_THAT(ReadFile(odd.File("run") + "/hetpar.sbatch"), HasSubstr("--mem-per-cpu=334M\n"));
  // Slurm's other spellings of a size.
  for (const char* size : {"96g", "96GB", "96gb", "98304"}) {
    TempDir other;
    ASSERT_EQ(RunOk({kHetparBin, "deploy", "slurm", "--config", kSourceDir + "/configs/tiny.yaml",
                     "--out", other.File("run"), "--memory-per-rank", size})
                  .exit_code,
              0)
        << size;
    EXPECT_THAT(ReadFile(other.File("run") + "/hetpar.sbatch"), HasSubstr("--mem-per-cpu=49152M\n"))
        << size;
  }
  const CommandResult zero =
      RunOk({kHetparBin, "deploy", "slurm", "--config", kSourceDir + "/configs/tiny.yaml", "--out",
             dir.File("refused"), "--memory-per-rank", "0G"});
  EXPECT_EQ(zero.exit_code, 2);
  EXPECT_THAT(zero.stderr_text, HasSubstr("--memory-per-rank '0G' must be more than 0"));
  for (const char* bad : {"96GiB", "1.5G", "G", "-1G", "96X"}) {
    const CommandResult refused =
        RunOk({kHetparBin, "deploy", "slurm", "--config", kSourceDir + "/configs/tiny.yaml",
               "--out", dir.File("refused"), "--memory-per-rank", bad});
    EXPECT_EQ(refused.exit_code, 2) << bad;
    EXPECT_THAT(refused.stderr_text,
                HasSubstr(absl::StrCat("--memory-per-rank '", bad, "': expected a Slurm memory "
                                       "size")))
        << bad;
  }
  EXPECT_FALSE(std::filesystem::exists(dir.File("refused")));
  // Without it, nothing: the cluster's default.
  TempDir none;
  ASSERT_EQ(RunOk({kHetparBin, "deploy", "slurm", "--config", kSourceDir + "/configs/tiny.yaml",
                   "--out", none.File("run")})
                .exit_code,
            0);
  EXPECT_THAT(ReadFile(none.File("run") + "/hetpar.sbatch"), Not(HasSubstr("--mem")));
}

TEST(JsonToYamlTest, ReadsBackAsTheSameValuesAndTypes) {
  const nlohmann::ordered_json value = {{"port", 50051},
                                        {"port_text", "50051"},
                                        {"flag", "--rank"},
                                        {"yes_text", "yes"},
                                        {"enabled", true},
                                        {"empty", nlohmann::ordered_json::object()},
                                        {"list", {"a", 1, {{"k", "v"}, {"k2", "v2"}}}},
                                        {"multi", "line one\n  line two\n"},
                                        {"quote", "it's \"quoted\": yes"}};
  const YAML::Node y = YAML::Load(deploy::JsonToYaml(value));
  EXPECT_EQ(y["port"].as<int>(), 50051);
  EXPECT_EQ(y["port"].Tag(), "?");  // plain: a number
  EXPECT_EQ(y["port_text"].as<std::string>(), "50051");
  EXPECT_EQ(y["port_text"].Tag(), "!");  // quoted: a string
  EXPECT_EQ(y["flag"].as<std::string>(), "--rank");
  EXPECT_EQ(y["yes_text"].Tag(), "!");
  EXPECT_TRUE(y["enabled"].as<bool>());
  EXPECT_TRUE(y["empty"].IsMap());
  EXPECT_EQ(y["empty"].size(), 0u);
  EXPECT_EQ(y["list"][0].as<std::string>(), "a");
  EXPECT_EQ(y["list"][1].as<int>(), 1);
  EXPECT_EQ(y["list"][2]["k2"].as<std::string>(), "v2");
  EXPECT_EQ(y["multi"].as<std::string>(), "line one\n  line two\n");
  EXPECT_EQ(y["quote"].as<std::string>(), "it's \"quoted\": yes");
}

}  // namespace
}  // namespace hetpar::testing
