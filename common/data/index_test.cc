#include "common/data/index.h"

#include <fcntl.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/fanotify.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>
#include <utility>
#include <vector>

#include "common/data/file_util.h"
#include "common/data/synth.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hetpar::data {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

class IndexTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (fs::temp_directory_path() / "hetpar_index_XXXXXX").string();
    ASSERT_NE(::mkdtemp(dir_.data()), nullptr);
    SynthOptions o = SynthOptionsForDirectory(dir_);
    o.samples = 40;
    o.val_samples = 0;
    o.val_manifest.clear();
    o.seed = 3;
    absl::StatusOr<SynthReport> report = GenerateSyntheticDataset(o);
    ASSERT_TRUE(report.ok()) << report.status();
  }
  void TearDown() override { fs::remove_all(dir_); }

  LoaderOptions Options(const std::string& manifest = "") const {
    LoaderOptions o;
    o.manifest = manifest.empty() ? dir_ + "/train.jsonl" : manifest;
    o.tokenizer = dir_ + "/tokenizer.model";
    o.image_size = 32;
    o.tokens_per_image = 16;
    o.seq_len = 128;
    return o;
  }
  // Appends a text-only sample to the manifest (changing its size and time).
  void AppendSample(const std::string& id, const std::string& prompt,
                    const std::string& text) const {
    std::ofstream out(dir_ + "/train.jsonl", std::ios::app);
    ManifestRecord r;
    r.id = id;
    r.prompt = prompt;
    r.text = text;
    out << ManifestRecordToJson(r) << "\n";
  }
  // LoadOrBuildIndex at `path` over a new loader of the 40 samples: built anew, with all of them.
  void ExpectBuiltInFull(const std::string& path) const {
    bool rebuilt = false;
    absl::StatusOr<DataIndex> index =
        LoadOrBuildIndex(*Make(Options()), path, IndexBuildOptions(), &rebuilt);
    ASSERT_TRUE(index.ok()) << index.status();
    EXPECT_TRUE(rebuilt);
    EXPECT_EQ(index->records.size(), 40u);
  }
  // A sample of one image, `image` (relative to the test's directory), and a caption.
  static ManifestRecord OneImageSample(const std::string& id, const std::string& image) {
    ManifestRecord r;
    r.id = id;
    r.prompt = "<image>describe the image.";
    r.images = {image};
    r.text = "the image is empty.";
    return r;
  }
  // The JSONL manifest `name` in the test's directory: `lines`, each ended by a newline.
  std::string WriteManifest(const std::string& name, const std::vector<std::string>& lines) const {
    std::string text;
    for (const std::string& l : lines) text += l + "\n";
    const std::string path = dir_ + "/" + name;
    EXPECT_TRUE(WriteFileAtomically(path, text).ok()) << path;
    return path;
  }
  std::unique_ptr<DataLoader> Make(const LoaderOptions& o) const {
    absl::StatusOr<std::unique_ptr<DataLoader>> loader = DataLoader::Create(o);
    EXPECT_TRUE(loader.ok()) << loader.status();
    return loader.ok() ? std::move(*loader) : nullptr;
  }

  std::string dir_;
};

TEST_F(IndexTest, RecordsMatchTheDecodedSamples) {
  std::unique_ptr<DataLoader> loader = Make(Options());
  ASSERT_NE(loader, nullptr);
  for (int threads : {1, 3}) {
    IndexBuildOptions build;
    build.threads = threads;
    absl::StatusOr<DataIndex> index = BuildIndex(*loader, build);
    ASSERT_TRUE(index.ok()) << index.status();
    ASSERT_EQ(index->records.size(), 40u);
    EXPECT_TRUE(index->bad.empty());
    int64_t tokens = 0;
    for (int64_t i = 0; i < loader->size(); ++i) {
      absl::StatusOr<LoadedSample> sample = loader->Load(i);
      ASSERT_TRUE(sample.ok()) << sample.status();
      const IndexRecord& r = index->records[static_cast<size_t>(i)];
      EXPECT_EQ(r.id, sample->id);
      EXPECT_EQ(index->Find(sample->id), &r);
      EXPECT_EQ(r.ordinal, i);
      EXPECT_EQ(r.line, i + 1);
      EXPECT_EQ(r.image_count, static_cast<int32_t>(sample->images.size()));
      EXPECT_EQ(r.tokens_per_image, 16);
      EXPECT_EQ(r.text_tokens, sample->tokens.text_tokens);
      EXPECT_EQ(r.loss_tokens, sample->tokens.loss_tokens);
      EXPECT_EQ(r.image_offsets, sample->tokens.image_offsets);
      EXPECT_EQ(r.token_checksum, sample->tokens.Checksum());
      EXPECT_NE(r.token_checksum, 0u);
      EXPECT_EQ(r.total_tokens(), sample->tokens.length());
      EXPECT_FALSE(r.truncated);
      tokens += sample->tokens.length();
    }
    EXPECT_EQ(index->total_tokens(), tokens);
  }
}

// A build reports how far it is: (0, n) first, (n, n) last, counts that never go back between.
TEST_F(IndexTest, ABuildReportsItsProgressFromStartToEnd) {
  std::unique_ptr<DataLoader> loader = Make(Options());
  ASSERT_NE(loader, nullptr);
  for (int threads : {1, 3}) {
    SCOPED_TRACE(threads);
    std::vector<std::pair<int64_t, int64_t>> calls;
    IndexBuildOptions build;
    build.threads = threads;
    build.progress_every = absl::Milliseconds(1);
    build.on_progress = [&](int64_t done, int64_t total) { calls.emplace_back(done, total); };
    absl::StatusOr<DataIndex> index = BuildIndex(*loader, build);
    ASSERT_TRUE(index.ok()) << index.status();
    ASSERT_GE(calls.size(), 2u);
    EXPECT_EQ(calls.front(), std::make_pair(int64_t{0}, int64_t{40}));
    EXPECT_EQ(calls.back(), std::make_pair(int64_t{40}, int64_t{40}));
    for (size_t i = 1; i < calls.size(); ++i) {
      EXPECT_EQ(calls[i].second, 40);
      EXPECT_GE(calls[i].first, calls[i - 1].first);
      EXPECT_LE(calls[i].first, 40);
    }
  }
}

