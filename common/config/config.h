// RunSpec configuration: YAML in, a validated and normalised hetpar.v1.RunSpec out.
//
// The schema is proto/hetpar/v1/run_spec.proto; this module maps YAML onto it by reflection, so
// a field added to the proto is accepted in YAML, printed and round-tripped without code here.
// Every problem is reported with the field path, the value, what was expected and where the
// value came from (`configs/run.yaml:12`, or `--set llm.layout.tp=3`). All problems in a file are
// reported at once, not just the first.
//
// Paths written in a config file are relative to that file's directory; paths from `--set` and
// defaults are relative to the current directory. The normalised spec holds absolute paths.
#ifndef HETPAR_COMMON_CONFIG_CONFIG_H_
#define HETPAR_COMMON_CONFIG_CONFIG_H_

#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "hetpar/v1/run_spec.pb.h"

namespace hetpar::config {

// Where each field of a loaded RunSpec was written: field path ("llm.layout.tp") -> location
// ("configs/tiny.yaml:14" or "--set llm.layout.tp=4"). Fields absent from the input have none.
class SourceMap {
 public:
  explicit SourceMap(std::string source_name = "") : source_name_(std::move(source_name)) {}

  // `from_flag`: a command-line flag set it (--set, or hetpar run's --out...), not the file.
  void Set(const std::string& path, std::string location, bool from_flag = false) {
    locations_[path] = std::move(location);
    if (from_flag) {
      from_flags_.insert(path);
    } else {
      from_flags_.erase(path);
    }
  }
  bool Has(const std::string& path) const { return locations_.count(path) > 0; }
  // Written in the file itself (not set by a flag): its relative paths are the file's.
  bool InFile(const std::string& path) const { return Has(path) && !from_flags_.count(path); }
  // The location of `path`; else that of its nearest written ancestor, saying that `path` itself
  // is not written (so a value reported is its default); else the source name.
  std::string Where(std::string_view path) const;
  const std::string& source_name() const { return source_name_; }

