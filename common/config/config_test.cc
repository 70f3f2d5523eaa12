#include "common/config/config.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace hetpar::config {
namespace {

using ::testing::HasSubstr;
namespace fs = std::filesystem;

// A valid spec; each test breaks one thing. Line numbers matter: tests assert them.
constexpr char kValid[] = R"(run:
  name: t
  steps: 3
  global_batch: 8
  micro_batch: 2
  dtype: float64
placement: non_colocated
encoder:
  model:
    image_size: 32
    patch: 8
    hidden: 64
    layers: 2
    heads: 4
    mlp: 128
    out_hidden: 64
  layout: {dp: 2, tp: 2}
llm:
  model:
    hidden: 64
    layers: 2
    heads: 4
    kv_heads: 2
    ffn: 128
    vocab: 256
    seq_len: 64
  layout: {dp: 2, tp: 2}
data:
  manifest: train.jsonl
  tokenizer: tok.model
)";

// Line (1-based) of the first line of kValid containing `needle`.
int LineOf(const std::string& text, const std::string& needle) {
  size_t pos = text.find(needle);
  EXPECT_NE(pos, std::string::npos) << needle;
  return 1 + static_cast<int>(std::count(text.begin(), text.begin() + pos, '\n'));
}

absl::StatusOr<LoadedRunSpec> Load(const std::string& text,
                                   std::vector<std::string> overrides = {}) {
  LoadOptions options;
  options.overrides = std::move(overrides);
  options.check_files = false;
  return LoadRunSpecFromString(text, "run.yaml", options);
}

std::string Replace(const std::string& from, const std::string& to) {
  std::string text = kValid;
  EXPECT_NE(text.find(from), std::string::npos) << from;
  return absl::StrReplaceAll(text, {{from, to}});
}

// The load fails, and its message names `field` at `run.yaml:line` and contains `detail`.
void ExpectIssue(const absl::StatusOr<LoadedRunSpec>& result, const std::string& field, int line,
                 const std::string& detail) {
  ASSERT_FALSE(result.ok()) << "expected an error about " << field;
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument);
  const std::string message(result.status().message());
  EXPECT_THAT(message, HasSubstr(field + ":"));
  if (line > 0) {
    // The field's own line, or its section's where the field is not written.
    EXPECT_THAT(message, ::testing::ContainsRegex("run\\.yaml:" + std::to_string(line) + "[);]"));
  }
  EXPECT_THAT(message, HasSubstr(detail));
}

TEST(ConfigTest, ValidSpecLoadsWithDefaults) {
  auto loaded = Load(kValid);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const auto& s = loaded->spec;
  EXPECT_EQ(s.run().global_batch(), 8);
  EXPECT_EQ(s.run().dtype(), hetpar::v1::DTYPE_FLOAT64);
  EXPECT_EQ(s.run().seed(), 1234);       // default
  EXPECT_EQ(s.run().max_inflight(), 2);  // default
  EXPECT_EQ(s.llm().layout().cp(), 1);   // default
  EXPECT_EQ(s.llm().model().kv_heads(), 2);
  EXPECT_EQ(s.transport(), hetpar::v1::TRANSPORT_KIND_UCX);
  EXPECT_DOUBLE_EQ(s.encoder().optimizer().lr(), 1e-3);
  EXPECT_EQ(s.data().image_token(), "<image>");
  EXPECT_TRUE(fs::path(s.data().manifest()).is_absolute());
  EXPECT_EQ(s.data().index(), s.data().manifest() + ".index");
  EXPECT_EQ(loaded->source.Where("llm.layout.tp"), "run.yaml:27");
}

TEST(ConfigTest, KvHeadsDefaultsToHeads) {
  auto loaded = Load(Replace("    kv_heads: 2\n", ""));
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->spec.llm().model().kv_heads(), 4);
}

TEST(ConfigTest, RoundTripYamlSpecYamlSpec) {
  auto first = Load(kValid);
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string yaml = RunSpecToYaml(first->spec);
  auto second = Load(yaml);
  ASSERT_TRUE(second.ok()) << second.status() << "\n" << yaml;
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(first->spec, second->spec))
      << first->spec.DebugString() << "\nvs\n"
      << second->spec.DebugString();
  EXPECT_EQ(RunSpecToYaml(second->spec), yaml);
}

TEST(ConfigTest, RoundTripKeepsDoublesExact) {
  auto loaded = Load(kValid, {"llm.optimizer.lr=0.1", "encoder.optimizer.eps=1.2345678901234567e-9",
                              "run.grad_clip=3"});
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  auto again = Load(RunSpecToYaml(loaded->spec));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->spec.llm().optimizer().lr(), 0.1);
  EXPECT_EQ(again->spec.encoder().optimizer().eps(), 1.2345678901234567e-9);
  EXPECT_EQ(again->spec.run().grad_clip(), 3.0);
}

TEST(ConfigTest, FormatDoubleIsShortestExact) {
  EXPECT_EQ(FormatDouble(0.001), "0.001");
  EXPECT_EQ(FormatDouble(1.0), "1.0");
  EXPECT_EQ(FormatDouble(1e-8), "1e-08");
  EXPECT_EQ(FormatDouble(10000), "10000.0");
  EXPECT_EQ(std::stod(FormatDouble(0.1 + 0.2)), 0.1 + 0.2);
}

TEST(ConfigTest, UnknownKeySuggestsTheNearestName) {
  const std::string text = Replace("    kv_heads: 2", "    kv_haeds: 2");
  ExpectIssue(Load(text), "llm.model.kv_haeds", LineOf(text, "kv_haeds"),
              "unknown key 'kv_haeds'; did you mean 'kv_heads'?");
}

TEST(ConfigTest, UnknownTopLevelKeyListsChoicesWhenNothingIsClose) {
  const std::string text = std::string(kValid) + "zzzzzzzz: 1\n";
  ExpectIssue(Load(text), "zzzzzzzz", LineOf(text, "zzzzzzzz"), "expected one of {run,");
}

TEST(ConfigTest, WrongTypeNamesTheExpectedType) {
  const std::string text =
      Replace("layers: 2\n    heads: 4\n    mlp", "layers: two\n    heads: 4\n    mlp");
  ExpectIssue(Load(text), "encoder.model.layers", LineOf(text, "layers: two"),
              "expected an integer, got 'two'");
}

TEST(ConfigTest, MappingWhereScalarExpected) {
  const std::string text = Replace("  steps: 3", "  steps: {a: 1}");
  ExpectIssue(Load(text), "run.steps", LineOf(text, "steps:"),
              "expected an integer, got a mapping");
}

TEST(ConfigTest, BadEnumValueListsChoices) {
  const std::string text = Replace("dtype: float64", "dtype: flaot64");
  ExpectIssue(Load(text), "run.dtype", LineOf(text, "dtype:"),
              "expected float32 | float64 | bfloat16 (did you mean 'float64'?)");
}