TEST_F(IndexTest, FileRoundTripKeepsEveryField) {
  // The generator already wrote the index; reading it gives what building gives.
  absl::StatusOr<DataIndex> read = ReadIndex(dir_ + "/train.jsonl.index");
  ASSERT_TRUE(read.ok()) << read.status();
  std::unique_ptr<DataLoader> loader = Make(Options());
  absl::StatusOr<DataIndex> built = BuildIndex(*loader, IndexBuildOptions());
  ASSERT_TRUE(built.ok());
  ASSERT_EQ(read->records.size(), built->records.size());
  for (size_t i = 0; i < built->records.size(); ++i) {
    EXPECT_EQ(read->records[i], built->records[i]) << i;
  }
  EXPECT_EQ(read->source.manifest_stamp, built->source.manifest_stamp);
  EXPECT_EQ(read->source.tokenizer_stamp, built->source.tokenizer_stamp);
  EXPECT_EQ(read->source.seq_len, 128);
  EXPECT_EQ(read->source.tokens_per_image, 16);
  EXPECT_EQ(read->source.image_token, "<image>");
  EXPECT_TRUE(CheckIndexSource(*read, *CurrentIndexSource(Options())).ok());
}

TEST_F(IndexTest, StaleIndexIsDetectedAndRebuilt) {
  const std::string path = dir_ + "/train.jsonl.index";
  std::unique_ptr<DataLoader> loader = Make(Options());
  bool rebuilt = true;
  absl::StatusOr<DataIndex> same = LoadOrBuildIndex(*loader, path, IndexBuildOptions(), &rebuilt);
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_FALSE(rebuilt);

  // A different seq_len makes it stale.
  LoaderOptions longer = Options();
  longer.seq_len = 100;
  absl::Status s = CheckIndexSource(*same, *CurrentIndexSource(longer));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("seq_len is 100 (index: 128)"));

  // Appending a sample changes the manifest's size and time.
  ::usleep(10000);
  AppendSample("extra", "what is one plus one?", "two.");
  s = CheckIndexSource(*same, *CurrentIndexSource(Options()));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("manifest " + dir_ + "/train.jsonl is now"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("hetpar data index"));

  std::unique_ptr<DataLoader> reloaded = Make(Options());
  absl::StatusOr<DataIndex> fresh =
      LoadOrBuildIndex(*reloaded, path, IndexBuildOptions(), &rebuilt);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_TRUE(rebuilt);
  ASSERT_EQ(fresh->records.size(), 41u);
  EXPECT_EQ(fresh->records.back().id, "extra");
  EXPECT_EQ(fresh->records.back().image_count, 0);
  // And now it is current.
  absl::StatusOr<DataIndex> again =
      LoadOrBuildIndex(*reloaded, path, IndexBuildOptions(), &rebuilt);
  ASSERT_TRUE(again.ok());
  EXPECT_FALSE(rebuilt);
  EXPECT_EQ(again->records.size(), 41u);
}

// An index built without decoding images (hetpar data index --no-verify-images) let a corrupt
// image through; a caller that verifies (training) rebuilds it and skips the sample, instead of
// failing the step that meets it.
TEST_F(IndexTest, AnIndexBuiltWithoutDecodingImagesIsRebuiltByACallerThatDecodes) {
  std::string png = *ReadFileToString(dir_ + "/images/train/train-000001-0.png");
  png.resize(png.size() / 2);
  ASSERT_TRUE(WriteFileAtomically(dir_ + "/half.png", png).ok());
  const std::string manifest =
      WriteManifest("cut.jsonl", {ManifestRecordToJson(MakeSynthSample(3, "train", 0, 3).record),
                                  ManifestRecordToJson(OneImageSample("corrupt", "half.png"))});
  LoaderOptions skip = Options(manifest);
  skip.skip_bad_samples = true;
  std::unique_ptr<DataLoader> loader = Make(skip);
  ASSERT_NE(loader, nullptr);
  const std::string path = manifest + ".index";
  IndexBuildOptions quick;
  quick.verify_images = false;
  bool rebuilt = false;
  absl::StatusOr<DataIndex> unverified = LoadOrBuildIndex(*loader, path, quick, &rebuilt);
  ASSERT_TRUE(unverified.ok()) << unverified.status();
  EXPECT_EQ(unverified->records.size(), 2u);  // the file exists
  EXPECT_FALSE(ReadIndex(path)->images_verified);
  // Another quick load takes it as it is.
  ASSERT_TRUE(LoadOrBuildIndex(*loader, path, quick, &rebuilt).ok());
  EXPECT_FALSE(rebuilt);
  absl::StatusOr<DataIndex> verified =
      LoadOrBuildIndex(*loader, path, IndexBuildOptions(), &rebuilt);
  ASSERT_TRUE(verified.ok()) << verified.status();
  EXPECT_TRUE(rebuilt);
  ASSERT_EQ(verified->records.size(), 1u);
  EXPECT_EQ(verified->records[0].id, "train-000000");
  ASSERT_EQ(verified->bad.size(), 1u);
  EXPECT_EQ(verified->bad[0].id, "corrupt");
  EXPECT_TRUE(ReadIndex(path)->images_verified);
  ASSERT_TRUE(LoadOrBuildIndex(*loader, path, IndexBuildOptions(), &rebuilt).ok());
  EXPECT_FALSE(rebuilt);
}

// A data set whose index cannot be written (a read-only mount; here a path below a regular
// file, which no one can create) is still opened: the index is built and returned, only not kept.
TEST_F(IndexTest, AnIndexThatCannotBeSavedIsStillUsed) {
  const std::string path = dir_ + "/train.jsonl/train.jsonl.index";
  ASSERT_FALSE(WriteIndex(*BuildIndex(*Make(Options()), IndexBuildOptions()), path).ok());
  ExpectBuiltInFull(path);
  absl::StatusOr<DataIndex> index = LoadOrBuildIndex(*Make(Options()), path, IndexBuildOptions());
  ASSERT_TRUE(index.ok()) << index.status();
  EXPECT_EQ(index->file, "") << "an index that was not saved names a file";
}

