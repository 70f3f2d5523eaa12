#include "common/config/config.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <sstream>
#include <tuple>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/errno_status.h"
#include "common/plan/step_plan.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "google/protobuf/reflection.h"
#include "nlohmann/json.hpp"
#include "yaml-cpp/eventhandler.h"
#include "yaml-cpp/yaml.h"

namespace hetpar::config {
namespace {

namespace fs = std::filesystem;
namespace pb = google::protobuf;
using hetpar::v1::RunSpec;

constexpr int kMaxDepth = 16;

std::string Join(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

// Levenshtein distance, for "did you mean" suggestions.
size_t EditDistance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

std::string Suggest(std::string_view key, const std::vector<std::string>& candidates) {
  std::string best;
  size_t best_distance = std::string::npos;
  for (const auto& candidate : candidates) {
    size_t d = EditDistance(key, candidate);
    if (d < best_distance) {
      best_distance = d;
      best = candidate;
    }
  }
  // Suggest only plausible typos: at most a third of the word changed.
  if (best.empty() || best_distance > std::max<size_t>(2, key.size() / 3)) return "";
  return best;
}

std::vector<std::string> FieldNames(const pb::Descriptor* descriptor) {
  std::vector<std::string> names;
  for (int i = 0; i < descriptor->field_count(); ++i) names.push_back(descriptor->field(i)->name());
  return names;
}

std::string Lower(std::string_view text) {
  std::string out(text);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// "TransportKind" -> "TRANSPORT_KIND_", the prefix of its value names.
std::string EnumPrefix(const pb::EnumDescriptor* descriptor) {
  std::string prefix;
  const std::string& name = descriptor->name();
  for (size_t i = 0; i < name.size(); ++i) {
    if (i > 0 && std::isupper(static_cast<unsigned char>(name[i]))) prefix += '_';
    prefix += static_cast<char>(std::toupper(static_cast<unsigned char>(name[i])));
  }
  return prefix + "_";
}

// The YAML spelling of an enum value: DTYPE_FLOAT32 -> "float32".
std::string EnumYamlName(const pb::EnumValueDescriptor* value) {
  std::string prefix = EnumPrefix(value->type());
  std::string name = value->name();
  if (name.rfind(prefix, 0) == 0) name = name.substr(prefix.size());
  return Lower(name);
}

std::vector<std::string> EnumChoices(const pb::EnumDescriptor* descriptor) {
  std::vector<std::string> names;
  for (int i = 0; i < descriptor->value_count(); ++i) {
    if (descriptor->value(i)->number() == 0) continue;  // UNSPECIFIED is not a user choice
    names.push_back(EnumYamlName(descriptor->value(i)));
  }
  return names;
}

std::string Quote(std::string_view text) {
  std::string out = "'";
  for (char c : text.substr(0, 60)) out += (std::isprint(static_cast<unsigned char>(c)) ? c : '?');
  if (text.size() > 60) out += "...";
  return out + "'";
}

std::string NodeKind(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Null:
      return "nothing";
    case YAML::NodeType::Scalar:
      return Quote(node.Scalar());
    case YAML::NodeType::Sequence:
      return "a list";
    case YAML::NodeType::Map:
      return "a mapping";
    case YAML::NodeType::Undefined:
      return "nothing";
  }
  return "nothing";
}

bool ParseInt64(const std::string& text, int64_t* out) {
  if (text.empty()) return false;
  errno = 0;
  char* end = nullptr;
  long long v = std::strtoll(text.c_str(), &end, 10);
  if (errno != 0 || end != text.c_str() + text.size()) return false;
  *out = v;
  return true;
}

bool ParseDouble(const std::string& text, double* out) {
  if (text.empty()) return false;
  errno = 0;
  char* end = nullptr;
  double v = std::strtod(text.c_str(), &end);
  if (errno != 0 || end != text.c_str() + text.size() || !std::isfinite(v)) return false;
  *out = v;
  return true;
}

bool ParseBool(const std::string& text, bool* out) {
  std::string t = Lower(text);
  if (t == "true" || t == "yes" || t == "on") {
    *out = true;
  } else if (t == "false" || t == "no" || t == "off") {
    *out = false;
  } else {
    return false;
  }
  return true;
}

// data.synth.val_samples when a config leaves it out: an eighth of the training samples.
int64_t DefaultSynthValSamples(int64_t samples) { return std::max<int64_t>(1, samples / 8); }

// How the user gave an override: the flag override_flags names for it, else its --set.
std::string OverrideFlag(const std::string& assignment,
                         const std::map<std::string, std::string>& flags) {
  auto it = flags.find(assignment);
  return it != flags.end() ? it->second : absl::StrCat("--set ", assignment);
}

// Converts a YAML tree onto a proto message by reflection, collecting every problem.
class YamlToProto {
 public:
  YamlToProto(SourceMap* source, std::vector<ConfigIssue>* issues)
      : source_(source), issues_(issues) {}

  void Message(const YAML::Node& node, pb::Message* message, const std::string& path, int depth) {
    const pb::Descriptor* descriptor = message->GetDescriptor();
    if (node.IsNull()) return;  // `encoder:` with nothing under it: all defaults
    if (!node.IsMap()) {
      Issue(path,
            absl::StrCat("expected a mapping with keys ", KeyList(descriptor), ", got ",
                         NodeKind(node)),
            node);
      return;
    }
    if (depth > kMaxDepth) {
      Issue(path, "nested too deeply", node);
      return;
    }
    // YAML leaves a key written twice in one mapping to the reader; yaml-cpp keeps both, and
    // taking either would drop a value the file states.
    std::map<std::string, int> seen;  // key -> its first line (0 when unknown)
    for (const auto& item : node) {
      const YAML::Node& key = item.first;
      const YAML::Node& value = item.second;
      if (!key.IsScalar()) {
        Issue(path, absl::StrCat("keys must be plain names, got ", NodeKind(key)), key);
        continue;
      }
      const std::string name = key.Scalar();
      const std::string field_path = Join(path, name);
      if (auto [first, fresh] = seen.emplace(name, key.Mark().line + 1); !fresh) {
        Issue(field_path,
              absl::StrCat("written twice in one mapping",
                           first->second > 0 ? absl::StrCat(" (first at line ", first->second, ")")
                                             : std::string(),
                           "; keep one"),
              key);
        continue;
      }
      const pb::FieldDescriptor* field = descriptor->FindFieldByName(name);
      if (field == nullptr) {
        std::string message = absl::StrCat("unknown key ", Quote(name));
        std::string suggestion = Suggest(name, FieldNames(descriptor));
        if (!suggestion.empty()) {
          absl::StrAppend(&message, "; did you mean '", suggestion, "'?");
        } else {
          absl::StrAppend(&message, "; expected one of ", KeyList(descriptor));
        }
        Issue(field_path, message, key);
        continue;
      }
      if (key.Mark().line >= 0) {
        source_->Set(field_path, absl::StrCat(source_->source_name(), ":", key.Mark().line + 1));
      }
      Field(value, message, field, field_path, depth);
    }
  }

 private:
  void Field(const YAML::Node& value, pb::Message* message, const pb::FieldDescriptor* field,
             const std::string& path, int depth) {
    const pb::Reflection* reflection = message->GetReflection();
    if (field->is_repeated()) {
      Issue(path, "list fields are not supported", value);
      return;
    }
    if (field->cpp_type() == pb::FieldDescriptor::CPPTYPE_MESSAGE) {
      Message(value, reflection->MutableMessage(message, field), path, depth + 1);
      return;
    }
    if (!value.IsScalar()) {
      Issue(path, absl::StrCat("expected ", Expected(field), ", got ", NodeKind(value)), value);
      return;
    }
    const std::string& text = value.Scalar();
    switch (field->cpp_type()) {
      case pb::FieldDescriptor::CPPTYPE_INT64: {
        int64_t v;
        if (!ParseInt64(text, &v)) return Bad(path, field, value);
        reflection->SetInt64(message, field, v);
        return;
      }
      case pb::FieldDescriptor::CPPTYPE_INT32: {
        int64_t v;
        if (!ParseInt64(text, &v) || v < INT32_MIN || v > INT32_MAX) {
          return Bad(path, field, value);
        }
        reflection->SetInt32(message, field, static_cast<int32_t>(v));
        return;
      }
      case pb::FieldDescriptor::CPPTYPE_DOUBLE: {
        double v;
        if (!ParseDouble(text, &v)) return Bad(path, field, value);
        reflection->SetDouble(message, field, v);
        return;
      }
      case pb::FieldDescriptor::CPPTYPE_FLOAT: {
        double v;
        if (!ParseDouble(text, &v)) return Bad(path, field, value);
        reflection->SetFloat(message, field, static_cast<float>(v));
        return;
      }
      case pb::FieldDescriptor::CPPTYPE_BOOL: {
        bool v;
        if (!ParseBool(text, &v)) return Bad(path, field, value);
        reflection->SetBool(message, field, v);
        return;
      }
      case pb::FieldDescriptor::CPPTYPE_STRING:
        reflection->SetString(message, field, text);
        return;
      case pb::FieldDescriptor::CPPTYPE_ENUM: {
        const pb::EnumDescriptor* type = field->enum_type();
        const std::string wanted = Lower(text);
        for (int i = 0; i < type->value_count(); ++i) {
          if (type->value(i)->number() != 0 && EnumYamlName(type->value(i)) == wanted) {
            reflection->SetEnum(message, field, type->value(i));
            return;
          }
        }
        std::string message_text = absl::StrCat("unknown value ", Quote(text), "; expected ",
                                                absl::StrJoin(EnumChoices(type), " | "));
        std::string suggestion = Suggest(wanted, EnumChoices(type));
        if (!suggestion.empty())
          absl::StrAppend(&message_text, " (did you mean '", suggestion, "'?)");
        Issue(path, message_text, value);
        return;
      }
      case pb::FieldDescriptor::CPPTYPE_UINT32:
      case pb::FieldDescriptor::CPPTYPE_UINT64:
      case pb::FieldDescriptor::CPPTYPE_MESSAGE:
        Issue(path, "field type is not supported in YAML", value);
        return;
    }
  }

  static std::string Expected(const pb::FieldDescriptor* field) {
    switch (field->cpp_type()) {
      case pb::FieldDescriptor::CPPTYPE_INT32:
      case pb::FieldDescriptor::CPPTYPE_INT64:
      case pb::FieldDescriptor::CPPTYPE_UINT32:
      case pb::FieldDescriptor::CPPTYPE_UINT64:
        return "an integer";
      case pb::FieldDescriptor::CPPTYPE_DOUBLE:
      case pb::FieldDescriptor::CPPTYPE_FLOAT:
        return "a number";
      case pb::FieldDescriptor::CPPTYPE_BOOL:
        return "true or false";
      case pb::FieldDescriptor::CPPTYPE_STRING:
        return "a string";
      case pb::FieldDescriptor::CPPTYPE_ENUM:
        return "one of " + absl::StrJoin(EnumChoices(field->enum_type()), " | ");
      case pb::FieldDescriptor::CPPTYPE_MESSAGE:
        return "a mapping";
    }
    return "a value";
  }

  static std::string KeyList(const pb::Descriptor* descriptor) {
    return "{" + absl::StrJoin(FieldNames(descriptor), ", ") + "}";
  }

  void Bad(const std::string& path, const pb::FieldDescriptor* field, const YAML::Node& value) {
    Issue(path, absl::StrCat("expected ", Expected(field), ", got ", NodeKind(value)), value);
  }

  void Issue(const std::string& path, std::string message, const YAML::Node& at) {
    std::string where = source_->source_name();
    if (at.Mark().line >= 0) where = absl::StrCat(where, ":", at.Mark().line + 1);
    // A node a --set put there has its line in the flag's text, not in the file. A mapping on
    // the way to a --set's key that the file did not have (no line: the --set made it, so a
    // misspelt `--set llm.modle.heads=2` is told at its flag) is the flag's too.
    for (const auto& [overridden, flag] : overrides_) {
      if (path == overridden || absl::StartsWith(path, overridden + ".") ||
          (at.Mark().line < 0 && absl::StartsWith(overridden, path + "."))) {
        where = flag;
      }
    }
    issues_->push_back({path, std::move(message), where});
  }

 public:
  // The paths set by --set flags (path -> the flag that set it), for Issue's locations.
  void SetOverrides(const std::vector<std::string>& assignments,
                    const std::map<std::string, std::string>& flags) {
    for (const std::string& assignment : assignments) {
      overrides_.emplace_back(assignment.substr(0, assignment.find('=')),
                              OverrideFlag(assignment, flags));
    }
  }

 private:
  SourceMap* source_;
  std::vector<ConfigIssue>* issues_;
  std::vector<std::pair<std::string, std::string>> overrides_;
};

// Writes `value` at `target`: a mapping onto a mapping merges key by key (so that
// `--set encoder.layout={tp: 2}` keeps the file's dp), anything else replaces.
void Merge(YAML::Node target, const YAML::Node& value) {
  if (!target.IsMap() || !value.IsMap()) {
    target = value;
    return;
  }
  for (const auto& item : value) {
    if (!item.first.IsScalar()) {
      target[item.first] = item.second;
      continue;
    }
    const std::string key = item.first.Scalar();
    if (target[key] && target[key].IsMap() && item.second.IsMap()) {
      Merge(target[key], item.second);
    } else {
      target[key] = item.second;
    }
  }
}

// Records `where` as the location of every key under `path` that `value` (a --set's mapping)
// writes.
void MarkOverridden(const YAML::Node& value, const std::string& path, const std::string& where,
                    SourceMap* source) {
  if (!value.IsMap()) return;
  for (const auto& entry : value) {
    if (!entry.first.IsScalar()) continue;
    const std::string key = absl::StrCat(path, ".", entry.first.Scalar());
    source->Set(key, where, /*from_flag=*/true);
    MarkOverridden(entry.second, key, where, source);
  }
}

// Applies one `a.b.c=value` override onto the YAML tree.
absl::Status ApplyOverride(YAML::Node root, const std::string& assignment) {
  const size_t eq = assignment.find('=');
  if (eq == std::string::npos || eq == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--set ", Quote(assignment), ": expected KEY.PATH=VALUE, for example llm.layout.tp=2"));
  }
  const std::string path = assignment.substr(0, eq);
  const std::string text = assignment.substr(eq + 1);
  std::vector<std::string> keys = absl::StrSplit(path, '.');
  YAML::Node value;
  try {
    value = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("--set ", path, ": cannot parse value ", Quote(text), ": ", e.msg));
  }
  // yaml-cpp's operator[] returns handles; walk with explicit copies so nested maps are created.
  std::vector<YAML::Node> chain{root};
  for (size_t i = 0; i + 1 < keys.size(); ++i) {
    if (keys[i].empty()) {
      return absl::InvalidArgumentError(absl::StrCat("--set ", Quote(path), ": empty key"));
    }
    YAML::Node parent = chain.back();
    if (parent[keys[i]] && !parent[keys[i]].IsMap() && !parent[keys[i]].IsNull()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--set ", path, ": '", absl::StrJoin(keys.begin(), keys.begin() + i + 1, "."),
          "' is a value, not a mapping"));
    }
    if (!parent[keys[i]] || parent[keys[i]].IsNull())
      parent[keys[i]] = YAML::Node(YAML::NodeType::Map);
    chain.push_back(parent[keys[i]]);
  }
  if (keys.back().empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--set ", Quote(path), ": empty key"));
  }
  YAML::Node parent = chain.back();
  if (parent[keys.back()] && parent[keys.back()].IsMap() && value.IsMap()) {
    Merge(parent[keys.back()], value);
  } else {
    parent[keys.back()] = value;
  }
  return absl::OkStatus();
}

