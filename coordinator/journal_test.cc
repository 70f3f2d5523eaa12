// The coordinator's journal: written and read back field by field, the file on disk checked
// against the documented format, every kind of damage refused with a message naming the file and
// the field, and the newest complete checkpoint found among complete, incomplete and unrelated
// entries of checkpoint.dir.
#include "coordinator/journal.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace hetpar::coordinator {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

class JournalTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "journal_test.XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override {
    std::error_code ec;
    if (!dir_.empty()) fs::remove_all(dir_, ec);
  }

  void WriteText(const std::string& path, const std::string& text) {
    std::ofstream out(path);
    out << text;
    ASSERT_TRUE(out.good()) << path;
  }

  // A journal with every field set to a value other than its default.
  static Journal FullJournal() {
    Journal journal;
    journal.run = "tiny";
    journal.state = v1::RUN_STATE_RUNNING;
    journal.generation = 3;
    journal.committed_steps = 7;
    journal.total_steps = 10;
    journal.checkpoint_dir = "/shared/ckpt";
    journal.last_checkpoint = "/shared/ckpt/step-000006";
    journal.last_checkpoint_step = 6;
    journal.restarts = 2;
    return journal;
  }

  // The documented journal.json of FullJournal(), as a test would write it by hand.
  static nlohmann::json FullJournalJson() {
    return {{"format", 1},
            {"run", "tiny"},
            {"state", "running"},
            {"generation", 3},
            {"committed_steps", 7},
            {"total_steps", 10},
            {"checkpoint_dir", "/shared/ckpt"},
            {"last_checkpoint", "/shared/ckpt/step-000006"},
            {"last_checkpoint_step", 6},
            {"restarts", 2}};
  }

  // Reads FullJournalJson() changed by `edit` and returns the (expected) error.
  absl::Status ReadEdited(const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json j = FullJournalJson();
    edit(j);
    WriteText(dir_ + "/journal.json", j.dump());
    absl::StatusOr<std::optional<Journal>> read = ReadJournal(dir_);
    return read.status();
  }

  // A complete checkpoint of `step` at <dir_>/<name>, with a manifest as CompleteIfAllWritten
  // (common/train/checkpoint.cc) writes it.
  std::string MakeCheckpoint(const std::string& name, int64_t step, const std::string& run = "",
                             uint64_t write_id = 0) {
    const std::string path = dir_ + "/" + name;
    fs::create_directories(path);
    const nlohmann::json manifest = {
        {"format", 1},
        {"step", step},
        {"write_id", write_id},
        {"shards", nlohmann::json::array({{{"name", "encoder.tp0of1.pp0of1"},
                                           {"file", "encoder.tp0of1.pp0of1.bin"},
                                           {"bytes", 16},
                                           {"crc32", 1234}}})},
        {"extra", {{"samples_trained", step * 8}}}};
    nlohmann::json written = manifest;
    if (!run.empty()) written["extra"]["run"] = run;
    WriteText(path + "/manifest.json", written.dump(2) + "\n");
    return path;
  }

  std::string dir_;
};

TEST_F(JournalTest, JournalPathIsJournalJsonInTheRunDirectory) {
  EXPECT_EQ(JournalPath("/runs/tiny"), "/runs/tiny/journal.json");
}

TEST_F(JournalTest, RoundTripKeepsEveryField) {
  const Journal written = FullJournal();
  ASSERT_TRUE(WriteJournal(dir_, written).ok());
  absl::StatusOr<std::optional<Journal>> read = ReadJournal(dir_);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_TRUE(read->has_value());
  const Journal& got = **read;
  EXPECT_EQ(got.run, "tiny");
  EXPECT_EQ(got.state, v1::RUN_STATE_RUNNING);
  EXPECT_EQ(got.generation, 3);
  EXPECT_EQ(got.committed_steps, 7);
  EXPECT_EQ(got.total_steps, 10);
  EXPECT_EQ(got.checkpoint_dir, "/shared/ckpt");
  EXPECT_EQ(got.last_checkpoint, "/shared/ckpt/step-000006");
  EXPECT_EQ(got.last_checkpoint_step, 6);
  EXPECT_EQ(got.restarts, 2);
  EXPECT_TRUE(got == written);
}