// An index that cannot be written at its path (here a path below a regular file; a read-only
// data set in a run) is kept at the fallback path instead: built and written there once, then
// read from there. A fresh index at the path itself still comes first.
TEST_F(IndexTest, AnIndexThatCannotBeWrittenAtItsPathIsKeptAtTheFallback) {
  std::atomic<int> builds{0};
  IndexBuildOptions options;
  options.on_progress = [&](int64_t done, int64_t) {
    if (done == 0) builds.fetch_add(1);
  };
  options.fallback_path = dir_ + "/ckpt/data-index/train.jsonl-0.index";
  const std::string unwritable = dir_ + "/train.jsonl/train.jsonl.index";
  bool rebuilt = false;
  absl::StatusOr<DataIndex> built =
      LoadOrBuildIndex(*Make(Options()), unwritable, options, &rebuilt);
  ASSERT_TRUE(built.ok()) << built.status();
  EXPECT_TRUE(rebuilt);
  EXPECT_EQ(built->file, options.fallback_path);
  EXPECT_EQ(built->records.size(), 40u);
  // Built under the lock beside it, whose directory was new: the run's other processes waited.
  EXPECT_TRUE(fs::exists(dir_ + "/ckpt/data-index/.train.jsonl-0.index.lock"));
  absl::StatusOr<DataIndex> written = ReadIndex(options.fallback_path);
  ASSERT_TRUE(written.ok()) << written.status();
  EXPECT_EQ(written->IdDigest(), built->IdDigest());
  EXPECT_EQ(builds.load(), 1);

  absl::StatusOr<DataIndex> again =
      LoadOrBuildIndex(*Make(Options()), unwritable, options, &rebuilt);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_FALSE(rebuilt);
  EXPECT_EQ(again->file, options.fallback_path);
  EXPECT_EQ(builds.load(), 1) << "the index kept at the fallback was built again";

  // Asked to rebuild: built again, into the fallback.
  IndexBuildOptions rebuild = options;
  rebuild.rebuild = true;
  absl::StatusOr<DataIndex> rebuilt_index =
      LoadOrBuildIndex(*Make(Options()), unwritable, rebuild, &rebuilt);
  ASSERT_TRUE(rebuilt_index.ok()) << rebuilt_index.status();
  EXPECT_TRUE(rebuilt);
  EXPECT_EQ(rebuilt_index->file, options.fallback_path);
  EXPECT_EQ(builds.load(), 2);

  // The generator's index beside the manifest is fresh: it is used, not the fallback.
  const std::string beside = dir_ + "/train.jsonl.index";
  ASSERT_TRUE(fs::exists(beside));
  absl::StatusOr<DataIndex> used = LoadOrBuildIndex(*Make(Options()), beside, options, &rebuilt);
  ASSERT_TRUE(used.ok()) << used.status();
  EXPECT_FALSE(rebuilt);
  EXPECT_EQ(used->file, beside);
  EXPECT_EQ(builds.load(), 2);
}

// Processes that find the index missing at once (a run's coordinator and its workers) do not all
// build it: one holds `.<name>.lock` beside it while it builds, and the others wait for it.
// Here the test holds the lock: a LoadOrBuildIndex under it builds nothing while it waits, and
// reads the index the holder wrote once it lets go.
TEST_F(IndexTest, OneProcessBuildsAMissingIndexWhileTheOthersWaitForIt) {
  const std::string path = dir_ + "/train.jsonl.index";
  const std::string lock_path = dir_ + "/.train.jsonl.index.lock";
  fs::remove(path);  // the generator's
  std::atomic<int> builds{0};
  IndexBuildOptions waiting;
  waiting.on_progress = [&](int64_t done, int64_t) {
    if (done == 0) builds.fetch_add(1);
  };
  std::atomic<bool> cancel{false};
  waiting.cancel = &cancel;
  {
    absl::StatusOr<WaitedFileLock> held =
        WaitedFileLock::Take(lock_path, "holding the lock in a test", absl::Seconds(10));
    ASSERT_TRUE(held.ok()) << held.status();
    ASSERT_TRUE(held->held());
    // Cancelled while it waits (whenever the cancel comes, the lock is held throughout): no build.
    cancel.store(true);
    absl::StatusOr<DataIndex> cancelled = LoadOrBuildIndex(*Make(Options()), path, waiting);
    EXPECT_TRUE(absl::IsCancelled(cancelled.status())) << cancelled.status();
    EXPECT_THAT(std::string(cancelled.status().message()),
                HasSubstr("stopped waiting for another process building the data index " + path));
    cancel.store(false);
    // The holder builds and writes the index while the other waits (or before it looks).
    bool rebuilt = true;
    absl::StatusOr<DataIndex> waited;
    std::thread other(
        [&] { waited = LoadOrBuildIndex(*Make(Options()), path, waiting, &rebuilt); });
    absl::StatusOr<DataIndex> built = BuildIndex(*Make(Options()), IndexBuildOptions());
    ASSERT_TRUE(built.ok()) << built.status();
    const absl::Status written = WriteIndex(*built, path);
    held = absl::CancelledError("released");  // lets go of the lock
    other.join();
    ASSERT_TRUE(written.ok()) << written;
    ASSERT_TRUE(waited.ok()) << waited.status();
    EXPECT_FALSE(rebuilt);
    EXPECT_EQ(waited->records.size(), 40u);
    EXPECT_EQ(waited->IdDigest(), built->IdDigest());
  }
  EXPECT_EQ(builds.load(), 0) << "a process built the index that another was building";
  // Nobody holds the lock: a stale index is rebuilt by whoever finds it so.
  AppendSample("late", "a prompt", "a text");
  bool rebuilt = false;
  absl::StatusOr<DataIndex> fresh = LoadOrBuildIndex(*Make(Options()), path, waiting, &rebuilt);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_TRUE(rebuilt);
  EXPECT_EQ(fresh->records.size(), 41u);
  EXPECT_EQ(builds.load(), 1);
}