// Field access by dotted path, for defaults and path resolution.
pb::Message* MutableAt(pb::Message* root, const std::string& path,
                       const pb::FieldDescriptor** leaf) {
  std::vector<std::string> keys = absl::StrSplit(path, '.');
  pb::Message* message = root;
  for (size_t i = 0; i < keys.size(); ++i) {
    const pb::FieldDescriptor* field = message->GetDescriptor()->FindFieldByName(keys[i]);
    if (field == nullptr) return nullptr;
    if (i + 1 == keys.size()) {
      *leaf = field;
      return message;
    }
    message = message->GetReflection()->MutableMessage(message, field);
  }
  return nullptr;
}

class Defaults {
 public:
  Defaults(LoadedRunSpec* loaded) : loaded_(loaded) {}

  void Int(const std::string& path, int64_t value) {
    const pb::FieldDescriptor* field = nullptr;
    pb::Message* message = Target(path, &field);
    if (message != nullptr) message->GetReflection()->SetInt64(message, field, value);
  }
  void Double(const std::string& path, double value) {
    const pb::FieldDescriptor* field = nullptr;
    pb::Message* message = Target(path, &field);
    if (message != nullptr) message->GetReflection()->SetDouble(message, field, value);
  }
  void String(const std::string& path, const std::string& value) {
    const pb::FieldDescriptor* field = nullptr;
    pb::Message* message = Target(path, &field);
    if (message != nullptr) message->GetReflection()->SetString(message, field, value);
  }
  void Enum(const std::string& path, int number) {
    const pb::FieldDescriptor* field = nullptr;
    pb::Message* message = Target(path, &field);
    if (message != nullptr) message->GetReflection()->SetEnumValue(message, field, number);
  }

 private:
  // The message holding `path` when the input did not write it; nullptr otherwise.
  pb::Message* Target(const std::string& path, const pb::FieldDescriptor** field) {
    if (loaded_->source.Has(path)) return nullptr;
    return MutableAt(&loaded_->spec, path, field);
  }
  LoadedRunSpec* loaded_;
};

