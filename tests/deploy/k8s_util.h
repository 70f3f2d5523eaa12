// Reading rendered Kubernetes manifests in tests: every object of a directory's YAML files, and
// the containers of its workloads.
#ifndef HETPAR_TESTS_DEPLOY_K8S_UTIL_H_
#define HETPAR_TESTS_DEPLOY_K8S_UTIL_H_

#include <filesystem>
#include <string>
#include <vector>

#include "yaml-cpp/yaml.h"

namespace hetpar::testing {

// Every document of every *.yaml file under `dir` (recursively), kustomization excluded.
inline std::vector<YAML::Node> LoadObjects(const std::string& dir) {
  std::vector<YAML::Node> objects;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(dir)) {
    if (entry.path().extension() != ".yaml" || entry.path().filename() == "kustomization.yaml") {
      continue;
    }
    for (const YAML::Node& doc : YAML::LoadAllFromFile(entry.path().string())) {
      if (doc.IsMap()) objects.push_back(doc);
    }
  }
  return objects;
}

inline std::vector<YAML::Node> OfKind(const std::vector<YAML::Node>& objects,
                                      const std::string& kind) {
  std::vector<YAML::Node> out;
  for (const YAML::Node& o : objects) {
    if (o["kind"].as<std::string>() == kind) out.push_back(o);
  }
  return out;
}

inline YAML::Node Named(const std::vector<YAML::Node>& objects, const std::string& kind,
                        const std::string& name) {
  for (const YAML::Node& o : OfKind(objects, kind)) {
    if (o["metadata"]["name"].as<std::string>() == name) return o;
  }
  return YAML::Node();
}

}  // namespace hetpar::testing

#endif  // HETPAR_TESTS_DEPLOY_K8S_UTIL_H_
