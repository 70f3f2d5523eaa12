#include "common/data/manifest.h"

#include <stdlib.h>

#include <filesystem>

#include "common/data/file_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hetpar::data {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

class ManifestTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (fs::temp_directory_path() / "hetpar_manifest_XXXXXX").string();
    ASSERT_NE(::mkdtemp(dir_.data()), nullptr);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string Write(const std::string& text) {
    const std::string path = dir_ + "/m.jsonl";
    EXPECT_TRUE(WriteFileAtomically(path, text).ok());
    return path;
  }
  std::string dir_;
};

TEST_F(ManifestTest, ParsesRecordsInOrder) {
  const std::string path = Write(
      "{\"id\": \"a\", \"images\": [\"img/a.png\", \"/abs/b.jpg\"], \"prompt\": "
      "\"<image><image>x\", "
      "\"text\": \"cap a\", \"extra\": 1}\n"
      "\n"
      "{\"id\": \"b\", \"text\": \"only text\"}\r\n"
      "{\"id\": 17, \"images\": [], \"text\": \"numeric id\"}");
  absl::StatusOr<Manifest> m = ReadManifest(path, false);
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->records.size(), 3u);
  EXPECT_EQ(m->records[0].id, "a");
  EXPECT_EQ(m->records[0].images, (std::vector<std::string>{"img/a.png", "/abs/b.jpg"}));
  EXPECT_EQ(m->records[0].prompt, "<image><image>x");
  EXPECT_EQ(m->records[0].text, "cap a");
  EXPECT_EQ(m->records[0].line, 1);
  EXPECT_EQ(m->records[1].id, "b");
  EXPECT_TRUE(m->records[1].images.empty());
  EXPECT_EQ(m->records[1].text, "only text");
  EXPECT_EQ(m->records[1].line, 3);
  EXPECT_EQ(m->records[2].id, "17");
  EXPECT_EQ(m->records[2].line, 4);
  EXPECT_EQ(m->Find("b"), std::optional<int64_t>(1));
  EXPECT_EQ(m->Find("zzz"), std::nullopt);
  EXPECT_EQ(m->ResolveImagePath("img/a.png"), dir_ + "/img/a.png");
  EXPECT_EQ(m->ResolveImagePath("/abs/b.jpg"), "/abs/b.jpg");
  EXPECT_TRUE(m->bad.empty());
}

TEST_F(ManifestTest, BadLinesAreListedWithTheirLineNumbers) {
  const std::string path = Write(
      "{\"id\": \"ok\", \"text\": \"fine\"}\n"
      "{\"id\": \"broken\", \"text\": \n"
      "{\"id\": \"notext\"}\n"
      "{\"id\": \"ok\", \"text\": \"again\"}\n"
      "{\"id\": \"imgs\", \"images\": \"a.png\", \"text\": \"t\"}\n"
      "[1, 2]\n"
      "{\"id\": \"last\", \"text\": \"good\"}\n");
  absl::StatusOr<Manifest> strict = ReadManifest(path, false);
  ASSERT_EQ(strict.status().code(), absl::StatusCode::kInvalidArgument);
  const std::string message(strict.status().message());
  EXPECT_THAT(message, HasSubstr("5 bad line(s)"));
  EXPECT_THAT(message, HasSubstr(path + ":2): not valid JSON"));
  EXPECT_THAT(message, HasSubstr("sample 'notext' (" + path + ":3): \"text\" is missing"));
  EXPECT_THAT(message,
              HasSubstr("sample 'ok' (" + path + ":4): duplicate id; first used on line 1"));
  EXPECT_THAT(message, HasSubstr("sample 'imgs' (" + path + ":5): \"images\" is not an array"));
  EXPECT_THAT(message, HasSubstr(path + ":6): expected a JSON object"));

  absl::StatusOr<Manifest> lenient = ReadManifest(path, true);
  ASSERT_TRUE(lenient.ok()) << lenient.status();
  ASSERT_EQ(lenient->records.size(), 2u);
  EXPECT_EQ(lenient->records[0].id, "ok");
  EXPECT_EQ(lenient->records[1].id, "last");
  EXPECT_EQ(lenient->records[1].line, 7);
  ASSERT_EQ(lenient->bad.size(), 5u);
  EXPECT_EQ(lenient->bad[0].line, 2);
  EXPECT_EQ(lenient->bad[1].id, "notext");
  EXPECT_EQ(lenient->bad[2].line, 4);
}

TEST_F(ManifestTest, MissingManifestIsNotFound) {
  absl::StatusOr<Manifest> m = ReadManifest(dir_ + "/nope.jsonl", false);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("nope.jsonl"));
}

TEST_F(ManifestTest, RecordJsonRoundTrips) {
  ManifestRecord record;
  record.id = "x-1";
  record.images = {"images/a.png"};
  record.prompt = "<image>describe \"it\".";
  record.text = "a red circle.\nnext line";
  const std::string path = Write(ManifestRecordToJson(record) + "\n");
  absl::StatusOr<Manifest> m = ReadManifest(path, false);
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->records.size(), 1u);
  EXPECT_EQ(m->records[0].id, record.id);
  EXPECT_EQ(m->records[0].images, record.images);
  EXPECT_EQ(m->records[0].prompt, record.prompt);
  EXPECT_EQ(m->records[0].text, record.text);
}

}  // namespace
}  // namespace hetpar::data
