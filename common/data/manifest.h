// The manifest: the training samples, in one of two file forms, each sample in one of two forms.
//
// File forms: JSONL (any name not ending in ".json": one JSON object per line, blank lines
// skipped) or a ".json" file holding one JSON array of sample objects (LLaVA's own format). A
// sample's position is its 1-based line in a JSONL file and its 0-based array index in a .json
// file (ManifestRecord::line); messages write them "file:line" and "file[index]".
//
// Sample forms:
//   prompt/text:  {"id": "train-000042", "images": ["images/train-000042-0.png"],
//                  "prompt": "<image>describe the image.", "text": "a small red circle."}
//     `id` (string, unique; an integer is accepted) and `text` (string) are required; `images`
//     and `prompt` are optional. The model sees prompt followed by text; loss is on the text
//     (see sequence.h); data.chat_template does not apply.
//   LLaVA-style (has "conversations"):
//                 {"id": "42", "image": "a.png",
//                  "conversations": [{"from": "human", "value": "<image>\nWhat is this?"},
//                                    {"from": "gpt", "value": "A red circle."}]}
//     `image` (one path, or a list) or `images` (a list), or neither for a text-only sample;
//     `id` a string or a number, optional (default "<file name>:<line or index>"). Turns: an
//     optional leading "system", then "human"/"user" and "gpt"/"assistant" alternating, starting
//     with human and ending with gpt. data.chat_template (chat_template.h) makes the text; loss
//     is on the assistant turns.
// Relative image paths are relative to the manifest's directory; other keys are ignored. `<image>`
// (the configured image token) marks where each image goes, in any text of the sample, once per
// image, in order.
#ifndef HETPAR_COMMON_DATA_MANIFEST_H_
#define HETPAR_COMMON_DATA_MANIFEST_H_

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/data/chat_template.h"
#include "common/data/file_util.h"

namespace hetpar::data {

struct ManifestRecord {
  std::string id;
  std::vector<std::string> images;     // as written in the manifest
  std::string prompt;                  // prompt/text form
  std::string text;                    // prompt/text form
  std::vector<ChatTurn> conversation;  // LLaVA-style form (then prompt and text are empty)
  // 1-based line of a JSONL manifest, or 0-based array index of a .json manifest.
  int64_t line = 0;
};

enum class ManifestFormat { kJsonLines, kJsonArray };

// A sample that cannot be used, and why. `where` is "manifest:line" (JSONL) or
// "manifest[index]" (.json); `path` the offending file (an image), empty when the problem is the
// manifest entry itself; `reason` is the whole explanation (it names the file, or the field of
// the entry, when there is one).
struct BadSample {
  std::string id;  // empty when the entry has no readable id
  std::string where;
  int64_t line = 0;  // ManifestRecord::line
  std::string path;
  std::string reason;
  absl::StatusCode code = absl::StatusCode::kInvalidArgument;
  // The file `path` as the data index saw it when it found the sample bad (data/index.h):
  // {-1, -1} missing; {-2, -2} not recorded (no path, a stat that failed, an older index).
  FileStamp path_stamp{-2, -2};

  // "sample 'train-000042' (data/train.jsonl:43): image file not found: data/images/x.png"
  std::string ToString() const;
  absl::Status ToStatus() const { return absl::Status(code, ToString()); }
};

struct Manifest {
  std::string path;      // as given
  std::string base_dir;  // directory that relative image paths are resolved against
  ManifestFormat format = ManifestFormat::kJsonLines;
  std::vector<ManifestRecord> records;  // good entries, in file order
  std::vector<BadSample> bad;           // entries that could not be read (only with skip_bad)

  // Position of `id` in `records`, or nullopt.
  std::optional<int64_t> Find(const std::string& id) const;
  // `image` resolved against base_dir (absolute paths are kept).
  std::string ResolveImagePath(const std::string& image) const;
  // Where entry `line` (ManifestRecord::line) is: "path:line" or "path[index]".
  std::string Where(int64_t line) const;

  std::unordered_map<std::string, int64_t> by_id;
};

// The file form of `path`: kJsonArray when it ends in ".json", else kJsonLines.
ManifestFormat ManifestFormatOf(const std::string& path);

// Reads and parses a manifest. Malformed entries (bad JSON, missing or mistyped fields, bad
// conversation turns, a duplicate id) are InvalidArgument listing every one with its line or
// index, the id and the field, unless `skip_bad`, which records them in Manifest::bad instead.
// A .json file that is not one JSON array of objects is InvalidArgument even with `skip_bad`.
// A missing file is NotFound. Cancelled, between entries, once *cancel turns true (from another
// thread).
absl::StatusOr<Manifest> ReadManifest(const std::string& path, bool skip_bad,
                                      const std::atomic<bool>* cancel = nullptr);

// One manifest entry (a JSON object, no newline) for `record`: the prompt/text form, or, when
// `conversation` is set, the LLaVA-style form ("images" and "conversations" with from = system,
// human, gpt); `line` is not written. Bytes that are not UTF-8 are written as U+FFFD.
std::string ManifestRecordToJson(const ManifestRecord& record);

}  // namespace hetpar::data

#endif  // HETPAR_COMMON_DATA_MANIFEST_H_