TEST_F(JournalTest, RoundTripOfEveryState) {
  for (v1::RunState state : {v1::RUN_STATE_WAITING, v1::RUN_STATE_RUNNING, v1::RUN_STATE_STOPPING,
                             v1::RUN_STATE_DONE, v1::RUN_STATE_FAILED}) {
    Journal written = FullJournal();
    written.state = state;
    ASSERT_TRUE(WriteJournal(dir_, written).ok());
    absl::StatusOr<std::optional<Journal>> read = ReadJournal(dir_);
    ASSERT_TRUE(read.ok()) << read.status();
    ASSERT_TRUE(read->has_value());
    EXPECT_EQ((*read)->state, state) << v1::RunState_Name(state);
    EXPECT_TRUE(**read == written) << v1::RunState_Name(state);
  }
}

TEST_F(JournalTest, RoundTripOfDefaultsAndEmptyStrings) {
  const Journal written;  // no checkpoints: empty strings, last_checkpoint_step -1
  ASSERT_TRUE(WriteJournal(dir_, written).ok());
  absl::StatusOr<std::optional<Journal>> read = ReadJournal(dir_);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_TRUE(read->has_value());
  EXPECT_EQ((*read)->run, "");
  EXPECT_EQ((*read)->state, v1::RUN_STATE_WAITING);
  EXPECT_EQ((*read)->generation, 1);
  EXPECT_EQ((*read)->checkpoint_dir, "");
  EXPECT_EQ((*read)->last_checkpoint, "");
  EXPECT_EQ((*read)->last_checkpoint_step, -1);
  EXPECT_TRUE(**read == written);
}

TEST_F(JournalTest, FileOnDiskHasTheDocumentedKeysAndValues) {
  ASSERT_TRUE(WriteJournal(dir_, FullJournal()).ok());
  std::ifstream in(dir_ + "/journal.json");
  ASSERT_TRUE(in.good());
  const nlohmann::json on_disk = nlohmann::json::parse(in, nullptr, false);
  ASSERT_FALSE(on_disk.is_discarded());
  ASSERT_TRUE(on_disk.is_object());
  EXPECT_EQ(on_disk, FullJournalJson()) << on_disk.dump(2);
  // Spelled out, so that a mismatch names the key.
  EXPECT_EQ(on_disk.at("format"), 1);
  EXPECT_EQ(on_disk.at("state"), "running");
  EXPECT_EQ(on_disk.at("run"), "tiny");
  EXPECT_EQ(on_disk.at("committed_steps"), 7);
  EXPECT_EQ(on_disk.at("last_checkpoint_step"), 6);
  EXPECT_EQ(on_disk.size(), 10u);
}

TEST_F(JournalTest, StateNamesOnDisk) {
  const std::vector<std::pair<v1::RunState, std::string>> names = {
      {v1::RUN_STATE_WAITING, "waiting"},
      {v1::RUN_STATE_RUNNING, "running"},
      {v1::RUN_STATE_STOPPING, "stopping"},
      {v1::RUN_STATE_DONE, "done"},
      {v1::RUN_STATE_FAILED, "failed"}};
  for (const auto& [state, name] : names) {
    Journal journal = FullJournal();
    journal.state = state;
    ASSERT_TRUE(WriteJournal(dir_, journal).ok());
    std::ifstream in(dir_ + "/journal.json");
    const nlohmann::json on_disk = nlohmann::json::parse(in, nullptr, false);
    ASSERT_TRUE(on_disk.is_object());
    EXPECT_EQ(on_disk.at("state"), name);
  }
}

TEST_F(JournalTest, HandWrittenJournalIsRead) {
  WriteText(dir_ + "/journal.json", FullJournalJson().dump());
  absl::StatusOr<std::optional<Journal>> read = ReadJournal(dir_);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_TRUE(read->has_value());
  EXPECT_TRUE(**read == FullJournal());
}

