// `hetpar validate` as a user runs it: real process, exit codes, stdout and stderr.
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/util/subprocess.h"

namespace hetpar {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using testing::RunCommand;
namespace fs = std::filesystem;

const std::string kBin = HETPAR_BIN;
const std::string kSource = HETPAR_SOURCE_DIR;

TEST(CliValidateTest, Help) {
  auto r = RunCommand({kBin, "--help"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 0);
  EXPECT_THAT(r->stdout_text, HasSubstr("validate"));
  EXPECT_THAT(r->stdout_text, HasSubstr("heterogeneous parallelism"));
}

// The subcommands hetpar hands to hetpar-reference (convert, score) name the command typed.
TEST(CliValidateTest, ForwardedCommandsHelpNamesHetpar) {
  for (const std::vector<std::string>& command :
       std::vector<std::vector<std::string>>{{"convert", "from-hf"}, {"score"}}) {
    std::vector<std::string> argv = {kBin};
    argv.insert(argv.end(), command.begin(), command.end());
    argv.push_back("--help");
    auto r = RunCommand(argv);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->exit_code, 0) << r->stderr_text;
    std::string typed = "hetpar";
    for (const std::string& word : command) typed += " " + word;
    EXPECT_THAT(r->stdout_text, HasSubstr("Usage: " + typed + " [OPTIONS]")) << r->stdout_text;
    EXPECT_THAT(r->stdout_text, ::testing::Not(HasSubstr("hetpar-reference")));
  }
}

TEST(CliValidateTest, Version) {
  auto r = RunCommand({kBin, "--version"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 0);
  EXPECT_THAT(r->stdout_text, HasSubstr("hetpar 0."));
}

TEST(CliValidateTest, ExampleConfigsPrintTheirSpec) {
  for (const char* name : {"tiny.yaml", "large-example.yaml"}) {
    auto r = RunCommand({kBin, "validate", "--config", kSource + "/configs/" + name});
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->exit_code, 0) << r->stderr_text;
    EXPECT_THAT(r->stdout_text, HasSubstr("global_batch:"));
    EXPECT_THAT(r->stdout_text, HasSubstr("kv_heads:"));
  }
}

TEST(CliValidateTest, OverridesApply) {
  auto r = RunCommand(
      {kBin, "validate", "--config", kSource + "/configs/tiny.yaml", "--set", "run.steps=77"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 0) << r->stderr_text;
  EXPECT_THAT(r->stdout_text, HasSubstr("steps: 77"));
}

TEST(CliValidateTest, BadConfigExitsTwoWithFieldAndLine) {
  const fs::path path =
      fs::temp_directory_path() / ("hetpar_cli_bad_" + std::to_string(::getpid()) + ".yaml");
  {
    std::ifstream in(kSource + "/configs/tiny.yaml");
    std::stringstream text;
    text << in.rdbuf();
    std::string yaml = text.str();
    const std::string from = "    kv_heads: 2";
    yaml.replace(yaml.find(from), from.size(), "    kv_heads: 3");
    std::ofstream(path) << yaml;
  }
  auto r = RunCommand({kBin, "validate", "--config", path.string()});
  fs::remove(path);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 2);
  EXPECT_THAT(r->stderr_text,
              HasSubstr("llm.model.kv_heads: =3 does not divide llm.model.heads=4"));
  EXPECT_THAT(r->stderr_text, HasSubstr(path.string() + ":"));
  EXPECT_EQ(r->stdout_text, "");
}

// What a run cannot do yet is refused by validate (and so by run) with the field and the line,
// not accepted and then failed after the workers registered.
TEST(CliValidateTest, FeaturesThatDoNotRunYetAreRefusedWithFieldAndLine) {
  const fs::path path =
      fs::temp_directory_path() / ("hetpar_cli_future_" + std::to_string(::getpid()) + ".yaml");
  std::string yaml;
  {
    std::ifstream in(kSource + "/configs/tiny.yaml");
    std::stringstream text;
    text << in.rdbuf();
    yaml = text.str();
  }
  if (yaml.back() != '\n') yaml += '\n';
  const int checkpoint_line = static_cast<int>(std::count(yaml.begin(), yaml.end(), '\n')) + 2;
  yaml += "checkpoint:\n  resume_from: /tmp/hetpar-no-such-checkpoint\n";
  std::ofstream(path) << yaml;
  auto r = RunCommand({kBin, "validate", "--config", path.string(), "--set", "llm.layout.pp=2",
                       "--set", "run.max_inflight=1"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 2);
  EXPECT_THAT(r->stderr_text, HasSubstr("run.max_inflight: =1 is less than llm.layout.pp=2"));
  EXPECT_THAT(r->stderr_text,
              HasSubstr("checkpoint.resume_from: ='/tmp/hetpar-no-such-checkpoint': no complete "
                        "checkpoint: '/tmp/hetpar-no-such-checkpoint/manifest.json' does not "
                        "exist"));
  EXPECT_THAT(r->stderr_text, HasSubstr(path.string() + ":" + std::to_string(checkpoint_line)));
  EXPECT_EQ(r->stdout_text, "");
  // `hetpar run` refuses it before starting anything.
  r = RunCommand({kBin, "run", "--config", path.string(), "--out", path.string() + ".run"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 2);
  EXPECT_THAT(r->stderr_text, HasSubstr("checkpoint.resume_from"));
  EXPECT_FALSE(fs::exists(path.string() + ".run"));
  // `hetpar plan` still routes such a layout, and says that a run would refuse it.
  r = RunCommand({kBin, "plan", "--config", kSource + "/configs/tiny.yaml", "--set",
                  "llm.layout.pp=2", "--set", "run.max_inflight=1"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 0) << r->stderr_text;
  EXPECT_THAT(r->stderr_text, HasSubstr("note: `hetpar run` refuses this config for now: "
                                        "run.max_inflight: =1"));
  // Context parallelism runs: no note.
  r = RunCommand(
      {kBin, "plan", "--config", kSource + "/configs/tiny.yaml", "--set", "llm.layout.cp=2"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 0) << r->stderr_text;
  EXPECT_THAT(r->stderr_text, Not(HasSubstr("refuses")));
  fs::remove(path);
}

// Against a data set on disk, validate checks what the run would check of its tokenizer.
TEST(CliValidateTest, TheTokenizerMustFitTheVocabularyAndHoldTheImageToken) {
  char pattern[] = "/tmp/hetpar-validate-XXXXXX";
  const std::string dir = ::mkdtemp(pattern);
  auto synth = RunCommand({kBin, "data", "synth", "--out", dir, "--samples", "8",
                           "--val-samples", "2"});
  ASSERT_TRUE(synth.ok()) << synth.status();
  ASSERT_EQ(synth->exit_code, 0) << synth->stderr_text;
  const std::vector<std::string> on_disk = {
      kBin,  "validate", "--config", kSource + "/configs/tiny.yaml", "--set",
      "data.synth.samples=0", "--set", "data.manifest=" + dir + "/train.jsonl", "--set",
      "data.val_manifest=" + dir + "/val.jsonl", "--set", "data.tokenizer=" + dir + "/tokenizer.model"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> argv = on_disk;
    argv.insert(argv.end(), extra.begin(), extra.end());
    return RunCommand(argv);
  };
  auto fits = with({});
  ASSERT_TRUE(fits.ok()) << fits.status();
  EXPECT_EQ(fits->exit_code, 0) << fits->stderr_text;
  // The synthetic tokenizer has 256 pieces.
  auto small = with({"--set", "llm.model.vocab=128"});
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_EQ(small->exit_code, 2);
  EXPECT_THAT(small->stderr_text,
              HasSubstr("llm.model.vocab: =128 is smaller than the tokenizer's 256 pieces"));
  EXPECT_THAT(small->stderr_text, HasSubstr("(--set llm.model.vocab=128)"));
  EXPECT_TRUE(small->stdout_text.empty());
  auto token = with({"--set", "data.image_token=<picture>"});
  ASSERT_TRUE(token.ok()) << token.status();
  EXPECT_EQ(token->exit_code, 2);
  EXPECT_THAT(token->stderr_text,
              HasSubstr("data.image_token: '<picture>' is not a piece of the tokenizer"));
  // A synthetic data set already generated is used as it is, so it is checked too.
  auto generated = with({"--set", "data.synth.samples=8", "--set", "llm.model.vocab=128"});
  ASSERT_TRUE(generated.ok()) << generated.status();
  EXPECT_EQ(generated->exit_code, 2) << generated->stdout_text;
  EXPECT_THAT(generated->stderr_text,
              HasSubstr("llm.model.vocab: =128 is smaller than the tokenizer's 256 pieces"));
  fs::remove_all(dir);
}

TEST(CliValidateTest, MissingConfigExitsTwo) {
  auto r = RunCommand({kBin, "validate", "--config", "/nonexistent/run.yaml"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 2);
  EXPECT_THAT(r->stderr_text, HasSubstr("cannot read config file '/nonexistent/run.yaml'"));
}

TEST(CliValidateTest, UsageErrorExitsTwo) {
  auto r = RunCommand({kBin, "validate"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 2);
  EXPECT_THAT(r->stderr_text, HasSubstr("--config"));
}

}  // namespace
}  // namespace hetpar
