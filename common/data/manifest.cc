#include "common/data/manifest.h"

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "common/data/file_util.h"
#include "nlohmann/json.hpp"

namespace hetpar::data {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

constexpr size_t kMaxListedProblems = 20;

// Parses one line; returns the reason it is bad, or nullopt. *record is filled as far as it can
// be (its id is kept for the message).
std::optional<std::string> ParseLine(const std::string& text, ManifestRecord* record) {
  Json json;
  try {
    json = Json::parse(text);
  } catch (const Json::parse_error& e) {
    return absl::StrCat("not valid JSON: ", e.what());
  }
  if (!json.is_object()) return std::string("expected a JSON object");
  auto id = json.find("id");
  if (id == json.end() || !id->is_string() || id->get<std::string>().empty()) {
    if (id != json.end() && id->is_number_integer()) {
      record->id = std::to_string(id->get<int64_t>());
    } else {
      return std::string("\"id\" is missing or not a non-empty string");
    }
  } else {
    record->id = id->get<std::string>();
  }
  auto text_field = json.find("text");
  if (text_field == json.end() || !text_field->is_string()) {
    return std::string("\"text\" is missing or not a string");
  }
  record->text = text_field->get<std::string>();
  auto prompt = json.find("prompt");
  if (prompt != json.end()) {
    if (!prompt->is_string()) return std::string("\"prompt\" is not a string");
    record->prompt = prompt->get<std::string>();
  }
  auto images = json.find("images");
  if (images != json.end() && !images->is_null()) {
    if (!images->is_array()) return std::string("\"images\" is not an array of paths");
    for (const Json& image : *images) {
      if (!image.is_string() || image.get<std::string>().empty()) {
        return std::string("\"images\" holds an entry that is not a non-empty path string");
      }
      record->images.push_back(image.get<std::string>());
    }
  }
  return std::nullopt;
}

}  // namespace

std::string BadSample::ToString() const {
  std::string out = id.empty() ? std::string("sample") : absl::StrCat("sample '", id, "'");
  absl::StrAppend(&out, " (", where, "): ", reason);
  return out;
}

std::optional<int64_t> Manifest::Find(const std::string& id) const {
  auto it = by_id.find(id);
  if (it == by_id.end()) return std::nullopt;
  return it->second;
}

std::string Manifest::ResolveImagePath(const std::string& image) const {
  fs::path p(image);
  if (p.is_absolute() || base_dir.empty()) return p.lexically_normal().string();
  return (fs::path(base_dir) / p).lexically_normal().string();
}

absl::StatusOr<Manifest> ReadManifest(const std::string& path, bool skip_bad) {
  absl::StatusOr<std::string> contents = ReadFileToString(path);
  if (!contents.ok()) {
    return absl::Status(contents.status().code(),
                        absl::StrCat("manifest: ", contents.status().message()));
  }
  Manifest manifest;
  manifest.path = path;
  manifest.base_dir = fs::path(path).parent_path().string();
  std::vector<BadSample> problems;
  int64_t line_number = 0;
  size_t start = 0;
  while (start < contents->size()) {
    size_t end = contents->find('\n', start);
    if (end == std::string::npos) end = contents->size();
    std::string line = contents->substr(start, end - start);
    start = end + 1;
    ++line_number;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;  // blank lines are allowed
    ManifestRecord record;
    record.line = line_number;
    std::optional<std::string> reason = ParseLine(line, &record);
    if (!reason && manifest.by_id.count(record.id) > 0) {
      reason = absl::StrCat("duplicate id; first used on line ",
                            manifest.records[static_cast<size_t>(manifest.by_id[record.id])].line);
    }
    if (reason) {
      BadSample bad;
      bad.id = record.id;
      bad.where = absl::StrCat(path, ":", line_number);
      bad.line = line_number;
      bad.reason = *reason;
      problems.push_back(std::move(bad));
      continue;
    }
    manifest.by_id[record.id] = static_cast<int64_t>(manifest.records.size());
    manifest.records.push_back(std::move(record));
  }
  if (!problems.empty() && !skip_bad) {
    std::string message = absl::StrCat("manifest ", path, " has ", problems.size(),
                                       " bad line(s) (set data.skip_bad_samples to skip them):");
    for (size_t i = 0; i < problems.size() && i < kMaxListedProblems; ++i) {
      absl::StrAppend(&message, "\n  ", problems[i].ToString());
    }
    if (problems.size() > kMaxListedProblems) {
      absl::StrAppend(&message, "\n  ... and ", problems.size() - kMaxListedProblems, " more");
    }
    return absl::InvalidArgumentError(message);
  }
  manifest.bad = std::move(problems);
  return manifest;
}

std::string ManifestRecordToJson(const ManifestRecord& record) {
  Json json = Json::object();
  json["id"] = record.id;
  json["images"] = record.images;
  if (!record.prompt.empty()) json["prompt"] = record.prompt;
  json["text"] = record.text;
  return json.dump(-1, ' ', false, Json::error_handler_t::replace);
}

}  // namespace hetpar::data
