#include "common/data/manifest.h"

#include <stdlib.h>

#include <atomic>
#include <filesystem>
#include <string>

#include "absl/strings/str_cat.h"
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
  std::string Write(const std::string& text, const std::string& name = "m.jsonl") {
    const std::string path = dir_ + "/" + name;
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
      "{\"id\": 17, \"images\": [], \"text\": \"numeric id\"}\n"
      "{\"id\": 18446744073709551615, \"text\": \"past INT64_MAX\"}\n"
      "{\"id\": -5, \"text\": \"negative\"}");
  absl::StatusOr<Manifest> m = ReadManifest(path, false);
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->records.size(), 5u);
  EXPECT_EQ(m->records[3].id, "18446744073709551615");
  EXPECT_EQ(m->records[4].id, "-5");
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

std::vector<ChatTurn> Turns(std::vector<std::pair<ChatRole, std::string>> turns) {
  std::vector<ChatTurn> out;
  for (auto& [role, text] : turns) out.push_back(ChatTurn{role, text});
  return out;
}

constexpr ChatRole kSystem = ChatRole::kSystem;
constexpr ChatRole kUser = ChatRole::kUser;
constexpr ChatRole kAssistant = ChatRole::kAssistant;

TEST_F(ManifestTest, ParsesALlavaJsonArray) {
  const std::string path = Write(R"([
  {"id": "000000033471", "image": "coco/a.png",
   "conversations": [{"from": "human", "value": "<image>\nWhat is this?"},
                     {"from": "gpt", "value": "A red circle."},
                     {"from": "human", "value": "And its size?"},
                     {"from": "gpt", "value": "Small."}]},
  {"id": 17, "images": ["a.png", "/abs/b.png"],
   "conversations": [{"from": "system", "value": "Be brief."},
                     {"from": "user", "value": "<image><image>Compare."},
                     {"from": "assistant", "value": "Same."}]},
  {"conversations": [{"from": "human", "value": "Two plus three?"},
                     {"from": "gpt", "value": "Five."}], "source": "ignored"}
])",
                                 "llava.json");
  EXPECT_EQ(ManifestFormatOf(path), ManifestFormat::kJsonArray);
  absl::StatusOr<Manifest> m = ReadManifest(path, false);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->format, ManifestFormat::kJsonArray);
  ASSERT_EQ(m->records.size(), 3u);
  const ManifestRecord& a = m->records[0];
  EXPECT_EQ(a.id, "000000033471");
  EXPECT_EQ(a.images, (std::vector<std::string>{"coco/a.png"}));
  EXPECT_EQ(a.conversation, Turns({{kUser, "<image>\nWhat is this?"},
                                   {kAssistant, "A red circle."},
                                   {kUser, "And its size?"},
                                   {kAssistant, "Small."}}));
  EXPECT_TRUE(a.prompt.empty());
  EXPECT_TRUE(a.text.empty());
  EXPECT_EQ(a.line, 0);  // the array index
  const ManifestRecord& b = m->records[1];
  EXPECT_EQ(b.id, "17");
  EXPECT_EQ(b.images, (std::vector<std::string>{"a.png", "/abs/b.png"}));
  EXPECT_EQ(
      b.conversation,
      Turns({{kSystem, "Be brief."}, {kUser, "<image><image>Compare."}, {kAssistant, "Same."}}));
  EXPECT_EQ(b.line, 1);
  const ManifestRecord& c = m->records[2];
  EXPECT_EQ(c.id, "llava.json:2");  // no id: file name and array index
  EXPECT_TRUE(c.images.empty());
  EXPECT_EQ(c.conversation, Turns({{kUser, "Two plus three?"}, {kAssistant, "Five."}}));
  EXPECT_EQ(c.line, 2);
  EXPECT_EQ(m->Find("17"), std::optional<int64_t>(1));
  EXPECT_EQ(m->Where(2), path + "[2]");
  EXPECT_EQ(m->ResolveImagePath("coco/a.png"), dir_ + "/coco/a.png");
}

TEST_F(ManifestTest, ConversationsInJsonlAndMixedWithPromptText) {
  const std::string path = Write(
      "{\"id\": \"old\", \"prompt\": \"<image>describe.\", \"images\": [\"a.png\"], \"text\": "
      "\"red.\"}\n"
      "{\"image\": \"b.png\", \"conversations\": [{\"from\": \"human\", \"value\": "
      "\"<image>hi\"}, {\"from\": \"gpt\", \"value\": \"hello.\"}]}\n");
  EXPECT_EQ(ManifestFormatOf(path), ManifestFormat::kJsonLines);
  absl::StatusOr<Manifest> m = ReadManifest(path, false);
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->records.size(), 2u);
  EXPECT_EQ(m->records[0].prompt, "<image>describe.");
  EXPECT_EQ(m->records[0].text, "red.");
  EXPECT_TRUE(m->records[0].conversation.empty());
  EXPECT_EQ(m->records[1].id, "m.jsonl:2");  // no id: file name and line
  EXPECT_EQ(m->records[1].images, (std::vector<std::string>{"b.png"}));
  EXPECT_EQ(m->records[1].conversation, Turns({{kUser, "<image>hi"}, {kAssistant, "hello."}}));
  EXPECT_EQ(m->records[1].line, 2);
  EXPECT_EQ(m->Where(2), path + ":2");
}