void ResolvePath(LoadedRunSpec* loaded, const std::string& path) {
  const pb::FieldDescriptor* field = nullptr;
  pb::Message* message = MutableAt(&loaded->spec, path, &field);
  if (message == nullptr) return;
  std::string value = message->GetReflection()->GetString(*message, field);
  if (value.empty()) return;
  fs::path p(value);
  if (p.is_relative()) {
    // Written in the file: relative to the file. Otherwise (a flag, default): to the cwd.
    const bool from_file = loaded->source.InFile(path);
    fs::path base =
        from_file && !loaded->base_dir.empty() ? fs::path(loaded->base_dir) : fs::current_path();
    p = base / p;
  }
  message->GetReflection()->SetString(message, field, p.lexically_normal().string());
}

// Marks every sub-message present, so a normalised spec is the same whether or not the input
// wrote an empty section.
void MaterialiseMessages(pb::Message* message) {
  const pb::Descriptor* descriptor = message->GetDescriptor();
  for (int i = 0; i < descriptor->field_count(); ++i) {
    const pb::FieldDescriptor* field = descriptor->field(i);
    if (field->cpp_type() == pb::FieldDescriptor::CPPTYPE_MESSAGE && !field->is_repeated()) {
      MaterialiseMessages(message->GetReflection()->MutableMessage(message, field));
    }
  }
}

// Emits a message as a YAML mapping by reflection.
void EmitMessage(YAML::Emitter& out, const pb::Message& message) {
  const pb::Descriptor* descriptor = message.GetDescriptor();
  const pb::Reflection* reflection = message.GetReflection();
  out << YAML::BeginMap;
  for (int i = 0; i < descriptor->field_count(); ++i) {
    const pb::FieldDescriptor* field = descriptor->field(i);
    if (field->is_repeated()) continue;
    out << YAML::Key << field->name() << YAML::Value;
    switch (field->cpp_type()) {
      case pb::FieldDescriptor::CPPTYPE_MESSAGE:
        EmitMessage(out, reflection->GetMessage(message, field));
        break;
      case pb::FieldDescriptor::CPPTYPE_INT64:
        out << reflection->GetInt64(message, field);
        break;
      case pb::FieldDescriptor::CPPTYPE_INT32:
        out << reflection->GetInt32(message, field);
        break;
      case pb::FieldDescriptor::CPPTYPE_UINT32:
        out << reflection->GetUInt32(message, field);
        break;
      case pb::FieldDescriptor::CPPTYPE_UINT64:
        out << reflection->GetUInt64(message, field);
        break;
      case pb::FieldDescriptor::CPPTYPE_DOUBLE:
        out << FormatDouble(reflection->GetDouble(message, field));
        break;
      case pb::FieldDescriptor::CPPTYPE_FLOAT:
        out << FormatDouble(reflection->GetFloat(message, field));
        break;
      case pb::FieldDescriptor::CPPTYPE_BOOL:
        out << reflection->GetBool(message, field);
        break;
      case pb::FieldDescriptor::CPPTYPE_STRING:
        out << YAML::DoubleQuoted << reflection->GetString(message, field);
        break;
      case pb::FieldDescriptor::CPPTYPE_ENUM:
        out << EnumYamlName(reflection->GetEnum(message, field));
        break;
    }
  }
  out << YAML::EndMap;
}

// ---- semantic validation ----

// The most ranks one module's layout may have. It bounds every product of layout sizes the
// validator and the planner form, far from int64's range, and is far above any real cluster.
constexpr int64_t kMaxModuleRanks = int64_t{1} << 20;
// The largest run.grad_bucket_mib (1 TiB): its byte count stays an exact int64.
constexpr double kMaxGradBucketMib = 1024.0 * 1024.0;
// Samples in one global batch: far above any batch trained today (thousands to tens of
// thousands), far below one whose per-step sample lists no worker could hold.
constexpr int64_t kMaxGlobalBatch = int64_t{1} << 24;
// The longest run.name.
constexpr size_t kMaxRunNameChars = 128;

// The product of `factors`, or nullopt where it overflows int64.
std::optional<int64_t> Product(std::initializer_list<int64_t> factors) {
  int64_t product = 1;
  for (const int64_t factor : factors) {
    if (__builtin_mul_overflow(product, factor, &product)) return std::nullopt;
  }
  return product;
}

// Whether `address` is host:port with a port in [0, 65535] ([::1]:port for IPv6).
bool IsHostPort(const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0) return false;
  const std::string port = address.substr(colon + 1);
  int64_t value = -1;
  return !port.empty() && port.find_first_not_of("0123456789") == std::string::npos &&
         absl::SimpleAtoi(port, &value) && value >= 0 && value <= 65535;
}

class Checker {
 public:
  Checker(const LoadedRunSpec& loaded, std::vector<ConfigIssue>* issues)
      : loaded_(loaded), issues_(issues) {}

  void Fail(const std::string& path, std::string message) {
    issues_->push_back({path, std::move(message), loaded_.source.Where(path)});
  }

  // A size that must be >= minimum. Returns whether it is.
  bool AtLeast(const std::string& path, int64_t value, int64_t minimum) {
    if (value >= minimum) return true;
    if (!loaded_.source.Has(path)) {
      Fail(path, absl::StrCat("is required: expected an integer >= ", minimum));
    } else {
      Fail(path, absl::StrCat("=", value, " must be >= ", minimum));
    }
    return false;
  }

  // A size read into a 32-bit integer (token ids, the loader's sizes): at most INT32_MAX.
  bool FitsInt32(const std::string& path, int64_t value) {
    if (value <= std::numeric_limits<int32_t>::max()) return true;
    Fail(path, absl::StrCat("=", value, " must be <= ", std::numeric_limits<int32_t>::max(),
                            " (read as a 32-bit integer)"));
    return false;
  }

  void Divides(const std::string& divisor_path, int64_t divisor, const std::string& path,
               int64_t value, std::string_view why = "") {
    if (divisor <= 0 || value <= 0 || value % divisor == 0) return;
    Fail(divisor_path,
         absl::StrCat("=", divisor, " does not divide ", path, "=", value,
                      why.empty() ? std::string() : absl::StrCat(" (", std::string(why), ")")));
  }

  void FileExists(const std::string& path, const std::string& value, bool required) {
    if (value.empty()) {
      if (required) Fail(path, "is required: expected a file path");
      return;
    }
    std::error_code ec;
    if (!fs::exists(value, ec)) Fail(path, absl::StrCat("file '", value, "' does not exist"));
  }

 private:
  const LoadedRunSpec& loaded_;
  std::vector<ConfigIssue>* issues_;
};

// The scalar at `path` ("llm.model.heads": a module, its model, a field) of a RunSpec's YAML, as
// its text; none when absent or not a scalar.
std::optional<std::string> ModelScalarAt(const YAML::Node& runspec, std::string_view path) {
  const std::vector<std::string> parts =
      absl::StrSplit(absl::string_view(path.data(), path.size()), '.');
  if (parts.size() != 3 || !runspec.IsMap()) return std::nullopt;
  const YAML::Node module = runspec[parts[0]];
  if (!module || !module.IsMap()) return std::nullopt;
  const YAML::Node model = module[parts[1]];
  if (!model || !model.IsMap()) return std::nullopt;
  const YAML::Node value = model[parts[2]];
  if (!value || !value.IsScalar()) return std::nullopt;
  return value.Scalar();
}

}  // namespace

