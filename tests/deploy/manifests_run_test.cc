// "Runs the manifests": renders the Kubernetes manifests of a small tiny run, reads each
// container's command, arguments and environment, and starts them as local processes, changing
// only addresses (the coordinator Service and pod IPs become loopback, the pod index the replica)
// and paths (each volume mount, and each container's /tmp, becomes a local directory). The
// workers start first and wait for the coordinator. The run must complete, write its run
// directory, and match the reference trainer under `hetpar compare`.
#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "tests/coordinator/coordinator_test_util.h"
#include "tests/deploy/k8s_util.h"
#include "tests/util/subprocess.h"

namespace hetpar::testing {
namespace {

using ::testing::HasSubstr;

const std::string kBinDir = std::filesystem::path(kHetparBin).parent_path().string();

// A port for the coordinator, which binds it only after every worker has started: one outside
// the kernel's ephemeral range (which bind(0) never hands out, so no other test's listener or
// connection takes it meanwhile) that nothing holds now; where that range leaves no room, one
// that bind(0) picks.
int FreePort() {
  int low = 32768, high = 60999;
  std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> low >> high;
  const auto bound = [](int port) {  // the port bound (the one asked for, or the kernel's), or -1
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return -1;
    sockaddr_in addr = {};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    socklen_t len = sizeof(addr);
    const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
                    ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
    ::close(fd);
    return ok ? static_cast<int>(ntohs(addr.sin_port)) : -1;
  };
  // Below the range where it leaves room, else above it.
  const int first = low - 1024 >= 2000 ? std::max(1024, low - 10000) : high + 1;
  const int last = low - 1024 >= 2000 ? low - 1 : 65535;
  std::mt19937 random(std::random_device{}());
  for (int attempt = 0; last - first >= 1000 && attempt < 200; ++attempt) {
    const int port = first + static_cast<int>(random() % static_cast<unsigned>(last - first + 1));
    if (bound(port) == port) return port;
  }
  return bound(0);
}

// One container of one pod, turned into a local process's argv (run through `env -i` so it sees
// only the manifest's environment).
struct LocalContainer {
  std::string name;  // pod/container
  std::vector<std::string> argv;
  std::vector<std::string> probe;  // its readiness probe's command, if it has one
};

class ManifestsRunTest : public ::testing::Test {
 protected:
  void RunTheManifests(const std::vector<std::string>& sets, size_t expected_workers);
  std::map<std::string, std::string> worker_logs_;  // container name -> its log