// A build cancelled from another thread (a worker or coordinator shutting down) stops.
TEST_F(IndexTest, ACancelledBuildStops) {
  std::atomic<bool> cancel{true};
  IndexBuildOptions options;
  options.cancel = &cancel;
  absl::StatusOr<DataIndex> index = BuildIndex(*Make(Options()), options);
  EXPECT_TRUE(absl::IsCancelled(index.status())) << index.status();
  EXPECT_THAT(std::string(index.status().message()),
              HasSubstr("stopped indexing " + dir_ + "/train.jsonl after 0 of 40 samples"));
}

// So is a read of an existing index (a worker that ends while it opens its data set): cancelled,
// it neither returns the index nor builds another; the index is left as it was.
TEST_F(IndexTest, ACancelledReadOfAnIndexStopsWithoutBuilding) {
  const std::string path = dir_ + "/train.jsonl.index";
  ASSERT_TRUE(LoadOrBuildIndex(*Make(Options()), path, IndexBuildOptions()).ok());
  absl::StatusOr<std::string> before = ReadFileToString(path);
  ASSERT_TRUE(before.ok()) << before.status();
  std::atomic<bool> cancel{true};
  IndexBuildOptions options;
  options.cancel = &cancel;
  int builds = 0;
  options.on_progress = [&](int64_t done, int64_t) { builds += done == 0 ? 1 : 0; };
  bool rebuilt = true;
  absl::StatusOr<DataIndex> index = LoadOrBuildIndex(*Make(Options()), path, options, &rebuilt);
  EXPECT_EQ(index.status().code(), absl::StatusCode::kCancelled) << index.status();
  EXPECT_EQ(index.status().message(), "stopped reading the data index " + path + " at line 1");
  EXPECT_FALSE(rebuilt);
  EXPECT_EQ(builds, 0);
  EXPECT_EQ(*ReadFileToString(path), *before);
  cancel = false;
  index = LoadOrBuildIndex(*Make(Options()), path, options, &rebuilt);
  ASSERT_TRUE(index.ok()) << index.status();
  EXPECT_EQ(index->records.size(), 40u);
  EXPECT_FALSE(rebuilt);
}

// A Hugging Face tokenizer's bos and eos come from the tokenizer_config.json beside it: one
// added, changed or removed makes the index stale.
TEST_F(IndexTest, TheTokenizerConfigBesideTheTokenizerIsPartOfTheIndexSource) {
  const std::string path = dir_ + "/train.jsonl.index";
  bool rebuilt = false;
  ASSERT_TRUE(LoadOrBuildIndex(*Make(Options()), path, IndexBuildOptions(), &rebuilt).ok());
  const std::string config = dir_ + "/tokenizer_config.json";
  ASSERT_TRUE(WriteFileAtomically(config, R"({"eos_token": "</s>"})").ok());
  absl::Status stale = CheckIndexSource(*ReadIndex(path), *CurrentIndexSource(Options()));
  EXPECT_EQ(stale.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(stale.message()),
              HasSubstr("the tokenizer_config.json beside " + dir_ + "/tokenizer.model changed"));
  ASSERT_TRUE(LoadOrBuildIndex(*Make(Options()), path, IndexBuildOptions(), &rebuilt).ok());
  EXPECT_TRUE(rebuilt);
  EXPECT_TRUE(CheckIndexSource(*ReadIndex(path), *CurrentIndexSource(Options())).ok());
  fs::remove(config);
  stale = CheckIndexSource(*ReadIndex(path), *CurrentIndexSource(Options()));
  EXPECT_THAT(std::string(stale.message()), HasSubstr("tokenizer.model is gone"));
}

// An index is of the files as its loader read them: a sample appended to the manifest after the
// loader read it (while a large manifest is parsed, or the build runs) leaves the index built
// from that loader stale, so the next start indexes the new sample instead of taking the index
// for fresh without it.
TEST_F(IndexTest, AManifestEditedAfterItsLoaderReadItLeavesTheIndexStale) {
  std::unique_ptr<DataLoader> loader = Make(Options());
  ASSERT_NE(loader, nullptr);
  AppendSample("late", "what is two plus two?", "four.");
  const std::string path = dir_ + "/train.jsonl.index";
  bool rebuilt = false;
  absl::StatusOr<DataIndex> built = LoadOrBuildIndex(*loader, path, IndexBuildOptions(), &rebuilt);
  ASSERT_TRUE(built.ok()) << built.status();
  EXPECT_EQ(built->records.size(), 40u);  // what the loader read
  const absl::Status stale = CheckIndexSource(*ReadIndex(path), *CurrentIndexSource(Options()));
  EXPECT_EQ(stale.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(stale.message()), HasSubstr("manifest " + dir_ + "/train.jsonl is now"));
  absl::StatusOr<DataIndex> next =
      LoadOrBuildIndex(*Make(Options()), path, IndexBuildOptions(), &rebuilt);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_TRUE(rebuilt);
  ASSERT_EQ(next->records.size(), 41u);
  EXPECT_EQ(next->records.back().id, "late");
}