absl::StatusOr<CheckpointSummary> ReadCheckpointSummary(const std::string& dir) {
  const std::string path = (fs::path(dir) / "manifest.json").string();
  // Not opened unless a regular file: opening a FIFO would wait for a writer.
  std::error_code error;
  if (const fs::file_status status = fs::status(path, error);
      fs::exists(status) && !fs::is_regular_file(status)) {
    return absl::DataLossError(absl::StrCat("'", path, "' is not a regular file"));
  }
  std::ifstream in(path);
  if (!in) {
    const int open_error = errno;
    if (open_error != ENOENT && open_error != ENOTDIR && open_error != 0) {
      // Permissions, an I/O error, a stale NFS handle: not an incomplete checkpoint, which a
      // restart would pass over for an older one.
      return ErrnoStatus(open_error, absl::StrCat("cannot read checkpoint manifest '", path, "'"));
    }
    return absl::NotFoundError(
        absl::StrCat("no complete checkpoint: '", path,
                     "' does not exist (expected a step-NNNNNN directory of checkpoint.dir)"));
  }
  const nlohmann::json manifest = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (manifest.is_discarded() || !manifest.is_object() || !manifest.contains("step") ||
      !manifest["step"].is_number_integer() || manifest["step"].get<int64_t>() < 0) {
    return absl::DataLossError(
        absl::StrCat("'", path, "' is not a checkpoint manifest (no non-negative integer step)"));
  }
  CheckpointSummary summary;
  summary.step = manifest["step"].get<int64_t>();
  if (manifest.contains("write_id") && manifest["write_id"].is_number_unsigned()) {
    summary.write_id = manifest["write_id"].get<uint64_t>();
  }
  // Written by the workers (common/worker/module_state.cc).
  const nlohmann::json& extra = manifest.value("extra", nlohmann::json::object());
  if (extra.is_object() && extra.contains("samples_trained") &&
      extra["samples_trained"].is_number_integer()) {
    summary.samples_trained = extra["samples_trained"].get<int64_t>();
  }
  if (extra.is_object() && extra.contains("seed") && extra["seed"].is_number_integer()) {
    summary.seed = extra["seed"].get<int64_t>();
  }
  if (extra.is_object() && extra.contains("run") && extra["run"].is_string()) {
    summary.run = extra["run"].get<std::string>();
  }
  if (extra.is_object() && extra.contains("runspec") && extra["runspec"].is_string()) {
    // The normalised YAML of the RunSpec it was written under (module_state.cc).
    try {
      const YAML::Node runspec = YAML::Load(extra["runspec"].get<std::string>());
      // <module>.model.layers; none when absent or not a positive integer.
      const auto layers = [&runspec](const char* module) -> std::optional<int64_t> {
        const std::optional<std::string> text =
            ModelScalarAt(runspec, absl::StrCat(module, ".model.layers"));
        int64_t value = 0;
        if (!text || !absl::SimpleAtoi(*text, &value) || value < 1) return std::nullopt;
        return value;
      };
      summary.encoder_layers = layers("encoder");
      summary.llm_layers = layers("llm");
      for (std::string_view path : kCheckpointArchitectureFields) {
        if (std::optional<std::string> text = ModelScalarAt(runspec, path)) {
          summary.architecture.emplace(path, *std::move(text));
        }
      }
      if (runspec.IsMap()) {
        // The emitter writes true or false (config::RunSpecToYaml).
        summary.encoder_no_final_norm =
            ModelScalarAt(runspec, "encoder.model.no_final_norm") == "true";
      }
    } catch (const YAML::Exception&) {
      // Not readable: the manifest does not say.
    }
  }
  if (extra.is_object() && extra.contains("data") && extra["data"].is_object()) {
    const nlohmann::json& data = extra["data"];
    const auto count = [&data](const char* key) -> int64_t {
      return data.contains(key) && data[key].is_number_integer() ? data[key].get<int64_t>() : -1;
    };
    CheckpointDataPosition position{count("index_samples"), count("epoch"), count("offset")};
    if (data.contains("index_digest") && data["index_digest"].is_number_unsigned() &&
        data["index_digest"].get<uint64_t>() <= 0xffffffffu) {
      position.index_digest = static_cast<uint32_t>(data["index_digest"].get<uint64_t>());
    }
    // Only a position that fits its own index: anything else is read as not recorded.
    if (position.index_samples > 0 && position.epoch >= 0 && position.offset >= 0 &&
        position.offset <= position.index_samples) {
      summary.data = position;
    }
  }
  return summary;
}

std::string SourceMap::Where(std::string_view path) const {
  std::string p(path);
  while (true) {
    auto it = locations_.find(p);
    if (it != locations_.end()) {
      if (p.size() == path.size()) return it->second;
      return absl::StrCat(it->second, "; ", std::string(path), " is not set there");
    }
    size_t dot = p.rfind('.');
    if (dot == std::string::npos) break;
    p.resize(dot);
  }
  return source_name_;
}

std::string ConfigIssue::ToString() const {
  return where.empty() ? absl::StrCat(path, ": ", message)
                       : absl::StrCat(path, ": ", message, " (", where, ")");
}

std::string FormatDouble(double value) {
  char buffer[64];
  // Shortest text that parses back to the same double (fixed or scientific, whichever is shorter).
  auto result = std::to_chars(buffer, buffer + sizeof(buffer), value);
  std::string text(buffer, result.ptr);
  // Keep it a YAML float, not an integer: "1" -> "1.0".
  if (text.find_first_of(".eEn") == std::string::npos) text += ".0";
  return text;
}

// Where a second YAML document with content starts in `text`, if it has one (an empty one, as a
// trailing `---` makes, sets nothing). Reads at most two documents: yaml-cpp's LoadAll can keep
// finding empty documents in some malformed inputs.
std::optional<YAML::Mark> SecondDocument(std::string_view text) {
  class Starts final : public YAML::EventHandler {
   public:
    void OnDocumentStart(const YAML::Mark& mark) override {
      starts.push_back(mark);
      content.push_back(false);
    }
    void OnDocumentEnd() override {}
    void OnNull(const YAML::Mark&, YAML::anchor_t) override {}
    void OnAlias(const YAML::Mark&, YAML::anchor_t) override { Content(); }
    void OnScalar(const YAML::Mark&, const std::string&, YAML::anchor_t,
                  const std::string&) override {
      Content();
    }
    void OnSequenceStart(const YAML::Mark&, const std::string&, YAML::anchor_t,
                         YAML::EmitterStyle::value) override {
      Content();
    }
    void OnSequenceEnd() override {}
    void OnMapStart(const YAML::Mark&, const std::string&, YAML::anchor_t,
                    YAML::EmitterStyle::value) override {
      Content();
    }
    void OnMapEnd() override {}
    void Content() {
      if (!content.empty()) content.back() = true;
    }
    std::vector<YAML::Mark> starts;
    std::vector<bool> content;  // by document
  };
  std::istringstream stream{std::string(text)};
  YAML::Parser parser(stream);
  Starts starts;
  for (int documents = 0; documents < 2 && parser.HandleNextDocument(starts); ++documents) {
  }
  if (starts.starts.size() < 2 || !starts.content[1]) return std::nullopt;
  return starts.starts[1];
}

int64_t TokensPerImage(const hetpar::v1::EncoderModel& model) {
  if (model.patch() <= 0 || model.image_size() <= 0) return 0;
  const int64_t side = model.image_size() / model.patch();
  int64_t tokens = 0;
  // More than int64 holds is more than any llm.model.seq_len: the largest value says so.
  if (__builtin_mul_overflow(side, side, &tokens)) return std::numeric_limits<int64_t>::max();
  return tokens;
}

absl::StatusOr<LoadedRunSpec> ParseRunSpecYaml(
    std::string_view yaml_text, std::string_view source_name,
    const std::vector<std::string>& overrides,
    const std::map<std::string, std::string>& override_flags) {
  LoadedRunSpec loaded;
  loaded.source = SourceMap(std::string(source_name));
  YAML::Node root;
  try {
    root = YAML::Load(std::string(yaml_text));
    // Reading the first document and dropping the rest would ignore what the others set.
    if (const std::optional<YAML::Mark> second = SecondDocument(yaml_text); second.has_value()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the config holds more than one YAML document (separated by '---'); expected one (",
          std::string(source_name), ":", second->line + 1, ")"));
    }
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(
        "invalid YAML: ", e.msg, " (", std::string(source_name), ":", e.mark.line + 1, ")"));
  }
  if (!root.IsMap() && !root.IsNull()) {
    std::vector<std::string> keys = FieldNames(RunSpec::descriptor());
    return absl::InvalidArgumentError(
        absl::StrCat("the config must be a mapping with keys ", absl::StrJoin(keys, ", "),
                     "; got ", NodeKind(root), " (", std::string(source_name), ")"));
  }
  if (root.IsNull()) root = YAML::Node(YAML::NodeType::Map);
  for (const auto& assignment : overrides) {
    absl::Status status = ApplyOverride(root, assignment);
    if (!status.ok()) return status;
  }
  std::vector<ConfigIssue> issues;
  YamlToProto converter(&loaded.source, &issues);
  converter.SetOverrides(overrides, override_flags);
  converter.Message(root, &loaded.spec, "", 0);
  // Overridden fields point at the flag that set them: its path and, for a mapping, every key
  // the flag wrote under it (its own text's lines are no lines of the file; the keys of the
  // file's mapping it merged into keep theirs). Relative paths among them resolve against the
  // current directory, as those of any --set.
  for (const auto& assignment : overrides) {
    const size_t eq = assignment.find('=');
    const std::string path = assignment.substr(0, eq);
    const std::string where = OverrideFlag(assignment, override_flags);
    loaded.source.Set(path, where, /*from_flag=*/true);
    YAML::Node value;
    try {
      value = YAML::Load(assignment.substr(eq + 1));  // parsed once already by ApplyOverride
    } catch (const YAML::Exception&) {
      continue;
    }
    MarkOverridden(value, path, where, &loaded.source);
  }
  if (!issues.empty()) {
    std::vector<std::string> lines;
    for (const auto& issue : issues) lines.push_back(issue.ToString());
    return absl::InvalidArgumentError(absl::StrJoin(lines, "\n"));
  }
  return loaded;
}