TEST(ConfigTest, DeviceIsCpuByDefaultCudaOrRefused) {
  auto loaded = Load(kValid);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->spec.run().device(), "cpu");
  const std::string cuda = Replace("dtype: float64", "dtype: float64\n  device: cuda");
  auto on_gpu = Load(cuda);
  ASSERT_TRUE(on_gpu.ok()) << on_gpu.status();
  EXPECT_EQ(on_gpu->spec.run().device(), "cuda");
  const std::string text = Replace("dtype: float64", "dtype: float64\n  device: gpu0");
  ExpectIssue(Load(text), "run.device", LineOf(text, "device:"),
              "=\"gpu0\" is not a device; expected \"cpu\" or \"cuda\"");
}

TEST(ConfigTest, NcclTransportNeedsCudaAndSeparateProcesses) {
  const std::string cuda = Replace("dtype: float64", "dtype: float64\n  device: cuda");
  auto nccl = Load(cuda, {"transport=nccl"});
  ASSERT_TRUE(nccl.ok()) << nccl.status();
  EXPECT_EQ(nccl->spec.transport(), hetpar::v1::TRANSPORT_KIND_NCCL);
  ExpectIssue(Load(kValid, {"transport=nccl"}), "transport", 0,
              "nccl moves CUDA tensors and needs run.device: cuda (got \"cpu\")");
  ExpectIssue(Load(cuda, {"transport=nccl", "placement=colocated"}), "transport", 0,
              "nccl needs placement: non_colocated");
}

TEST(ConfigTest, ZeroSize) {
  const std::string text =
      Replace("  layout: {dp: 2, tp: 2}\nllm", "  layout: {dp: 0, tp: 2}\nllm");
  ExpectIssue(Load(text), "encoder.layout.dp", LineOf(text, "{dp: 0"), "=0 must be >= 1");
}

TEST(ConfigTest, NegativeSize) {
  const std::string text = Replace("    hidden: 64\n    layers: 2\n    heads: 4\n    kv",
                                   "    hidden: -64\n    layers: 2\n    heads: 4\n    kv");
  ExpectIssue(Load(text), "llm.model.hidden", LineOf(text, "-64"), "=-64 must be >= 1");
}

TEST(ConfigTest, RunNameIsOnePlainPathComponent) {
  for (const char* good : {"run.name=tiny", "run.name=vit0.6b-llm7b_4images", "run.name=7b"}) {
    auto loaded = Load(kValid, {good});
    EXPECT_TRUE(loaded.ok()) << good << ": " << loaded.status();
  }
  // Each would leave runs/ (the default run.out_dir is runs/<name>) or start a hidden one.
  for (const char* bad : {"run.name=../x", "run.name=a/b", "run.name=.hidden", "run.name=-x",
                          "run.name=a b"}) {
    SCOPED_TRACE(bad);
    ExpectIssue(Load(kValid, {bad}), "run.name", 0, "is not a run name; expected at most 128");
  }
  ExpectIssue(Load(kValid, {"run.name=" + std::string(129, 'a')}), "run.name", 0,
              std::string(128, 'a') + "...\" is not a run name");
}

TEST(ConfigTest, MissingRequiredField) {
  const std::string text = Replace("    vocab: 256\n", "");
  ExpectIssue(Load(text), "llm.model.vocab",
              LineOf(text, "  model:\n    hidden: 64\n    layers: 2\n    heads: 4\n    kv"),
              "is required");
  // Its section's line, saying that the field is not there.
  ExpectIssue(Load(text), "llm.model.vocab", 0, "llm.model.vocab is not set there)");
  // A default reported against the value of another field says so too.
  ExpectIssue(Load(kValid, {"llm.model.layers=4", "llm.layout.pp=4"}), "run.max_inflight",
              LineOf(kValid, "run:"), "=2 is less than llm.layout.pp=4");
  EXPECT_THAT(
      std::string(Load(kValid, {"llm.model.layers=4", "llm.layout.pp=4"}).status().message()),
      HasSubstr("; run.max_inflight is not set there)"));
}

TEST(ConfigTest, TpMustDivideHeads) {
  const std::string text =
      Replace("  layout: {dp: 2, tp: 2}\nllm", "  layout: {dp: 2, tp: 3}\nllm");
  ExpectIssue(Load(text), "encoder.layout.tp", LineOf(text, "tp: 3"),
              "=3 does not divide encoder.model.heads=4");
}

TEST(ConfigTest, TpMustDivideHidden) {
  const std::string text = Replace("    hidden: 64\n    layers: 2\n    heads: 4\n    mlp",
                                   "    hidden: 68\n    layers: 2\n    heads: 4\n    mlp");
  // heads 4 divides 68, tp 2 divides 68 too; make tp 4 via override to hit hidden.
  auto result = Load(text, {"encoder.layout.tp=8"});
  ExpectIssue(result, "encoder.layout.tp", 0, "=8 does not divide encoder.model.hidden=68");
  EXPECT_THAT(std::string(result.status().message()), HasSubstr("--set encoder.layout.tp=8"));
}

TEST(ConfigTest, TpMustDivideFfn) {
  const std::string text = Replace("    ffn: 128", "    ffn: 129");
  ExpectIssue(Load(text), "llm.layout.tp", 0, "does not divide llm.model.ffn=129");
  ExpectIssue(Load(text), "llm.layout.tp", LineOf(text, "  layout: {dp: 2, tp: 2}\ndata"), "");
}

// The projector is split by features: its output rows too.
TEST(ConfigTest, TpMustDivideTheEncodersOutHidden) {
  auto result =
      Load(kValid, {"encoder.layout.tp=3", "encoder.layout.dp=1", "encoder.model.hidden=96",
                    "encoder.model.heads=3", "encoder.model.mlp=192"});
  ExpectIssue(
      result, "encoder.layout.tp", 0,
      "=3 does not divide encoder.model.out_hidden=64 (the projector is split by features)");
}

// Token ids and the loader's sizes are 32-bit: a larger value is refused, not truncated.
TEST(ConfigTest, SizesReadAs32BitIntegersAreRefusedPastTheirRange) {
  ExpectIssue(Load(kValid, {"llm.model.seq_len=2147483648"}), "llm.model.seq_len", 0,
              "=2147483648 must be <= 2147483647");
  ExpectIssue(Load(kValid, {"llm.model.vocab=4294967552"}), "llm.model.vocab", 0,
              "=4294967552 must be <= 2147483647");
  ExpectIssue(Load(kValid, {"encoder.model.image_size=4294967296"}), "encoder.model.image_size", 0,
              "=4294967296 must be <= 2147483647");
}

