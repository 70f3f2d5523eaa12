#include "common/data/index.h"

#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <functional>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/errno_status.h"
#include "common/logging.h"
#include "common/status.h"
#include "nlohmann/json.hpp"

namespace hetpar::data {

namespace {

// A sample's own problem (a missing or corrupt file, a bad field) makes a bad sample; a read that
// failed for another reason does not: an I/O error or a stale NFS handle, no memory, no free
// descriptors, no permission.
bool IsFailedRead(const absl::Status& status) {
  if (const std::optional<int> err = ErrnoOf(status); err.has_value()) {
    return *err != ENOENT && *err != ENOTDIR && *err != EISDIR && *err != ELOOP &&
           *err != ENAMETOOLONG;
  }
  switch (status.code()) {
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kUnknown:
    case absl::StatusCode::kDeadlineExceeded:
    case absl::StatusCode::kCancelled:
    case absl::StatusCode::kAborted:
      return true;
    default:
      return false;
  }
}

using Json = nlohmann::json;

constexpr size_t kMaxListedProblems = 20;

const char* OverlongName(OverlongPolicy policy) {
  switch (policy) {
    case OverlongPolicy::kReject:
      return "reject";
    case OverlongPolicy::kTruncate:
      return "truncate";
  }
  return "reject";
}

// Compact JSON; bytes that are not UTF-8 (a path, a decoder message) become U+FFFD instead of
// throwing.
std::string Dump(const Json& json) {
  return json.dump(-1, ' ', false, Json::error_handler_t::replace);
}

void Reindex(DataIndex* index) {
  index->by_id.clear();
  for (size_t i = 0; i < index->records.size(); ++i) index->by_id[index->records[i].id] = i;
}

Json BadToJson(const BadSample& bad) {
  Json json{{"id", bad.id},     {"where", bad.where},   {"line", bad.line},
            {"path", bad.path}, {"reason", bad.reason}, {"code", static_cast<int>(bad.code)}};
  if (bad.path_stamp.size != -2) {
    json["path_size"] = bad.path_stamp.size;
    json["path_mtime_ns"] = bad.path_stamp.mtime_ns;
  }
  return json;
}

// A bad sample's file as it is now (BadSample::path_stamp): {-1, -1} when it does not exist,
// {-2, -2} when that cannot be told (no path; a stat that failed otherwise).
FileStamp PathStamp(const std::string& path) {
  if (path.empty()) return {-2, -2};
  absl::StatusOr<FileStamp> stamp = StatFile(path);
  if (stamp.ok()) return *stamp;
  if (stamp.status().code() == absl::StatusCode::kNotFound) return {-1, -1};
  return {-2, -2};
}

// At most this many of an index's bad samples have their files stat'ed when it is loaded (spread
// over all of them): a data set whose image folder is missing has as many bad samples as images.
constexpr size_t kMaxCheckedBadFiles = 10000;

// OK when no checked bad sample's file changed since `index` was built (one repaired, or one
// that appeared); FailedPrecondition naming the first that did otherwise.
absl::Status CheckBadSampleFiles(const DataIndex& index) {
  const size_t n = index.bad.size();
  const size_t stride =
      n <= kMaxCheckedBadFiles ? 1 : (n + kMaxCheckedBadFiles - 1) / kMaxCheckedBadFiles;
  for (size_t i = 0; i < n; i += stride) {
    const BadSample& bad = index.bad[i];
    if (bad.path_stamp.size == -2) continue;
    const FileStamp now = PathStamp(bad.path);
    if (now.size == -2 || now == bad.path_stamp) continue;
    return absl::FailedPreconditionError(absl::StrCat(
        "the file ", bad.path, " of bad sample '", bad.id, "' (", bad.where, ") ",
        now.size == -1 ? std::string("is gone")
        : bad.path_stamp.size == -1
            ? "exists now"
            : absl::StrCat("changed (now ", now.size, " bytes, mtime ", now.mtime_ns, " ns)"),
        " since the index was built: the sample may be usable now"));
  }
  return absl::OkStatus();
}

IndexSource IndexSourceWith(const LoaderOptions& options, const SourceStamps& stamps) {
  IndexSource source;
  source.manifest = options.manifest;
  source.manifest_stamp = stamps.manifest;
  source.tokenizer = options.tokenizer;
  source.tokenizer_stamp = stamps.tokenizer;
  source.tokenizer_config_stamp = stamps.tokenizer_config;
  source.image_token = options.image_token;
  source.tokens_per_image = options.tokens_per_image;
  source.seq_len = options.seq_len;
  source.overlong = options.overlong;
  source.chat_template = options.chat_template;
  source.skip_bad_samples = options.skip_bad_samples;
  return source;
}

}  // namespace

absl::StatusOr<IndexSource> LoadedIndexSource(const DataLoader& loader,
                                              const LoaderOptions& options) {
  if (!loader.stamps().has_value()) return CurrentIndexSource(options);
  return IndexSourceWith(options, *loader.stamps());
}

absl::StatusOr<IndexSource> CurrentIndexSource(const LoaderOptions& options) {
  absl::StatusOr<SourceStamps> stamps = StampSources(options);
  if (!stamps.ok()) return stamps.status();
  return IndexSourceWith(options, *stamps);
}

const IndexRecord* DataIndex::Find(const std::string& id) const {
  auto it = by_id.find(id);
  return it == by_id.end() ? nullptr : &records[it->second];
}

uint32_t DataIndex::IdDigest() const {
  uLong crc = ::crc32(0L, Z_NULL, 0);
  for (const IndexRecord& r : records) {
    crc = ::crc32(crc, reinterpret_cast<const Bytef*>(r.id.data()), static_cast<uInt>(r.id.size()));
    crc = ::crc32(crc, reinterpret_cast<const Bytef*>("\n"), 1);
  }
  return static_cast<uint32_t>(crc);
}

int64_t DataIndex::total_tokens() const {
  int64_t sum = 0;
  for (const IndexRecord& r : records) sum += r.total_tokens();
  return sum;
}

int64_t DataIndex::total_loss_tokens() const {
  int64_t sum = 0;
  for (const IndexRecord& r : records) sum += r.loss_tokens;
  return sum;
}

int64_t DataIndex::total_images() const {
  int64_t sum = 0;
  for (const IndexRecord& r : records) sum += r.image_count;
  return sum;
}

namespace {

// Why a training run cannot use `index`: bad samples without skip_bad_samples (every problem
// listed, up to kMaxListedProblems), or no usable sample; OK when it can.
absl::Status UnusableIndex(const DataIndex& index) {
  const std::string& manifest = index.source.manifest;
  if (!index.bad.empty() && !index.source.skip_bad_samples) {
    std::string message =
        absl::StrCat(index.bad.size(), " bad sample(s) in ", manifest,
                     " (fix them, or set data.skip_bad_samples: true to skip them):");
    for (size_t i = 0; i < index.bad.size() && i < kMaxListedProblems; ++i) {
      absl::StrAppend(&message, "\n  ", index.bad[i].ToString());
    }
    if (index.bad.size() > kMaxListedProblems) {
      absl::StrAppend(&message, "\n  ... and ", index.bad.size() - kMaxListedProblems, " more");
    }
    return absl::Status(index.bad.front().code, message);
  }
  if (index.records.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("manifest ", manifest, " has no usable sample (", index.bad.size(), " bad)"));
  }
  return absl::OkStatus();
}

// Every sample of the loader's manifest described: the usable ones as records, the bad ones
// (malformed manifest lines too) in `bad`, whether or not the loader skips them. Fails only for
// what is not a sample's own problem (a read that failed) and when cancelled.
absl::StatusOr<DataIndex> DescribeAll(const DataLoader& loader, const IndexBuildOptions& options) {
  // The files as the loader read them: a manifest edited since then looks stale.
  absl::StatusOr<IndexSource> source = LoadedIndexSource(loader, loader.options());
  if (!source.ok()) return source.status();
  const int64_t n = loader.size();
  std::vector<absl::StatusOr<IndexRecord>> described(static_cast<size_t>(n),
                                                     absl::UnknownError("not described"));
  const int threads =
      static_cast<int>(std::clamp<int64_t>(options.threads, 1, std::max<int64_t>(1, n)));
  const absl::Time start = absl::Now();
  std::function<void(int64_t, int64_t)> progress = options.on_progress;
  bool started = false;
  bool reported = false;  // the default's: a line between the first and the last was logged
  if (!progress) {
    progress = [&](int64_t done, int64_t total) {
      const absl::Duration elapsed = absl::Now() - start;
      const std::string& manifest = loader.options().manifest;
      if (!started) {
        started = true;
        HETPAR_LOG(INFO) << "indexing " << manifest << ": " << total << " samples ("
                         << (options.verify_images ? "decoding" : "finding") << " their images), "
                         << threads << " thread(s)";
      } else if (done < total) {
        reported = true;
        std::string left;
        if (done > 0 && elapsed > absl::ZeroDuration()) {
          const double rate = static_cast<double>(done) / absl::ToDoubleSeconds(elapsed);
          left = absl::StrCat(", ", static_cast<int64_t>(rate), " samples/s, about ",
                              absl::FormatDuration(absl::Trunc(
                                  absl::Seconds(static_cast<double>(total - done) / rate),
                                  absl::Seconds(1))),
                              " left");
        }
        HETPAR_LOG(INFO) << "indexing " << manifest << ": " << done << " of " << total
                         << " samples (" << 100 * done / total << "%)" << left;
      } else if (reported) {
        HETPAR_LOG(INFO) << "indexed " << manifest << ": " << total << " samples in "
                         << absl::FormatDuration(absl::Trunc(elapsed, absl::Seconds(1)));
      }
    };
  }
  progress(0, n);
  std::atomic<int64_t> done{0};
  std::atomic<int> running{threads};
  absl::Notification finished;
  auto work = [&](int t) {
    for (int64_t i = t; i < n; i += threads) {
      if (IsCancelled(options.cancel)) break;
      described[static_cast<size_t>(i)] = loader.Describe(i, options.verify_images);
      done.fetch_add(1, std::memory_order_relaxed);
    }
    if (running.fetch_sub(1) == 1) finished.Notify();
  };
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back(work, t);
  while (!finished.WaitForNotificationWithTimeout(options.progress_every)) {
    progress(done.load(std::memory_order_relaxed), n);
  }
  for (std::thread& th : pool) th.join();
  if (IsCancelled(options.cancel)) {
    return absl::CancelledError(absl::StrCat("stopped indexing ", loader.options().manifest,
                                             " after ", done.load(), " of ", n, " samples"));
  }
  progress(n, n);

  DataIndex index;
  index.source = *source;
  index.images_verified = options.verify_images;
  // Malformed manifest lines the loader skipped and the samples' own problems, by line.
  std::vector<std::pair<int64_t, BadSample>> bad;
  for (const BadSample& b : loader.manifest().bad) {
    bad.emplace_back(b.line, b);
  }
  for (int64_t i = 0; i < n; ++i) {
    absl::StatusOr<IndexRecord>& r = described[static_cast<size_t>(i)];
    if (!r.ok() && IsFailedRead(r.status())) {
      // Not the sample's own problem: recorded as bad (data.skip_bad_samples), it would be
      // skipped by every later run that reuses this index, also once the read works again.
      const BadSample problem = loader.DescribeProblem(i, r.status());
      return absl::Status(
          r.status().code(),
          absl::StrCat("indexing ", loader.options().manifest, ": ", problem.ToString(),
                       " (a read that failed, not a bad sample: no index is built; try again "
                       "once the file system answers)"));
    }
    if (r.ok()) {
      index.records.push_back(std::move(*r));
    } else {
      // Its path_stamp is the file's before it was read (DataLoader::Describe): a file repaired
      // since, also while the build still ran, is seen as changed at the next start.
      BadSample problem = loader.DescribeProblem(i, r.status());
      bad.emplace_back(problem.line, std::move(problem));
    }
  }
  std::stable_sort(bad.begin(), bad.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  for (auto& entry : bad) index.bad.push_back(std::move(entry.second));
  Reindex(&index);
  return index;
}

void LogSkipped(const DataIndex& index, const std::string& from) {
  for (const BadSample& b : index.bad) {
    HETPAR_LOG(WARNING) << "skipping bad sample" << from << ": " << b.ToString();
  }
}

}  // namespace

absl::StatusOr<DataIndex> BuildIndex(const DataLoader& loader, const IndexBuildOptions& options) {
  absl::StatusOr<DataIndex> index = DescribeAll(loader, options);
  if (!index.ok()) return index.status();
  if (absl::Status unusable = UnusableIndex(*index); !unusable.ok()) return unusable;
  LogSkipped(*index, "");
  return index;
}

absl::Status WriteIndex(const DataIndex& index, const std::string& path) {
  const IndexSource& s = index.source;
  Json header = {{"hetpar_data_index", kIndexFormatVersion},
                 {"manifest", s.manifest},
                 {"manifest_size", s.manifest_stamp.size},
                 {"manifest_mtime_ns", s.manifest_stamp.mtime_ns},
                 {"tokenizer", s.tokenizer},
                 {"tokenizer_size", s.tokenizer_stamp.size},
                 {"tokenizer_mtime_ns", s.tokenizer_stamp.mtime_ns},
                 {"tokenizer_config_size", s.tokenizer_config_stamp.size},
                 {"tokenizer_config_mtime_ns", s.tokenizer_config_stamp.mtime_ns},
                 {"image_token", s.image_token},
                 {"tokens_per_image", s.tokens_per_image},
                 {"seq_len", s.seq_len},
                 {"overlong", OverlongName(s.overlong)},
                 {"chat_template", ChatTemplateName(s.chat_template)},
                 {"skip_bad_samples", s.skip_bad_samples},
                 {"images_verified", index.images_verified},
                 {"samples", index.records.size()},
                 {"bad_samples", index.bad.size()}};
  std::string out = Dump(header);
  out.push_back('\n');
  for (const IndexRecord& r : index.records) {
    Json line = {{"id", r.id},
                 {"ordinal", r.ordinal},
                 {"line", r.line},
                 {"images", r.image_count},
                 {"tokens_per_image", r.tokens_per_image},
                 {"text_tokens", r.text_tokens},
                 {"loss_tokens", r.loss_tokens},
                 {"image_offsets", r.image_offsets},
                 {"truncated", r.truncated}};
    if (r.token_checksum != 0) line["token_crc"] = r.token_checksum;
    out += Dump(line);
    out.push_back('\n');
  }
  for (const BadSample& b : index.bad) {
    out += Dump(Json{{"bad", BadToJson(b)}});
    out.push_back('\n');
  }
  return Annotate(WriteFileAtomically(path, out), absl::StrCat("writing data index ", path));
}

absl::StatusOr<DataIndex> ReadIndex(const std::string& path, const std::atomic<bool>* cancel) {
  absl::StatusOr<std::string> contents = ReadFileToString(path);
  if (!contents.ok()) return Annotate(contents.status(), "data index");
  DataIndex index;
  int64_t expected_samples = -1;
  int64_t expected_bad = -1;
  int64_t line_number = 0;
  size_t start = 0;
  try {
    while (start < contents->size()) {
      size_t end = contents->find('\n', start);
      if (end == std::string::npos) end = contents->size();
      const std::string line = contents->substr(start, end - start);
      start = end + 1;
      ++line_number;
      if (line_number % 4096 == 1 && IsCancelled(cancel)) {
        return absl::CancelledError(
            absl::StrCat("stopped reading the data index ", path, " at line ", line_number));
      }
      if (line.empty()) continue;
      const Json json = Json::parse(line);
      if (line_number == 1) {
        if (!json.contains("hetpar_data_index")) {
          return absl::DataLossError(
              absl::StrCat("data index ", path, ": line 1 is not an index header"));
        }
        const int version = json.at("hetpar_data_index").get<int>();
        if (version != kIndexFormatVersion && version != 1) {
          return absl::DataLossError(absl::StrCat("data index ", path, " has format version ",
                                                  version, "; expected 1 to ",
                                                  kIndexFormatVersion));
        }
        IndexSource& s = index.source;
        s.manifest = json.at("manifest").get<std::string>();
        s.manifest_stamp.size = json.at("manifest_size").get<int64_t>();
        s.manifest_stamp.mtime_ns = json.at("manifest_mtime_ns").get<int64_t>();
        s.tokenizer = json.at("tokenizer").get<std::string>();
        s.tokenizer_stamp.size = json.at("tokenizer_size").get<int64_t>();
        s.tokenizer_stamp.mtime_ns = json.at("tokenizer_mtime_ns").get<int64_t>();
        // Absent from older files: not recorded, and not compared.
        s.tokenizer_config_stamp.size = json.value("tokenizer_config_size", int64_t{-2});
        s.tokenizer_config_stamp.mtime_ns = json.value("tokenizer_config_mtime_ns", int64_t{-2});
        s.image_token = json.at("image_token").get<std::string>();
        s.tokens_per_image = json.at("tokens_per_image").get<int32_t>();
        s.seq_len = json.at("seq_len").get<int32_t>();
        s.overlong = json.at("overlong").get<std::string>() == "truncate"
                         ? OverlongPolicy::kTruncate
                         : OverlongPolicy::kReject;
        // Indexes written before chat templates existed were built with plain.
        absl::StatusOr<ChatTemplate> chat_template =
            ParseChatTemplate(json.value("chat_template", std::string("plain")));
        if (!chat_template.ok()) {
          return absl::DataLossError(
              absl::StrCat("data index ", path, ": line 1: ", chat_template.status().message()));
        }
        s.chat_template = *chat_template;
        s.skip_bad_samples = json.at("skip_bad_samples").get<bool>();
        index.images_verified = json.value("images_verified", true);
        expected_samples = json.at("samples").get<int64_t>();
        expected_bad = json.at("bad_samples").get<int64_t>();
        continue;
      }
      if (json.contains("bad")) {
        const Json& b = json.at("bad");
        BadSample bad;
        bad.id = b.at("id").get<std::string>();
        bad.where = b.at("where").get<std::string>();
        bad.line = b.at("line").get<int64_t>();
        bad.path = b.at("path").get<std::string>();
        bad.reason = b.at("reason").get<std::string>();
        bad.code = static_cast<absl::StatusCode>(b.at("code").get<int>());
        if (b.contains("path_size")) {
          bad.path_stamp = {b.at("path_size").get<int64_t>(), b.at("path_mtime_ns").get<int64_t>()};
        }
        index.bad.push_back(std::move(bad));
        continue;
      }
      IndexRecord r;
      r.id = json.at("id").get<std::string>();
      r.ordinal = json.at("ordinal").get<int64_t>();
      r.line = json.at("line").get<int64_t>();
      r.image_count = json.at("images").get<int32_t>();
      r.tokens_per_image = json.at("tokens_per_image").get<int32_t>();
      r.text_tokens = json.at("text_tokens").get<int32_t>();
      r.loss_tokens = json.at("loss_tokens").get<int32_t>();
      r.image_offsets = json.at("image_offsets").get<std::vector<int32_t>>();
      r.truncated = json.at("truncated").get<bool>();
      if (json.contains("token_crc")) r.token_checksum = json.at("token_crc").get<uint32_t>();
      if (static_cast<int32_t>(r.image_offsets.size()) != r.image_count) {
        return absl::DataLossError(absl::StrCat("data index ", path, ":", line_number, ": sample '",
                                                r.id, "' has ", r.image_count, " images but ",
                                                r.image_offsets.size(), " image offsets"));
      }
      index.records.push_back(std::move(r));
    }
  } catch (const Json::exception& e) {
    return absl::DataLossError(
        absl::StrCat("data index ", path, ":", line_number, " is not valid: ", e.what()));
  }
  if (expected_samples < 0) {
    return absl::DataLossError(absl::StrCat("data index ", path, " is empty (no header)"));
  }
  if (static_cast<int64_t>(index.records.size()) != expected_samples ||
      static_cast<int64_t>(index.bad.size()) != expected_bad) {
    return absl::DataLossError(absl::StrCat(
        "data index ", path, " is incomplete: header says ", expected_samples, " samples and ",
        expected_bad, " bad, the file holds ", index.records.size(), " and ", index.bad.size()));
  }
  Reindex(&index);
  if (index.by_id.size() != index.records.size()) {
    return absl::DataLossError(absl::StrCat("data index ", path, " repeats a sample id"));
  }
  return index;
}

absl::Status CheckIndexSource(const DataIndex& index, const IndexSource& current) {
  const IndexSource& built = index.source;
  std::vector<std::string> changes;
  if (built.manifest_stamp != current.manifest_stamp) {
    changes.push_back(absl::StrCat(
        "manifest ", current.manifest, " is now ", current.manifest_stamp.size, " bytes, mtime ",
        current.manifest_stamp.mtime_ns, " ns (index built from ", built.manifest_stamp.size,
        " bytes, mtime ", built.manifest_stamp.mtime_ns, " ns)"));
  }
  if (built.tokenizer_config_stamp.size != -2 &&
      built.tokenizer_config_stamp != current.tokenizer_config_stamp) {
    changes.push_back(absl::StrCat(
        "the tokenizer_config.json beside ", current.tokenizer,
        current.tokenizer_config_stamp.size < 0
            ? std::string(" is gone")
            : absl::StrCat(" changed (now ", current.tokenizer_config_stamp.size, " bytes, mtime ",
                           current.tokenizer_config_stamp.mtime_ns, " ns)")));
  }
  if (built.tokenizer_stamp != current.tokenizer_stamp) {
    changes.push_back(absl::StrCat("tokenizer ", current.tokenizer, " changed (now ",
                                   current.tokenizer_stamp.size, " bytes, mtime ",
                                   current.tokenizer_stamp.mtime_ns, " ns)"));
  }
  if (built.image_token != current.image_token) {
    changes.push_back(absl::StrCat("image_token is '", current.image_token, "' (index: '",
                                   built.image_token, "')"));
  }
  if (built.tokens_per_image != current.tokens_per_image) {
    changes.push_back(absl::StrCat("tokens per image is ", current.tokens_per_image,
                                   " (index: ", built.tokens_per_image, ")"));
  }
  if (built.seq_len != current.seq_len) {
    changes.push_back(
        absl::StrCat("seq_len is ", current.seq_len, " (index: ", built.seq_len, ")"));
  }
  if (built.overlong != current.overlong) {
    changes.push_back(absl::StrCat("overlong is ", OverlongName(current.overlong),
                                   " (index: ", OverlongName(built.overlong), ")"));
  }
  if (built.chat_template != current.chat_template) {
    changes.push_back(absl::StrCat("chat_template is ", ChatTemplateName(current.chat_template),
                                   " (index: ", ChatTemplateName(built.chat_template), ")"));
  }
  if (built.skip_bad_samples != current.skip_bad_samples) {
    changes.push_back(absl::StrCat("skip_bad_samples is ", current.skip_bad_samples,
                                   " (index: ", built.skip_bad_samples, ")"));
  }
  if (changes.empty()) return absl::OkStatus();
  std::string message = "data index is stale:";
  for (const std::string& c : changes) absl::StrAppend(&message, " ", c, ";");
  absl::StrAppend(&message, " rebuild it (hetpar data index)");
  return absl::FailedPreconditionError(message);
}

namespace {

// The index at `path` when it was built from `current` (decoding its images where `options`
// verify them, and with no skipped sample's file changed since); otherwise why not: NotFound when
// it is missing, FailedPrecondition when it is stale, the read's error when it is damaged.
absl::StatusOr<DataIndex> FreshIndexAt(const std::string& path, const IndexSource& current,
                                       const IndexBuildOptions& options) {
  absl::StatusOr<DataIndex> existing = ReadIndex(path, options.cancel);
  if (!existing.ok()) return existing.status();
  absl::Status fresh = CheckIndexSource(*existing, current);
  if (fresh.ok() && options.verify_images && !existing->images_verified) {
    // A bad image it let through would fail a training step, again on every retry, even
    // under data.skip_bad_samples.
    fresh = absl::FailedPreconditionError(
        "it was built without decoding its images (hetpar data index --no-verify-images), and "
        "training decodes each image once first");
  }
  if (fresh.ok()) fresh = CheckBadSampleFiles(*existing);
  if (!fresh.ok()) return fresh;
  return existing;
}

// `.<name>.lock` beside the index `path`.
std::string IndexLockPath(const std::string& path) {
  const std::filesystem::path p(path);
  return (p.parent_path() / ("." + p.filename().string() + ".lock")).string();
}

// Indexing a large data set takes long; a holder past this is taken as stuck.
constexpr absl::Duration kIndexLockTimeout = absl::Hours(4);

// Why no file can be made beside `path` (its directory is missing, is not a directory, is on a
// read-only file system or is not this user's to write); "" when one can.
std::string CannotWriteBeside(const std::string& path) {
  std::filesystem::path dir = std::filesystem::path(path).parent_path();
  if (dir.empty()) dir = ".";
  std::error_code error;
  if (!std::filesystem::is_directory(dir, error)) {
    return absl::StrCat(dir.string(), " is not a directory",
                        error ? absl::StrCat(" (", error.message(), ")") : "");
  }
  if (::access(dir.c_str(), W_OK | X_OK) != 0) {
    return absl::StrCat("cannot write in ", dir.string(), ": ", std::strerror(errno));
  }
  return "";
}

// LoadOrBuildIndex at `path`; `fallback` when `path` is options.fallback_path, which has none of
// its own.
absl::StatusOr<DataIndex> LoadOrBuildIndexAt(const DataLoader& loader, const std::string& path,
                                             const IndexBuildOptions& options, bool* rebuilt,
                                             bool fallback) {
  if (rebuilt != nullptr) *rebuilt = false;
  // An index of the files as the loader read them, which it then reads samples of.
  absl::StatusOr<IndexSource> current = LoadedIndexSource(loader, loader.options());
  if (!current.ok()) return current.status();
  absl::StatusOr<DataIndex> existing = options.rebuild ? absl::NotFoundError("rebuilding as asked")
                                                       : FreshIndexAt(path, *current, options);
  if (absl::IsCancelled(existing.status())) return existing.status();
  if (!fallback && !existing.ok() && !options.fallback_path.empty() &&
      options.fallback_path != path) {
    if (const std::string why = CannotWriteBeside(path); !why.empty()) {
      // A read-only data set: its index is kept (and shared by the run's processes) elsewhere,
      // rather than built again by each of them at every start.
      const std::string state =
          options.rebuild ? std::string("is to be rebuilt")
          : absl::IsNotFound(existing.status())
              ? std::string("is missing")
              : absl::StrCat("is not usable (", existing.status().message(), ")");
      HETPAR_LOG(INFO) << "the data index " << path << " " << state
                       << " and cannot be written there (" << why << "): using "
                       << options.fallback_path;
      // Rebuilt at the fallback, it is read only where the one beside the manifest is not.
      if (options.rebuild && FreshIndexAt(path, *current, options).ok()) {
        HETPAR_LOG(WARNING) << "the data index " << path << " matches the files as far as their "
                            << "sizes and modification times tell, and runs read it before "
                            << options.fallback_path
                            << ": a rebuild there changes nothing for them; rebuild it where it "
                            << "can be written, remove it, or set data.index to "
                            << options.fallback_path;
      }
      return LoadOrBuildIndexAt(loader, options.fallback_path, options, rebuilt,
                                /*fallback=*/true);
    }
  }
  // Processes opening one data set at once (a run's coordinator and workers, several workers on
  // a node): one builds the index, the others wait for it and read what it wrote. Without the
  // lock (a read-only data set, whose index is not saved either), each builds its own.
  std::optional<WaitedFileLock> lock;
  if (!existing.ok()) {
    // The lock file's directory first: a fallback's (under checkpoint.dir) is new at a run's first
    // start, and without it every process would build its own.
    if (const std::string dir = std::filesystem::path(path).parent_path().string(); !dir.empty()) {
      (void)MakeDirectories(dir);  // a directory that cannot be made: no lock, and no file
    }
    absl::StatusOr<WaitedFileLock> taken =
        WaitedFileLock::Take(IndexLockPath(path), absl::StrCat("building the data index ", path),
                             kIndexLockTimeout, options.cancel, /*quiet_when_unlockable=*/true);
    if (!taken.ok()) return taken.status();
    lock.emplace(*std::move(taken));
    // Another process may have built it, while this one waited or before it asked.
    if (!options.rebuild) existing = FreshIndexAt(path, *current, options);
    if (absl::IsCancelled(existing.status())) return existing.status();
  }
  if (existing.ok()) {
    if (absl::Status unusable = UnusableIndex(*existing); !unusable.ok()) {
      // A build that found the data set unusable, recorded so that its waiters and later starts
      // need not decode every image again to learn it.
      return absl::Status(
          unusable.code(),
          absl::StrCat(unusable.message(), "\n(as the data index ", path,
                       " records them: the manifest, the tokenizer and the files checked are "
                       "unchanged since its build; repair them and the next start indexes "
                       "again, or rebuild it with `hetpar data index --rebuild`)"));
    }
    LogSkipped(*existing, absl::StrCat(" (from index ", path, ")"));
    existing->file = path;
    return existing;
  }
  if (absl::IsFailedPrecondition(existing.status())) {
    HETPAR_LOG(INFO) << "rebuilding " << path << ": " << existing.status().message();
  } else if (!absl::IsNotFound(existing.status())) {
    HETPAR_LOG(WARNING) << "rebuilding " << path << ": " << existing.status().message();
  }
  absl::StatusOr<DataIndex> built = DescribeAll(loader, options);
  if (!built.ok()) return built.status();
  // An unusable data set's index is written all the same: the processes waiting for this build,
  // and later starts while the files stay as they are, read the same failure from it instead of
  // each decoding every image again (its bad samples' file stamps tell when they are repaired).
  const absl::Status unusable = UnusableIndex(*built);
  const absl::Status saved = WriteIndex(*built, path);
  if (!unusable.ok()) return unusable;
  LogSkipped(*built, "");
  if (absl::Status s = saved; !s.ok()) {
    if (options.require_saved) return s;
    // A data set on a read-only mount: the index is good, only not kept for the next start.
    HETPAR_LOG(WARNING) << "the data index built for " << loader.options().manifest
                        << " is not saved (" << s.message() << "); it is built again at every "
                        << "start: "
                        << (fallback ? "make this path writable, or set data.index to a "
                                       "writable path"
                                     : "set data.index to a writable path, or checkpoint.dir "
                                       "(which keeps the index of a read-only data set when "
                                       "data.index is the default), or write it once with "
                                       "`hetpar data index`");
  } else {
    built->file = path;
  }
  if (rebuilt != nullptr) *rebuilt = true;
  return built;
}

}  // namespace

absl::StatusOr<DataIndex> LoadOrBuildIndex(const DataLoader& loader, const std::string& path,
                                           const IndexBuildOptions& options, bool* rebuilt) {
  return LoadOrBuildIndexAt(loader, path, options, rebuilt, /*fallback=*/false);
}

}  // namespace hetpar::data