TEST_F(JournalTest, NoJournalIsNulloptNotAnError) {
  absl::StatusOr<std::optional<Journal>> read = ReadJournal(dir_);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_FALSE(read->has_value());
}

TEST_F(JournalTest, NoRunDirectoryIsNulloptNotAnError) {
  absl::StatusOr<std::optional<Journal>> read = ReadJournal(dir_ + "/absent");
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_FALSE(read->has_value());
}

TEST_F(JournalTest, MalformedJsonIsDataLossNamingThePath) {
  WriteText(dir_ + "/journal.json", "{\"format\": 1, \"run\": ");
  absl::StatusOr<std::optional<Journal>> read = ReadJournal(dir_);
  EXPECT_EQ(read.status().code(), absl::StatusCode::kDataLoss) << read.status();
  EXPECT_THAT(std::string(read.status().message()), HasSubstr(dir_ + "/journal.json"));
}

TEST_F(JournalTest, EmptyFileIsDataLossNamingThePath) {
  WriteText(dir_ + "/journal.json", "");
  absl::StatusOr<std::optional<Journal>> read = ReadJournal(dir_);
  EXPECT_EQ(read.status().code(), absl::StatusCode::kDataLoss) << read.status();
  EXPECT_THAT(std::string(read.status().message()), HasSubstr(dir_ + "/journal.json"));
}

TEST_F(JournalTest, JsonThatIsNotAnObjectIsDataLoss) {
  WriteText(dir_ + "/journal.json", "[1, 2, 3]\n");
  absl::StatusOr<std::optional<Journal>> read = ReadJournal(dir_);
  EXPECT_EQ(read.status().code(), absl::StatusCode::kDataLoss) << read.status();
  EXPECT_THAT(std::string(read.status().message()), HasSubstr(dir_ + "/journal.json"));
}

TEST_F(JournalTest, WronglyTypedFieldIsDataLossNamingTheField) {
  const absl::Status status = ReadEdited([](nlohmann::json& j) { j["committed_steps"] = "x"; });
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("\"committed_steps\""));
  EXPECT_THAT(std::string(status.message()), HasSubstr(dir_ + "/journal.json"));
  EXPECT_THAT(std::string(status.message()), HasSubstr("\"x\""));  // the value found
}

TEST_F(JournalTest, EveryMissingFieldIsDataLossNamingTheField) {
  for (const std::string field :
       {"format", "run", "state", "generation", "committed_steps", "total_steps", "checkpoint_dir",
        "last_checkpoint", "last_checkpoint_step", "restarts"}) {
    const absl::Status status = ReadEdited([&](nlohmann::json& j) { j.erase(field); });
    EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << field << ": " << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr("\"" + field + "\"")) << field;
    EXPECT_THAT(std::string(status.message()), HasSubstr(dir_ + "/journal.json")) << field;
  }
}

TEST_F(JournalTest, EveryWronglyTypedFieldIsDataLossNamingTheField) {
  // Strings where numbers belong and numbers where strings belong.
  const std::vector<std::pair<std::string, nlohmann::json>> wrong = {
      {"format", "one"},
      {"run", 5},
      {"state", 2},
      {"generation", "3"},
      {"committed_steps", nlohmann::json::array()},
      {"total_steps", nullptr},
      {"checkpoint_dir", false},
      {"last_checkpoint", nlohmann::json::object()},
      {"last_checkpoint_step", "6"},
      {"restarts", "0"}};
  for (const auto& [field, value] : wrong) {
    const absl::Status status = ReadEdited([&](nlohmann::json& j) { j[field] = value; });
    EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << field << ": " << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr("\"" + field + "\"")) << field;
  }
}

TEST_F(JournalTest, FractionalHugeOrNegativeNumbersAreDataLossNamingTheField) {
  const std::vector<std::pair<std::string, nlohmann::json>> wrong = {
      {"committed_steps", 7.9},
      {"total_steps", 1e30},
      {"restarts", nlohmann::json(uint64_t{18446744073709551615u})},
      {"generation", -2},
      {"committed_steps", -1},
      {"format", 1.5},
      {"format", true}};
  for (const auto& [field, value] : wrong) {
    const absl::Status status = ReadEdited([&](nlohmann::json& j) { j[field] = value; });
    EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss)
        << field << "=" << value << ": " << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr("\"" + field + "\"")) << field;
  }
}