// A manifest replaced while its loader reads it (between the loader's two stats; here the same
// lines in another order, of the same size): an index built from that loader is never taken for
// fresh, not even once the new file is given the old one's time (`touch -r`, a sync that keeps
// times), which makes the two files' stamps equal. A fanotify permission event holds the loader's
// open of the manifest while the test replaces it, so no timing decides the order.
TEST_F(IndexTest, AManifestReplacedWhileItsLoaderReadItLeavesTheIndexStale) {
  const std::string manifest = dir_ + "/train.jsonl";
  // Read before the mark: from then on, each open waits for the test's answer.
  std::vector<std::string> lines;
  {
    std::ifstream in(manifest);
    for (std::string line; std::getline(in, line);) lines.push_back(line);
  }
  ASSERT_GE(lines.size(), 2u);
  std::swap(lines[0], lines[1]);
  const absl::StatusOr<FileStamp> first = StatFile(manifest);
  ASSERT_TRUE(first.ok()) << first.status();
  const int fan = ::fanotify_init(FAN_CLASS_CONTENT | FAN_CLOEXEC, O_RDONLY);
  if (fan < 0) {
    GTEST_SKIP() << "fanotify_init: " << ::strerror(errno) << " (it needs CAP_SYS_ADMIN)";
  }
  if (::fanotify_mark(fan, FAN_MARK_ADD, FAN_OPEN_PERM, AT_FDCWD, manifest.c_str()) != 0) {
    const int error = errno;
    ::close(fan);
    GTEST_SKIP() << "fanotify_mark FAN_OPEN_PERM: " << ::strerror(error);
  }

  // Answers every open of the marked manifest, replacing it at the first (the loader's).
  std::string replace_error = "the loader did not open the manifest within 60 s";
  std::thread replacer([&] {
    bool replaced = false;
    struct pollfd p = {fan, POLLIN, 0};
    while (!replaced && ::poll(&p, 1, 60000) == 1) {
      alignas(struct fanotify_event_metadata) char buffer[4096];
      ssize_t n = ::read(fan, buffer, sizeof(buffer));
      if (n <= 0) break;
      for (auto* event = reinterpret_cast<struct fanotify_event_metadata*>(buffer);
           FAN_EVENT_OK(event, n); event = FAN_EVENT_NEXT(event, n)) {
        if (!replaced) {
          replaced = true;
          std::ostringstream text;
          for (const std::string& line : lines) text << line << "\n";
          replace_error.clear();
          if (absl::Status s = WriteFileAtomically(manifest, text.str()); !s.ok()) {
            replace_error = s.ToString();
          }
        }
        if (event->fd >= 0) {
          const struct fanotify_response allow = {event->fd, FAN_ALLOW};
          (void)!::write(fan, &allow, sizeof(allow));
          ::close(event->fd);
        }
      }
    }
  });
  std::unique_ptr<DataLoader> loader = Make(Options());
  replacer.join();
  ::close(fan);
  ASSERT_TRUE(replace_error.empty()) << replace_error;
  ASSERT_NE(loader, nullptr);
  // The replacement is given the first file's time; with the same size, it now looks like it.
  const struct timespec times[2] = {{first->mtime_ns / 1000000000, first->mtime_ns % 1000000000},
                                    {first->mtime_ns / 1000000000, first->mtime_ns % 1000000000}};
  ASSERT_EQ(::utimensat(AT_FDCWD, manifest.c_str(), times, 0), 0) << ::strerror(errno);
  ASSERT_EQ(*StatFile(manifest), *first);

  const std::string path = dir_ + "/train.jsonl.index";
  bool rebuilt = false;
  absl::StatusOr<DataIndex> built = LoadOrBuildIndex(*loader, path, IndexBuildOptions(), &rebuilt);
  ASSERT_TRUE(built.ok()) << built.status();
  ASSERT_EQ(built->records.size(), 40u);
  const std::string first_read = built->records[0].id;  // the first line of the file read
  const absl::Status stale = CheckIndexSource(*ReadIndex(path), *CurrentIndexSource(Options()));
  EXPECT_EQ(stale.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(stale.message()), HasSubstr("manifest " + manifest + " is now"));
  absl::StatusOr<DataIndex> next =
      LoadOrBuildIndex(*Make(Options()), path, IndexBuildOptions(), &rebuilt);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_TRUE(rebuilt);
  ASSERT_EQ(next->records.size(), 40u);
  EXPECT_EQ(next->records[1].id, first_read);  // the replacement's order
}

// The id digest is the CRC-32 of the ids in index order, each ended by a newline (zlib.crc32 of
// b"a\nb\n" and b"b\na\n" in Python): the same samples in another order differ.
TEST(IndexIdDigestTest, IsTheCrcOfTheIdsInIndexOrder) {
  DataIndex ab;
  ab.records.resize(2);
  ab.records[0].id = "a";
  ab.records[1].id = "b";
  EXPECT_EQ(ab.IdDigest(), 0x18572a97u);
  std::swap(ab.records[0], ab.records[1]);
  EXPECT_EQ(ab.IdDigest(), 0x21cfd6bau);
}