// One bad entry per case; each message names the file, the index, the id and the field.
TEST_F(ManifestTest, BadLlavaEntriesNameFileIndexIdAndField) {
  const std::string path = Write(R"([
  {"id": "ok", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
  {"id": "bot", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"},
                                  {"from": "bot", "value": "x"}]},
  {"id": "novalue", "conversations": [{"from": "human"}, {"from": "gpt", "value": "a"}]},
  {"id": "gptfirst", "conversations": [{"from": "gpt", "value": "a"}, {"from": "human", "value": "q"}]},
  {"id": "twohumans", "conversations": [{"from": "human", "value": "q"}, {"from": "user", "value": "q"}]},
  {"id": "endshuman", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"},
                                        {"from": "human", "value": "q2"}]},
  {"id": "latesystem", "conversations": [{"from": "human", "value": "q"}, {"from": "system", "value": "s"},
                                         {"from": "gpt", "value": "a"}]},
  {"id": "onlysystem", "conversations": [{"from": "system", "value": "s"}]},
  {"id": "notarray", "conversations": {"from": "human"}},
  {"id": "turnnotobject", "conversations": ["hi", {"from": "gpt", "value": "a"}]},
  {"id": "both", "image": "a.png", "images": ["b.png"],
   "conversations": [{"from": "human", "value": "<image>q"}, {"from": "gpt", "value": "a"}]},
  {"id": "badimage", "images": ["a.png", 3],
   "conversations": [{"from": "human", "value": "<image>q"}, {"from": "gpt", "value": "a"}]},
  {"id": true, "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
  {"id": "ok", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
  {"id": "mixed", "text": "t", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
  "not an object",
  {"id": 99, "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
])",
                                 "bad.json");
  absl::StatusOr<Manifest> strict = ReadManifest(path, false);
  ASSERT_EQ(strict.status().code(), absl::StatusCode::kInvalidArgument);
  const std::string message(strict.status().message());
  EXPECT_THAT(message, HasSubstr("manifest " + path + " has 15 bad sample(s)"));
  const std::vector<std::string> expected = {
      "sample 'bot' (" + path +
          "[1]): conversations[2].from='bot' is not one of human, user, gpt, assistant, system",
      "sample 'novalue' (" + path + "[2]): conversations[0].value is missing or not a string",
      "sample 'gptfirst' (" + path +
          "[3]): conversations[0].from='gpt': expected human or user (turns alternate human, "
          "gpt, ..., starting with human)",
      "sample 'twohumans' (" + path +
          "[4]): conversations[1].from='user': expected gpt or assistant (turns alternate human, "
          "gpt, ...)",
      "sample 'endshuman' (" + path +
          "[5]): conversations[2].from='human' ends the conversation; expected it to end with a "
          "gpt or assistant turn",
      "sample 'latesystem' (" + path +
          "[6]): conversations[1].from='system': a system turn may only come first",
      "sample 'onlysystem' (" + path + "[7]): \"conversations\" holds no human and gpt turn",
      "sample 'notarray' (" + path + "[8]): \"conversations\" is not an array of turns",
      "sample 'turnnotobject' (" + path +
          "[9]): conversations[0] is not an object with \"from\" and \"value\"",
      "sample 'both' (" + path + "[10]): \"image\" and \"images\" are both given; use one of them",
      "sample 'badimage' (" + path + "[11]): images[1] is not a non-empty path string",
      "sample (" + path + "[12]): \"id\" is not a string or a number",
      "sample 'ok' (" + path + "[13]): duplicate id; first used at index 0",
      "sample 'mixed' (" + path +
          "[14]): \"conversations\" and \"prompt\"/\"text\" are both given; use one form of sample",
      "sample (" + path + "[15]): expected a JSON object",
  };
  for (const std::string& e : expected) EXPECT_THAT(message, HasSubstr(e));

  absl::StatusOr<Manifest> lenient = ReadManifest(path, true);
  ASSERT_TRUE(lenient.ok()) << lenient.status();
  ASSERT_EQ(lenient->records.size(), 2u);
  EXPECT_EQ(lenient->records[0].id, "ok");
  EXPECT_EQ(lenient->records[0].line, 0);
  EXPECT_EQ(lenient->records[1].id, "99");
  EXPECT_EQ(lenient->records[1].line, 16);
  ASSERT_EQ(lenient->bad.size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(lenient->bad[i].ToString(), expected[i]);
    EXPECT_EQ(lenient->bad[i].line, static_cast<int64_t>(i + 1));
    EXPECT_EQ(lenient->bad[i].where, path + "[" + std::to_string(i + 1) + "]");
  }
}

TEST_F(ManifestTest, BadConversationInJsonlNamesTheLine) {
  const std::string path = Write(
      "{\"id\": \"a\", \"text\": \"fine\"}\n"
      "\n"
      "{\"id\": \"b\", \"conversations\": [{\"from\": \"human\", \"value\": \"q\"}, "
      "{\"from\": \"robot\", \"value\": \"a\"}]}\n");
  absl::StatusOr<Manifest> m = ReadManifest(path, false);
  ASSERT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(m.status().message()),
              HasSubstr("manifest " + path + " has 1 bad line(s)"));
  EXPECT_THAT(std::string(m.status().message()),
              HasSubstr("sample 'b' (" + path +
                        ":3): conversations[1].from='robot' is not one of human, user, gpt, "
                        "assistant, system"));
}