// A bound refused from the file shows the value it refuses, as one from --set does.
TEST(ConfigTest, RefusedValuesAreShownWithTheirField) {
  const std::string theta = Replace("    seq_len: 64", "    seq_len: 64\n    rope_theta: -1");
  ExpectIssue(Load(theta), "llm.model.rope_theta", LineOf(theta, "rope_theta"),
              "=-1.0 must be > 0");
  ExpectIssue(Load(kValid, {"llm.model.heads=64", "llm.model.kv_heads=1", "llm.layout.tp=1"}),
              "llm.model.heads", 0, "=64 gives an odd head size 1");
  for (const char* field : {"coordinator.register_timeout_s", "failure.step_timeout_s"}) {
    ExpectIssue(Load(kValid, {std::string(field) + "=-2.5"}), field, 0,
                "=-2.5 must be > 0 seconds");
  }
  // Workers heartbeat every fifth of the timeout: a timeout of milliseconds loses them all.
  for (const char* value : {"-2.5", "0.02", "0.99"}) {
    ExpectIssue(Load(kValid, {std::string("coordinator.heartbeat_timeout_s=") + value}),
                "coordinator.heartbeat_timeout_s", 0,
                std::string("=") + (std::string(value) == "0.02" ? "0.02" : value) +
                    " must be >= 1.0 seconds: workers heartbeat every fifth of it");
  }
  EXPECT_TRUE(Load(kValid, {"coordinator.heartbeat_timeout_s=1"}).ok());
  // A sample needs a position to predict and a token before it.
  ExpectIssue(
      Load(kValid, {"llm.model.seq_len=1", "encoder.model.image_size=8", "encoder.model.patch=8"}),
      "llm.model.seq_len", 0, "=1 must be >= 2");
}

// What the synthetic data set's generator needs of the model is refused naming the model's
// fields when the config is validated, not later by `hetpar data synth` without them.
TEST(ConfigTest, TheSyntheticDataSetsNeedsAreCheckedAgainstTheModel) {
  ASSERT_TRUE(Load(kValid, {"data.synth.samples=64"}).ok());
  ExpectIssue(Load(kValid, {"data.synth.samples=64", "llm.model.vocab=32"}), "llm.model.vocab", 0,
              "=32 is too small for the synthetic data set's tokenizer (data.synth); expected >= "
              "64");
  ExpectIssue(Load(kValid, {"data.synth.samples=64", "llm.model.seq_len=60"}), "llm.model.seq_len",
              0,
              "=60 cannot hold one image of 16 tokens and a synthetic caption of up to 48 tokens "
              "(data.synth); expected >= 64");
  ExpectIssue(Load(kValid, {"data.synth.samples=64", "encoder.model.image_size=2048",
                            "llm.model.seq_len=65600"}),
              "encoder.model.image_size", 0, "=2048 is outside what the synthetic data set draws");
  // The generator writes JSONL and a sentencepiece model: paths that would be read back as a
  // LLaVA JSON array or a tokenizer.json are refused, each named.
  const auto json_paths =
      Load(kValid, {"data.synth.samples=64", "data.manifest=train.json",
                    "data.val_manifest=val.json", "data.tokenizer=tokenizer.json"});
  ExpectIssue(json_paths, "data.manifest", 0,
              "/train.json' ends in .json, which is read as a LLaVA JSON array, but data.synth "
              "writes a JSONL manifest there; name a .jsonl file");
  ExpectIssue(json_paths, "data.val_manifest", 0, "/val.json' ends in .json");
  ExpectIssue(json_paths, "data.tokenizer", 0,
              "/tokenizer.json' ends in .json, which is read as a Hugging Face tokenizer.json, "
              "but data.synth writes a sentencepiece model there; name a .model file");
  // A negative validation count is refused with generation off too; the other fields stay, as
  // when data.synth.samples=0 turns off a config's generation.
  ExpectIssue(Load(kValid, {"data.synth.val_samples=-5"}), "data.synth.val_samples", 0,
              "=-5 must be >= 0");
  EXPECT_TRUE(
      Load(kValid, {"data.synth.samples=0", "data.synth.val_samples=16", "data.synth.seed=3"})
          .ok());
  // Without generation, none of it applies.
  EXPECT_TRUE(Load(kValid, {"llm.model.vocab=32"}).ok());
}

TEST(ConfigTest, KvHeadsMustDivideHeads) {
  const std::string text = Replace("    kv_heads: 2", "    kv_heads: 3");
  ExpectIssue(Load(text), "llm.model.kv_heads", LineOf(text, "kv_heads: 3"),
              "=3 does not divide llm.model.heads=4");
}

TEST(ConfigTest, GlobalBatchMustSplitIntoMicroBatchesPerReplica) {
  const std::string text = Replace("  global_batch: 8", "  global_batch: 6");
  ExpectIssue(Load(text), "run.global_batch", LineOf(text, "global_batch"),
              "=6 is not divisible into run.micro_batch=2 per LLM replica x llm.layout.dp=2 "
              "(needs a multiple of 4)");
}

TEST(ConfigTest, SeqLenTooShortForOneImage) {
  const std::string text = Replace("    seq_len: 64", "    seq_len: 12");
  ExpectIssue(Load(text), "llm.model.seq_len", LineOf(text, "seq_len"),
              "=12 is too short for one image's 16 tokens");
}

TEST(ConfigTest, ColocatedLayoutsMustCoverTheSameRanks) {
  const std::string text = Replace("placement: non_colocated", "placement: colocated");
  auto result = Load(text, {"llm.layout.dp=1"});
  ExpectIssue(result, "placement", LineOf(text, "placement"),
              "encoder dp x tp = 4, llm dp x tp x cp x pp = 2");
  EXPECT_TRUE(Load(text).ok());
}

TEST(ConfigTest, OutHiddenMustMatchLlmHidden) {
  const std::string text = Replace("    out_hidden: 64", "    out_hidden: 32");
  ExpectIssue(Load(text), "encoder.model.out_hidden", LineOf(text, "out_hidden"),
              "=32 must equal llm.model.hidden=64");
}

TEST(ConfigTest, CpMustSplitTheSequence) {
  auto result = Load(kValid, {"llm.layout.cp=3"});
  ExpectIssue(result, "llm.model.seq_len", LineOf(kValid, "seq_len"),
              "=64 is not a multiple of 2 x llm.layout.cp=6");
}

TEST(ConfigTest, WhatARunCannotDoYetIsRefusedUnlessOnlyPlanning) {
  auto cp = Load(kValid, {"llm.layout.cp=2", "llm.layout.sequence_parallel=true"});
  ASSERT_TRUE(cp.ok()) << cp.status();
  EXPECT_EQ(cp->spec.llm().layout().cp(), 2);
  auto pp = Load(kValid, {"llm.layout.pp=2"});
  ASSERT_TRUE(pp.ok()) << pp.status();
  EXPECT_EQ(pp->spec.llm().layout().pp(), 2);
  // Colocated needs no job window: the encoder's forwards all run before the LLM's waves, so a
  // pipelined LLM runs with max_inflight left unset, and setting it is refused as doing nothing.
  auto colocated = Load(kValid, {"placement=colocated", "encoder.layout.dp=4", "llm.layout.pp=2"});
  EXPECT_TRUE(colocated.ok()) << colocated.status();
  ExpectIssue(Load(kValid, {"placement=colocated", "encoder.layout.dp=4", "llm.layout.pp=2",
                            "run.max_inflight=1"}),
              "run.max_inflight", 0, "=1 has no effect with placement: colocated");
  const std::string text = std::string(kValid) + "checkpoint:\n  dir: ckpt\n  every: 5\n";
  auto checkpoints = Load(text);
  ASSERT_TRUE(checkpoints.ok()) << checkpoints.status();
  EXPECT_EQ(checkpoints->spec.checkpoint().keep(), 2);  // default
  ExpectIssue(Load(kValid, {"placement=colocated", "encoder.layout.dp=2", "transport=inproc"}),
              "transport", 0, "inproc needs every rank in one process");
  // Planning takes the same layouts.
  LoadOptions planning;
  planning.check_files = false;
  planning.require_runnable = false;
  planning.overrides = {"llm.layout.cp=2", "llm.layout.pp=2"};
  auto planned = LoadRunSpecFromString(text, "run.yaml", planning);
  ASSERT_TRUE(planned.ok()) << planned.status();
  EXPECT_EQ(planned->spec.llm().layout().pp(), 2);
}

