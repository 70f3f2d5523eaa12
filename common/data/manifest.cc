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

// The id of a prompt/text entry (required) into record->id; the reason it is bad, or nullopt.
std::optional<std::string> ParsePromptTextId(const Json& json, ManifestRecord* record) {
  auto id = json.find("id");
  if (id == json.end() || !id->is_string() || id->get<std::string>().empty()) {
    if (id != json.end() && id->is_number_unsigned()) {
      record->id = std::to_string(id->get<uint64_t>());  // past INT64_MAX too
    } else if (id != json.end() && id->is_number_integer()) {
      record->id = std::to_string(id->get<int64_t>());
    } else {
      return std::string("\"id\" is missing or not a non-empty string");
    }
  } else {
    record->id = id->get<std::string>();
  }
  return std::nullopt;
}

std::optional<std::string> ParsePromptText(const Json& json, ManifestRecord* record) {
  if (auto reason = ParsePromptTextId(json, record)) return reason;
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

// The id of a LLaVA-style entry: a string or a number, `default_id` when absent.
std::optional<std::string> ParseConversationId(const Json& json, const std::string& default_id,
                                               ManifestRecord* record) {
  auto id = json.find("id");
  if (id == json.end() || id->is_null()) {
    record->id = default_id;
  } else if (id->is_string()) {
    if (id->get<std::string>().empty()) return std::string("\"id\" is an empty string");
    record->id = id->get<std::string>();
  } else if (id->is_number_unsigned()) {
    record->id = std::to_string(id->get<uint64_t>());
  } else if (id->is_number_integer()) {
    record->id = std::to_string(id->get<int64_t>());
  } else if (id->is_number()) {
    record->id = id->dump();
  } else {
    return std::string("\"id\" is not a string or a number");
  }
  return std::nullopt;
}

// "image" (a path or a list of paths) or "images" (a list), or neither.
std::optional<std::string> ParseConversationImages(const Json& json, ManifestRecord* record) {
  auto image = json.find("image");
  auto images = json.find("images");
  const bool has_image = image != json.end() && !image->is_null();
  const bool has_images = images != json.end() && !images->is_null();
  if (has_image && has_images) {
    return std::string("\"image\" and \"images\" are both given; use one of them");
  }
  if (!has_image && !has_images) return std::nullopt;
  const char* key = has_image ? "image" : "images";
  const Json& value = has_image ? *image : *images;
  if (has_image && value.is_string()) {
    if (value.get<std::string>().empty()) return std::string("\"image\" is an empty path");
    record->images.push_back(value.get<std::string>());
    return std::nullopt;
  }
  if (!value.is_array()) {
    return absl::StrCat("\"", key, "\" is not ",
                        has_image ? "a path or an array of paths" : "an array of paths");
  }
  for (size_t k = 0; k < value.size(); ++k) {
    if (!value[k].is_string() || value[k].get<std::string>().empty()) {
      return absl::StrCat(key, "[", k, "] is not a non-empty path string");
    }
    record->images.push_back(value[k].get<std::string>());
  }
  return std::nullopt;
}

std::optional<std::string> ParseConversation(const Json& json, const std::string& default_id,
                                             ManifestRecord* record) {
  if (auto reason = ParseConversationId(json, default_id, record)) return reason;
  if (json.contains("prompt") || json.contains("text")) {
    return std::string(
        "\"conversations\" and \"prompt\"/\"text\" are both given; use one form of sample");
  }
  if (auto reason = ParseConversationImages(json, record)) return reason;
  const Json& turns = json.at("conversations");
  if (!turns.is_array()) return std::string("\"conversations\" is not an array of turns");
  for (size_t i = 0; i < turns.size(); ++i) {
    const Json& turn = turns[i];
    if (!turn.is_object()) {
      return absl::StrCat("conversations[", i, "] is not an object with \"from\" and \"value\"");
    }
    auto from = turn.find("from");
    if (from == turn.end() || !from->is_string()) {
      return absl::StrCat("conversations[", i, "].from is missing or not a string");
    }
    const std::string role = from->get<std::string>();
    ChatTurn parsed;
    if (role == "human" || role == "user") {
      parsed.role = ChatRole::kUser;
    } else if (role == "gpt" || role == "assistant") {
      parsed.role = ChatRole::kAssistant;
    } else if (role == "system") {
      parsed.role = ChatRole::kSystem;
    } else {
      return absl::StrCat("conversations[", i, "].from='", role,
                          "' is not one of human, user, gpt, assistant, system");
    }
    auto value = turn.find("value");
    if (value == turn.end() || !value->is_string()) {
      return absl::StrCat("conversations[", i, "].value is missing or not a string");
    }
    parsed.text = value->get<std::string>();
    // An optional leading system turn, then human, gpt, human, gpt, ...
    const bool leading_system =
        !record->conversation.empty() && record->conversation.front().role == ChatRole::kSystem;
    const size_t position = record->conversation.size() - (leading_system ? 1 : 0);
    if (parsed.role == ChatRole::kSystem && i != 0) {
      return absl::StrCat("conversations[", i, "].from='", role,
                          "': a system turn may only come first");
    }
    if (parsed.role == ChatRole::kUser && position % 2 != 0) {
      return absl::StrCat("conversations[", i, "].from='", role,
                          "': expected gpt or assistant (turns alternate human, gpt, ...)");
    }
    if (parsed.role == ChatRole::kAssistant && position % 2 != 1) {
      return absl::StrCat("conversations[", i, "].from='", role,
                          "': expected human or user (turns alternate human, gpt, ..., starting "
                          "with human)");
    }
    record->conversation.push_back(std::move(parsed));
  }
  if (record->conversation.empty() || record->conversation.back().role != ChatRole::kAssistant) {
    if (record->conversation.empty() || record->conversation.back().role == ChatRole::kSystem) {
      return std::string("\"conversations\" holds no human and gpt turn");
    }
    const size_t last = record->conversation.size() - 1;
    return absl::StrCat("conversations[", last, "].from='",
                        turns[last].at("from").get<std::string>(),
                        "' ends the conversation; expected it to end with a gpt or assistant turn");
  }
  return std::nullopt;
}

// Parses one sample object; returns the reason it is bad, or nullopt. *record is filled as far
// as it can be (its id is kept for the message).
std::optional<std::string> ParseSample(const Json& json, const std::string& default_id,
                                       ManifestRecord* record) {
  if (!json.is_object()) return std::string("expected a JSON object");
  if (json.contains("conversations")) return ParseConversation(json, default_id, record);
  return ParsePromptText(json, record);
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

std::string Manifest::Where(int64_t line) const {
  return format == ManifestFormat::kJsonArray ? absl::StrCat(path, "[", line, "]")
                                              : absl::StrCat(path, ":", line);
}

ManifestFormat ManifestFormatOf(const std::string& path) {
  return fs::path(path).extension() == ".json" ? ManifestFormat::kJsonArray
                                               : ManifestFormat::kJsonLines;
}

absl::StatusOr<Manifest> ReadManifest(const std::string& path, bool skip_bad,
                                      const std::atomic<bool>* cancel) {
  absl::StatusOr<std::string> contents = ReadFileToString(path);
  if (!contents.ok()) {
    return absl::Status(contents.status().code(),
                        absl::StrCat("manifest: ", contents.status().message()));
  }
  Manifest manifest;
  manifest.path = path;
  manifest.base_dir = fs::path(path).parent_path().string();
  manifest.format = ManifestFormatOf(path);
  const bool array = manifest.format == ManifestFormat::kJsonArray;
  const std::string file_name = fs::path(path).filename().string();
  std::vector<BadSample> problems;
  const auto stopped = [&](int64_t at) {
    return absl::CancelledError(absl::StrCat("stopped reading the manifest ", path, " at ",
                                             array ? "index " : "line ", at));
  };
  // Adds the sample at `line` (a line number or an array index): `json`, or the reason it could
  // not be parsed.
  auto add = [&](int64_t line, const Json* json, std::optional<std::string> reason) {
    ManifestRecord record;
    record.line = line;
    if (!reason) reason = ParseSample(*json, absl::StrCat(file_name, ":", line), &record);
    if (!reason && manifest.by_id.count(record.id) > 0) {
      const int64_t first = manifest.records[static_cast<size_t>(manifest.by_id[record.id])].line;
      reason = array ? absl::StrCat("duplicate id; first used at index ", first)
                     : absl::StrCat("duplicate id; first used on line ", first);
    }
    if (reason) {
      BadSample bad;
      bad.id = record.id;
      bad.where = manifest.Where(line);
      bad.line = line;
      bad.reason = *reason;
      problems.push_back(std::move(bad));
      return;
    }
    manifest.by_id[record.id] = static_cast<int64_t>(manifest.records.size());
    manifest.records.push_back(std::move(record));
  };

  if (array) {
    Json json;
    try {
      json = Json::parse(*contents);
    } catch (const Json::parse_error& e) {
      return absl::InvalidArgumentError(
          absl::StrCat("manifest ", path, " is not valid JSON: ", e.what(),
                       " (a .json manifest is one JSON array of samples; name a file of one JSON "
                       "object per line .jsonl)"));
    }
    if (!json.is_array()) {
      return absl::InvalidArgumentError(
          absl::StrCat("manifest ", path, " holds a JSON ", json.type_name(),
                       "; expected one JSON array of samples (name a file of one JSON object per "
                       "line .jsonl)"));
    }
    for (size_t i = 0; i < json.size(); ++i) {
      if (i % 4096 == 0 && IsCancelled(cancel)) return stopped(static_cast<int64_t>(i));
      add(static_cast<int64_t>(i), &json[i], std::nullopt);
    }
  } else {
    int64_t line_number = 0;
    size_t start = 0;
    while (start < contents->size()) {
      size_t end = contents->find('\n', start);
      if (end == std::string::npos) end = contents->size();
      std::string line = contents->substr(start, end - start);
      start = end + 1;
      ++line_number;
      if (line_number % 4096 == 1 && IsCancelled(cancel)) return stopped(line_number);
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (line.find_first_not_of(" \t") == std::string::npos) continue;  // blank lines are allowed
      Json json;
      try {
        json = Json::parse(line);
      } catch (const Json::parse_error& e) {
        add(line_number, nullptr, absl::StrCat("not valid JSON: ", e.what()));
        continue;
      }
      add(line_number, &json, std::nullopt);
    }
  }
  if (!problems.empty() && !skip_bad) {
    std::string message = absl::StrCat("manifest ", path, " has ", problems.size(),
                                       array ? " bad sample(s)" : " bad line(s)",
                                       " (set data.skip_bad_samples to skip them):");
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
  if (!record.conversation.empty()) {
    Json turns = Json::array();
    for (const ChatTurn& turn : record.conversation) {
      const char* from = turn.role == ChatRole::kSystem ? "system"
                         : turn.role == ChatRole::kUser ? "human"
                                                        : "gpt";
      turns.push_back({{"from", from}, {"value", turn.text}});
    }
    json["conversations"] = std::move(turns);
    return json.dump(-1, ' ', false, Json::error_handler_t::replace);
  }
  if (!record.prompt.empty()) json["prompt"] = record.prompt;
  json["text"] = record.text;
  return json.dump(-1, ' ', false, Json::error_handler_t::replace);
}

}  // namespace hetpar::data
