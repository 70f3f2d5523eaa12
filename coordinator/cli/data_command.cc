// `hetpar data ...`: generate the synthetic data set, build and check data indexes, show how a
// sample is tokenised.
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/cli_checks.h"
#include "common/config/config.h"
#include "common/data/index.h"
#include "common/data/loader.h"
#include "common/data/synth.h"
#include "coordinator/cli/commands.h"

namespace hetpar::cli {
namespace {

namespace fs = std::filesystem;

struct ConfigOptions {
  std::string config;
  std::vector<std::string> overrides;
  std::string split = "train";
};

void AddConfigFlags(CLI::App* command, ConfigOptions* options, bool required) {
  auto* config = command->add_option("-c,--config", options->config, "RunSpec YAML file");
  if (required) config->required();
  command->add_option("--set", options->overrides,
                      "Override a config field, e.g. --set data.overlong=truncate (repeatable)");
}

// Loads the config without requiring the data files (they may be what the command makes).
absl::StatusOr<config::LoadedRunSpec> LoadConfig(const ConfigOptions& options) {
  config::LoadOptions load;
  load.overrides = options.overrides;
  load.check_files = false;
  return config::LoadRunSpecFile(options.config, load);
}

absl::StatusOr<data::Split> ParseSplit(const std::string& split) {
  if (split == "train") return data::Split::kTrain;
  if (split == "val") return data::Split::kVal;
  return absl::InvalidArgumentError(
      absl::StrCat("--split ", split, " is not a split; expected train or val"));
}

int Fail(const absl::Status& status, const std::string& context) {
  std::cerr << "hetpar data " << context << ": " << status.message() << "\n";
  return status.code() == absl::StatusCode::kInvalidArgument ? kExitInvalidInput : kExitFailure;
}

std::string IndexPath(const hetpar::v1::RunSpec& spec, data::Split split) {
  return split == data::Split::kTrain ? spec.data().index() : spec.data().val_manifest() + ".index";
}

// Where the split's index goes when it cannot be written at IndexPath, as in a run.
std::string IndexFallbackPath(const hetpar::v1::RunSpec& spec, data::Split split) {
  return split == data::Split::kTrain ? data::IndexFallbackPath(spec) : "";
}

// The file an index was read from or written to, for a message.
std::string IndexFileName(const data::DataIndex& index) {
  return index.file.empty() ? "(not saved)" : index.file;
}

// A split of a config opened for reading: the spec, the split, its loader options and loader.
struct OpenedSplit {
  config::LoadedRunSpec loaded;
  data::Split split = data::Split::kTrain;
  data::LoaderOptions options;
  std::unique_ptr<data::DataLoader> loader;
};

// Loads the config and opens its `options.split`; on failure prints why, sets *exit_code and
// returns nothing. `context` names the subcommand in messages. With `keep_bad_entries` the
// loader records malformed manifest entries (Manifest::bad) instead of failing at them, whatever
// data.skip_bad_samples says; `options` keeps the config's setting.
std::optional<OpenedSplit> OpenSplit(const ConfigOptions& options, const std::string& context,
                                     int* exit_code, bool keep_bad_entries = false) {
  absl::StatusOr<config::LoadedRunSpec> loaded = LoadConfig(options);
  if (!loaded.ok()) {
    std::cerr << "hetpar: invalid config " << options.config << ":\n"
              << loaded.status().message() << "\n";
    *exit_code = kExitInvalidInput;
    return std::nullopt;
  }
  OpenedSplit out;
  out.loaded = std::move(loaded).value();
  absl::StatusOr<data::Split> split = ParseSplit(options.split);
  if (!split.ok()) {
    *exit_code = Fail(split.status(), context);
    return std::nullopt;
  }
  out.split = *split;
  absl::StatusOr<data::LoaderOptions> loader_options =
      data::LoaderOptionsFromRunSpec(out.loaded.spec, out.split);
  if (!loader_options.ok()) {
    *exit_code = Fail(loader_options.status(), context);
    return std::nullopt;
  }
  out.options = *loader_options;
  data::LoaderOptions open = out.options;
  if (keep_bad_entries) open.skip_bad_samples = true;
  absl::StatusOr<std::unique_ptr<data::DataLoader>> loader = data::DataLoader::Create(open);
  if (!loader.ok()) {
    *exit_code = Fail(loader.status(), context);
    return std::nullopt;
  }
  out.loader = std::move(loader).value();
  return out;
}

void AddSynthCommand(CLI::App* data, int* exit_code) {
  struct Options {
    ConfigOptions config;
    std::string out;
    int64_t samples = 0;
    int64_t val_samples = -1;
    int64_t seed = -1;
    int32_t image_size = 0;
    int32_t patch = 0;
    int32_t vocab_size = 0;
    int32_t seq_len = 0;
    bool force = false;
  };
  auto o = std::make_shared<Options>();
  CLI::App* command = data->add_subcommand(
      "synth",
      "Generate the synthetic image-caption data set (PNG images of coloured shapes, captions, "
      "JSONL manifests, a sentencepiece tokenizer, data indexes): into --out DIR, or where a "
      "config's data section says");
  command->add_option("-o,--out", o->out,
                      "Directory for train.jsonl, val.jsonl, tokenizer.model and images/");
  AddConfigFlags(command, &o->config, false);
  command->add_option("-n,--samples", o->samples,
                      "Training samples (default: the config's "
                      "data.synth.samples)");
  command->add_option("--val-samples", o->val_samples,
                      "Validation samples (default: the config's, else samples / 8)");
  command->add_option("--seed", o->seed, "Generator seed (default: the config's, else 7)");
  command->add_option("--image-size", o->image_size,
                      "Image side in pixels (default: encoder.model.image_size, else 32)");
  command->add_option("--patch", o->patch,
                      "Encoder patch side; tokens per image = (image-size / patch)^2 (default: "
                      "encoder.model.patch, else 8)");
  command->add_option("--vocab-size", o->vocab_size,
                      "Largest tokenizer vocabulary (default: llm.model.vocab, else 256)");
  command->add_option("--seq-len", o->seq_len,
                      "Sequence length every sample must fit (default: llm.model.seq_len, else "
                      "128)");
  command->add_flag("--force", o->force, "Overwrite a data set that is already there");
  command->callback([o, exit_code] {
    if (o->out.empty() == o->config.config.empty()) {
      std::cerr << "hetpar data synth: give exactly one of --out DIR and --config FILE\n";
      *exit_code = kExitInvalidInput;
      return;
    }
    data::SynthOptions options;
    if (!o->config.config.empty()) {
      absl::StatusOr<config::LoadedRunSpec> loaded = LoadConfig(o->config);
      if (!loaded.ok()) {
        std::cerr << "hetpar: invalid config " << o->config.config << ":\n"
                  << loaded.status().message() << "\n";
        *exit_code = kExitInvalidInput;
        return;
      }
      hetpar::v1::RunSpec spec = loaded->spec;
      auto* synth = spec.mutable_data()->mutable_synth();
      if (o->samples > 0) synth->set_samples(o->samples);
      if (synth->samples() <= 0) {
        std::cerr << "hetpar data synth: " << o->config.config
                  << " has no data.synth.samples; pass --samples N\n";
        *exit_code = kExitInvalidInput;
        return;
      }
      if (o->val_samples >= 0) {
        synth->set_val_samples(o->val_samples);
      } else if (synth->val_samples() <= 0) {
        synth->set_val_samples(std::max<int64_t>(1, synth->samples() / 8));
      }
      if (o->seed >= 0) synth->set_seed(o->seed);
      absl::StatusOr<data::SynthOptions> from_spec = data::SynthOptionsFromRunSpec(spec);
      if (!from_spec.ok()) {
        *exit_code = Fail(from_spec.status(), "synth");
        return;
      }
      options = *from_spec;
    } else {
      options = data::SynthOptionsForDirectory(o->out);
      if (o->samples <= 0) {
        std::cerr << "hetpar data synth: --samples N (N >= 1) is required with --out\n";
        *exit_code = kExitInvalidInput;
        return;
      }
      options.samples = o->samples;
      options.val_samples =
          o->val_samples >= 0 ? o->val_samples : std::max<int64_t>(1, o->samples / 8);
      options.seed = static_cast<uint64_t>(o->seed >= 0 ? o->seed : 7);
    }
    if (o->image_size > 0 || o->patch > 0) {
      const int32_t size = o->image_size > 0 ? o->image_size : options.image_size;
      const int32_t patch = o->patch > 0 ? o->patch : 8;
      if (size % patch != 0) {
        std::cerr << "hetpar data synth: --patch " << patch << " does not divide --image-size "
                  << size << "\n";
        *exit_code = kExitInvalidInput;
        return;
      }
      options.image_size = size;
      options.tokens_per_image = (size / patch) * (size / patch);
    }
    if (o->vocab_size > 0) options.vocab_size = o->vocab_size;
    if (o->seq_len > 0) options.seq_len = o->seq_len;
    std::error_code ec;
    if (!o->force && fs::exists(options.train_manifest, ec)) {
      std::cerr << "hetpar data synth: " << options.train_manifest
                << " already exists; pass --force to regenerate the data set\n";
      *exit_code = kExitInvalidInput;
      return;
    }
    // Under the data set's lock: a run that finds it missing meanwhile waits for it.
    absl::StatusOr<data::SynthReport> report = data::GenerateSyntheticDatasetExclusively(options);
    if (!report.ok()) {
      *exit_code = Fail(report.status(), "synth");
      return;
    }
    std::cout << "wrote " << report->train_samples << " training samples to "
              << options.train_manifest << "\n";
    if (report->val_samples > 0) {
      std::cout << "wrote " << report->val_samples << " validation samples to "
                << options.val_manifest << "\n";
    }
    std::cout << "images: " << report->images << " PNG, " << options.image_size << "x"
              << options.image_size << " (" << options.tokens_per_image << " tokens each)\n"
              << "training samples by image count: 0: " << report->train_samples_by_images[0]
              << ", 1: " << report->train_samples_by_images[1]
              << ", 2: " << report->train_samples_by_images[2]
              << ", 3: " << report->train_samples_by_images[3] << "\n"
              << "tokenizer: " << options.tokenizer << " (" << report->vocab_size
              << " pieces, at most " << options.vocab_size << ")\n"
              << "longest sequence: " << report->max_total_tokens << " tokens (seq_len "
              << options.seq_len << ")\n";
    *exit_code = kExitOk;
  });
}

void AddIndexCommand(CLI::App* data, int* exit_code) {
  struct Options {
    ConfigOptions config;
    bool rebuild = false;
    bool no_verify = false;
    int threads = 1;
  };
  auto o = std::make_shared<Options>();
  CLI::App* command = data->add_subcommand(
      "index",
      "Build the data index of a split (sample id -> images, tokens per image, text and loss "
      "tokens), or reuse it when it matches the manifest and the settings");
  AddConfigFlags(command, &o->config, true);
  command->add_option("--split", o->config.split, "train or val");
  command->add_flag("--rebuild", o->rebuild, "Build even when the index is up to date");
  command->add_flag("--no-verify-images", o->no_verify,
                    "Only check that image files exist instead of decoding each one");
  command->add_option("--threads", o->threads, "Worker threads for building");
  command->callback([o, exit_code] {
    std::optional<OpenedSplit> opened = OpenSplit(o->config, "index", exit_code);
    if (!opened.has_value()) return;
    const std::string path = IndexPath(opened->loaded.spec, opened->split);
    data::IndexBuildOptions build;
    build.verify_images = !o->no_verify;
    build.threads = o->threads;
    build.require_saved = true;  // the file is what this command makes
    build.rebuild = o->rebuild;
    build.fallback_path = IndexFallbackPath(opened->loaded.spec, opened->split);
    bool rebuilt = true;
    absl::StatusOr<data::DataIndex> index =
        data::LoadOrBuildIndex(*opened->loader, path, build, &rebuilt);
    if (!index.ok()) {
      *exit_code = Fail(index.status(), "index");
      return;
    }
    for (const data::BadSample& bad : index->bad) {
      std::cerr << "skipped bad sample: " << bad.ToString() << "\n";
    }
    std::cout << "index " << index->file << (rebuilt ? " (built)" : " (up to date)") << ": "
              << index->records.size() << " samples, " << index->bad.size() << " skipped, "
              << index->total_images() << " images, " << index->total_tokens() << " tokens, "
              << index->total_loss_tokens() << " loss tokens\n";
    *exit_code = kExitOk;
  });
}

void AddCheckCommand(CLI::App* data, int* exit_code) {
  auto o = std::make_shared<ConfigOptions>();
  CLI::App* command = data->add_subcommand(
      "check",
      "Load every sample of a split as training would (decode, resize, tokenise) and compare "
      "it with the data index; list every bad sample; exit 1 if there is one");
  AddConfigFlags(command, o.get(), true);
  command->add_option("--split", o->split, "train or val");
  command->callback([o, exit_code] {
    // Every bad entry is listed, a malformed manifest line too, not only the first kind met.
    std::optional<OpenedSplit> opened = OpenSplit(*o, "check", exit_code,
                                                  /*keep_bad_entries=*/true);
    if (!opened.has_value()) return;
    // The index, when there is an up-to-date one, must agree with every loaded sample.
    // It is beside the manifest, or where a run keeps the index of a read-only data set.
    std::unique_ptr<data::DataIndex> index;
    // The files as the loader read them, with the split's own options.
    absl::StatusOr<data::IndexSource> current =
        data::LoadedIndexSource(*opened->loader, opened->options);
    std::string missing;     // the first index not found, when no other was
    std::string index_path;  // the one compared with
    bool said = false;
    for (const std::string& path : {IndexPath(opened->loaded.spec, opened->split),
                                    IndexFallbackPath(opened->loaded.spec, opened->split)}) {
      if (path.empty() || index != nullptr) continue;
      absl::StatusOr<data::DataIndex> read = data::ReadIndex(path);
      if (read.ok() && current.ok()) {
        absl::Status fresh = data::CheckIndexSource(*read, *current);
        if (fresh.ok()) {
          index = std::make_unique<data::DataIndex>(std::move(*read));
          index_path = path;
        } else {
          std::cerr << "not comparing with " << path << ": " << fresh.message() << "\n";
          said = true;
        }
      } else if (absl::IsNotFound(read.status())) {
        if (missing.empty()) missing = std::string(read.status().message());
      } else if (!read.ok()) {
        std::cerr << "not comparing with an index: " << read.status().message() << "\n";
        said = true;
      }
    }
    if (index == nullptr && !said && !missing.empty()) {
      std::cerr << "not comparing with an index: " << missing << "\n";
    }
    int64_t good = 0;
    int64_t bad = 0;
    int64_t mismatched = 0;
    for (const data::BadSample& b : opened->loader->manifest().bad) {
      std::cout << "bad: " << b.ToString() << "\n";
      ++bad;
    }
    for (int64_t i = 0; i < opened->loader->size(); ++i) {
      // Described first: an image path that is not a regular file (a FIFO without a writer would
      // block the read below) is refused without being opened.
      if (absl::StatusOr<data::IndexRecord> described = opened->loader->Describe(i, false);
          !described.ok()) {
        std::cout << "bad: " << described.status().message() << "\n";
        ++bad;
        continue;
      }
      absl::StatusOr<data::LoadedSample> sample = opened->loader->Load(i);
      if (!sample.ok()) {
        std::cout << "bad: " << sample.status().message() << "\n";
        ++bad;
        continue;
      }
      ++good;
      if (index == nullptr) continue;
      const data::IndexRecord* record = index->Find(sample->id);
      const data::TokenSequence& t = sample->tokens;
      // An index written before token checksums were is compared on its shapes only.
      const uint32_t checksum = t.Checksum();
      if (record == nullptr || record->image_count != t.images() ||
          record->text_tokens != t.text_tokens || record->loss_tokens != t.loss_tokens ||
          record->image_offsets != t.image_offsets ||
          (record->token_checksum != 0 && record->token_checksum != checksum) ||
          static_cast<int64_t>(sample->images.size()) != t.images()) {
        std::cout << "index mismatch: sample '" << sample->id << "' loads as " << t.images()
                  << " images, " << t.text_tokens << " text and " << t.loss_tokens
                  << " loss tokens, token checksum "
                  << absl::StrCat(absl::Hex(checksum, absl::kZeroPad8)) << "; the index says "
                  << (record == nullptr
                          ? std::string("nothing (not indexed)")
                          : absl::StrCat(record->image_count, " images, ", record->text_tokens,
                                         " text and ", record->loss_tokens,
                                         " loss tokens, token checksum ",
                                         absl::Hex(record->token_checksum, absl::kZeroPad8)))
                  << "\n";
        ++mismatched;
      }
    }
    std::cout << "checked " << opened->loader->manifest().path << ": " << good << " good, " << bad
              << " bad"
              << (index ? absl::StrCat(", ", mismatched, " index mismatches (", index_path, ")")
                        : "")
              << "\n";
    *exit_code = bad == 0 && mismatched == 0 ? kExitOk : kExitFailure;
  });
}

void AddShowCommand(CLI::App* data, int* exit_code) {
  struct Options {
    ConfigOptions config;
    std::string id;
    int64_t position = -1;
  };
  auto o = std::make_shared<Options>();
  CLI::App* command = data->add_subcommand(
      "show",
      "Print one sample's token sequence: position, token id, piece, label and loss mask, with "
      "each image's placeholder block");
  AddConfigFlags(command, &o->config, true);
  command->add_option("--split", o->config.split, "train or val");
  CLI::Option* id = command->add_option("--id", o->id, "Sample id (the manifest's)");
  command
      ->add_option("--position", o->position,
                   "Position in the data index: the sample id of step plans and of the workers' "
                   "data errors ('data index position N')")
      ->check(hetpar::kNonNegativeNumber)
      ->excludes(id);
  command->callback([o, exit_code] {
    if (o->id.empty() && o->position < 0) {
      std::cerr << "hetpar data show: give the sample as --id ID or --position N\n";
      *exit_code = kExitInvalidInput;
      return;
    }
    std::optional<OpenedSplit> opened = OpenSplit(o->config, "show", exit_code);
    if (!opened.has_value()) return;
    absl::StatusOr<int64_t> ordinal;
    std::string position;  // "index position N, " when shown by position
    if (o->position >= 0) {
      // Positions are the index's (samples skipped as bad shift those after them): load it, or
      // build it as training would.
      data::IndexBuildOptions build;
      build.fallback_path = IndexFallbackPath(opened->loaded.spec, opened->split);
      bool rebuilt = false;
      absl::StatusOr<data::DataIndex> index = data::LoadOrBuildIndex(
          *opened->loader, IndexPath(opened->loaded.spec, opened->split), build, &rebuilt);
      if (!index.ok()) {
        *exit_code = Fail(index.status(), "show");
        return;
      }
      if (rebuilt) {
        std::cerr << "hetpar data show: the data index " << IndexFileName(*index)
                  << " was built anew (its files "
                  << "changed, or it was missing): a run started before uses the positions of "
                  << "its own index, which may differ\n";
      }
      if (o->position >= static_cast<int64_t>(index->records.size())) {
        *exit_code = Fail(absl::InvalidArgumentError(absl::StrCat(
                              "--position ", o->position, " is outside the data index ",
                              IndexFileName(*index), " of ", index->records.size(),
                              " samples (positions 0 to ", index->records.size() - 1, ")")),
                          "show");
        return;
      }
      ordinal = index->records[static_cast<size_t>(o->position)].ordinal;
      position = absl::StrCat("index position ", o->position, ", ");
    } else {
      ordinal = opened->loader->Ordinal(o->id);
    }
    if (!ordinal.ok()) {
      *exit_code = Fail(ordinal.status(), "show");
      return;
    }
    absl::StatusOr<data::TokenSequence> seq = opened->loader->Tokenize(*ordinal);
    if (!seq.ok()) {
      *exit_code = Fail(seq.status(), "show");
      return;
    }
    const data::Tokenizer& tok = opened->loader->tokenizer();
    const data::ManifestRecord& record =
        opened->loader->manifest().records[static_cast<size_t>(*ordinal)];
    std::cout << "sample '" << record.id << "' (" << position
              << opened->loader->manifest().Where(record.line) << "): " << seq->length()
              << " tokens, " << seq->images() << " images, " << seq->text_tokens << " text tokens, "
              << seq->loss_tokens << " loss tokens" << (seq->truncated ? ", truncated" : "")
              << "\n";
    std::cout << "pos  id    piece            label  loss\n";
    size_t image = 0;
    for (int32_t i = 0; i < seq->length(); ++i) {
      const size_t p = static_cast<size_t>(i);
      if (image < seq->image_offsets.size() && seq->image_offsets[image] == i) {
        const int32_t end = i + opened->options.tokens_per_image - 1;
        std::cout << std::setw(3) << i << "-" << end << "  image " << image << ": "
                  << record.images[image] << " (" << opened->options.tokens_per_image
                  << " placeholder rows, id " << seq->input_ids[p] << ")\n";
        i = end;
        ++image;
        continue;
      }
      std::cout << std::setw(3) << i << "  " << std::setw(4) << seq->input_ids[p] << "  "
                << std::left << std::setw(16) << tok.Piece(seq->input_ids[p]) << std::right << " "
                << std::setw(5)
                << (seq->loss_mask[p] ? std::to_string(seq->labels[p]) : std::string("-")) << "  "
                << static_cast<int>(seq->loss_mask[p]) << "\n";
    }
    *exit_code = kExitOk;
  });
}

void AddDataCommand(CLI::App& app, int* exit_code) {
  CLI::App* data = app.add_subcommand(
      "data", "The training data: generate the synthetic set, build and check data indexes");
  data->require_subcommand(1);
  AddSynthCommand(data, exit_code);
  AddIndexCommand(data, exit_code);
  AddCheckCommand(data, exit_code);
  AddShowCommand(data, exit_code);
}

}  // namespace

HETPAR_REGISTER_COMMAND(40, AddDataCommand);

}  // namespace hetpar::cli