TEST_F(ManifestTest, AJsonFileMustHoldOneArray) {
  const std::string object = Write("{\"id\": \"a\", \"text\": \"t\"}\n", "one.json");
  absl::StatusOr<Manifest> m = ReadManifest(object, true);  // not skippable
  ASSERT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(
      std::string(m.status().message()),
      HasSubstr("manifest " + object + " holds a JSON object; expected one JSON array of samples"));
  const std::string lines =
      Write("{\"id\": \"a\", \"text\": \"t\"}\n{\"id\": \"b\", \"text\": \"t\"}\n", "lines.json");
  m = ReadManifest(lines, true);
  ASSERT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(m.status().message()),
              HasSubstr("manifest " + lines + " is not valid JSON"));
  EXPECT_EQ(ReadManifest(dir_ + "/missing.json", false).status().code(),
            absl::StatusCode::kNotFound);
}

// A worker that ends while it opens its data set (WorkerContext's opening, BatchSource::Create)
// cancels the read of a long manifest instead of waiting for its end.
TEST_F(ManifestTest, ACancelledReadStopsWithCancelled) {
  std::string lines;
  std::string array = "[";
  for (int i = 0; i < 5000; ++i) {
    const std::string sample = absl::StrCat("{\"id\": \"s", i, "\", \"text\": \"t\"}");
    absl::StrAppend(&lines, sample, "\n");
    absl::StrAppend(&array, i > 0 ? "," : "", sample);
  }
  array += "]";
  const std::string jsonl = Write(lines, "many.jsonl");
  const std::string json = Write(array, "many.json");
  std::atomic<bool> cancel{false};
  for (const std::string& path : {jsonl, json}) {
    absl::StatusOr<Manifest> m = ReadManifest(path, false, &cancel);
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_EQ(m->records.size(), 5000u);
  }
  cancel = true;
  absl::StatusOr<Manifest> m = ReadManifest(jsonl, false, &cancel);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(m.status().message(), "stopped reading the manifest " + jsonl + " at line 1");
  m = ReadManifest(json, false, &cancel);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(m.status().message(), "stopped reading the manifest " + json + " at index 0");
}

TEST_F(ManifestTest, ConversationRecordJsonRoundTrips) {
  ManifestRecord record;
  record.id = "c-1";
  record.images = {"a.png", "b.png"};
  record.conversation = Turns({{kSystem, "be \"brief\"."},
                               {kUser, "<image>\nwhat?"},
                               {kAssistant, "red."},
                               {kUser, "<image>and this?"},
                               {kAssistant, "blue."}});
  const std::string line = ManifestRecordToJson(record);
  EXPECT_THAT(line, HasSubstr("\"conversations\":[{\"from\":\"system\""));
  EXPECT_THAT(line, HasSubstr("{\"from\":\"human\",\"value\":\"<image>\\nwhat?\"}"));
  EXPECT_THAT(line, HasSubstr("{\"from\":\"gpt\",\"value\":\"red.\"}"));
  for (const std::string& name : {std::string("r.jsonl"), std::string("r.json")}) {
    const std::string path = Write(name == "r.json" ? "[" + line + "]" : line + "\n", name);
    absl::StatusOr<Manifest> m = ReadManifest(path, false);
    ASSERT_TRUE(m.ok()) << m.status();
    ASSERT_EQ(m->records.size(), 1u);
    EXPECT_EQ(m->records[0].id, record.id);
    EXPECT_EQ(m->records[0].images, record.images);
    EXPECT_EQ(m->records[0].conversation, record.conversation);
  }
}

}  // namespace
}  // namespace hetpar::data