TEST(ConfigTest, CheckpointFieldsAreChecked) {
  const std::string every = std::string(kValid) + "checkpoint:\n  every: 5\n";
  ExpectIssue(Load(every), "checkpoint.every", LineOf(every, "every: 5"),
              "=5 needs checkpoint.dir");
  ExpectIssue(Load(kValid, {"checkpoint.dir=c", "checkpoint.keep=0"}), "checkpoint.keep", 0,
              "=0 must be >= 1");
  // keep without a directory keeps nothing; the default is what written configs carry.
  ExpectIssue(Load(kValid, {"checkpoint.keep=5"}), "checkpoint.keep", 0,
              "=5 has no effect without checkpoint.dir (no checkpoint is written)");
  EXPECT_TRUE(Load(kValid, {"checkpoint.keep=2"}).ok());
  EXPECT_TRUE(Load(kValid, {"checkpoint.dir=c", "checkpoint.keep=5"}).ok());
  // resume_from must name a complete checkpoint before run.steps.
  const fs::path dir =
      fs::temp_directory_path() / ("hetpar_config_ckpt_" + std::to_string(::getpid()));
  fs::create_directories(dir / "step-000004");
  auto with_files = [&](const std::string& resume, int64_t steps) {
    LoadOptions o;
    o.overrides = {"checkpoint.resume_from=" + resume, "run.steps=" + std::to_string(steps),
                   "data.synth.samples=64"};
    return LoadRunSpecFromString(kValid, "run.yaml", o);
  };
  const std::string step4 = (dir / "step-000004").string();
  ExpectIssue(with_files(step4, 10), "checkpoint.resume_from", 0,
              "no complete checkpoint: '" + step4 + "/manifest.json' does not exist");
  // Given by a flag of its own (hetpar run --resume), an override's errors name that flag.
  {
    LoadOptions o;
    o.overrides = {"checkpoint.resume_from=" + step4, "run.steps=x10", "data.synth.samples=64"};
    o.override_flags = {{"checkpoint.resume_from=" + step4, "--resume " + step4}};
    const auto flagged = LoadRunSpecFromString(kValid, "run.yaml", o);
    EXPECT_THAT(std::string(flagged.status().message()),
                HasSubstr("run.steps: expected an integer"));
    EXPECT_THAT(std::string(flagged.status().message()), HasSubstr("(--set run.steps=x10)"));
    o.override_flags.emplace("run.steps=x10", "--steps x10");
    EXPECT_THAT(std::string(LoadRunSpecFromString(kValid, "run.yaml", o).status().message()),
                HasSubstr("(--steps x10)"));
    o.overrides[1] = "run.steps=10";
    const std::string message(LoadRunSpecFromString(kValid, "run.yaml", o).status().message());
    EXPECT_THAT(message, HasSubstr("/manifest.json' does not exist (expected a step-NNNNNN "
                                   "directory of checkpoint.dir) (--resume " +
                                   step4 + ")"));
    EXPECT_THAT(message, ::testing::Not(HasSubstr("--set checkpoint.resume_from")));
  }
  // A manifest that cannot be read is not taken for a missing one.
  fs::create_directories(dir / "step-000006");
  fs::create_symlink("manifest.json", dir / "step-000006" / "manifest.json");  // a loop: ELOOP
  const absl::StatusOr<CheckpointSummary> unreadable =
      ReadCheckpointSummary((dir / "step-000006").string());
  EXPECT_EQ(unreadable.status().code(), absl::StatusCode::kUnavailable) << unreadable.status();
  EXPECT_THAT(std::string(unreadable.status().message()),
              HasSubstr("cannot read checkpoint manifest '" + (dir / "step-000006").string() +
                        "/manifest.json': Too many levels of symbolic links"));
  std::ofstream(dir / "step-000004" / "manifest.json") << "{\"format\": 1}";
  ExpectIssue(with_files(step4, 10), "checkpoint.resume_from", 0, "is not a checkpoint manifest");
  std::ofstream(dir / "step-000004" / "manifest.json")
      << R"({"format": 1, "step": 4, "extra": {"samples_trained": 32}})";
  EXPECT_EQ(ReadCheckpointSummary(step4)->step, 4);
  EXPECT_EQ(ReadCheckpointSummary(step4)->samples_trained, 32);
  auto resumed = with_files(step4, 10);  // kValid: global_batch 8, 4 x 8 = 32
  EXPECT_TRUE(resumed.ok()) << resumed.status();
  std::ofstream(dir / "step-000004" / "manifest.json")
      << R"({"format": 1, "step": 4, "extra": {"samples_trained": 64}})";
  ExpectIssue(with_files(step4, 10), "checkpoint.resume_from", 0,
              "trained 64 samples in 4 steps (a global batch of 16); run.global_batch=8");
  ExpectIssue(with_files(step4, 4), "checkpoint.resume_from", 0,
              "is at step 4, which is not before run.steps=4");
  // Trained under another seed: the epoch order would change mid-epoch.
  std::ofstream(dir / "step-000004" / "manifest.json")
      << R"({"format": 1, "step": 4, "extra": {"samples_trained": 32, "seed": 99}})";
  EXPECT_EQ(ReadCheckpointSummary(step4)->seed, 99);
  ExpectIssue(with_files(step4, 10), "run.seed", 0,
              "=1234 differs from the seed 99 that checkpoint.resume_from='" + step4 +
                  "' was trained with: the data order would change mid-epoch; resume with "
                  "run.seed=99");
  // Mid-epoch as the manifest records it (32 of 40 samples of epoch 0): still refused.
  std::ofstream(dir / "step-000004" / "manifest.json")
      << R"({"format": 1, "step": 4, "extra": {"samples_trained": 32, "seed": 99, "data": )"
      << R"({"index_samples": 40, "epoch": 0, "offset": 32}}})";
  ASSERT_TRUE(ReadCheckpointSummary(step4)->data.has_value());
  EXPECT_EQ(ReadCheckpointSummary(step4)->data->index_samples, 40);
  EXPECT_EQ(ReadCheckpointSummary(step4)->data->epoch, 0);
  EXPECT_EQ(ReadCheckpointSummary(step4)->data->offset, 32);
  ExpectIssue(with_files(step4, 10), "run.seed", 0, "differs from the seed 99");
  // At the end of an epoch (32 of 32, or 0 of the next): the next epoch's order may follow
  // another seed.
  for (const char* position : {R"({"index_samples": 32, "epoch": 0, "offset": 32})",
                               R"({"index_samples": 16, "epoch": 2, "offset": 0})"}) {
    std::ofstream(dir / "step-000004" / "manifest.json")
        << R"({"format": 1, "step": 4, "extra": {"samples_trained": 32, "seed": 99, "data": )"
        << position << "}}";
    auto reseeded = with_files(step4, 10);
    EXPECT_TRUE(reseeded.ok()) << position << ": " << reseeded.status();
  }
  // A position that does not fit its own index is read as none (the seed check stands).
  std::ofstream(dir / "step-000004" / "manifest.json")
      << R"({"format": 1, "step": 4, "extra": {"samples_trained": 32, "seed": 99, "data": )"
      << R"({"index_samples": 16, "epoch": 2, "offset": 17}}})";
  EXPECT_FALSE(ReadCheckpointSummary(step4)->data.has_value());
  ExpectIssue(with_files(step4, 10), "run.seed", 0, "differs from the seed 99");
  // Written for 4 LLM layers (kValid has 2): the resume would load layers 0 and 1 and drop the
  // others without a word.
  const auto with_runspec = [&](int encoder_layers, int llm_layers) {
    const nlohmann::json manifest = {
        {"format", 1},
        {"step", 4},
        {"extra",
         {{"samples_trained", 32},
          {"runspec", absl::StrCat("encoder:\n  model:\n    layers: ", encoder_layers,
                                   "\nllm:\n  model:\n    layers: ", llm_layers, "\n")}}}};
    std::ofstream(dir / "step-000004" / "manifest.json") << manifest.dump();
  };
  with_runspec(2, 4);
  EXPECT_EQ(ReadCheckpointSummary(step4)->llm_layers, 4);
  EXPECT_EQ(ReadCheckpointSummary(step4)->encoder_layers, 2);
  ExpectIssue(with_files(step4, 10), "llm.model.layers", 0,
              "=2 differs from the 4 layers of checkpoint.resume_from='" + step4 +
                  "': a resume continues the model the checkpoint holds; resume with "
                  "llm.model.layers=4");
  with_runspec(3, 2);
  ExpectIssue(with_files(step4, 10), "encoder.model.layers", 0, "=2 differs from the 3 layers");
  with_runspec(2, 2);
  EXPECT_TRUE(with_files(step4, 10).ok());
  EXPECT_EQ(ReadCheckpointSummary(step4)->encoder_no_final_norm, false);
  // Trained with 8 query heads over 2 KV heads and a tanh GELU: the same tensors, read as 4 heads
  // and an exact GELU, would be another model. Each field named, with the value to resume with.
  {
    const auto with_model = [&](const std::string& encoder_model, const std::string& llm_model) {
      const nlohmann::json manifest = {
          {"format", 1},
          {"step", 4},
          {"extra",
           {{"samples_trained", 32},
            {"runspec", "encoder:\n  model:\n    layers: 2\n" + encoder_model +
                            "llm:\n  model:\n    layers: 2\n" + llm_model}}}};
      std::ofstream(dir / "step-000004" / "manifest.json") << manifest.dump();
    };
    with_model("    heads: 4\n    activation: \"gelu_tanh\"\n",
               "    heads: 8\n    kv_heads: 2\n    vocab: 256\n");
    EXPECT_EQ(ReadCheckpointSummary(step4)->architecture,
              (std::map<std::string, std::string>{{"encoder.model.heads", "4"},
                                                  {"encoder.model.activation", "gelu_tanh"},
                                                  {"llm.model.heads", "8"},
                                                  {"llm.model.kv_heads", "2"},
                                                  {"llm.model.vocab", "256"}}));
    const auto changed = with_files(step4, 10);
    ExpectIssue(changed, "llm.model.heads", LineOf(kValid, "    heads: 4\n    kv_heads"),
                "=4 differs from the 8 that checkpoint.resume_from='" + step4 +
                    "' was trained with: a resume continues the model the checkpoint holds; "
                    "resume with llm.model.heads=8");
    ExpectIssue(changed, "encoder.model.activation", 0,
                "=gelu differs from the gelu_tanh that checkpoint.resume_from='" + step4);
    EXPECT_THAT(std::string(changed.status().message()),
                ::testing::Not(HasSubstr("kv_heads:")));  // 2 in both
    // The same values: resumed.
    with_model("    heads: 4\n    activation: \"gelu\"\n",
               "    heads: 4\n    kv_heads: 2\n    vocab: 256\n");
    const auto same = with_files(step4, 10);
    EXPECT_TRUE(same.ok()) << same.status();
  }
  // Written without the tower's final norm: resumed with it, its norm would be missing; written
  // with it and resumed without, the trained norm would be dropped without a word.
  const nlohmann::json without_norm = {
      {"format", 1},
      {"step", 4},
      {"extra",
       {{"samples_trained", 32},
        {"runspec",
         "encoder:\n  model:\n    layers: 2\n    no_final_norm: true\nllm:\n  model:\n"
         "    layers: 2\n"}}}};
  std::ofstream(dir / "step-000004" / "manifest.json") << without_norm.dump();
  EXPECT_EQ(ReadCheckpointSummary(step4)->encoder_no_final_norm, true);
  ExpectIssue(with_files(step4, 10), "encoder.model.no_final_norm", 0,
              "=false differs from checkpoint.resume_from='" + step4 +
                  "', written without the tower's final norm: a resume continues the model the "
                  "checkpoint holds; resume with encoder.model.no_final_norm=true");
  {
    LoadOptions o;
    o.overrides = {"checkpoint.resume_from=" + step4, "run.steps=10", "data.synth.samples=64",
                   "encoder.model.no_final_norm=true"};
    EXPECT_TRUE(LoadRunSpecFromString(kValid, "run.yaml", o).ok());
  }
  with_runspec(2, 2);
  {
    LoadOptions o;
    o.overrides = {"checkpoint.resume_from=" + step4, "run.steps=10", "data.synth.samples=64",
                   "encoder.model.no_final_norm=true"};
    ExpectIssue(LoadRunSpecFromString(kValid, "run.yaml", o), "encoder.model.no_final_norm", 0,
                "=true differs from checkpoint.resume_from='" + step4 +
                    "', written with the tower's final norm");
  }
  fs::remove_all(dir);
  // The spec of a run already under way (its evaluation reads its config.yaml): the checkpoint
  // it started from may be pruned by now; the field is dropped, not checked.
  LoadOptions finished;
  finished.overrides = {"checkpoint.resume_from=" + step4, "data.synth.samples=64"};
  finished.resume = false;
  auto evaluated = LoadRunSpecFromString(kValid, "run.yaml", finished);
  ASSERT_TRUE(evaluated.ok()) << evaluated.status();
  EXPECT_EQ(evaluated->spec.checkpoint().resume_from(), "");
}