TEST_F(IndexTest, BadSamplesFailTheBuildOrAreSkippedWithoutShiftingOthers) {
  // Lines 1-3 good, 4 missing image, 5 corrupt manifest line, 6 good, 7 corrupt image.
  std::string png = *ReadFileToString(dir_ + "/images/train/train-000001-0.png");
  png.resize(png.size() / 2);
  ASSERT_TRUE(WriteFileAtomically(dir_ + "/half.png", png).ok());
  std::vector<std::string> lines;
  for (int i = 0; i < 3; ++i)
    lines.push_back(ManifestRecordToJson(MakeSynthSample(3, "train", i, 3).record));
  lines.push_back(ManifestRecordToJson(OneImageSample("missing", "images/none.png")));
  lines.push_back("{\"id\": \"broken\"");
  lines.push_back(ManifestRecordToJson(MakeSynthSample(3, "train", 5, 3).record));
  lines.push_back(ManifestRecordToJson(OneImageSample("corrupt", "half.png")));
  const std::string manifest = WriteManifest("mixed.jsonl", lines);

  // Strict: the manifest line already fails loading.
  EXPECT_FALSE(DataLoader::Create(Options(manifest)).ok());
  // Strict over a manifest without the malformed line: the build lists both bad images.
  std::vector<std::string> no_broken = lines;
  no_broken.erase(no_broken.begin() + 4);
  const std::string manifest2 = WriteManifest("mixed2.jsonl", no_broken);
  absl::StatusOr<DataIndex> strict = BuildIndex(*Make(Options(manifest2)), IndexBuildOptions());
  ASSERT_FALSE(strict.ok());
  EXPECT_EQ(strict.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(strict.status().message()), HasSubstr("2 bad sample(s)"));
  EXPECT_THAT(std::string(strict.status().message()),
              HasSubstr("sample 'missing' (" + manifest2 + ":4): image file not found"));
  EXPECT_THAT(std::string(strict.status().message()),
              HasSubstr("sample 'corrupt' (" + manifest2 + ":6): corrupt PNG"));
  EXPECT_THAT(std::string(strict.status().message()), HasSubstr("data.skip_bad_samples"));

  // Skipping: the three bad ones are recorded with ids, lines and paths; the others keep theirs.
  LoaderOptions skip = Options(manifest);
  skip.skip_bad_samples = true;
  std::unique_ptr<DataLoader> loader = Make(skip);
  ASSERT_NE(loader, nullptr);
  absl::StatusOr<DataIndex> index = BuildIndex(*loader, IndexBuildOptions());
  ASSERT_TRUE(index.ok()) << index.status();
  ASSERT_EQ(index->records.size(), 4u);
  const std::vector<std::string> ids = {"train-000000", "train-000001", "train-000002",
                                        "train-000005"};
  const std::vector<int64_t> line_numbers = {1, 2, 3, 6};
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_EQ(index->records[i].id, ids[i]);
    EXPECT_EQ(index->records[i].line, line_numbers[i]);
    absl::StatusOr<LoadedSample> sample = loader->LoadById(ids[i]);
    ASSERT_TRUE(sample.ok());
    EXPECT_EQ(index->records[i].loss_tokens, sample->tokens.loss_tokens);
  }
  ASSERT_EQ(index->bad.size(), 3u);
  EXPECT_EQ(index->bad[0].id, "missing");
  EXPECT_EQ(index->bad[0].line, 4);
  EXPECT_EQ(index->bad[0].path, dir_ + "/images/none.png");
  EXPECT_EQ(index->bad[0].code, absl::StatusCode::kNotFound);
  EXPECT_EQ(index->bad[1].line, 5);
  EXPECT_THAT(index->bad[1].reason, HasSubstr("not valid JSON"));
  EXPECT_EQ(index->bad[2].id, "corrupt");
  EXPECT_EQ(index->bad[2].path, dir_ + "/half.png");
  EXPECT_EQ(index->bad[2].code, absl::StatusCode::kDataLoss);

  // The skipped samples survive a write and a read.
  ASSERT_TRUE(WriteIndex(*index, dir_ + "/mixed.index").ok());
  absl::StatusOr<DataIndex> read = ReadIndex(dir_ + "/mixed.index");
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_EQ(read->bad.size(), 3u);
  EXPECT_EQ(read->bad[2].ToString(), index->bad[2].ToString());
  EXPECT_EQ(read->bad[2].code, absl::StatusCode::kDataLoss);
  EXPECT_TRUE(read->source.skip_bad_samples);
  // With the files as the build saw them: the missing one missing, the corrupt one its size.
  EXPECT_EQ(read->bad[0].path_stamp, (FileStamp{-1, -1}));
  EXPECT_EQ(read->bad[1].path_stamp, (FileStamp{-2, -2}));  // a manifest line: no file
  EXPECT_EQ(read->bad[2].path_stamp.size, static_cast<int64_t>(png.size()));
  EXPECT_EQ(read->bad[2].path_stamp, index->bad[2].path_stamp);
}

// A sample skipped for its file comes back once the file is repaired or appears: the index that
// skipped it is rebuilt at the next start, where it used to keep skipping it until someone ran
// `hetpar data index --rebuild`.
TEST_F(IndexTest, ASkippedSampleComesBackOnceItsFileIsRepaired) {
  const std::string good_png = *ReadFileToString(dir_ + "/images/train/train-000001-0.png");
  ASSERT_TRUE(
      WriteFileAtomically(dir_ + "/half.png", good_png.substr(0, good_png.size() / 2)).ok());
  const std::string manifest =
      WriteManifest("repair.jsonl", {ManifestRecordToJson(MakeSynthSample(3, "train", 0, 3).record),
                                     ManifestRecordToJson(MakeSynthSample(3, "train", 1, 3).record),
                                     ManifestRecordToJson(OneImageSample("missing", "late.png")),
                                     ManifestRecordToJson(OneImageSample("corrupt", "half.png"))});
  LoaderOptions skip = Options(manifest);
  skip.skip_bad_samples = true;
  const std::string path = dir_ + "/repair.index";
  const auto load = [&](bool* rebuilt) {
    return LoadOrBuildIndex(*Make(skip), path, IndexBuildOptions(), rebuilt);
  };
  const auto ids = [](const DataIndex& index) {
    std::vector<std::string> out;
    for (const IndexRecord& r : index.records) out.push_back(r.id);
    return out;
  };
  bool rebuilt = false;
  absl::StatusOr<DataIndex> first = load(&rebuilt);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_TRUE(rebuilt);
  EXPECT_EQ(first->bad.size(), 2u);
  // Nothing changed: the index is read, not built.
  absl::StatusOr<DataIndex> again = load(&rebuilt);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_FALSE(rebuilt);
  EXPECT_EQ(again->bad.size(), 2u);

  ASSERT_TRUE(WriteFileAtomically(dir_ + "/half.png", good_png).ok());
  absl::StatusOr<DataIndex> repaired = load(&rebuilt);
  ASSERT_TRUE(repaired.ok()) << repaired.status();
  EXPECT_TRUE(rebuilt);
  EXPECT_EQ(ids(*repaired), (std::vector<std::string>{"train-000000", "train-000001", "corrupt"}));
  ASSERT_EQ(repaired->bad.size(), 1u);
  EXPECT_EQ(repaired->bad[0].id, "missing");

  ASSERT_TRUE(WriteFileAtomically(dir_ + "/late.png", good_png).ok());
  absl::StatusOr<DataIndex> complete = load(&rebuilt);
  ASSERT_TRUE(complete.ok()) << complete.status();
  EXPECT_TRUE(rebuilt);
  EXPECT_EQ(ids(*complete),
            (std::vector<std::string>{"train-000000", "train-000001", "missing", "corrupt"}));
  EXPECT_TRUE(complete->bad.empty());
}