TEST_F(JournalTest, UnknownStateIsDataLossNamingState) {
  const absl::Status status = ReadEdited([](nlohmann::json& j) { j["state"] = "paused"; });
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("\"state\""));
  EXPECT_THAT(std::string(status.message()), HasSubstr("paused"));
}

TEST_F(JournalTest, OtherFormatIsDataLossMentioningTheFormat) {
  const absl::Status status = ReadEdited([](nlohmann::json& j) { j["format"] = 2; });
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("format 2"));
  EXPECT_THAT(std::string(status.message()), HasSubstr("reads 1"));
  EXPECT_THAT(std::string(status.message()), HasSubstr(dir_ + "/journal.json"));
}

TEST(JournalUnfinishedTest, EveryStateButDoneIsUnfinished) {
  for (v1::RunState state : {v1::RUN_STATE_WAITING, v1::RUN_STATE_RUNNING, v1::RUN_STATE_STOPPING,
                             v1::RUN_STATE_FAILED}) {
    Journal journal;
    journal.state = state;
    journal.committed_steps = 10;
    journal.total_steps = 10;  // every step committed, yet the run directory is not complete
    EXPECT_TRUE(journal.Unfinished()) << v1::RunState_Name(state);
  }
}

TEST(JournalUnfinishedTest, DoneWithEveryStepIsFinished) {
  Journal journal;
  journal.state = v1::RUN_STATE_DONE;
  journal.committed_steps = 10;
  journal.total_steps = 10;
  EXPECT_FALSE(journal.Unfinished());
}

TEST(JournalUnfinishedTest, DoneAfterAnEarlyStopIsUnfinished) {
  Journal journal;
  journal.state = v1::RUN_STATE_DONE;
  journal.committed_steps = 4;
  journal.total_steps = 10;
  EXPECT_TRUE(journal.Unfinished());
}

TEST_F(JournalTest, NewestCheckpointOfEmptyDirStringIsNullopt) {
  EXPECT_FALSE(NewestCompleteCheckpoint("").has_value());
}

TEST_F(JournalTest, NewestCheckpointOfMissingDirIsNullopt) {
  EXPECT_FALSE(NewestCompleteCheckpoint(dir_ + "/absent").has_value());
}

TEST_F(JournalTest, NewestCheckpointOfEmptyDirIsNullopt) {
  EXPECT_FALSE(NewestCompleteCheckpoint(dir_).has_value());
}

TEST_F(JournalTest, NewestCheckpointPassesOverIncompleteAndUnrelatedEntries) {
  MakeCheckpoint("step-000002", 2);
  const std::string step4 = MakeCheckpoint("step-000004", 4);
  fs::create_directories(dir_ + "/step-000006");  // being written: shards, no manifest yet
  WriteText(dir_ + "/step-000006/encoder.tp0of1.pp0of1.bin", "0123456789abcdef");
  // Unrelated entries, one of them with a manifest of a newer step.
  fs::create_directories(dir_ + "/notes");
  WriteText(dir_ + "/README", "not a checkpoint\n");
  const std::string other = MakeCheckpoint("export-000009", 9);
  ASSERT_TRUE(fs::exists(other + "/manifest.json"));

  std::optional<FoundCheckpoint> found = NewestCompleteCheckpoint(dir_);
  ASSERT_TRUE(found.has_value());
  EXPECT_EQ(found->step, 4);
  EXPECT_EQ(fs::path(found->path).lexically_normal(), fs::path(step4).lexically_normal());
}

