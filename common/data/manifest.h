// The JSONL manifest: one sample per line, LLaVA-like.
//
//   {"id": "train-000042", "images": ["images/train-000042-0.png"],
//    "prompt": "<image>describe the image.", "text": "a small red circle at the top left."}
//
// `id` (string, unique) and `text` (string) are required; `images` (relative paths are
// relative to the manifest's directory) and `prompt` are optional; other keys are ignored. The
// model sees prompt followed by text; loss is on the text (see sequence.h). `<image>` (the
// configured image token) marks where each image goes, in the prompt or the text, once per entry
// of `images`, in order.
#ifndef HETPAR_COMMON_DATA_MANIFEST_H_
#define HETPAR_COMMON_DATA_MANIFEST_H_

#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace hetpar::data {

struct ManifestRecord {
  std::string id;
  std::vector<std::string> images;  // as written in the manifest
  std::string prompt;
  std::string text;
  int64_t line = 0;  // 1-based line in the manifest
};

// A sample that cannot be used, and why. `where` is "manifest:line"; `path` the offending file
// (an image), empty when the problem is the manifest line itself; `reason` is the whole
// explanation (it names the file when there is one).
struct BadSample {
  std::string id;  // empty when the line has no readable id
  std::string where;
  int64_t line = 0;  // 1-based manifest line
  std::string path;
  std::string reason;
  absl::StatusCode code = absl::StatusCode::kInvalidArgument;

  // "sample 'train-000042' (data/train.jsonl:43): image file not found: data/images/x.png"
  std::string ToString() const;
  absl::Status ToStatus() const { return absl::Status(code, ToString()); }
};

struct Manifest {
  std::string path;                     // as given
  std::string base_dir;                 // directory that relative image paths are resolved against
  std::vector<ManifestRecord> records;  // good lines, in file order
  std::vector<BadSample> bad;           // lines that could not be read (only with skip_bad)

  // Position of `id` in `records`, or nullopt.
  std::optional<int64_t> Find(const std::string& id) const;
  // `image` resolved against base_dir (absolute paths are kept).
  std::string ResolveImagePath(const std::string& image) const;

  std::unordered_map<std::string, int64_t> by_id;
};

// Reads and parses a manifest. Malformed lines (bad JSON, missing or mistyped fields, a
// duplicate id) are InvalidArgument listing every one with its line, unless `skip_bad`, which
// records them in Manifest::bad instead. A missing file is NotFound.
absl::StatusOr<Manifest> ReadManifest(const std::string& path, bool skip_bad);

// One manifest line (no newline) for `record`; `line` is not written. Bytes that are not UTF-8
// are written as U+FFFD.
std::string ManifestRecordToJson(const ManifestRecord& record);

}  // namespace hetpar::data

#endif  // HETPAR_COMMON_DATA_MANIFEST_H_