void ApplyDefaults(LoadedRunSpec* loaded) {
  MaterialiseMessages(&loaded->spec);
  Defaults d(loaded);
  RunSpec& s = loaded->spec;
  d.String("run.name", "hetpar-run");
  d.Int("run.steps", 10);
  d.Int("run.micro_batch", 1);
  d.Int("run.seed", 1234);
  d.Enum("run.dtype", hetpar::v1::DTYPE_FLOAT32);
  d.Int("run.max_inflight", kDefaultMaxInflight);
  d.Double("run.grad_clip", 1.0);
  d.Double("run.grad_bucket_mib", 25.0);
  d.String("run.device", "cpu");
  d.Int("run.log_every", 1);
  d.String("run.out_dir", "runs/" + s.run().name());
  d.Enum("placement", hetpar::v1::PLACEMENT_NON_COLOCATED);
  for (const std::string module : {"encoder", "llm"}) {
    for (const std::string dim : {"dp", "tp", "cp", "pp"}) d.Int(module + ".layout." + dim, 1);
    d.Double(module + ".optimizer.lr", 1e-3);
    d.Double(module + ".optimizer.weight_decay", 0.0);
    d.Double(module + ".optimizer.beta1", 0.9);
    d.Double(module + ".optimizer.beta2", 0.999);
    d.Double(module + ".optimizer.eps", 1e-8);
    d.Int(module + ".optimizer.warmup_steps", 0);
  }
  d.Int("encoder.model.channels", 3);
  d.String("encoder.model.activation", "gelu");
  d.Double("encoder.model.norm_eps", 1e-6);
  d.Int("llm.model.kv_heads", s.llm().model().heads());
  d.Double("llm.model.rope_theta", 10000.0);
  d.Double("llm.model.norm_eps", 1e-5);
  d.String("data.image_token", "<image>");
  d.String("data.chat_template", "plain");
  d.Enum("data.overlong", hetpar::v1::OVERLONG_POLICY_REJECT);
  if (s.data().synth().samples() > 0) {
    d.Int("data.synth.val_samples", DefaultSynthValSamples(s.data().synth().samples()));
    d.Int("data.synth.seed", 7);
  }
  d.Enum("transport", hetpar::v1::TRANSPORT_KIND_UCX);
  d.Int("checkpoint.every", 0);
  d.Int("checkpoint.keep", kDefaultCheckpointKeep);
  d.String("coordinator.listen", "127.0.0.1:50051");
  d.Double("coordinator.heartbeat_timeout_s", 10.0);
  d.Double("coordinator.register_timeout_s", 120.0);
  d.Int("failure.max_step_attempts", 3);
  d.Double("failure.step_timeout_s", 600.0);
  d.Double("failure.peer_timeout_s", 300.0);
  d.Double("failure.coordinator_timeout_s", 300.0);
  d.Int("failure.min_encoder_replicas", 1);
  d.Int("failure.min_llm_replicas", 1);

  for (const char* path : {"data.manifest", "data.val_manifest", "data.tokenizer",
                           "coordinator.token_file", "checkpoint.dir", "checkpoint.resume_from",
                           "run.out_dir", "encoder.init_from", "llm.init_from"}) {
    ResolvePath(loaded, path);
  }
  // The index sits beside the manifest unless the config names one.
  if (!loaded->source.Has("data.index") && !s.data().manifest().empty()) {
    s.mutable_data()->set_index(s.data().manifest() + ".index");
  }
  ResolvePath(loaded, "data.index");
}

std::vector<ConfigIssue> Validate(const LoadedRunSpec& loaded, bool check_files,
                                  bool require_runnable, bool resume_at_end) {
  LoadOptions options;
  options.check_files = check_files;
  options.require_runnable = require_runnable;
  options.resume_at_end = resume_at_end;
  return Validate(loaded, options);
}