TEST(ConfigTest, FailureDeadlinesHaveDefaultsAndMustBePositive) {
  auto defaults = Load(kValid);
  ASSERT_TRUE(defaults.ok()) << defaults.status();
  EXPECT_EQ(defaults->spec.failure().max_step_attempts(), 3);
  EXPECT_EQ(defaults->spec.failure().step_timeout_s(), 600.0);
  EXPECT_EQ(defaults->spec.failure().peer_timeout_s(), 300.0);
  EXPECT_EQ(defaults->spec.failure().coordinator_timeout_s(), 300.0);
  ExpectIssue(Load(kValid, {"failure.max_step_attempts=0"}), "failure.max_step_attempts", 0,
              "=0 must be >= 1");
  ExpectIssue(Load(kValid, {"failure.peer_timeout_s=-1"}), "failure.peer_timeout_s", 0,
              "=-1.0 must be > 0 seconds");
  ExpectIssue(Load(kValid, {"failure.step_timeout_s=0"}), "failure.step_timeout_s", 0,
              "=0.0 must be > 0 seconds");
  auto set = Load(kValid, {"failure.coordinator_timeout_s=45.5", "failure.max_step_attempts=5"});
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(set->spec.failure().coordinator_timeout_s(), 45.5);
  EXPECT_EQ(set->spec.failure().max_step_attempts(), 5);
}