// A build that finds the data set unusable (bad samples without data.skip_bad_samples, or no
// usable sample) writes its index all the same: the next LoadOrBuildIndex over unchanged files
// fails the same way from it, without decoding any image again (what a process that waited for
// the build, or a run started again, meets), and one over a repaired file builds anew.
TEST_F(IndexTest, AnUnusableDataSetIsRecordedSoTheNextOpeningFailsWithoutBuilding) {
  const std::string good_png = *ReadFileToString(dir_ + "/images/train/train-000001-0.png");
  ASSERT_TRUE(
      WriteFileAtomically(dir_ + "/half.png", good_png.substr(0, good_png.size() / 2)).ok());
  const std::string strict_manifest =
      WriteManifest("strict.jsonl", {ManifestRecordToJson(MakeSynthSample(3, "train", 0, 3).record),
                                     ManifestRecordToJson(MakeSynthSample(3, "train", 1, 3).record),
                                     ManifestRecordToJson(OneImageSample("corrupt", "half.png"))});
  const std::string only_bad_manifest = WriteManifest(
      "only_bad.jsonl", {ManifestRecordToJson(OneImageSample("corrupt", "half.png"))});
  std::atomic<int> builds{0};
  IndexBuildOptions counted;
  counted.on_progress = [&](int64_t done, int64_t) {
    if (done == 0) builds.fetch_add(1);
  };
  const auto load = [&](const LoaderOptions& o, const std::string& path, bool* rebuilt) {
    return LoadOrBuildIndex(*Make(o), path, counted, rebuilt);
  };

  const std::string strict_path = dir_ + "/strict.index";
  bool rebuilt = false;
  absl::StatusOr<DataIndex> first = load(Options(strict_manifest), strict_path, &rebuilt);
  ASSERT_FALSE(first.ok());
  EXPECT_EQ(first.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(first.status().message()), HasSubstr("1 bad sample(s)"));
  EXPECT_THAT(std::string(first.status().message()),
              HasSubstr("sample 'corrupt' (" + strict_manifest + ":3): corrupt PNG"));
  EXPECT_EQ(builds.load(), 1);
  ASSERT_TRUE(fs::exists(strict_path)) << "the failed build left no record";

  absl::StatusOr<DataIndex> again = load(Options(strict_manifest), strict_path, &rebuilt);
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(again.status().message()),
              HasSubstr("sample 'corrupt' (" + strict_manifest + ":3): corrupt PNG"));
  EXPECT_THAT(std::string(again.status().message()),
              HasSubstr("as the data index " + strict_path + " records them"));
  EXPECT_EQ(builds.load(), 1) << "the unchanged data set was indexed again";

  // The same files under data.skip_bad_samples train without the corrupt sample.
  LoaderOptions skip = Options(strict_manifest);
  skip.skip_bad_samples = true;
  absl::StatusOr<DataIndex> skipping = load(skip, dir_ + "/skip.index", &rebuilt);
  ASSERT_TRUE(skipping.ok()) << skipping.status();
  EXPECT_TRUE(rebuilt);
  EXPECT_EQ(skipping->records.size(), 2u);
  EXPECT_EQ(builds.load(), 2);

  // Skipping every sample leaves none: recorded too.
  LoaderOptions only_bad = Options(only_bad_manifest);
  only_bad.skip_bad_samples = true;
  const std::string only_bad_path = dir_ + "/only_bad.index";
  absl::StatusOr<DataIndex> none = load(only_bad, only_bad_path, &rebuilt);
  ASSERT_FALSE(none.ok());
  EXPECT_THAT(std::string(none.status().message()), HasSubstr("has no usable sample (1 bad)"));
  EXPECT_EQ(builds.load(), 3);
  absl::StatusOr<DataIndex> none_again = load(only_bad, only_bad_path, &rebuilt);
  ASSERT_FALSE(none_again.ok());
  EXPECT_THAT(std::string(none_again.status().message()),
              HasSubstr("has no usable sample (1 bad)"));
  EXPECT_EQ(builds.load(), 3) << "the unchanged data set was indexed again";

  // The image repaired: the strict data set is indexed anew, and whole.
  ASSERT_TRUE(WriteFileAtomically(dir_ + "/half.png", good_png).ok());
  absl::StatusOr<DataIndex> repaired = load(Options(strict_manifest), strict_path, &rebuilt);
  ASSERT_TRUE(repaired.ok()) << repaired.status();
  EXPECT_TRUE(rebuilt);
  EXPECT_EQ(repaired->records.size(), 3u);
  EXPECT_TRUE(repaired->bad.empty());
  EXPECT_EQ(builds.load(), 4);
}

// A read that fails (here EIO: the image is /proc/self/mem, unreadable at offset 0) is not a bad
// sample: under data.skip_bad_samples it would be recorded in the index, and every later run
// that reuses the index would skip the sample, also once the file system answers again. The
// build fails instead, naming the sample and the error.
TEST_F(IndexTest, AReadThatFailsIsNotABadSample) {
  fs::create_symlink("/proc/self/mem", dir_ + "/unreadable.png");
  std::vector<std::string> lines;
  for (int i = 0; i < 2; ++i) {
    lines.push_back(ManifestRecordToJson(MakeSynthSample(3, "train", i, 3).record));
  }
  lines.push_back(ManifestRecordToJson(OneImageSample("failing", "unreadable.png")));
  const std::string manifest = WriteManifest("failing.jsonl", lines);
  LoaderOptions skip = Options(manifest);
  skip.skip_bad_samples = true;
  std::unique_ptr<DataLoader> loader = Make(skip);
  ASSERT_NE(loader, nullptr);
  const absl::StatusOr<DataIndex> index = BuildIndex(*loader, IndexBuildOptions());
  ASSERT_FALSE(index.ok()) << "the failing read was indexed as a bad sample";
  EXPECT_THAT(std::string(index.status().message()),
              HasSubstr("sample 'failing' (" + manifest + ":3)"));
  EXPECT_THAT(std::string(index.status().message()), HasSubstr("Input/output error"));
  EXPECT_THAT(std::string(index.status().message()),
              HasSubstr("a read that failed, not a bad sample"));
}