  // Local directory for a volume of pod `pod`: Secrets and ConfigMaps are written out as files,
  // an emptyDir is an empty directory of the pod's own.
  std::string VolumeDir(const YAML::Node& volume, const std::string& pod) {
    const std::string name = volume["name"].as<std::string>();
    if (volume["persistentVolumeClaim"]) {
      return dir_.File("volumes/" + volume["persistentVolumeClaim"]["claimName"].as<std::string>());
    }
    if (volume["emptyDir"]) {  // the workers' /dev/shm: the local processes use the host's
      const std::string local = dir_.File("emptydirs/" + pod + "/" + name);
      std::filesystem::create_directories(local);
      return local;
    }
    const bool secret = static_cast<bool>(volume["secret"]);
    const std::string object_name = secret ? volume["secret"]["secretName"].as<std::string>()
                                           : volume["configMap"]["name"].as<std::string>();
    const std::string local = dir_.File((secret ? "secrets/" : "configmaps/") + object_name);
    const YAML::Node object = Named(objects_, secret ? "Secret" : "ConfigMap", object_name);
    EXPECT_TRUE(object) << "no " << (secret ? "Secret " : "ConfigMap ") << object_name;
    std::filesystem::create_directories(local);
    for (const auto& item : object[secret ? "stringData" : "data"]) {
      const std::string path = local + "/" + item.first.as<std::string>();
      std::ofstream(path) << item.second.as<std::string>();
      std::filesystem::permissions(
          path, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
    }
    return local;
  }

  // Container paths -> local paths, longest mount first.
  std::string Localize(std::string value, const std::map<std::string, std::string>& mounts) {
    for (auto it = mounts.rbegin(); it != mounts.rend(); ++it) {
      if (value == it->first || value.rfind(it->first + "/", 0) == 0) {
        return it->second + value.substr(it->first.size());
      }
    }
    return value;
  }

  std::vector<LocalContainer> Containers(const YAML::Node& workload, int64_t replicas) {
    std::vector<LocalContainer> out;
    const YAML::Node pod = workload["spec"]["template"]["spec"];
    for (int64_t index = 0; index < replicas; ++index) {
      const std::string pod_name =
          absl::StrCat(workload["metadata"]["name"].as<std::string>(), "-", index);
      std::map<std::string, std::string> volume_dirs;
      for (const YAML::Node& v : pod["volumes"]) {
        volume_dirs[v["name"].as<std::string>()] = VolumeDir(v, pod_name);
      }
      for (const YAML::Node& c : pod["containers"]) {
        LocalContainer local;
        local.name = absl::StrCat(pod_name, "-", c["name"].as<std::string>());
        // The container's own /tmp (its writable layer) is a directory of its own.
        std::map<std::string, std::string> mounts = {{"/tmp", dir_.File("tmp/" + local.name)}};
        std::filesystem::create_directories(mounts["/tmp"]);
        for (const YAML::Node& m : c["volumeMounts"]) {
          mounts[m["mountPath"].as<std::string>()] = volume_dirs[m["name"].as<std::string>()];
        }
        local.argv = {"/usr/bin/env", "-i", "PATH=" + kBinDir + ":/usr/bin:/bin"};
        for (const YAML::Node& e : c["env"]) {
          std::string value;
          if (e["value"]) {
            value = Localize(e["value"].as<std::string>(), mounts);
          } else {
            const std::string field = e["valueFrom"]["fieldRef"]["fieldPath"].as<std::string>();
            if (field == "status.podIP") {
              value = "127.0.0.1";
            } else if (field == "metadata.labels['apps.kubernetes.io/pod-index']") {
              value = std::to_string(index);
            } else {
              ADD_FAILURE() << "unexpected fieldRef " << field;
            }
          }
          // Addresses: the coordinator's Service and its listening address become loopback.
          value = absl::StrReplaceAll(
              value, {{service_address_, local_address_}, {"0.0.0.0:50051", local_address_}});
          local.argv.push_back(e["name"].as<std::string>() + "=" + value);
        }
        // Threads: two cores shared by five processes.
        local.argv.push_back("HETPAR_THREADS=1");
        for (const std::string& word : c["command"].as<std::vector<std::string>>()) {
          local.argv.push_back(word);
        }
        if (c["args"]) {
          for (const std::string& a : c["args"].as<std::vector<std::string>>()) {
            EXPECT_EQ(a.find("$("), std::string::npos) << "unexpanded reference in " << a;
            local.argv.push_back(Localize(a, mounts));
          }
        }
        if (c["readinessProbe"]["exec"]) {
          for (const std::string& word :
               c["readinessProbe"]["exec"]["command"].as<std::vector<std::string>>()) {
            local.probe.push_back(Localize(word, mounts));
          }
        }
        out.push_back(std::move(local));
      }
    }
    return out;
  }

  TempDir dir_;
  std::vector<YAML::Node> objects_;
  std::string service_address_ = "tiny-coordinator:50051";
  std::string local_address_;
};

// Renders the tiny run's manifests with `sets`, runs their `expected_workers` worker containers
// and the coordinator as local processes, and checks the run against the reference.
void ManifestsRunTest::RunTheManifests(const std::vector<std::string>& sets,
                                       size_t expected_workers) {
  const int port = FreePort();
  ASSERT_GT(port, 0);
  local_address_ = absl::StrCat("127.0.0.1:", port);
  std::vector<std::string> render = {kHetparBin,
                                     "deploy",
                                     "k8s",
                                     "--config",
                                     kSourceDir + "/configs/tiny.yaml",
                                     "--image",
                                     "hetpar:test",
                                     "--out",
                                     dir_.File("k8s"),
                                     "--set",
                                     "run.steps=6",
                                     "--set",
                                     "run.dtype=float64",
                                     "--set",
                                     "data.synth.samples=64",
                                     "--set",
                                     "data.synth.val_samples=4"};
  for (const std::string& set : sets) render.insert(render.end(), {"--set", set});
  auto rendered = RunCommand(render, 60);
  ASSERT_TRUE(rendered.ok()) << rendered.status();
  ASSERT_EQ(rendered->exit_code, 0) << rendered->stderr_text;
  objects_ = LoadObjects(dir_.File("k8s"));

  std::vector<LocalContainer> workers;
  for (const YAML::Node& set : OfKind(objects_, "StatefulSet")) {
    for (LocalContainer& c : Containers(set, set["spec"]["replicas"].as<int64_t>())) {
      workers.push_back(std::move(c));
    }
  }
  ASSERT_EQ(workers.size(), expected_workers);
  const std::vector<LocalContainer> coordinators =
      Containers(Named(objects_, "Deployment", "tiny-coordinator"), 1);
  ASSERT_EQ(coordinators.size(), 1u);

  // The ConfigMap's RunSpec names container paths; the coordinator reads the localized copy.
  const std::string run_dir = dir_.File("volumes/tiny-run");
  const std::string data_dir = dir_.File("volumes/tiny-data");
  std::filesystem::create_directories(run_dir);
  std::filesystem::create_directories(data_dir);
  const std::string spec_path = dir_.File("configmaps/tiny-runspec/run.yaml");
  {
    const std::string text = ReadFile(spec_path);
    std::ofstream(spec_path) << absl::StrReplaceAll(
        text, {{"/var/lib/hetpar/run", run_dir}, {"/var/lib/hetpar/data", data_dir}});
  }

  // Workers first: each must wait for the coordinator, which is not up yet.
  std::vector<ChildProcess> processes;
  std::vector<std::string> logs;
  for (const LocalContainer& c : workers) {
    logs.push_back(dir_.File(c.name + ".log"));
    worker_logs_[c.name] = logs.back();
    auto p = ChildProcess::Start(c.argv, logs.back());
    ASSERT_TRUE(p.ok()) << p.status();
    processes.push_back(*std::move(p));
  }
  for (const std::string& log : logs) {
    ASSERT_TRUE(
        AwaitInFile(log, "waiting for the coordinator at 127\\.0\\.0\\.1", absl::Seconds(60)).ok())
        << log << ":\n"
        << ReadFile(log);
  }
  logs.push_back(dir_.File("coordinator.log"));
  auto coordinator = ChildProcess::Start(coordinators[0].argv, logs.back());
  ASSERT_TRUE(coordinator.ok()) << coordinator.status();
  processes.push_back(*std::move(coordinator));

  // Every process lingers after the run (as in a pod): wait for the coordinator to say so.
  auto done =
      AwaitInFile(logs.back(), "run tiny (done|failed); serving its status", absl::Seconds(400));
  std::string all_logs;
  for (const std::string& log : logs) absl::StrAppend(&all_logs, "== ", log, "\n", ReadFile(log));
  ASSERT_TRUE(done.ok()) << all_logs;
  EXPECT_EQ(*done, "done") << all_logs;
  for (size_t i = 0; i + 1 < logs.size(); ++i) {
    ASSERT_TRUE(AwaitInFile(logs[i], "idle until terminated", absl::Seconds(60)).ok())
        << logs[i] << ":\n"
        << ReadFile(logs[i]);
    // Each worker was ready (the file its probe tests made) from the first step, and is not
    // once the run is over: its probe, run here on its localized path, fails.
    ASSERT_EQ(workers[i].probe.size(), 3u) << workers[i].name;
    EXPECT_EQ(workers[i].probe[0], "test");
    EXPECT_THAT(ReadFile(logs[i]),
                HasSubstr(absl::StrCat("ready: trains with the run since step 0 ('",
                                       workers[i].probe[2], "' made)")));
    auto probe = RunCommand(workers[i].probe, 30);
    ASSERT_TRUE(probe.ok()) << probe.status();
    EXPECT_EQ(probe->exit_code, 1) << workers[i].probe[2];
  }
  for (ChildProcess& p : processes) {
    p.Signal(SIGTERM);
    auto code = p.Wait(60);
    ASSERT_TRUE(code.ok()) << code.status();
    EXPECT_EQ(*code, 0) << all_logs;
  }

  // The run directory on the run volume: 6 steps, final parameters, the model files.
  const std::string metrics = ReadFile(run_dir + "/metrics.jsonl");
  EXPECT_THAT(metrics, HasSubstr("\"step\":5"));
  EXPECT_THAT(metrics, HasSubstr("\"final_params\""));
  EXPECT_TRUE(std::filesystem::exists(run_dir + "/model/encoder.hpar"));
  EXPECT_TRUE(std::filesystem::exists(run_dir + "/model/llm.hpar"));

  auto reference = RunCommand(
      {kHetparBin, "run", "--reference", "--config", spec_path, "--out", dir_.File("reference")},
      300);
  ASSERT_TRUE(reference.ok()) << reference.status();
  ASSERT_EQ(reference->exit_code, 0) << reference->stderr_text;
  auto compare = RunCommand({kHetparBin, "compare", run_dir, dir_.File("reference")}, 60);
  ASSERT_TRUE(compare.ok()) << compare.status();
  EXPECT_EQ(compare->exit_code, 0) << compare->stdout_text << compare->stderr_text;
}

TEST_F(ManifestsRunTest, TinyManifestsFormARunThatMatchesTheReference) {
  RunTheManifests({}, 4);  // 2 encoder pods x 1 rank, 1 LLM pod x 2 ranks
}

// With pipeline stages each LLM pod holds one DP replica: its containers take that replica's
// ranks of both stages, so losing a pod loses one replica (docs/deploy.md).
TEST_F(ManifestsRunTest, WithPipelineStagesEachLlmPodHoldsOneDpReplica) {
  RunTheManifests({"llm.layout.dp=2", "llm.layout.tp=1", "llm.layout.pp=2"}, 6);
  for (int pod = 0; pod < 2; ++pod) {
    for (int local = 0; local < 2; ++local) {
      const std::string name = absl::StrCat("tiny-llm-", pod, "-rank-", local);
      ASSERT_EQ(worker_logs_.count(name), 1u) << name;
      // Its log lines carry its coordinates: "[r<world> llm dp<d> tp0 pp<s>]".
      EXPECT_THAT(ReadFile(worker_logs_[name]),
                  HasSubstr(absl::StrCat(" llm dp", pod, " tp0 pp", local, "]")))
          << name;
    }
  }
}

// A lingering worker still ends at once when terminated before its run is over (a pod deleted
// mid-run), here while it waits for a coordinator that never comes.
TEST(LingerTest, TerminatedBeforeTheRunEndsTheWorkerExitsAtOnce) {
  TempDir dir;
  const int port = FreePort();
  ASSERT_GT(port, 0);
  auto worker = ChildProcess::Start(
      {"/usr/bin/env", "-i", "HETPAR_TOKEN=a-token-for-this-test", kBinDir + "/hetpar-encoder",
       "--coordinator", absl::StrCat("127.0.0.1:", port), "--linger"},
      dir.File("worker.log"));
  ASSERT_TRUE(worker.ok()) << worker.status();
  ASSERT_TRUE(
      AwaitInFile(dir.File("worker.log"), "waiting for the coordinator", absl::Seconds(60)).ok())
      << ReadFile(dir.File("worker.log"));
  ASSERT_TRUE(worker->Signal(SIGTERM));
  auto code = worker->Wait(30);
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 128 + SIGTERM) << ReadFile(dir.File("worker.log"));
  EXPECT_THAT(ReadFile(dir.File("worker.log")),
              HasSubstr("terminated by signal 15 during the run"));
}

}  // namespace
}  // namespace hetpar::testing