TEST(ConfigTest, TheMinimumPoolsAreBetweenOneAndTheLayoutsReplicas) {
  auto defaults = Load(kValid);
  ASSERT_TRUE(defaults.ok()) << defaults.status();
  EXPECT_EQ(defaults->spec.failure().min_encoder_replicas(), 1);
  EXPECT_TRUE(Load(kValid, {"failure.min_encoder_replicas=2"}).ok());
  ExpectIssue(Load(kValid, {"failure.min_encoder_replicas=3"}), "failure.min_encoder_replicas", 0,
              "=3 must be in [1, encoder.layout.dp=2]");
  ExpectIssue(Load(kValid, {"failure.min_encoder_replicas=0"}), "failure.min_encoder_replicas", 0,
              "=0 must be in [1, encoder.layout.dp=2]");
  EXPECT_EQ(defaults->spec.failure().min_llm_replicas(), 1);
  EXPECT_TRUE(Load(kValid, {"failure.min_llm_replicas=2"}).ok());
  ExpectIssue(Load(kValid, {"failure.min_llm_replicas=3"}), "failure.min_llm_replicas", 0,
              "=3 must be in [1, llm.layout.dp=2]");
}

TEST(ConfigTest, TheInitialEncoderPoolIsBetweenTheMinimumAndTheLayoutsReplicas) {
  auto defaults = Load(kValid);
  ASSERT_TRUE(defaults.ok()) << defaults.status();
  EXPECT_EQ(defaults->spec.encoder().initial_replicas(), 0);  // unset: encoder.layout.dp
  auto one = Load(kValid, {"encoder.initial_replicas=1"});
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(one->spec.encoder().initial_replicas(), 1);
  ExpectIssue(Load(kValid, {"encoder.initial_replicas=3"}), "encoder.initial_replicas", 0,
              "=3 must be in [failure.min_encoder_replicas=1, encoder.layout.dp=2]");
  ExpectIssue(Load(kValid, {"encoder.initial_replicas=1", "failure.min_encoder_replicas=2"}),
              "encoder.initial_replicas", 0,
              "=1 must be in [failure.min_encoder_replicas=2, encoder.layout.dp=2]");
}

TEST(ConfigTest, PipelineStagesNeedTheEncoderToKeepAsManyJobsInFlight) {
  ExpectIssue(Load(kValid, {"llm.layout.pp=2", "run.max_inflight=1"}), "run.max_inflight", 0,
              "=1 is less than llm.layout.pp=2: the LLM's first stage runs 2 forwards");
  // A frozen encoder waits for no gradients.
  auto frozen = Load(kValid, {"llm.layout.pp=2", "run.max_inflight=1", "encoder.frozen=true"});
  EXPECT_TRUE(frozen.ok()) << frozen.status();
}

TEST(ConfigTest, TrainProjectorNeedsAFrozenEncoder) {
  ExpectIssue(Load(kValid, {"encoder.train_projector=true"}), "encoder.train_projector", 0,
              "=true needs encoder.frozen: true");
  auto frozen = Load(kValid, {"encoder.frozen=true", "encoder.train_projector=true"});
  ASSERT_TRUE(frozen.ok()) << frozen.status();
  EXPECT_TRUE(frozen->spec.encoder().frozen());
  EXPECT_TRUE(frozen->spec.encoder().train_projector());
}

TEST(ConfigTest, EncoderActivationAndNormEpsHaveDefaultsAndAreChecked) {
  auto loaded = Load(kValid);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->spec.encoder().model().activation(), "gelu");
  EXPECT_EQ(loaded->spec.encoder().model().norm_eps(), 1e-6);
  EXPECT_EQ(loaded->spec.data().chat_template(), "plain");
  auto tanh = Load(kValid, {"encoder.model.activation=gelu_tanh", "encoder.model.norm_eps=1e-5"});
  ASSERT_TRUE(tanh.ok()) << tanh.status();
  EXPECT_EQ(tanh->spec.encoder().model().activation(), "gelu_tanh");
  EXPECT_EQ(tanh->spec.encoder().model().norm_eps(), 1e-5);
  ExpectIssue(Load(kValid, {"encoder.model.activation=relu"}), "encoder.model.activation", 0,
              "='relu' is not one of: gelu, gelu_tanh");
  ExpectIssue(Load(kValid, {"encoder.model.norm_eps=0"}), "encoder.model.norm_eps", 0,
              "=0.0 must be > 0");
  ExpectIssue(Load(kValid, {"data.chat_template=alpaca"}), "data.chat_template", 0,
              "='alpaca' is not one of: plain, vicuna, llama3, chatml");
}

TEST(ConfigTest, EncoderHasNoPipeline) {
  ExpectIssue(Load(kValid, {"encoder.layout.pp=2"}), "encoder.layout.pp", 0,
              "the encoder is not pipelined");
}

TEST(ConfigTest, SeveralProblemsAreAllReported) {
  std::string text = Replace("    kv_heads: 2", "    kv_heads: 3");
  text = absl::StrReplaceAll(text, {{"  global_batch: 8", "  global_batch: 6"}});
  auto result = Load(text);
  ASSERT_FALSE(result.ok());
  EXPECT_THAT(std::string(result.status().message()), HasSubstr("llm.model.kv_heads"));
  EXPECT_THAT(std::string(result.status().message()), HasSubstr("run.global_batch"));
}

TEST(ConfigTest, YamlSyntaxErrorNamesTheLine) {
  auto result = Load("run:\n  steps: [1,\n");
  ASSERT_FALSE(result.ok());
  EXPECT_THAT(std::string(result.status().message()), HasSubstr("invalid YAML"));
  EXPECT_THAT(std::string(result.status().message()), HasSubstr("run.yaml:"));
}

TEST(ConfigTest, BadOverrideSyntax) {
  auto result = Load(kValid, {"llm.layout.tp"});
  ASSERT_FALSE(result.ok());
  EXPECT_THAT(std::string(result.status().message()), HasSubstr("expected KEY.PATH=VALUE"));
}