std::vector<ConfigIssue> Validate(const LoadedRunSpec& loaded, const LoadOptions& options) {
  const bool check_files = options.check_files;
  const bool require_runnable = options.require_runnable;
  const bool resume_at_end = options.resume_at_end;
  std::vector<ConfigIssue> issues;
  Checker c(loaded, &issues);
  const RunSpec& s = loaded.spec;

  // run
  c.AtLeast("run.steps", s.run().steps(), 1);
  bool batch_ok = c.AtLeast("run.global_batch", s.run().global_batch(), 1);
  if (s.run().global_batch() > kMaxGlobalBatch) {
    batch_ok = false;
    c.Fail("run.global_batch",
           absl::StrCat("=", s.run().global_batch(), " must be <= ", kMaxGlobalBatch, " samples"));
  }
  const bool micro_ok = c.AtLeast("run.micro_batch", s.run().micro_batch(), 1);
  c.AtLeast("run.max_inflight", s.run().max_inflight(), 1);
  c.AtLeast("run.log_every", s.run().log_every(), 1);
  if (s.run().grad_clip() < 0) {
    c.Fail("run.grad_clip", absl::StrCat("=", FormatDouble(s.run().grad_clip()),
                                         " must be >= 0 (0 turns clipping off)"));
  }
  if (!(s.run().grad_bucket_mib() > 0) || s.run().grad_bucket_mib() > kMaxGradBucketMib) {
    c.Fail("run.grad_bucket_mib", absl::StrCat("=", FormatDouble(s.run().grad_bucket_mib()),
                                               " must be > 0 and at most ",
                                               FormatDouble(kMaxGradBucketMib), " (1 TiB)"));
  }
  if (s.run().device() != "cpu" && s.run().device() != "cuda") {
    c.Fail("run.device",
           absl::StrCat("=\"", s.run().device(),
                        "\" is not a device; expected \"cpu\" or \"cuda\" (each worker then uses "
                        "the GPU of its local rank)"));
  }
  // The name becomes a directory (run.out_dir's default, runs/<name>), job and object names
  // and log text: one path component of plain characters.
  if (const std::string& name = s.run().name(); name.empty()) {
    c.Fail("run.name", "must not be empty");
  } else if (name.size() > kMaxRunNameChars || !std::isalnum(static_cast<unsigned char>(name[0])) ||
             !std::all_of(name.begin(), name.end(), [](char ch) {
               return std::isalnum(static_cast<unsigned char>(ch)) || ch == '.' || ch == '_' ||
                      ch == '-';
             })) {
    c.Fail("run.name",
           absl::StrCat("=\"", absl::CHexEscape(name.substr(0, kMaxRunNameChars)),
                        name.size() > kMaxRunNameChars ? "...\"" : "\"",
                        " is not a run name; expected at most ", kMaxRunNameChars,
                        " letters, digits, '.', '_' or '-', starting with a letter or digit "
                        "(it names the run directory runs/<name>)"));
  }
  if (s.run().peak_tflops() < 0) {
    c.Fail("run.peak_tflops", absl::StrCat("=", FormatDouble(s.run().peak_tflops()),
                                           " must be >= 0 (0: utilisation not reported)"));
  }

  // layouts
  bool layouts_ok = true;
  for (const std::string module : {"encoder", "llm"}) {
    const auto& layout = module == "encoder" ? s.encoder().layout() : s.llm().layout();
    const std::string p = module + ".layout.";
    layouts_ok &= c.AtLeast(p + "dp", layout.dp(), 1);
    layouts_ok &= c.AtLeast(p + "tp", layout.tp(), 1);
    layouts_ok &= c.AtLeast(p + "cp", layout.cp(), 1);
    layouts_ok &= c.AtLeast(p + "pp", layout.pp(), 1);
    if (layouts_ok) {
      const std::optional<int64_t> ranks =
          Product({layout.dp(), layout.tp(), layout.cp(), layout.pp()});
      if (!ranks.has_value() || *ranks > kMaxModuleRanks) {
        c.Fail(module + ".layout",
               absl::StrCat("dp x tp x cp x pp = ", layout.dp(), " x ", layout.tp(), " x ",
                            layout.cp(), " x ", layout.pp(), " is more than ", kMaxModuleRanks,
                            " ranks"));
        layouts_ok = false;
      }
    }
  }
  const auto& el = s.encoder().layout();
  const auto& ll = s.llm().layout();
  if (el.cp() > 1) {
    c.Fail("encoder.layout.cp", absl::StrCat("=", el.cp(),
                                             ": the encoder has no context "
                                             "parallelism (images are independent); expected 1"));
  }
  if (el.pp() > 1) {
    c.Fail("encoder.layout.pp",
           absl::StrCat("=", el.pp(), ": the encoder is not pipelined; expected 1"));
  }

  if (s.encoder().train_projector() && !s.encoder().frozen()) {
    c.Fail("encoder.train_projector",
           "=true needs encoder.frozen: true (an encoder that is not frozen trains its projector "
           "anyway); set encoder.frozen or drop train_projector");
  }

  // encoder model
  const auto& em = s.encoder().model();
  bool enc_ok = true;
  for (const auto& [name, value] :
       std::vector<std::pair<std::string, int64_t>>{{"image_size", em.image_size()},
                                                    {"patch", em.patch()},
                                                    {"hidden", em.hidden()},
                                                    {"layers", em.layers()},
                                                    {"heads", em.heads()},
                                                    {"mlp", em.mlp()},
                                                    {"out_hidden", em.out_hidden()},
                                                    {"channels", em.channels()}}) {
    enc_ok &= c.AtLeast("encoder.model." + name, value, 1);
  }
  if (em.channels() >= 1 && em.channels() != 3) {
    // The loader decodes every image to RGB and the synthetic generator writes RGB.
    c.Fail("encoder.model.channels",
           absl::StrCat("=", em.channels(), ": images are loaded as RGB; expected 3"));
  }
  if (em.activation() != "gelu" && em.activation() != "gelu_tanh") {
    c.Fail("encoder.model.activation",
           absl::StrCat("='", em.activation(), "' is not one of: gelu, gelu_tanh"));
  }
  enc_ok &= c.FitsInt32("encoder.model.image_size", em.image_size());
  if (!(em.norm_eps() > 0)) {
    c.Fail("encoder.model.norm_eps",
           absl::StrCat("=", FormatDouble(em.norm_eps()), " must be > 0"));
  }
  if (enc_ok) {
    if (em.image_size() % em.patch() != 0) {
      c.Fail("encoder.model.patch", absl::StrCat("=", em.patch(),
                                                 " does not divide "
                                                 "encoder.model.image_size=",
                                                 em.image_size()));
    }
    if (em.hidden() % em.heads() != 0) {
      c.Fail("encoder.model.heads",
             absl::StrCat("=", em.heads(), " does not divide encoder.model.hidden=", em.hidden()));
    }
    if (layouts_ok) {
      c.Divides("encoder.layout.tp", el.tp(), "encoder.model.heads", em.heads(),
                "attention is split by heads");
      c.Divides("encoder.layout.tp", el.tp(), "encoder.model.hidden", em.hidden());
      c.Divides("encoder.layout.tp", el.tp(), "encoder.model.mlp", em.mlp());
      c.Divides("encoder.layout.tp", el.tp(), "encoder.model.out_hidden", em.out_hidden(),
                "the projector is split by features");
    }
  }

  // llm model
  const auto& lm = s.llm().model();
  bool llm_ok = true;
  for (const auto& [name, value] :
       std::vector<std::pair<std::string, int64_t>>{{"hidden", lm.hidden()},
                                                    {"layers", lm.layers()},
                                                    {"heads", lm.heads()},
                                                    {"kv_heads", lm.kv_heads()},
                                                    {"ffn", lm.ffn()},
                                                    {"vocab", lm.vocab()},
                                                    {"seq_len", lm.seq_len()}}) {
    // A sample holds at least one position to predict and one token before it.
    llm_ok &= c.AtLeast("llm.model." + name, value, name == "seq_len" ? 2 : 1);
  }
  llm_ok &= c.FitsInt32("llm.model.vocab", lm.vocab());
  llm_ok &= c.FitsInt32("llm.model.seq_len", lm.seq_len());
  if (!(lm.rope_theta() > 0)) {
    c.Fail("llm.model.rope_theta",
           absl::StrCat("=", FormatDouble(lm.rope_theta()), " must be > 0"));
  }
  if (!(lm.norm_eps() > 0)) {
    c.Fail("llm.model.norm_eps", absl::StrCat("=", FormatDouble(lm.norm_eps()), " must be > 0"));
  }
  if (llm_ok) {
    if (lm.hidden() % lm.heads() != 0) {
      c.Fail("llm.model.heads",
             absl::StrCat("=", lm.heads(), " does not divide llm.model.hidden=", lm.hidden()));
    } else if ((lm.hidden() / lm.heads()) % 2 != 0) {
      c.Fail("llm.model.heads",
             absl::StrCat("=", lm.heads(), " gives an odd head size ", lm.hidden() / lm.heads(),
                          " (llm.model.hidden=", lm.hidden(),
                          "); rotary embeddings need an even head size"));
    }
    if (lm.heads() % lm.kv_heads() != 0) {
      c.Fail("llm.model.kv_heads",
             absl::StrCat("=", lm.kv_heads(), " does not divide llm.model.heads=", lm.heads(),
                          " (grouped-query attention)"));
    }
    if (layouts_ok) {
      c.Divides("llm.layout.tp", ll.tp(), "llm.model.heads", lm.heads(),
                "attention is split by heads");
      c.Divides("llm.layout.tp", ll.tp(), "llm.model.kv_heads", lm.kv_heads(),
                "key/value heads are split too");
      c.Divides("llm.layout.tp", ll.tp(), "llm.model.hidden", lm.hidden());
      c.Divides("llm.layout.tp", ll.tp(), "llm.model.ffn", lm.ffn());
      c.Divides("llm.layout.tp", ll.tp(), "llm.model.vocab", lm.vocab(),
                "the embedding and output head are split by vocabulary");
      if (ll.pp() > lm.layers()) {
        c.Fail("llm.layout.pp", absl::StrCat("=", ll.pp(), " is more than llm.model.layers=",
                                             lm.layers(), "; each stage needs a layer"));
      }
      if (ll.cp() > 1 && lm.seq_len() % (2 * ll.cp()) != 0) {
        c.Fail("llm.model.seq_len",
               absl::StrCat("=", lm.seq_len(), " is not a multiple of 2 x llm.layout.cp=",
                            2 * ll.cp(), " (causal load-balanced sequence chunks)"));
      }
      const int64_t shards = ll.tp() * (ll.cp() > 1 ? 2 * ll.cp() : 1);
      if (ll.sequence_parallel() && lm.seq_len() % shards != 0) {
        c.Fail("llm.model.seq_len",
               absl::StrCat("=", lm.seq_len(), " is not a multiple of ", shards,
                            " (llm.layout.tp x sequence chunks) needed by sequence_parallel"));
      }
    }
  }

  // across modules
  if (enc_ok && llm_ok) {
    if (em.out_hidden() != lm.hidden()) {
      c.Fail("encoder.model.out_hidden",
             absl::StrCat("=", em.out_hidden(), " must equal llm.model.hidden=", lm.hidden(),
                          " (the projector feeds image embeddings into the LLM)"));
    }
    const int64_t tokens = TokensPerImage(em);
    if (em.image_size() % em.patch() == 0 && lm.seq_len() < tokens) {
      c.Fail("llm.model.seq_len",
             absl::StrCat("=", lm.seq_len(), " is too short for one image's ", tokens,
                          " tokens (encoder.model.image_size=", em.image_size(),
                          " / patch=", em.patch(), " gives ", em.image_size() / em.patch(), "x",
                          em.image_size() / em.patch(), " patches)"));
    }
  }
  if (batch_ok && micro_ok && layouts_ok) {
    const std::optional<int64_t> wave = Product({s.run().micro_batch(), ll.dp()});
    const int64_t per_wave = wave.value_or(std::numeric_limits<int64_t>::max());
    if (!wave.has_value() || s.run().global_batch() % per_wave != 0) {
      c.Fail("run.global_batch",
             absl::StrCat("=", s.run().global_batch(), " is not divisible into run.micro_batch=",
                          s.run().micro_batch(), " per LLM replica x llm.layout.dp=", ll.dp(),
                          wave.has_value() ? absl::StrCat(" (needs a multiple of ", per_wave, ")")
                                           : std::string(" (their product overflows)")));
    }
  }
  if (s.placement() == hetpar::v1::PLACEMENT_UNSPECIFIED) c.Fail("placement", "is required");
  if (s.placement() == hetpar::v1::PLACEMENT_COLOCATED && layouts_ok) {
    const int64_t encoder_world = el.dp() * el.tp();
    const int64_t llm_world = ll.dp() * ll.tp() * ll.cp() * ll.pp();
    if (encoder_world != llm_world) {
      c.Fail("placement", absl::StrCat("colocated layouts must cover the same ranks: encoder "
                                       "dp x tp = ",
                                       encoder_world, ", llm dp x tp x cp x pp = ", llm_world));
    }
  }

  // optimizers
  for (const std::string module : {"encoder", "llm"}) {
    const auto& o = module == "encoder" ? s.encoder().optimizer() : s.llm().optimizer();
    const std::string p = module + ".optimizer.";
    if (!(o.lr() > 0)) c.Fail(p + "lr", absl::StrCat("=", FormatDouble(o.lr()), " must be > 0"));
    if (!(o.weight_decay() >= 0)) {
      c.Fail(p + "weight_decay",
             absl::StrCat("=", FormatDouble(o.weight_decay()), " must be >= 0"));
    }
    for (const auto& [name, beta] : {std::pair<const char*, double>{"beta1", o.beta1()},
                                     {"beta2", o.beta2()}}) {
      if (!(beta >= 0 && beta < 1)) {
        c.Fail(p + name, absl::StrCat("=", FormatDouble(beta), " must be in [0, 1)"));
      }
    }
    if (!(o.eps() > 0)) c.Fail(p + "eps", absl::StrCat("=", FormatDouble(o.eps()), " must be > 0"));
    if (o.warmup_steps() < 0) {
      c.Fail(p + "warmup_steps", absl::StrCat("=", o.warmup_steps(), " must be >= 0"));
    }
  }

  // data
  if (s.data().image_token().empty()) c.Fail("data.image_token", "must not be empty");
  if (const std::string& t = s.data().chat_template();
      t != "plain" && t != "vicuna" && t != "llama3" && t != "chatml") {
    c.Fail("data.chat_template",
           absl::StrCat("='", t, "' is not one of: plain, vicuna, llama3, chatml"));
  }
  const bool synth = s.data().synth().samples() > 0;
  if (s.data().synth().samples() < 0) {
    c.Fail("data.synth.samples",
           absl::StrCat("=", s.data().synth().samples(), " must be >= 0 (0 turns generation off)"));
  }
  // Checked with generation off too (data.synth.samples=0 over a config that generates keeps
  // the other fields, as does data.val_manifest="" to skip evaluation): a negative count is
  // wrong whatever turns it off.
  if (!synth && s.data().synth().val_samples() < 0) {
    c.Fail("data.synth.val_samples",
           absl::StrCat("=", s.data().synth().val_samples(), " must be >= 0"));
  }
  if (synth) {
    c.AtLeast("data.synth.val_samples", s.data().synth().val_samples(), 1);
    // The generator writes JSONL manifests and a sentencepiece model where the files are
    // missing, while a path ending in .json is read back as a LLaVA JSON array or a
    // tokenizer.json: such a set would be generated in full, then fail to load, on every start.
    // Files already there are not generated, and are read as their names say.
    for (const auto& [field, path, writes, suffix] :
         {std::tuple<const char*, std::string, const char*, const char*>{
              "data.manifest", s.data().manifest(), "a JSONL manifest", ".jsonl"},
          {"data.val_manifest", s.data().val_manifest(), "a JSONL manifest", ".jsonl"},
          {"data.tokenizer", s.data().tokenizer(), "a sentencepiece model", ".model"}}) {
      std::error_code missing;
      if (fs::path(path).extension() == ".json" && !fs::exists(path, missing)) {
        c.Fail(field, absl::StrCat("='", path, "' ends in .json, which is read as ",
                                   std::string_view(field) == "data.tokenizer"
                                       ? "a Hugging Face tokenizer.json"
                                       : "a LLaVA JSON array",
                                   ", but data.synth writes ", writes, " there; name a ", suffix,
                                   " file"));
      }
    }
    // What the generator needs of the model, said here with the fields rather than when
    // `hetpar run` generates the set.
    const int64_t seq_len = s.llm().model().seq_len();
    const int64_t tokens = TokensPerImage(s.encoder().model());
    if (seq_len >= 1 && tokens >= 1 && seq_len - tokens < kSynthCaptionTokens) {
      c.Fail("llm.model.seq_len",
             absl::StrCat("=", seq_len, " cannot hold one image of ", tokens,
                          " tokens and a synthetic caption of up to ", kSynthCaptionTokens,
                          " tokens (data.synth); expected >= ", tokens + kSynthCaptionTokens));
    }
    if (s.llm().model().vocab() >= 1 && s.llm().model().vocab() < kSynthMinVocab) {
      c.Fail("llm.model.vocab", absl::StrCat("=", s.llm().model().vocab(),
                                             " is too small for the synthetic data "
                                             "set's tokenizer (data.synth); expected >= ",
                                             kSynthMinVocab));
    }
    const int64_t image_size = s.encoder().model().image_size();
    if (image_size >= 1 && (image_size < kSynthMinImageSize || image_size > kSynthMaxImageSize)) {
      c.Fail("encoder.model.image_size",
             absl::StrCat("=", image_size,
                          " is outside what the synthetic data set draws "
                          "(data.synth): expected ",
                          kSynthMinImageSize, "..", kSynthMaxImageSize, " pixels"));
    }
  }
  if (check_files) {
    // A synthetic dataset is generated before a run, so its files may not exist yet.
    if (!synth) {
      c.FileExists("data.manifest", s.data().manifest(), true);
      c.FileExists("data.tokenizer", s.data().tokenizer(), true);
      c.FileExists("data.val_manifest", s.data().val_manifest(), false);
    }
    c.FileExists("coordinator.token_file", s.coordinator().token_file(), false);
    if (s.checkpoint().resume_from().empty()) {
      if (options.check_init_from) {
        c.FileExists("encoder.init_from", s.encoder().init_from(), false);
        c.FileExists("llm.init_from", s.llm().init_from(), false);
      }
    } else {
      // A resumed run's parameters all come from its checkpoint (init_from's files may be gone,
      // and are not checked); the checkpoint must fit the run.
      absl::StatusOr<CheckpointSummary> checkpoint =
          ReadCheckpointSummary(s.checkpoint().resume_from());
      if (!checkpoint.ok()) {
        c.Fail("checkpoint.resume_from", absl::StrCat("='", s.checkpoint().resume_from(),
                                                      "': ", checkpoint.status().message()));
      } else if (const int64_t step = checkpoint->step;
                 step > s.run().steps() || (step == s.run().steps() && !resume_at_end)) {
        c.Fail("checkpoint.resume_from",
               absl::StrCat("='", s.checkpoint().resume_from(), "' is at step ", step,
                            ", which is not before run.steps=", s.run().steps(),
                            ": nothing is left to train; raise run.steps"));
      } else if (const int64_t samples = checkpoint->samples_trained;
                 samples >= 0 && step > 0 && samples != step * s.run().global_batch()) {
        // The data position is the checkpoint's step times the global batch.
        c.Fail("checkpoint.resume_from",
               absl::StrCat("='", s.checkpoint().resume_from(), "' trained ", samples,
                            " samples in ", step, " steps (a global batch of ", samples / step,
                            "); run.global_batch=", s.run().global_batch(),
                            ": resume with the global batch it was written with"));
      } else if (checkpoint->seed.has_value() && *checkpoint->seed != s.run().seed() &&
                 !(checkpoint->data.has_value() && checkpoint->data->AtEpochBoundary())) {
        // The epoch order follows the seed: another one would train some samples of the
        // current epoch twice and skip others. At an epoch boundary (as the checkpoint records)
        // the next epoch's order simply follows the new seed.
        c.Fail("run.seed",
               absl::StrCat("=", s.run().seed(), " differs from the seed ", *checkpoint->seed,
                            " that checkpoint.resume_from='", s.checkpoint().resume_from(),
                            "' was trained with: the data order would change mid-epoch; resume "
                            "with run.seed=", *checkpoint->seed));
      }
      // A resume loads the checkpoint's parameters by name, layer by layer: a model of fewer
      // layers would drop the others without a word.
      if (checkpoint.ok()) {
        for (const auto& [field, recorded, configured] :
             {std::tuple<const char*, std::optional<int64_t>, int64_t>{
                  "encoder.model.layers", checkpoint->encoder_layers, s.encoder().model().layers()},
              {"llm.model.layers", checkpoint->llm_layers, s.llm().model().layers()}}) {
          if (recorded.has_value() && *recorded != configured) {
            c.Fail(field,
                   absl::StrCat("=", configured, " differs from the ", *recorded,
                                " layers of checkpoint.resume_from='", s.checkpoint().resume_from(),
                                "': a resume continues the model the checkpoint holds; "
                                "resume with ",
                                field, "=", *recorded));
          }
        }
        // Heads, sizes and the activation: the stored tensors read as the model they were
        // trained as. The configured values as the same emitter writes them.
        if (!checkpoint->architecture.empty()) {
          const YAML::Node configured = YAML::Load(RunSpecToYaml(s));
          for (const auto& [path, recorded] : checkpoint->architecture) {
            const std::string text = ModelScalarAt(configured, path).value_or("(unset)");
            if (text == recorded) continue;
            c.Fail(path,
                   absl::StrCat("=", text, " differs from the ", recorded,
                                " that checkpoint.resume_from='", s.checkpoint().resume_from(),
                                "' was trained with: a resume continues the model the "
                                "checkpoint holds; resume with ",
                                path, "=", recorded));
          }
        }
        // A checkpoint with the final norm resumed without it would drop the trained norm
        // without a word (the other way, its parameters are missing).
        const bool configured = s.encoder().model().no_final_norm();
        if (checkpoint->encoder_no_final_norm.has_value() &&
            *checkpoint->encoder_no_final_norm != configured) {
          c.Fail("encoder.model.no_final_norm",
                 absl::StrCat(
                     "=", configured ? "true" : "false", " differs from checkpoint.resume_from='",
                     s.checkpoint().resume_from(), "', written ", configured ? "with" : "without",
                     " the tower's final norm: a resume continues the model the "
                     "checkpoint holds; resume with encoder.model.no_final_norm=",
                     configured ? "false" : "true"));
        }
      }
    }
  } else if (!synth) {
    if (s.data().manifest().empty()) c.Fail("data.manifest", "is required: expected a file path");
    if (s.data().tokenizer().empty()) c.Fail("data.tokenizer", "is required: expected a file path");
  }

  // transport, checkpoint, coordinator
  if (s.transport() == hetpar::v1::TRANSPORT_KIND_INPROC &&
      s.placement() == hetpar::v1::PLACEMENT_NON_COLOCATED) {
    c.Fail("transport",
           "inproc needs placement: colocated (non-colocated modules run in "
           "separate processes); expected ucx");
  }
  if (s.transport() == hetpar::v1::TRANSPORT_KIND_NCCL) {
    if (s.run().device() != "cuda") {
      c.Fail("transport", absl::StrCat("nccl moves CUDA tensors and needs run.device: cuda (got \"",
                                       s.run().device(), "\"); expected ucx"));
    }
    if (s.placement() == hetpar::v1::PLACEMENT_COLOCATED) {
      c.Fail("transport",
             "nccl needs placement: non_colocated: a colocated worker holds an encoder and an LLM "
             "rank on one GPU, and NCCL refuses two ranks on one GPU; expected ucx (CUDA IPC "
             "between processes on one GPU)");
    }
  }
  if (s.checkpoint().every() < 0) {
    c.Fail("checkpoint.every", absl::StrCat("=", s.checkpoint().every(), " must be >= 0"));
  }
  c.AtLeast("checkpoint.keep", s.checkpoint().keep(), 1);
  // Without a directory nothing is kept. The default stays accepted because written configs
  // (config.yaml) carry it.
  if (s.checkpoint().dir().empty() && s.checkpoint().keep() != kDefaultCheckpointKeep &&
      s.checkpoint().keep() >= 1) {
    c.Fail("checkpoint.keep", absl::StrCat("=", s.checkpoint().keep(),
                                           " has no effect without checkpoint.dir (no checkpoint "
                                           "is written); set checkpoint.dir or leave it unset"));
  }
  if (s.checkpoint().every() > 0 && s.checkpoint().dir().empty()) {
    c.Fail("checkpoint.every", absl::StrCat("=", s.checkpoint().every(),
                                            " needs checkpoint.dir: expected the directory "
                                            "every rank writes its shards to"));
  }

  // What a run cannot do yet: refused here, before any worker registers, not after.
  if (require_runnable) {
    // The first stage runs pp forwards (1F1B warm-up) before its first backward returns the
    // gradients the encoder waits for to retire a job: the encoder must keep that many alive.
    if (ll.pp() > 1 && s.placement() == hetpar::v1::PLACEMENT_NON_COLOCATED &&
        plan::ImageGradientsCross(s) && s.run().max_inflight() < ll.pp()) {
      c.Fail("run.max_inflight",
             absl::StrCat("=", s.run().max_inflight(), " is less than llm.layout.pp=", ll.pp(),
                          ": the LLM's first stage runs ", ll.pp(),
                          " forwards before its first backward, so the encoder must keep that "
                          "many jobs in flight; expected >= ",
                          ll.pp()));
    }
    if (s.transport() == hetpar::v1::TRANSPORT_KIND_INPROC &&
        s.placement() == hetpar::v1::PLACEMENT_COLOCATED) {
      c.Fail("transport",
             "inproc needs every rank in one process, and a run starts one process per rank "
             "(the in-process backend serves tests); expected ucx (shared memory on one machine)");
    }
  }
  if (const std::string& l = s.coordinator().listen(); !IsHostPort(l)) {
    c.Fail("coordinator.listen",
           absl::StrCat("='", l, "' is not host:port with a port in [0, 65535] (e.g. "
                        "0.0.0.0:50051; port 0 picks one)"));
  }
  if (const std::string& m = s.coordinator().metrics_listen(); !m.empty() && !IsHostPort(m)) {
    c.Fail("coordinator.metrics_listen",
           absl::StrCat("='", m, "' is not host:port with a port in [0, 65535] (e.g. "
                        "0.0.0.0:9464; port 0 picks one)"));
  }
  if (!(s.coordinator().heartbeat_timeout_s() >= kMinHeartbeatTimeoutS)) {
    c.Fail("coordinator.heartbeat_timeout_s",
           absl::StrCat("=", FormatDouble(s.coordinator().heartbeat_timeout_s()),
                        " must be >= ", FormatDouble(kMinHeartbeatTimeoutS),
                        " seconds: workers heartbeat every fifth of it (at most every second), "
                        "and a shorter one takes a busy worker for a lost one"));
  }
  c.AtLeast("failure.max_step_attempts", s.failure().max_step_attempts(), 1);
  for (const auto& [field, value] :
       {std::pair<const char*, double>{"failure.step_timeout_s", s.failure().step_timeout_s()},
        {"failure.peer_timeout_s", s.failure().peer_timeout_s()},
        {"failure.coordinator_timeout_s", s.failure().coordinator_timeout_s()}}) {
    if (!(value > 0)) c.Fail(field, absl::StrCat("=", FormatDouble(value), " must be > 0 seconds"));
  }
  if (!(s.coordinator().register_timeout_s() > 0)) {
    c.Fail("coordinator.register_timeout_s",
           absl::StrCat("=", FormatDouble(s.coordinator().register_timeout_s()),
                        " must be > 0 seconds"));
  }
  for (const auto& [field, value, module] :
       {std::tuple<const char*, int64_t, const char*>{
            "failure.min_encoder_replicas", s.failure().min_encoder_replicas(), "encoder"},
        {"failure.min_llm_replicas", s.failure().min_llm_replicas(), "llm"}}) {
    const int64_t dp = std::max<int64_t>(
        1, std::string(module) == "encoder" ? s.encoder().layout().dp() : s.llm().layout().dp());
    if (s.placement() == hetpar::v1::PLACEMENT_COLOCATED) {
      if (value != 1) {
        c.Fail(field, absl::StrCat("=", value,
                                   ": a colocated run's ranks hold both modules, so a lost one "
                                   "ends the run and no pool shrinks; leave it at 1"));
      }
    } else if (value < 1 || value > dp) {
      c.Fail(field, absl::StrCat("=", value, " must be in [1, ", module, ".layout.dp=", dp, "]"));
    }
  }
  // Colocated ranks run every encoder forward of a step before the LLM's waves: no job
  // window to bound. The default stays accepted because written configs (config.yaml) carry it.
  if (s.placement() == hetpar::v1::PLACEMENT_COLOCATED &&
      s.run().max_inflight() != kDefaultMaxInflight) {
    c.Fail("run.max_inflight",
           absl::StrCat("=", s.run().max_inflight(),
                        " has no effect with placement: colocated (each rank runs all its "
                        "encoder forwards before the LLM's waves, so no jobs are in flight "
                        "across the boundary); leave it unset"));
  }
  if (const int64_t initial = s.encoder().initial_replicas(); initial != 0) {
    const int64_t dp = std::max<int64_t>(1, s.encoder().layout().dp());
    const int64_t minimum = std::max<int64_t>(1, s.failure().min_encoder_replicas());
    if (s.placement() == hetpar::v1::PLACEMENT_COLOCATED) {
      c.Fail("encoder.initial_replicas",
             absl::StrCat("=", initial,
                          ": a colocated run has no encoder pool of its own (every rank holds "
                          "both modules); leave it unset"));
    } else if (initial < minimum || initial > dp) {
      c.Fail("encoder.initial_replicas",
             absl::StrCat("=", initial, " must be in [failure.min_encoder_replicas=", minimum,
                          ", encoder.layout.dp=", dp, "] (unset: encoder.layout.dp)"));
    }
  }
  return issues;
}

