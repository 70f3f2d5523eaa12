// The data index: one record per usable sample (id, image count, tokens per image, text tokens,
// loss tokens, where each image's placeholder rows start), so the coordinator can plan steps
// without decoding an image. Built once from a DataLoader and written beside the manifest; it
// remembers the manifest's and the tokenizer's size and modification time and the sequence
// settings, and is rebuilt when any of them changed.
//
// File format (JSON lines): a header line {"hetpar_data_index": 2, ...} (format 1 is read too),
// one line per usable sample {"id", "ordinal", "line", "images", "tokens_per_image",
// "text_tokens", "loss_tokens", "image_offsets", "truncated", "token_crc"}, then one line per bad
// sample {"bad": {...}} (skipped, or the reason a recorded build failed).
// ("token_crc": TokenSequence::Checksum; absent from older files, which are not compared on it.)
// A sample is found again by "ordinal" (its position among the manifest's readable entries, what
// DataLoader::Load takes); "line" is for people: the 1-based line of a JSONL manifest or the
// 0-based array index of a .json manifest (ManifestRecord::line).
#ifndef HETPAR_COMMON_DATA_INDEX_H_
#define HETPAR_COMMON_DATA_INDEX_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/data/chat_template.h"
#include "common/data/file_util.h"
#include "common/data/loader.h"
#include "common/data/manifest.h"
#include "common/data/record.h"

namespace hetpar::data {

// 2: an index may record a failed build (bad samples without skip_bad_samples), which a reader
// of format 1 would take for an index that skips them. Format 1 files are read as before.
inline constexpr int kIndexFormatVersion = 2;

// What an index was built from; an index is valid only while all of it still holds.
struct IndexSource {
  std::string manifest;
  FileStamp manifest_stamp;
  std::string tokenizer;
  FileStamp tokenizer_stamp;
  // The tokenizer_config.json beside the tokenizer (a Hugging Face tokenizer's bos and eos);
  // {-1, -1}: none there; {-2, -2}: not recorded (an index written before it was), not compared.
  FileStamp tokenizer_config_stamp{-1, -1};
  std::string image_token;
  int32_t tokens_per_image = 0;
  int32_t seq_len = 0;
  OverlongPolicy overlong = OverlongPolicy::kReject;
  ChatTemplate chat_template = ChatTemplate::kPlain;  // absent from older files: plain
  bool skip_bad_samples = false;
};

// The IndexSource for a loader's options as the files are now (stat of manifest and tokenizer).
absl::StatusOr<IndexSource> CurrentIndexSource(const LoaderOptions& options);
// The IndexSource of `options` with the files as `loader` read them (DataLoader::stamps; as they
// are now when it has none). `options` may differ from the loader's in what they keep of bad
// entries (`hetpar data check` reads them all).
absl::StatusOr<IndexSource> LoadedIndexSource(const DataLoader& loader,
                                              const LoaderOptions& options);

struct DataIndex {
  IndexSource source;
  std::vector<IndexRecord> records;  // usable samples, in manifest order
  std::vector<BadSample> bad;        // samples skipped (skip_bad_samples), in manifest order
  // Built with IndexBuildOptions::verify_images: every kept image decoded. Absent from older
  // files: true (what the default build did).
  bool images_verified = false;

  // The record of `id`, or nullptr.
  const IndexRecord* Find(const std::string& id) const;
  int64_t total_tokens() const;
  int64_t total_loss_tokens() const;
  int64_t total_images() const;
  // The CRC-32 of the records' ids in index order, each followed by a newline: two indexes of the
  // same size over other samples, or the same ones in another order, differ in it.
  uint32_t IdDigest() const;

  std::unordered_map<std::string, size_t> by_id;  // id -> position in records
  // The file LoadOrBuildIndex read it from or wrote it to (the fallback path, when it went
  // there); empty when it was built and could not be saved, or not made by LoadOrBuildIndex.
  std::string file;
};

struct IndexBuildOptions {
  // Decode every image once (catches corrupt files); otherwise only check the files exist.
  bool verify_images = true;
  // Worker threads for building (samples are independent).
  int threads = 1;
  // LoadOrBuildIndex builds (and writes) the index even when its file is up to date.
  bool rebuild = false;
  // LoadOrBuildIndex fails when the index it built cannot be written (`hetpar data index`, whose
  // job is the file), instead of warning and returning it.
  bool require_saved = false;
  // Progress, as (samples described, samples): called when the build starts, every
  // `progress_every` while it runs, and when it ends, from the thread that called BuildIndex.
  // Unset: the build logs (INFO) its start, every `progress_every` how far it is, and its end
  // when it took longer than that.
  std::function<void(int64_t done, int64_t total)> on_progress;
  absl::Duration progress_every = absl::Seconds(10);
  // Turning true (from another thread) ends a build, LoadOrBuildIndex's read of an existing
  // index, or its wait for another process's build, with Cancelled.
  const std::atomic<bool>* cancel = nullptr;
  // Where LoadOrBuildIndex keeps the index when its path holds no usable one and no file can be
  // made beside it (a data set on a read-only mount, another user's directory): read there when
  // it is fresh, built and written there otherwise, under a lock of its own. Empty: nowhere
  // else (the index is built, used and not saved).
  std::string fallback_path;
};

// Describes every sample of the loader's manifest. A bad sample (including malformed manifest
// lines the loader skipped) fails the build with every problem listed, unless the loader's
// skip_bad_samples, which logs each one (HETPAR_LOG(WARNING), the run's log) and records it in
// DataIndex::bad. The records keep their ids and ordinals: a skipped sample never shifts another.
absl::StatusOr<DataIndex> BuildIndex(const DataLoader& loader, const IndexBuildOptions& options);

absl::Status WriteIndex(const DataIndex& index, const std::string& path);
// NotFound when missing; DataLoss for a file that is not a complete index. Cancelled, between
// lines, once *cancel turns true.
absl::StatusOr<DataIndex> ReadIndex(const std::string& path,
                                    const std::atomic<bool>* cancel = nullptr);

// OK when `index` was built from `current`; FailedPrecondition naming what changed otherwise.
absl::Status CheckIndexSource(const DataIndex& index, const IndexSource& current);

// Reads the index at `path` when it matches the loader's files and settings (and, when `options`
// verify images, was built decoding them); otherwise builds it and writes it to `path`, holding
// the lock `.<name>.lock` beside it (WaitedFileLock) so that of the processes that would build it
// at once one does and the others read its result. A `path`
// that cannot be written (a read-only data set) goes to options.fallback_path when there is one;
// otherwise, or when that cannot be written either, it only warns, unless `options` require the
// file: the index built is returned. A data set that cannot train (bad samples without
// skip_bad_samples, no usable sample) fails as BuildIndex does, and its index is written all the
// same: the next call over unchanged files reads the failure instead of building again.
// *rebuilt (optional) tells which happened.
absl::StatusOr<DataIndex> LoadOrBuildIndex(const DataLoader& loader, const std::string& path,
                                           const IndexBuildOptions& options,
                                           bool* rebuilt = nullptr);

}  // namespace hetpar::data

#endif  // HETPAR_COMMON_DATA_INDEX_H_
