#include "coordinator/deploy/deploy.h"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace hetpar::deploy {
namespace {

// A string YAML reads back as the same string without quotes.
bool PlainSafe(const std::string& s) {
  if (s.empty()) return false;
  static const char* const kReserved[] = {"true", "false", "yes", "no", "on",   "off",
                                          "null", "y",     "n",   "~",  ".inf", ".nan"};
  std::string lower = s;
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return std::tolower(c); });
  for (const char* word : kReserved) {
    if (lower == word) return false;
  }
  if (!std::isalpha(static_cast<unsigned char>(s[0])) && s[0] != '/' && s[0] != '_') return false;
  for (char c : s) {
    if (!std::isalnum(static_cast<unsigned char>(c)) &&
        std::string_view("_./-=").find(c) == std::string_view::npos) {
      return false;
    }
  }
  return true;
}

void Emit(const nlohmann::ordered_json& v, int indent, std::string* out);

std::string Scalar(const nlohmann::ordered_json& v) {
  if (v.is_string()) {
    const std::string& s = v.get_ref<const std::string&>();
    return PlainSafe(s) ? s : v.dump();  // a JSON string is a valid double-quoted YAML string
  }
  return v.dump();
}

// The value after "key:" or "- ": inline for scalars and empty collections, else on new lines.
void EmitValue(const nlohmann::ordered_json& v, int indent, std::string* out) {
  if (v.is_string() && v.get_ref<const std::string&>().find('\n') != std::string::npos &&
      v.get_ref<const std::string&>()[0] != ' ') {
    // A literal block: "|" keeps one final newline, "|-" none.
    const std::string& s = v.get_ref<const std::string&>();
    const bool final_newline = s.back() == '\n';
    std::vector<std::string> lines = absl::StrSplit(s, '\n');
    if (final_newline) lines.pop_back();
    absl::StrAppend(out, final_newline ? " |\n" : " |-\n");
    for (const std::string& line : lines) {
      absl::StrAppend(out, line.empty() ? "" : std::string(indent + 2, ' '), line, "\n");
    }
    return;
  }
  if (v.is_object() || v.is_array()) {
    if (v.empty()) {
      absl::StrAppend(out, v.is_object() ? " {}\n" : " []\n");
      return;
    }
    out->push_back('\n');
    Emit(v, indent + 2, out);
    return;
  }
  absl::StrAppend(out, " ", Scalar(v), "\n");
}

void Emit(const nlohmann::ordered_json& v, int indent, std::string* out) {
  const std::string pad(indent, ' ');
  if (v.is_object()) {
    for (const auto& [key, value] : v.items()) {
      absl::StrAppend(out, pad, Scalar(nlohmann::ordered_json(key)), ":");
      EmitValue(value, indent, out);
    }
  } else if (v.is_array()) {
    for (const auto& item : v) {
      if (item.is_object() && !item.empty()) {
        // "- key: value" with the item's other keys aligned under the first.
        std::string body;
        Emit(item, indent + 2, &body);
        absl::StrAppend(out, pad, "- ", body.substr(indent + 2));
      } else {
        absl::StrAppend(out, pad, "-");
        EmitValue(item, indent, out);
      }
    }
  } else {
    absl::StrAppend(out, pad, Scalar(v), "\n");
  }
}

}  // namespace

std::string JsonToYaml(const nlohmann::ordered_json& value) {
  std::string out;
  Emit(value, 0, &out);
  return out;
}

ModuleShape EncoderShape(const v1::RunSpec& spec) {
  // The pods or node groups the pool starts with (encoder.initial_replicas); more can be added
  // up to encoder.layout.dp while the run trains.
  const int64_t initial = spec.encoder().initial_replicas();
  return {initial > 0 ? std::min<int64_t>(initial, spec.encoder().layout().dp())
                      : spec.encoder().layout().dp(),
          spec.encoder().layout().tp()};
}

ModuleShape LlmShape(const v1::RunSpec& spec) {
  const auto& l = spec.llm().layout();
  return {l.dp(), l.tp() * l.cp() * l.pp(), std::max<int64_t>(1, l.pp())};
}

std::string ObjectName(const std::string& run_name) {
  std::string name;
  for (char c : run_name) {
    const char lower = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (std::isalnum(static_cast<unsigned char>(lower))) {
      name.push_back(lower);
    } else if (!name.empty() && name.back() != '-') {
      name.push_back('-');
    }
  }
  if (name.size() > 40) name.resize(40);
  while (!name.empty() && name.back() == '-') name.pop_back();
  if (name.empty() || !std::isalpha(static_cast<unsigned char>(name[0]))) {
    name = "hetpar-" + name;
  }
  return name;
}