TEST_F(JournalTest, NewestCheckpointPassesOverMalformedManifests) {
  MakeCheckpoint("step-000002", 2);
  fs::create_directories(dir_ + "/step-000008");
  WriteText(dir_ + "/step-000008/manifest.json", R"({"format": 1, "shards": []})");  // no step
  fs::create_directories(dir_ + "/step-000010");
  WriteText(dir_ + "/step-000010/manifest.json", "{\"format\": 1, \"st");  // cut short
  fs::create_directories(dir_ + "/step-000012");
  WriteText(dir_ + "/step-000012/manifest.json", R"({"format": 1, "step": "12"})");
  fs::create_directories(dir_ + "/step-000014");
  WriteText(dir_ + "/step-000014/manifest.json", R"({"format": 1, "step": -14})");

  std::optional<FoundCheckpoint> found = NewestCompleteCheckpoint(dir_);
  ASSERT_TRUE(found.has_value());
  EXPECT_EQ(found->step, 2);
  EXPECT_EQ(fs::path(found->path).lexically_normal(),
            fs::path(dir_ + "/step-000002").lexically_normal());
}

TEST_F(JournalTest, NewestCheckpointAtMostAStepPassesOverNewerOnes) {
  for (int step : {2, 4, 6}) MakeCheckpoint(absl::StrFormat("step-%06d", step), step);
  EXPECT_EQ(NewestCompleteCheckpoint(dir_, 5)->step, 4);
  EXPECT_EQ(NewestCompleteCheckpoint(dir_, 4)->step, 4);  // at most: the bound itself counts
  EXPECT_EQ(fs::path(NewestCompleteCheckpoint(dir_, 3)->path).filename(), "step-000002");
  EXPECT_FALSE(NewestCompleteCheckpoint(dir_, 1).has_value());
  EXPECT_EQ(NewestCompleteCheckpoint(dir_, 100)->step, 6);
}

TEST_F(JournalTest, NewestCheckpointIsTheHighestStep) {
  // The newest wins whatever order the directory lists them in.
  for (int step : {10, 3, 12, 7}) {
    char name[32];
    std::snprintf(name, sizeof(name), "step-%06d", step);
    MakeCheckpoint(name, step);
  }
  std::optional<FoundCheckpoint> found = NewestCompleteCheckpoint(dir_);
  ASSERT_TRUE(found.has_value());
  EXPECT_EQ(found->step, 12);
  EXPECT_EQ(fs::path(found->path).filename(), "step-000012");
}

TEST_F(JournalTest, NewestCheckpointOfARunPassesOverAnotherRunsNewerOnes) {
  // Run b resumed from run a's step 2 in the same directory; a also wrote step 6.
  MakeCheckpoint("step-000002", 2, "a");
  MakeCheckpoint("step-000004", 4, "b");
  MakeCheckpoint("step-000006", 6, "a");
  MakeCheckpoint("step-000008", 8);  // names no run: anyone's
  EXPECT_EQ(NewestCompleteCheckpoint(dir_, 7, "b")->step, 4);
  EXPECT_EQ(NewestCompleteCheckpoint(dir_, 7, "a")->step, 6);
  EXPECT_EQ(NewestCompleteCheckpoint(dir_, 7)->step, 6);
  EXPECT_EQ(NewestCompleteCheckpoint(dir_, 100, "b")->step, 8);
  EXPECT_FALSE(NewestCompleteCheckpoint(dir_, 3, "b").has_value());
}

// Run "tiny" resumed from its own step 4 in a directory where the same-named run it resumed
// from went on to steps 6 and 8: those are foreign to the resumed run, which then writes its
// own step 8 (another write id) and step 10.
TEST_F(JournalTest, ForeignCheckpointsAreThoseAfterTheStartAndNeverCount) {
  MakeCheckpoint("step-000004", 4, "tiny", 41);
  MakeCheckpoint("step-000006", 6, "tiny", 61);
  MakeCheckpoint("step-000008", 8, "tiny", 81);
  const std::vector<CheckpointWrite> foreign = CompleteCheckpointsAfter(dir_, 4);
  EXPECT_EQ(foreign, (std::vector<CheckpointWrite>{{6, 61}, {8, 81}}));
  EXPECT_EQ(NewestCompleteCheckpoint(dir_, 100, "tiny", foreign)->step, 4);
  // Without them, the newest is the other run's.
  EXPECT_EQ(NewestCompleteCheckpoint(dir_, 100, "tiny")->step, 8);
  // The resumed run's own write of step 8 replaces the other's: it counts.
  MakeCheckpoint("step-000008", 8, "tiny", 82);
  EXPECT_EQ(NewestCompleteCheckpoint(dir_, 100, "tiny", foreign)->step, 8);
  EXPECT_EQ(NewestCompleteCheckpoint(dir_, 100, "tiny", foreign)->write_id, 82u);
  MakeCheckpoint("step-000010", 10, "tiny", 101);
  EXPECT_EQ(NewestCompleteCheckpoint(dir_, 100, "tiny", foreign)->step, 10);
}