TEST(ConfigTest, OverrideUnknownKeyIsReported) {
  auto result = Load(kValid, {"llm.layuot.tp=2"});
  ExpectIssue(result, "llm.layuot", 0, "did you mean 'layout'?");
}

TEST(ConfigTest, AnOverrideProblemNamesTheFlagNotALineOfTheFile) {
  const std::string message(Load(kValid, {"run.steps=1e3"}).status().message());
  EXPECT_THAT(message, HasSubstr("run.steps: expected an integer, got '1e3' (--set run.steps=1e3)"));
  EXPECT_THAT(message, ::testing::Not(HasSubstr("run.yaml")));
  // Under a mapping the flag set, too.
  EXPECT_THAT(std::string(Load(kValid, {"llm.layout={tp: x}"}).status().message()),
              HasSubstr("llm.layout.tp: expected an integer, got 'x' (--set llm.layout={tp: x})"));
}

TEST(ConfigTest, AMisspeltKeyOnAnOverridesWayNamesTheFlag) {
  // The flag made the mapping `modle` (and a top-level `optimizer`): the file has no line of it.
  EXPECT_THAT(std::string(Load(kValid, {"llm.modle.heads=2"}).status().message()),
              HasSubstr("llm.modle: unknown key 'modle'"));
  EXPECT_THAT(std::string(Load(kValid, {"llm.modle.heads=2"}).status().message()),
              HasSubstr("(--set llm.modle.heads=2)"));
  EXPECT_THAT(std::string(Load(kValid, {"optimizer.lr=1"}).status().message()),
              HasSubstr("(--set optimizer.lr=1)"));
  // A key the file wrote keeps the file's line, whatever a --set under it does.
  const std::string text = Replace("  steps: 3", "  steps: 3\n  stpes: {a: 1}");
  const std::string message(Load(text, {"run.stpes.x=1"}).status().message());
  EXPECT_THAT(message, HasSubstr("run.stpes: unknown key"));
  EXPECT_THAT(message, ::testing::Not(HasSubstr("(--set run.stpes.x=1)")));
}

TEST(ConfigTest, AMappingOverrideMergesIntoTheFilesMapping) {
  // The file's llm.layout is {dp: 2, tp: 2}: setting tp alone keeps dp.
  auto result = Load(kValid, {"llm.layout={tp: 1}"});
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->spec.llm().layout().dp(), 2);
  EXPECT_EQ(result->spec.llm().layout().tp(), 1);
  // Each key is where it was written: the flag's in the flag, the file's in the file.
  EXPECT_EQ(result->source.Where("llm.layout.tp"), "--set llm.layout={tp: 1}");
  EXPECT_EQ(result->source.Where("llm.layout.dp"),
            "run.yaml:" + std::to_string(LineOf(kValid, "  layout: {dp: 2, tp: 2}\ndata")));
  // A problem with a key the flag's mapping set names the flag, not a line of the file.
  ExpectIssue(Load(kValid, {"encoder.layout={dp: 2, tp: 3}"}), "encoder.layout.tp", 0,
              "=3 does not divide encoder.model.heads=4 (attention is split by heads) (--set "
              "encoder.layout={dp: 2, tp: 3})");
}

TEST(ConfigTest, AKeyWrittenTwiceIsRefusedWithBothLines) {
  const int steps = LineOf(kValid, "steps");
  auto result = Load(Replace("  steps: 3\n", "  steps: 3\n  steps: 7\n"));
  ExpectIssue(result, "run.steps", steps + 1,
              "written twice in one mapping (first at line " + std::to_string(steps) + ")");
  // A section written twice would merge the two.
  auto sections = Load(std::string(kValid) + "run:\n  steps: 5\n");
  ExpectIssue(sections, "run", 0, "written twice in one mapping (first at line 1)");
}

TEST(ConfigTest, ATrailingEmptyDocumentIsNoSecondDocument) {
  EXPECT_TRUE(Load(std::string(kValid) + "---\n").ok());
  EXPECT_TRUE(Load(std::string("---\n") + kValid + "...\n").ok());
}

TEST(ConfigTest, ASecondYamlDocumentIsRefused) {
  auto result = Load(std::string(kValid) + "---\nrun: {steps: 4}\n");
  ASSERT_FALSE(result.ok());
  EXPECT_THAT(std::string(result.status().message()),
              HasSubstr("holds more than one YAML document (separated by '---'); expected "
                        "one (run.yaml:" + std::to_string(LineOf(kValid, "tok.model") + 1) + ")"));
}

TEST(ConfigTest, LayoutsPastTheRankLimitAreRefusedNotOverflowed) {
  // 2^32 x 2^32 wraps int64 to 0: unchecked, "% 0" would crash the validator.
  auto batch = Load(kValid, {"run.micro_batch=4294967296", "llm.layout.dp=4294967296",
                             "llm.layout.tp=1", "llm.model.kv_heads=4"});
  ExpectIssue(batch, "llm.layout", 0, "is more than 1048576 ranks");
  // tp x 2cp wraps to 0 with sequence parallelism.
  auto shards = Load(kValid, {"llm.layout.tp=4611686018427387904", "llm.layout.cp=2",
                              "llm.layout.sequence_parallel=true"});
  ExpectIssue(shards, "llm.layout", 0, "is more than 1048576 ranks");
  // micro_batch x dp past int64 is no divisor of any global batch.
  auto wave = Load(kValid, {"run.micro_batch=4611686018427387904"});
  ExpectIssue(wave, "run.global_batch", 0, "(their product overflows)");
}

TEST(ConfigTest, AGlobalBatchNoWorkerCouldHoldIsRefused) {
  // 2^40 samples validated once and ended the workers with std::bad_alloc at the first step.
  ExpectIssue(Load(kValid, {"run.global_batch=1099511627776"}), "run.global_batch", 0,
              "=1099511627776 must be <= 16777216 samples");
  // 2^24 itself is allowed.
  EXPECT_TRUE(Load(kValid, {"run.global_batch=16777216"}).ok());
}

TEST(ConfigTest, AnImageOfTooManyPatchesIsTooLongForAnySequence) {
  // 2^33 patches a side would wrap their square in int64 to 0, which would pass the length
  // check: such a side is refused first, and the largest one left is too long.
  ExpectIssue(Load(kValid, {"encoder.model.image_size=8589934592", "encoder.model.patch=1"}),
              "encoder.model.image_size", 0, "=8589934592 must be <= 2147483647");
  ExpectIssue(Load(kValid, {"encoder.model.image_size=2147483647", "encoder.model.patch=1"}),
              "llm.model.seq_len", 0, "is too short for one image's 4611686014132420609 tokens");
}

TEST(ConfigTest, ImagesHaveThreeChannels) {
  ExpectIssue(Load(kValid, {"encoder.model.channels=1"}), "encoder.model.channels", 0,
              "=1: images are loaded as RGB; expected 3");
  EXPECT_TRUE(Load(kValid, {"encoder.model.channels=3"}).ok());
}