v1::RunSpec RelocatedSpec(const v1::RunSpec& spec, const std::string& data_dir,
                          const std::string& out_dir, std::string* data_root) {
  v1::RunSpec out = spec;
  v1::DataSpec* data = out.mutable_data();
  std::vector<std::string*> paths;
  for (std::string* p : {data->mutable_manifest(), data->mutable_val_manifest(),
                         data->mutable_tokenizer(), data->mutable_index()}) {
    if (!p->empty()) paths.push_back(p);
  }
  // The deepest directory holding every data file.
  std::filesystem::path root;
  for (const std::string* p : paths) {
    const std::filesystem::path dir = std::filesystem::path(*p).lexically_normal().parent_path();
    if (root.empty()) {
      root = dir;
      continue;
    }
    std::filesystem::path common;
    auto a = root.begin();
    auto b = dir.begin();
    for (; a != root.end() && b != dir.end() && *a == *b; ++a, ++b) common /= *a;
    root = common;
  }
  for (std::string* p : paths) {
    const std::filesystem::path relative =
        std::filesystem::path(*p).lexically_normal().lexically_relative(root);
    *p = (std::filesystem::path(data_dir) / relative).string();
  }
  if (data_root != nullptr) *data_root = root.string();
  // Checkpoints go on the run's volume, the one place every pod writes and keeps: the
  // config's directory is a path on the machine that rendered it. A checkpoint to resume from
  // that lies under it keeps its place below the new one.
  if (!spec.checkpoint().dir().empty()) {
    const std::filesystem::path from =
        std::filesystem::path(spec.checkpoint().dir()).lexically_normal();
    const std::filesystem::path to = std::filesystem::path(out_dir) / "checkpoints";
    out.mutable_checkpoint()->set_dir(to.string());
    if (const std::string& resume = spec.checkpoint().resume_from(); !resume.empty()) {
      const std::filesystem::path relative =
          std::filesystem::path(resume).lexically_normal().lexically_relative(from);
      if (!relative.empty() && *relative.begin() != "..") {
        out.mutable_checkpoint()->set_resume_from((to / relative).string());
      }
    }
  }
  out.mutable_run()->set_out_dir(out_dir);
  out.mutable_coordinator()->clear_token_file();
  return out;
}

int64_t RanksPerNode(const DeployOptions& options) {
  if (options.ranks_per_node >= 0) return options.ranks_per_node;
  return options.device == Device::kGpu ? options.gpus_per_node : 0;
}

std::vector<std::string> PlacementProblems(const config::LoadedRunSpec& loaded,
                                           const DeployOptions& options) {
  const v1::RunSpec& spec = loaded.spec;
  std::vector<std::string> problems;
  auto check = [&](const std::string& module, const std::string& field, int64_t value,
                   const ModuleShape& shape) {
    const std::string where = loaded.source.Where(field);
    if (options.device == Device::kGpu && shape.ranks_per_replica > options.gpus_per_node) {
      problems.push_back(
          absl::StrCat(field, ": =", value, " puts ", shape.ranks_per_replica, " GPUs in one ",
                       module, " replica, more than a node has (--gpus-per-node ",
                       options.gpus_per_node, "); a replica's ranks share a node (", where, ")"));
    }
    if (options.ranks_per_node > 0 && shape.ranks_per_replica > options.ranks_per_node) {
      problems.push_back(
          absl::StrCat(field, ": =", value, " puts ", shape.ranks_per_replica, " ranks in one ",
                       module, " replica, more than a node runs (--ranks-per-node ",
                       options.ranks_per_node, "); a replica's ranks share a node (", where, ")"));
    }
    if (options.cpus_per_node > 0 &&
        shape.ranks_per_replica * options.cpus_per_rank > options.cpus_per_node) {
      problems.push_back(absl::StrCat(field, ": =", value, " puts ", shape.ranks_per_replica,
                                      " ranks x ", options.cpus_per_rank,
                                      " CPUs (--cpus-per-rank) in one ", module,
                                      " replica, more than a node has (--cpus-per-node ",
                                      options.cpus_per_node, ") (", where, ")"));
    }
  };
  if (options.device == Device::kGpu && options.ranks_per_node > options.gpus_per_node) {
    problems.push_back(absl::StrCat("--ranks-per-node ", options.ranks_per_node,
                                    " is more than a node's GPUs (--gpus-per-node ",
                                    options.gpus_per_node, "); each rank takes one"));
  }
  if (spec.placement() == v1::PLACEMENT_COLOCATED) {
    check("colocated", "llm.layout.tp", spec.llm().layout().tp(), LlmShape(spec));
  } else {
    check("encoder", "encoder.layout.tp", spec.encoder().layout().tp(), EncoderShape(spec));
    check("LLM", "llm.layout.tp", spec.llm().layout().tp(), LlmShape(spec));
  }
  return problems;
}

}  // namespace hetpar::deploy
