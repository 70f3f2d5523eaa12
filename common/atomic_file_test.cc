// Atomic files: whole or absent, whatever happens to the writer.
#include "common/atomic_file.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hetpar {
namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string Read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::vector<std::string> Entries(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) {
    names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

std::string Pattern(size_t bytes, int seed) {
  std::string s(bytes, '\0');
  for (size_t i = 0; i < bytes; ++i)
    s[i] = static_cast<char>((i * 131 + seed * 7 + i / 977) & 0xff);
  return s;
}

// Whether the writer makes unnamed files in `dir`: the file system has O_TMPFILE, and /proc
// names them once they are whole.
bool HasUnnamedFiles(const std::string& dir) {
  if (::access("/proc/self/fd", X_OK) != 0) return false;
  const int fd = ::open(dir.c_str(), O_TMPFILE | O_WRONLY | O_CLOEXEC, 0600);
  if (fd < 0) return false;
  ::close(fd);
  return true;
}

// Both ways of making the temporary file: unnamed (O_TMPFILE), and named from the start. Asked
// for an unnamed one where the file system cannot make it, the writer falls back to a named one,
// and the cases check that fallback instead.
class AtomicFileTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "atomic_file_test.XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
    options_.unnamed_temporary = GetParam();
    unnamed_ = GetParam() && HasUnnamedFiles(dir_);
    if (GetParam() && !unnamed_) {
      std::cout << "the file system of " << dir_
                << " has no O_TMPFILE (or there is no /proc/self/fd): the writer's fallback, a "
                   "named temporary file, is what these cases check\n";
    }
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string dir_;
  AtomicFileOptions options_;
  bool unnamed_ = false;  // whether the writer's temporary files are unnamed here
};

TEST_P(AtomicFileTest, ACommittedFileIsWhatWasAppendedWithItsSizeAndChecksum) {
  const std::string path = dir_ + "/a/b/shard.bin";  // parents are made
  const std::string data = Pattern(3 * 1024 * 1024 + 17, 1);
  auto file = AtomicFileWriter::Create(path, options_);
  ASSERT_TRUE(file.ok()) << file.status();
  for (size_t at = 0; at < data.size(); at += 1000003) {
    const size_t n = std::min<size_t>(1000003, data.size() - at);
    ASSERT_TRUE((*file)->Append(data.data() + at, n).ok());
  }
  // Nothing under the target's name before the commit.
  EXPECT_FALSE(fs::exists(path));
  ASSERT_TRUE((*file)->Commit().ok());
  EXPECT_EQ(Read(path), data);
  EXPECT_EQ((*file)->written().bytes, data.size());
  EXPECT_EQ((*file)->written().crc32,
            crc32_z(0, reinterpret_cast<const Bytef*>(data.data()), data.size()));
  file->reset();
  EXPECT_THAT(Entries(dir_ + "/a/b"), ElementsAre("shard.bin"));
}

// Sets the process's umask for a scope; the old one comes back however the scope ends.
class ScopedUmask {
 public:
  explicit ScopedUmask(mode_t mask) : old_(::umask(mask)) {}
  ~ScopedUmask() { ::umask(old_); }
  void Set(mode_t mask) { ::umask(mask); }

 private:
  mode_t old_;
};

