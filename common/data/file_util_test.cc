#include "common/data/file_util.h"

#include <stdlib.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "common/atomic_file.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hetpar::data {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

std::string MakeTempDir() {
  std::string pattern = (fs::temp_directory_path() / "hetpar_file_util_XXXXXX").string();
  char* dir = ::mkdtemp(pattern.data());
  EXPECT_NE(dir, nullptr);
  return pattern;
}

TEST(FileUtilTest, AtomicWriteThenReadGivesEveryByte) {
  const std::string dir = MakeTempDir();
  const std::string path = dir + "/a/b/file.bin";  // parents are created
  std::string contents;
  for (int i = 0; i < 200000; ++i) contents.push_back(static_cast<char>((i * 7919) & 0xff));
  ASSERT_TRUE(WriteFileAtomically(path, contents).ok());
  absl::StatusOr<std::string> read = ReadFileToString(path);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_EQ(read->size(), contents.size());
  for (size_t i = 0; i < contents.size(); ++i) {
    ASSERT_EQ((*read)[i], contents[i]) << "mismatch at byte " << i;
  }
  // No temporary file is left behind.
  int files = 0;
  for (const auto& entry : fs::directory_iterator(dir + "/a/b")) {
    (void)entry;
    ++files;
  }
  EXPECT_EQ(files, 1);
  fs::remove_all(dir);
}

TEST(FileUtilTest, AFileLongerThanAllowedIsRefusedNamingItsPath) {
  const std::string dir = MakeTempDir();
  ASSERT_TRUE(WriteFileAtomically(dir + "/ten", "0123456789").ok());
  absl::StatusOr<std::string> exact = ReadFileToString(dir + "/ten", 10);
  ASSERT_TRUE(exact.ok()) << exact.status();
  EXPECT_EQ(*exact, "0123456789");
  absl::StatusOr<std::string> over = ReadFileToString(dir + "/ten", 9);
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(over.status().message(), dir + "/ten is longer than 9 bytes, the most it may be");
  // A file without an end.
  EXPECT_EQ(ReadFileToString("/dev/zero", 1 << 20).status().code(),
            absl::StatusCode::kResourceExhausted);
  fs::remove_all(dir);
}

TEST(FileUtilTest, NonDurableWriteAndSync) {
  const std::string dir = MakeTempDir();
  ASSERT_TRUE(
      WriteFileAtomically(dir + "/x", "hello", AtomicFileOptions{0644, /*durable=*/false}).ok());
  EXPECT_TRUE(SyncFileSystem(dir).ok());
  EXPECT_EQ(*ReadFileToString(dir + "/x"), "hello");
  fs::remove_all(dir);
}

TEST(FileUtilTest, StatSeesSizeAndModification) {
  const std::string dir = MakeTempDir();
  const std::string path = dir + "/f";
  ASSERT_TRUE(WriteFileAtomically(path, "12345").ok());
  absl::StatusOr<FileStamp> first = StatFile(path);
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(first->size, 5);
  EXPECT_GT(first->mtime_ns, 0);
  ::usleep(20000);
  {
    std::ofstream out(path, std::ios::app);
    out << "6";
  }
  absl::StatusOr<FileStamp> second = StatFile(path);
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(second->size, 6);
  EXPECT_NE(*first, *second);
  fs::remove_all(dir);
}

TEST(FileUtilTest, MissingFilesAreNotFoundNamingThePath) {
  absl::StatusOr<std::string> read = ReadFileToString("/nonexistent/hetpar/file");
  EXPECT_EQ(read.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(read.status().message()), HasSubstr("/nonexistent/hetpar/file"));
  absl::StatusOr<FileStamp> stat = StatFile("/nonexistent/hetpar/file");
  EXPECT_EQ(stat.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(StatFile("/tmp").status().code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace hetpar::data