TEST(ConfigTest, ListenAddressesAreHostAndAPortInRange) {
  ExpectIssue(Load(kValid, {"coordinator.listen=127.0.0.1:99999"}), "coordinator.listen", 0,
              "='127.0.0.1:99999' is not host:port with a port in [0, 65535]");
  ExpectIssue(Load(kValid, {"coordinator.listen=garbage"}), "coordinator.listen", 0,
              "is not host:port");
  ExpectIssue(Load(kValid, {"coordinator.metrics_listen=:80"}), "coordinator.metrics_listen", 0,
              "is not host:port");
  EXPECT_TRUE(Load(kValid, {"coordinator.listen='[::1]:0'"}).ok());  // quoted: YAML reads [ as a list
  EXPECT_TRUE(Load(kValid, {"coordinator.listen=0.0.0.0:65535"}).ok());
}

TEST(ConfigTest, GradientBucketsHaveAnUpperBound) {
  ExpectIssue(Load(kValid, {"run.grad_bucket_mib=1e308"}), "run.grad_bucket_mib", 0,
              "must be > 0 and at most 1048576.0 (1 TiB)");
  EXPECT_TRUE(Load(kValid, {"run.grad_bucket_mib=1048576"}).ok());
}

class ConfigFilesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("hetpar_config_test_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string Write(const std::string& name, const std::string& text) {
    std::ofstream(dir_ / name) << text;
    return (dir_ / name).string();
  }
  fs::path dir_;
};

TEST_F(ConfigFilesTest, MissingFilesAreNamed) {
  const std::string path = Write("run.yaml", kValid);
  auto result = LoadRunSpecFile(path);
  ASSERT_FALSE(result.ok());
  const std::string message(result.status().message());
  EXPECT_THAT(message, HasSubstr("data.manifest: file '" + (dir_ / "train.jsonl").string() +
                                 "' does not exist (" + path + ":" +
                                 std::to_string(LineOf(kValid, "manifest")) + ")"));
  EXPECT_THAT(message, HasSubstr("data.tokenizer: file '"));
}

TEST_F(ConfigFilesTest, InitFromIsAFileBesideTheConfig) {
  Write("train.jsonl", "");
  Write("tok.model", "");
  Write("llm.hpar", "");
  const std::string text =
      absl::StrReplaceAll(std::string(kValid), {{"llm:\n", "llm:\n  init_from: llm.hpar\n"}});
  auto result = LoadRunSpecFile(Write("run.yaml", text));
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->spec.llm().init_from(), (dir_ / "llm.hpar").string());
  const std::string missing = absl::StrReplaceAll(
      std::string(kValid), {{"encoder:\n", "encoder:\n  init_from: encoder.hpar\n"}});
  auto bad = LoadRunSpecFile(Write("bad.yaml", missing));
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()),
              HasSubstr("encoder.init_from: file '" + (dir_ / "encoder.hpar").string() +
                        "' does not exist"));
}

TEST_F(ConfigFilesTest, RelativePathsResolveAgainstTheConfigFile) {
  Write("train.jsonl", "");
  Write("tok.model", "");
  auto result = LoadRunSpecFile(Write("run.yaml", kValid));
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->spec.data().manifest(), (dir_ / "train.jsonl").string());
}

// A path set by --set is relative to the current directory, also inside a mapping the flag
// writes; one written in the file is relative to the file.
TEST_F(ConfigFilesTest, PathsInAnOverridesMappingResolveAgainstTheCurrentDirectory) {
  Write("train.jsonl", "");
  Write("tok.model", "");
  LoadOptions options;
  options.overrides = {"checkpoint={dir: ckpt, every: 2}"};
  auto result = LoadRunSpecFile(Write("run.yaml", kValid), options);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->spec.checkpoint().dir(), (fs::current_path() / "ckpt").string());
  EXPECT_EQ(result->spec.data().manifest(), (dir_ / "train.jsonl").string());
}

// hetpar run's --out and --resume are overrides named after their flags: their relative paths
// are the current directory's, as a --set's, not the config file's.
TEST_F(ConfigFilesTest, PathsOfFlagsNamedInErrorsResolveAgainstTheCurrentDirectory) {
  Write("train.jsonl", "");
  Write("tok.model", "");
  LoadOptions options;
  options.overrides = {"checkpoint.dir=ckpt"};
  options.AddFlagOverride("run.out_dir=runs/try", "--out runs/try");
  auto result = LoadRunSpecFile(Write("run.yaml", kValid), options);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_NE(dir_, fs::current_path());
  EXPECT_EQ(result->spec.run().out_dir(), (fs::current_path() / "runs/try").string());
  EXPECT_EQ(result->spec.checkpoint().dir(), (fs::current_path() / "ckpt").string());
  // Written in the file, the same field is the file's.
  auto in_file = LoadRunSpecFile(
      Write("out.yaml", std::string(kValid) + "checkpoint:\n  dir: ckpt\n"), LoadOptions());
  ASSERT_TRUE(in_file.ok()) << in_file.status();
  EXPECT_EQ(in_file->spec.checkpoint().dir(), (dir_ / "ckpt").string());
}

// data.synth generates only missing files: LLaVA JSON and a tokenizer.json already there are
// read as such, so their .json names are not refused.
TEST_F(ConfigFilesTest, ExistingJsonDataUnderSynthIsNotRefused) {
  LoadOptions options;
  options.overrides = {"data.synth.samples=64", "data.manifest=" + Write("train.json", "[]"),
                       "data.tokenizer=" + Write("tokenizer.json", "{}")};
  const auto result = LoadRunSpecFile(Write("run.yaml", kValid), options);
  EXPECT_THAT(std::string(result.status().message()), ::testing::Not(HasSubstr("ends in .json")));
  options.overrides[2] = "data.tokenizer=" + (dir_ / "absent.json").string();
  EXPECT_THAT(std::string(LoadRunSpecFile(Write("run.yaml", kValid), options).status().message()),
              HasSubstr("absent.json' ends in .json, which is read as a Hugging Face"));
}

TEST_F(ConfigFilesTest, SynthesisedDataMayBeAbsent) {
  const std::string path = Write("run.yaml", std::string(kValid) + "  synth: {samples: 64}\n");
  auto result = LoadRunSpecFile(path);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->spec.data().synth().val_samples(), 8);
}

TEST_F(ConfigFilesTest, MissingConfigFileIsNotFound) {
  auto result = LoadRunSpecFile((dir_ / "nope.yaml").string());
  EXPECT_EQ(result.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(result.status().message()), HasSubstr("nope.yaml"));
}

TEST_F(ConfigFilesTest, ADirectoryIsNoConfigFile) {
  auto result = LoadRunSpecFile(dir_.string());
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(result.status().message()), HasSubstr("is a directory"));
}

TEST_F(ConfigFilesTest, ExampleConfigsValidate) {
  for (const char* name : {"tiny.yaml", "tiny-colocated.yaml", "large-example.yaml"}) {
    const std::string path = std::string(HETPAR_SOURCE_DIR) + "/configs/" + name;
    auto result = LoadRunSpecFile(path);
    EXPECT_TRUE(result.ok()) << name << ": " << result.status();
  }
}

}  // namespace
}  // namespace hetpar::config