namespace {

// Defaults and validation over a parsed spec; all problems become one InvalidArgument.
absl::StatusOr<LoadedRunSpec> Finish(LoadedRunSpec loaded, const LoadOptions& options) {
  if (!options.resume) loaded.spec.mutable_checkpoint()->clear_resume_from();
  ApplyDefaults(&loaded);
  std::vector<ConfigIssue> issues = Validate(loaded, options);
  if (issues.empty()) return loaded;
  std::vector<std::string> lines;
  for (const auto& issue : issues) lines.push_back(issue.ToString());
  return absl::InvalidArgumentError(absl::StrJoin(lines, "\n"));
}

}  // namespace

absl::StatusOr<LoadedRunSpec> LoadRunSpecFromString(std::string_view yaml_text,
                                                    std::string_view source_name,
                                                    const LoadOptions& options) {
  auto parsed = ParseRunSpecYaml(yaml_text, source_name, options.overrides, options.override_flags);
  if (!parsed.ok()) return parsed.status();
  return Finish(std::move(parsed).value(), options);
}

absl::StatusOr<LoadedRunSpec> LoadRunSpecFile(const std::string& path, const LoadOptions& options) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    return absl::InvalidArgumentError(
        absl::StrCat("config file '", path, "' is a directory; expected a YAML file"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("cannot read config file '", path, "'"));
  }
  std::stringstream buffer;
  buffer << in.rdbuf();
  auto parsed = ParseRunSpecYaml(buffer.str(), path, options.overrides, options.override_flags);
  if (!parsed.ok()) return parsed.status();
  LoadedRunSpec loaded = std::move(parsed).value();
  loaded.base_dir = fs::absolute(fs::path(path), ec).parent_path().string();
  return Finish(std::move(loaded), options);
}

std::string RunSpecToYaml(const RunSpec& spec) {
  YAML::Emitter out;
  EmitMessage(out, spec);
  return std::string(out.c_str()) + "\n";
}

}  // namespace hetpar::config