 private:
  std::string source_name_;
  std::map<std::string, std::string> locations_;
  std::set<std::string> from_flags_;
};

struct LoadedRunSpec {
  hetpar::v1::RunSpec spec;
  SourceMap source;
  std::string base_dir;  // directory that relative paths in the file are resolved against
};

// One problem found in a config.
struct ConfigIssue {
  std::string path;              // field path, e.g. "encoder.layout.tp"
  std::string message;           // what is wrong and what was expected
  std::string where;             // "file:line", "--set ...", or the file name
  std::string ToString() const;  // "encoder.layout.tp: ... (configs/run.yaml:12)"
};

struct LoadOptions {
  // `key.path=value` overrides applied on top of the file, as from `--set`.
  std::vector<std::string> overrides;
  // The flag a user gave for an override that did not come from `--set` (its `key.path=value` ->
  // "--resume /ckpt/step-000040"): errors name that flag where they name a --set otherwise.
  std::map<std::string, std::string> override_flags;
  // Appends `assignment` (`key.path=value`) to the overrides, named `flag` in errors.
  void AddFlagOverride(std::string assignment, std::string flag) {
    override_flags.emplace(assignment, std::move(flag));
    overrides.push_back(std::move(assignment));
  }
  // Check that input files (manifest, tokenizer, token file) exist.
  bool check_files = true;
  // Keep (and check) checkpoint.resume_from. Off where the spec is that of a run already under
  // way or done (its evaluation, a restarted coordinator's check of its config.yaml): the field is
  // then cleared, since the checkpoint the run started from may have been pruned since.
  bool resume = true;
  // Accept a checkpoint.resume_from of run.steps committed steps: a restarted coordinator
  // continuing a run whose every step was committed, so that its workers write the outputs from
  // that checkpoint. Any other resume must leave a step to train.
  bool resume_at_end = false;
  // Refuse what a run cannot do yet (the in-process transport, fewer encoder jobs in flight
  // than LLM pipeline stages), so that a config that validates is one that runs. `hetpar plan`
  // turns this off: the plan library already routes those layouts.
  bool require_runnable = true;
  // Check that encoder.init_from and llm.init_from exist (with check_files, for a run that is not
  // resumed). Off for a restarted coordinator's first look at its config: a run continued from a
  // checkpoint of its own needs not the files it started from (and it checks them itself when it
  // has to start over).
  bool check_init_from = true;
};

// run.max_inflight when a config leaves it out, and the only value a colocated run accepts.
inline constexpr int64_t kDefaultMaxInflight = 2;
// checkpoint.keep when a config leaves it out, and the only value accepted without a directory.
inline constexpr int64_t kDefaultCheckpointKeep = 2;
// The shortest coordinator.heartbeat_timeout_s accepted.
inline constexpr double kMinHeartbeatTimeoutS = 1.0;

// Where the training data stood at a checkpoint (StepCommit.data): `offset` samples of epoch
// `epoch`'s order taken over a data index of `index_samples` samples.
struct CheckpointDataPosition {
  int64_t index_samples = 0;
  int64_t epoch = 0;
  int64_t offset = 0;
  uint32_t index_digest = 0;  // the index's sample-id digest; 0: not recorded
  // An index of `samples` samples with id digest `digest` (0: unknown) is the one recorded.
  bool SameIndex(int64_t samples, uint32_t digest) const {
    return samples == index_samples && (index_digest == 0 || digest == 0 || digest == index_digest);
  }
  // No sample of an epoch taken yet, or all of them: the next step starts a new epoch's order.
  bool AtEpochBoundary() const { return offset == 0 || offset == index_samples; }
};

// What a complete checkpoint's manifest.json (train/checkpoint.h writes it) says of where the run
// was: NotFound without a manifest (the checkpoint is incomplete or not one), DataLoss for a
// manifest without a step.
struct CheckpointSummary {
  int64_t step = 0;              // committed steps
  int64_t samples_trained = -1;  // -1: the manifest does not say
  std::optional<int64_t> seed;   // run.seed it was trained with; none: the manifest does not say
  std::string run;               // run.name it was written by; empty: the manifest does not say
  uint64_t write_id = 0;         // the write's id (a new one each time a step is written); 0: none
  std::optional<CheckpointDataPosition> data;  // none: the manifest does not say
  // encoder.model.layers and llm.model.layers of the RunSpec it was written under; none: the
  // manifest does not say.
  std::optional<int64_t> encoder_layers, llm_layers;
  // encoder.model.no_final_norm of that RunSpec (false where it is absent: written before the
  // field, or false); none: the manifest holds no readable RunSpec.
  std::optional<bool> encoder_no_final_norm;
  // The fields of that RunSpec that decide how the stored parameters are read, apart from the
  // layers ("encoder.model.heads" -> "16"; kCheckpointArchitectureFields), as its YAML writes
  // them; only those it holds.
  std::map<std::string, std::string> architecture;
};
// The model fields a resume must keep, besides the layers and encoder.model.no_final_norm: a
// change of size fails to load, and a change of heads or activation would read the same tensors
// as another model without a word.
inline constexpr std::string_view kCheckpointArchitectureFields[] = {
    "encoder.model.image_size", "encoder.model.patch",      "encoder.model.hidden",
    "encoder.model.heads",      "encoder.model.mlp",        "encoder.model.out_hidden",
    "encoder.model.channels",   "encoder.model.activation", "llm.model.hidden",
    "llm.model.heads",          "llm.model.kv_heads",       "llm.model.ffn",
    "llm.model.vocab"};
absl::StatusOr<CheckpointSummary> ReadCheckpointSummary(const std::string& dir);

// Parses YAML text into a RunSpec without defaults or semantic checks. Syntax errors, unknown
// keys (with a "did you mean") and wrong types are returned together as InvalidArgument.
// An override's location in errors: LoadOptions::override_flags names the flag that set it.
absl::StatusOr<LoadedRunSpec> ParseRunSpecYaml(
    std::string_view yaml_text, std::string_view source_name,
    const std::vector<std::string>& overrides = {},
    const std::map<std::string, std::string>& override_flags = {});

// Fills every field the input left out with its documented default and resolves relative paths.
void ApplyDefaults(LoadedRunSpec* loaded);

// Semantic checks over a spec with defaults applied: sizes, divisibility, layouts, files, and
// with `require_runnable` the features a run does not have yet (see LoadOptions); with
// `resume_at_end` a checkpoint.resume_from at run.steps (LoadOptions::resume_at_end).
std::vector<ConfigIssue> Validate(const LoadedRunSpec& loaded, bool check_files = true,
                                  bool require_runnable = true, bool resume_at_end = false);
// The same with every option of `options` (check_init_from too).
std::vector<ConfigIssue> Validate(const LoadedRunSpec& loaded, const LoadOptions& options);

// Parse + defaults + validation of a YAML text. Errors are InvalidArgument, one issue per line.
absl::StatusOr<LoadedRunSpec> LoadRunSpecFromString(std::string_view yaml_text,
                                                    std::string_view source_name,
                                                    const LoadOptions& options = {});

// The same for a file; a missing or unreadable file is NotFound naming the path.
absl::StatusOr<LoadedRunSpec> LoadRunSpecFile(const std::string& path,
                                              const LoadOptions& options = {});

// The whole spec as YAML, every field written, in the proto's field order. Loading the result
// gives back an equal RunSpec.
std::string RunSpecToYaml(const hetpar::v1::RunSpec& spec);

// Shortest decimal text that parses back to exactly `value`.
std::string FormatDouble(double value);

// Number of image tokens the encoder produces per image: (image_size / patch)^2.
int64_t TokensPerImage(const hetpar::v1::EncoderModel& model);

// What the synthetic data set (data.synth) needs of the model: text tokens a caption takes at
// most beside its images, the smallest vocabulary its captions' pieces fit, and its image sizes.
inline constexpr int64_t kSynthCaptionTokens = 48;
inline constexpr int64_t kSynthMinVocab = 64;
inline constexpr int64_t kSynthMinImageSize = 8;
inline constexpr int64_t kSynthMaxImageSize = 1024;

}  // namespace hetpar::config

#endif  // HETPAR_COMMON_CONFIG_CONFIG_H_