TEST_F(JournalTest, ForeignCheckpointsAndFirstStepRoundTripAndAreOptional) {
  Journal written = FullJournal();
  written.foreign_checkpoints = {{6, 61}, {8, 18446744073709551615u}};
  written.first_step = 4;
  ASSERT_TRUE(WriteJournal(dir_, written).ok());
  absl::StatusOr<std::optional<Journal>> read = ReadJournal(dir_);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ((*read)->foreign_checkpoints, written.foreign_checkpoints);
  EXPECT_EQ((*read)->first_step, 4);
  // A journal without the field (none found, or written before it existed) has none.
  WriteText(dir_ + "/journal.json", FullJournalJson().dump());
  read = ReadJournal(dir_);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_TRUE((*read)->foreign_checkpoints.empty());
  EXPECT_EQ((*read)->first_step, -1);
  // A malformed one is named.
  for (const nlohmann::json& bad : {nlohmann::json(3), nlohmann::json::array({{{"step", 6}}}),
                                    nlohmann::json::array({{{"step", -1}, {"write_id", 1}}}),
                                    nlohmann::json::array({{{"step", 6}, {"write_id", -1}}})}) {
    const absl::Status status =
        ReadEdited([&](nlohmann::json& j) { j["foreign_checkpoints"] = bad; });
    EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << bad;
    EXPECT_THAT(std::string(status.message()), HasSubstr("\"foreign_checkpoints\"")) << bad;
  }
}

// Two live runs never write one checkpoint.dir: the second's claim is refused, naming the
// first's pid and run directory, until the first ends.
TEST_F(JournalTest, ASecondRunCannotClaimACheckpointDirInUse) {
  v1::RunSpec first;
  first.mutable_run()->set_out_dir(dir_ + "/runs/lr-1e-4");
  first.mutable_checkpoint()->set_dir(dir_ + "/ckpt");
  v1::RunSpec second = first;
  second.mutable_run()->set_out_dir(dir_ + "/runs/lr-3e-4");
  absl::StatusOr<std::unique_ptr<DirectoryLock>> held = ClaimCheckpointDir(first);
  ASSERT_TRUE(held.ok()) << held.status();
  ASSERT_NE(*held, nullptr);
  EXPECT_TRUE(fs::is_directory(dir_ + "/ckpt"));  // created with its claim
  const absl::StatusOr<std::unique_ptr<DirectoryLock>> refused = ClaimCheckpointDir(second);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr(absl::StrFormat("checkpoint.dir %s/ckpt is in use by another hetpar "
                                        "process (pid %d, run directory %s/runs/lr-1e-4): two "
                                        "runs writing one checkpoint.dir",
                                        dir_, ::getpid(), dir_)));
  held->reset();  // the first run ends
  const absl::StatusOr<std::unique_ptr<DirectoryLock>> after = ClaimCheckpointDir(second);
  EXPECT_TRUE(after.ok()) << after.status();
  // Without a checkpoint.dir there is nothing to claim.
  v1::RunSpec none;
  const absl::StatusOr<std::unique_ptr<DirectoryLock>> nothing = ClaimCheckpointDir(none);
  ASSERT_TRUE(nothing.ok());
  EXPECT_EQ(*nothing, nullptr);
}

}  // namespace
}  // namespace hetpar::coordinator