TEST_P(AtomicFileTest, TheFileHasTheModeAskedLessTheUmask) {
  ScopedUmask umask(022);
  for (const int mode : {0644, 0600}) {
    AtomicFileOptions options = options_;
    options.mode = mode;
    const std::string path = dir_ + "/mode-" + std::to_string(mode);
    ASSERT_TRUE(WriteFileAtomically(path, "secret\n", options).ok());
    struct stat st;
    ASSERT_EQ(::stat(path.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, static_cast<mode_t>(mode & ~022)) << path;
  }
  umask.Set(077);
  ASSERT_TRUE(WriteFileAtomically(dir_ + "/private", "x", options_).ok());
  struct stat st;
  ASSERT_EQ(::stat((dir_ + "/private").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
}

TEST_P(AtomicFileTest, AnAbandonedOrNonDurableWriteLeavesNothingButTheFile) {
  const std::string path = dir_ + "/config.yaml";
  ASSERT_TRUE(WriteFileAtomically(path, "old\n", options_).ok());
  {
    auto file = AtomicFileWriter::Create(path, options_);
    ASSERT_TRUE(file.ok()) << file.status();
    ASSERT_TRUE((*file)->Append("new\n", 4).ok());
  }  // destroyed without a commit
  EXPECT_EQ(Read(path), "old\n");
  EXPECT_THAT(Entries(dir_), ElementsAre("config.yaml"));
  AtomicFileOptions quick = options_;
  quick.durable = false;
  ASSERT_TRUE(WriteFileAtomically(path, "newer\n", quick).ok());
  EXPECT_EQ(Read(path), "newer\n");
  EXPECT_THAT(Entries(dir_), ElementsAre("config.yaml"));
}

TEST_P(AtomicFileTest, WritersOfOnePathAtOnceLeaveOneWholeFile) {
  const std::string path = dir_ + "/manifest.json";
  constexpr size_t kBytes = 256 * 1024;
  std::vector<std::thread> writers;
  std::vector<int> failures(4, 0);
  for (int w = 0; w < 4; ++w) {
    writers.emplace_back([&, w] {
      const std::string data = Pattern(kBytes, w);
      for (int i = 0; i < 10; ++i) failures[w] += !WriteFileAtomically(path, data, options_).ok();
    });
  }
  for (std::thread& t : writers) t.join();
  EXPECT_THAT(failures, ElementsAre(0, 0, 0, 0));
  const std::string got = Read(path);
  bool whole = false;
  for (int w = 0; w < 4; ++w) whole |= got == Pattern(kBytes, w);
  EXPECT_TRUE(whole) << "the file is no one writer's whole file (" << got.size() << " bytes)";
  EXPECT_THAT(Entries(dir_), ElementsAre("manifest.json"));
}

// A writer killed mid-write: with an unnamed temporary file nothing is left; with a named one,
// its temporary file (what a file system without O_TMPFILE gets).
TEST_P(AtomicFileTest, AWriterKilledMidWrite) {
  const std::string path = dir_ + "/llm-pp0-tp0.hpar";
  ASSERT_TRUE(WriteFileAtomically(path, "step 3\n", options_).ok());
  int appended[2];
  ASSERT_EQ(::pipe(appended), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::close(appended[0]);
    auto file = AtomicFileWriter::Create(path, options_);
    if (!file.ok()) std::_Exit(1);
    const std::string data = Pattern(1 << 20, 3);
    if (!(*file)->Append(data.data(), data.size()).ok()) std::_Exit(2);
    const char byte = 1;
    if (::write(appended[1], &byte, 1) != 1) std::_Exit(3);
    for (;;) ::pause();  // killed here, mid-write
  }
  ::close(appended[1]);
  char byte = 0;
  const ssize_t got = ::read(appended[0], &byte, 1);
  ::close(appended[0]);
  ::kill(child, SIGKILL);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_EQ(got, 1) << "the writer did not get to append (exit status " << status << ")";
  EXPECT_EQ(Read(path), "step 3\n");
  const std::vector<std::string> entries = Entries(dir_);
  if (unnamed_) {
    EXPECT_THAT(entries, ElementsAre("llm-pp0-tp0.hpar"));
  } else {
    ASSERT_EQ(entries.size(), 2u);
    EXPECT_EQ(entries[0], "llm-pp0-tp0.hpar");
    EXPECT_THAT(entries[1], HasSubstr("llm-pp0-tp0.hpar.tmp-"));
    EXPECT_EQ(entries[1].size(), std::string("llm-pp0-tp0.hpar.tmp-").size() + 6);
  }
}

INSTANTIATE_TEST_SUITE_P(Temporaries, AtomicFileTest, ::testing::Values(true, false),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? std::string("Unnamed") : std::string("Named");
                         });

}  // namespace
}  // namespace hetpar