TEST_F(IndexTest, DamagedIndexFilesAreDataLoss) {
  const std::string path = dir_ + "/train.jsonl.index";
  std::string text = *ReadFileToString(path);
  // Drop the last record: the header's count no longer matches.
  text.resize(text.rfind('\n', text.size() - 2) + 1);
  ASSERT_TRUE(WriteFileAtomically(dir_ + "/short.index", text).ok());
  absl::StatusOr<DataIndex> a = ReadIndex(dir_ + "/short.index");
  EXPECT_EQ(a.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(a.status().message()), HasSubstr("incomplete"));
  ASSERT_TRUE(WriteFileAtomically(dir_ + "/junk.index", "{\"x\": 1}\n").ok());
  EXPECT_EQ(ReadIndex(dir_ + "/junk.index").status().code(), absl::StatusCode::kDataLoss);
  ASSERT_TRUE(WriteFileAtomically(dir_ + "/broken.index", text.substr(0, 40)).ok());
  EXPECT_EQ(ReadIndex(dir_ + "/broken.index").status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(ReadIndex(dir_ + "/none.index").status().code(), absl::StatusCode::kNotFound);
  // A damaged index is rebuilt by LoadOrBuildIndex.
  ASSERT_TRUE(WriteFileAtomically(path, text).ok());
  ExpectBuiltInFull(path);
}

TEST_F(IndexTest, TheChatTemplateIsPartOfTheIndexSource) {
  const std::string path = dir_ + "/train.jsonl.index";
  absl::StatusOr<DataIndex> plain = ReadIndex(path);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(plain->source.chat_template, ChatTemplate::kPlain);
  LoaderOptions vicuna = Options();
  vicuna.chat_template = ChatTemplate::kVicuna;
  absl::Status s = CheckIndexSource(*plain, *CurrentIndexSource(vicuna));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("chat_template is vicuna (index: plain)"));

  // Written and read back.
  DataIndex chatml = *plain;
  chatml.source.chat_template = ChatTemplate::kChatml;
  ASSERT_TRUE(WriteIndex(chatml, dir_ + "/chatml.index").ok());
  const std::string text = *ReadFileToString(dir_ + "/chatml.index");
  EXPECT_THAT(text.substr(0, text.find('\n')), HasSubstr("\"chat_template\":\"chatml\""));
  EXPECT_EQ(ReadIndex(dir_ + "/chatml.index")->source.chat_template, ChatTemplate::kChatml);

  // An index written before chat templates existed (no key) was built with plain.
  std::string old = *ReadFileToString(path);
  const size_t key = old.find("\"chat_template\":\"plain\",");
  ASSERT_NE(key, std::string::npos);
  old.erase(key, std::string("\"chat_template\":\"plain\",").size());
  ASSERT_TRUE(WriteFileAtomically(dir_ + "/old.index", old).ok());
  absl::StatusOr<DataIndex> read_old = ReadIndex(dir_ + "/old.index");
  ASSERT_TRUE(read_old.ok()) << read_old.status();
  EXPECT_EQ(read_old->source.chat_template, ChatTemplate::kPlain);
}

TEST_F(IndexTest, AJsonManifestIndexKeepsOrdinalsAndArrayIndexes) {
  // [0] good, [1] a missing image, [2] good; skipping keeps every sample's ordinal and index.
  const std::string turns =
      R"("conversations": [{"from": "human", "value": "what is two plus three?"}, )"
      R"({"from": "gpt", "value": "five."}]})";
  const std::string text = "[{\"id\": \"a\", " + turns +
                           ",\n {\"id\": \"b\", \"image\": "
                           "\"images/none.png\", \"conversations\": [{\"from\": \"human\", "
                           "\"value\": \"<image>describe the image.\"}, {\"from\": \"gpt\", "
                           "\"value\": \"empty.\"}]},\n {\"id\": 7, " +
                           turns + "]";
  const std::string manifest = dir_ + "/chat.json";
  ASSERT_TRUE(WriteFileAtomically(manifest, text).ok());
  LoaderOptions skip = Options(manifest);
  skip.skip_bad_samples = true;
  skip.chat_template = ChatTemplate::kVicuna;
  std::unique_ptr<DataLoader> loader = Make(skip);
  ASSERT_NE(loader, nullptr);
  absl::StatusOr<DataIndex> index = BuildIndex(*loader, IndexBuildOptions());
  ASSERT_TRUE(index.ok()) << index.status();
  ASSERT_EQ(index->records.size(), 2u);
  EXPECT_EQ(index->records[0].id, "a");
  EXPECT_EQ(index->records[0].ordinal, 0);
  EXPECT_EQ(index->records[0].line, 0);
  EXPECT_EQ(index->records[1].id, "7");
  EXPECT_EQ(index->records[1].ordinal, 2);
  EXPECT_EQ(index->records[1].line, 2);
  ASSERT_EQ(index->bad.size(), 1u);
  EXPECT_EQ(index->bad[0].id, "b");
  EXPECT_EQ(index->bad[0].line, 1);
  EXPECT_EQ(index->bad[0].where, manifest + "[1]");
  EXPECT_EQ(index->source.chat_template, ChatTemplate::kVicuna);
  // The record finds its sample again by ordinal.
  for (const IndexRecord& r : index->records) {
    absl::StatusOr<LoadedSample> sample = loader->Load(r.ordinal);
    ASSERT_TRUE(sample.ok()) << sample.status();
    EXPECT_EQ(sample->id, r.id);
    EXPECT_EQ(sample->tokens.loss_tokens, r.loss_tokens);
  }
  ASSERT_TRUE(WriteIndex(*index, dir_ + "/chat.json.index").ok());
  absl::StatusOr<DataIndex> read = ReadIndex(dir_ + "/chat.json.index");
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->records[1], index->records[1]);
  EXPECT_EQ(read->bad[0].where, manifest + "[1]");
  EXPECT_TRUE(CheckIndexSource(*read, *CurrentIndexSource(skip)).ok());
}

}  // namespace
}  // namespace hetpar::data
