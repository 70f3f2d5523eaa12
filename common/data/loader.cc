#include "common/data/loader.h"

#include <sys/stat.h>
#include <zlib.h>

#include <filesystem>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/config/config.h"
#include "common/data/file_util.h"
#include "common/status.h"

namespace hetpar::data {
namespace {

// Status payload carrying the file a sample error is about (BadSample::path).
constexpr char kPathPayload[] = "type.hetpar.dev/data.path";
// Status payload carrying that file's stamp, "size mtime_ns", taken before it was read
// (BadSample::path_stamp).
constexpr char kPathStampPayload[] = "type.hetpar.dev/data.path-stamp";

void SetPathStamp(absl::Status* error, const FileStamp& stamp) {
  error->SetPayload(kPathStampPayload, absl::Cord(absl::StrCat(stamp.size, " ", stamp.mtime_ns)));
}

std::string Where(const Manifest& manifest, const ManifestRecord& record) {
  return manifest.Where(record.line);
}

}  // namespace

absl::StatusOr<LoaderOptions> LoaderOptionsFromRunSpec(const hetpar::v1::RunSpec& spec,
                                                       Split split) {
  LoaderOptions options;
  options.manifest = split == Split::kTrain ? spec.data().manifest() : spec.data().val_manifest();
  if (options.manifest.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(split == Split::kTrain ? "data.manifest" : "data.val_manifest",
                     " is empty: expected a manifest path (.jsonl or .json)"));
  }
  absl::StatusOr<ChatTemplate> chat_template = ParseChatTemplate(spec.data().chat_template());
  if (!chat_template.ok()) return chat_template.status();
  options.chat_template = *chat_template;
  options.tokenizer = spec.data().tokenizer();
  options.image_token = spec.data().image_token().empty() ? "<image>" : spec.data().image_token();
  options.image_size = static_cast<int32_t>(spec.encoder().model().image_size());
  options.tokens_per_image = static_cast<int32_t>(config::TokensPerImage(spec.encoder().model()));
  options.seq_len = static_cast<int32_t>(spec.llm().model().seq_len());
  options.max_vocab = static_cast<int32_t>(spec.llm().model().vocab());
  options.overlong = spec.data().overlong() == hetpar::v1::OVERLONG_POLICY_TRUNCATE
                         ? OverlongPolicy::kTruncate
                         : OverlongPolicy::kReject;
  options.skip_bad_samples = spec.data().skip_bad_samples();
  return options;
}

std::string IndexFallbackPath(const hetpar::v1::RunSpec& spec) {
  const std::string& manifest = spec.data().manifest();
  if (manifest.empty() || spec.checkpoint().dir().empty() ||
      spec.data().index() != manifest + ".index") {
    return "";
  }
  const uint32_t crc = static_cast<uint32_t>(::crc32(
      0, reinterpret_cast<const Bytef*>(manifest.data()), static_cast<uInt>(manifest.size())));
  return absl::StrCat(spec.checkpoint().dir(), "/data-index/",
                      std::filesystem::path(manifest).filename().string(), "-",
                      absl::Hex(crc, absl::kZeroPad8), ".index");
}

DataLoader::DataLoader(LoaderOptions options, Manifest manifest,
                       std::unique_ptr<Tokenizer> tokenizer, int32_t image_token_id)
    : options_(std::move(options)),
      manifest_(std::move(manifest)),
      tokenizer_(std::move(tokenizer)),
      image_token_id_(image_token_id) {}

absl::StatusOr<SourceStamps> StampSources(const LoaderOptions& options) {
  SourceStamps stamps;
  absl::StatusOr<FileStamp> manifest = StatFile(options.manifest);
  if (!manifest.ok()) return Annotate(manifest.status(), "manifest");
  stamps.manifest = *manifest;
  absl::StatusOr<FileStamp> tokenizer = StatFile(options.tokenizer);
  if (!tokenizer.ok()) return Annotate(tokenizer.status(), "tokenizer");
  stamps.tokenizer = *tokenizer;
  const std::string config =
      (std::filesystem::path(options.tokenizer).parent_path() / "tokenizer_config.json").string();
  if (absl::StatusOr<FileStamp> stamp = StatFile(config); stamp.ok()) {
    stamps.tokenizer_config = *stamp;
  } else if (!absl::IsNotFound(stamp.status())) {
    return Annotate(stamp.status(), "tokenizer config");
  }
  return stamps;
}

absl::StatusOr<std::unique_ptr<DataLoader>> DataLoader::Create(const LoaderOptions& options,
                                                               const std::atomic<bool>* cancel) {
  if (options.image_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("loader image_size=", options.image_size, "; expected >= 1"));
  }
  if (options.tokens_per_image <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("loader tokens_per_image=", options.tokens_per_image, "; expected >= 1"));
  }
  if (options.seq_len < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("loader seq_len=", options.seq_len, "; expected >= 2"));
  }
  if (options.image_token.empty()) {
    return absl::InvalidArgumentError("loader image_token is empty; expected e.g. <image>");
  }
  for (int c = 0; c < 3; ++c) {
    if (!(options.normalization.stddev[c] > 0)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "normalisation stddev[", c, "]=", options.normalization.stddev[c], "; expected > 0"));
    }
  }
  // Before reading them, and again after (below); a stat that fails leaves them unknown (the
  // reads below then say why).
  absl::StatusOr<SourceStamps> stamps = StampSources(options);
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = Tokenizer::Load(options.tokenizer);
  if (!tokenizer.ok()) return tokenizer.status();
  if (options.max_vocab > 0 && (*tokenizer)->vocab_size() > options.max_vocab) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokenizer ", options.tokenizer, " has ", (*tokenizer)->vocab_size(),
                     " pieces > llm.model.vocab=", options.max_vocab,
                     "; train it with a vocabulary of at most ", options.max_vocab, " pieces"));
  }
  std::optional<int32_t> image_id = (*tokenizer)->PieceId(options.image_token);
  if (!image_id) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokenizer ", options.tokenizer, " has no piece for the image token '",
                     options.image_token, "'; train it with '", options.image_token,
                     "' as a user-defined symbol (hetpar data synth does)"));
  }
  absl::StatusOr<Manifest> manifest =
      ReadManifest(options.manifest, options.skip_bad_samples, cancel);
  if (!manifest.ok()) return manifest.status();
  std::unique_ptr<DataLoader> loader(
      new DataLoader(options, std::move(*manifest), std::move(*tokenizer), *image_id));
  if (stamps.ok()) {
    loader->stamps_ = *stamps;
    // A file replaced while it was read (after the first stat): what was read is of neither
    // stamp, so it is given one that no file has, and an index of it is never taken for fresh.
    absl::StatusOr<SourceStamps> after = StampSources(options);
    if (!after.ok() || after->manifest != stamps->manifest ||
        after->tokenizer != stamps->tokenizer ||
        after->tokenizer_config != stamps->tokenizer_config) {
      loader->stamps_->manifest = FileStamp{-3, -3};
    }
  }
  return loader;
}

absl::StatusOr<int64_t> DataLoader::Ordinal(const std::string& id) const {
  std::optional<int64_t> ordinal = manifest_.Find(id);
  if (!ordinal) {
    return absl::NotFoundError(
        absl::StrCat("sample '", id, "' is not in manifest ", manifest_.path));
  }
  return *ordinal;
}

absl::Status DataLoader::CheckOrdinal(int64_t ordinal) const {
  if (ordinal < 0 || ordinal >= size()) {
    return absl::OutOfRangeError(absl::StrCat("sample ordinal ", ordinal, " is outside [0, ",
                                              size(), ") of manifest ", manifest_.path));
  }
  return absl::OkStatus();
}

absl::Status DataLoader::SampleError(const ManifestRecord& record, absl::StatusCode code,
                                     const std::string& reason) const {
  BadSample bad;
  bad.id = record.id;
  bad.where = Where(manifest_, record);
  bad.line = record.line;
  bad.reason = reason;
  bad.code = code;
  return bad.ToStatus();
}

BadSample DataLoader::DescribeProblem(int64_t ordinal, const absl::Status& status) const {
  BadSample bad;
  bad.code = status.code();
  bad.reason = std::string(status.message());
  if (ordinal < 0 || ordinal >= size()) return bad;
  const ManifestRecord& record = manifest_.records[static_cast<size_t>(ordinal)];
  bad.id = record.id;
  bad.where = Where(manifest_, record);
  bad.line = record.line;
  // Strip the "sample 'id' (where): " prefix SampleError wrote.
  BadSample prefix = bad;
  prefix.reason.clear();
  const std::string head = prefix.ToString();
  if (bad.reason.compare(0, head.size(), head) == 0) bad.reason.erase(0, head.size());
  if (auto path = status.GetPayload(kPathPayload)) {
    bad.path = std::string(*path);
  }
  if (auto stamp = status.GetPayload(kPathStampPayload)) {
    const std::vector<std::string> parts = absl::StrSplit(std::string(*stamp), ' ');
    FileStamp parsed;
    if (parts.size() == 2 && absl::SimpleAtoi(parts[0], &parsed.size) &&
        absl::SimpleAtoi(parts[1], &parsed.mtime_ns)) {
      bad.path_stamp = parsed;
    }
  }
  return bad;
}

absl::StatusOr<TokenSequence> DataLoader::Tokenize(int64_t ordinal) const {
  if (absl::Status s = CheckOrdinal(ordinal); !s.ok()) return s;
  const ManifestRecord& record = manifest_.records[static_cast<size_t>(ordinal)];
  // A prompt/text record is the plain template's one-turn conversation.
  const bool conversation = !record.conversation.empty();
  const std::vector<ChatPart> parts =
      conversation
          ? ApplyChatTemplate(options_.chat_template, record.conversation)
          : ApplyChatTemplate(ChatTemplate::kPlain, {ChatTurn{ChatRole::kUser, record.prompt},
                                                     ChatTurn{ChatRole::kAssistant, record.text}});
  absl::StatusOr<EncodedChat> encoded = EncodeChatParts(parts, *tokenizer_, options_.image_token);
  if (!encoded.ok()) {
    return SampleError(record, encoded.status().code(), std::string(encoded.status().message()));
  }
  if (encoded->image_placeholders != static_cast<int>(record.images.size())) {
    return SampleError(
        record, absl::StatusCode::kInvalidArgument,
        absl::StrCat(conversation ? "conversations hold " : "prompt and text hold ",
                     encoded->image_placeholders, " '", options_.image_token,
                     "' placeholder(s) but ",
                     conversation ? "the sample names " : "\"images\" lists ", record.images.size(),
                     conversation ? " image file(s); " : " file(s); ",
                     "expected one placeholder per image"));
  }
  SequenceOptions seq;
  seq.tokens_per_image = options_.tokens_per_image;
  seq.seq_len = options_.seq_len;
  seq.overlong = options_.overlong;
  seq.image_token_id = image_token_id_;
  absl::StatusOr<TokenSequence> sequence = BuildTokenSequence(encoded->segments, seq);
  if (!sequence.ok()) {
    return SampleError(record, sequence.status().code(), std::string(sequence.status().message()));
  }
  return sequence;
}

absl::StatusOr<std::vector<float>> DataLoader::LoadImage(const ManifestRecord& record,
                                                         size_t k) const {
  const std::string path = manifest_.ResolveImagePath(record.images[k]);
  absl::StatusOr<std::string> bytes = ReadFileToString(path, kMaxImageFileBytes);
  absl::Status error;
  if (!bytes.ok()) {
    error = SampleError(record, bytes.status().code(),
                        bytes.status().code() == absl::StatusCode::kNotFound
                            ? absl::StrCat("image file not found: ", path)
                            : std::string(bytes.status().message()));
  } else {
    absl::StatusOr<RgbImage> image = DecodeImage(*bytes, path);
    if (image.ok()) {
      return ToNormalizedChw(ResizeImage(*image, options_.image_size, options_.image_size),
                             options_.normalization);
    }
    error = SampleError(record, image.status().code(), std::string(image.status().message()));
  }
  error.SetPayload(kPathPayload, absl::Cord(path));
  return error;
}

absl::StatusOr<IndexRecord> DataLoader::Describe(int64_t ordinal, bool verify_images) const {
  absl::StatusOr<TokenSequence> sequence = Tokenize(ordinal);
  if (!sequence.ok()) return sequence.status();
  const ManifestRecord& record = manifest_.records[static_cast<size_t>(ordinal)];
  for (size_t k = 0; k < static_cast<size_t>(sequence->images()); ++k) {
    // A regular file (a FIFO or a device would hang or never end), then decoded when asked.
    const std::string path = manifest_.ResolveImagePath(record.images[k]);
    absl::StatusOr<FileStamp> stamp = StatFile(path);
    if (!stamp.ok()) {
      absl::Status error = SampleError(record, stamp.status().code(),
                                       stamp.status().code() == absl::StatusCode::kNotFound
                                           ? absl::StrCat("image file not found: ", path)
                                           : std::string(stamp.status().message()));
      error.SetPayload(kPathPayload, absl::Cord(path));
      if (absl::IsNotFound(stamp.status())) SetPathStamp(&error, FileStamp{-1, -1});
      return error;
    }
    if (verify_images) {
      absl::StatusOr<std::vector<float>> image = LoadImage(record, k);
      if (!image.ok()) {
        // The stamp from before the read: a file repaired since differs from it.
        absl::Status error = image.status();
        SetPathStamp(&error, *stamp);
        return error;
      }
    }
  }
  IndexRecord out;
  out.id = record.id;
  out.ordinal = ordinal;
  out.line = record.line;
  out.image_count = sequence->images();
  out.tokens_per_image = options_.tokens_per_image;
  out.text_tokens = sequence->text_tokens;
  out.loss_tokens = sequence->loss_tokens;
  out.image_offsets = sequence->image_offsets;
  out.truncated = sequence->truncated;
  out.token_checksum = sequence->Checksum();
  return out;
}

absl::StatusOr<LoadedSample> DataLoader::Load(int64_t ordinal) const {
  absl::StatusOr<TokenSequence> sequence = Tokenize(ordinal);
  if (!sequence.ok()) return sequence.status();
  const ManifestRecord& record = manifest_.records[static_cast<size_t>(ordinal)];
  LoadedSample sample;
  sample.id = record.id;
  sample.ordinal = ordinal;
  sample.images.reserve(static_cast<size_t>(sequence->images()));
  const size_t pixels = static_cast<size_t>(options_.image_size) * options_.image_size * 3;
  for (size_t k = 0; k < static_cast<size_t>(sequence->images()); ++k) {
    if (options_.blank_images) {
      sample.images.emplace_back(pixels, 0.0f);
      continue;
    }
    absl::StatusOr<std::vector<float>> image = LoadImage(record, k);
    if (!image.ok()) return image.status();
    sample.images.push_back(std::move(*image));
  }
  sample.tokens = std::move(*sequence);
  return sample;
}

absl::StatusOr<std::vector<float>> DataLoader::LoadImage(int64_t ordinal, int64_t k) const {
  if (absl::Status s = CheckOrdinal(ordinal); !s.ok()) return s;
  const ManifestRecord& record = manifest_.records[static_cast<size_t>(ordinal)];
  if (k < 0 || k >= static_cast<int64_t>(record.images.size())) {
    return absl::OutOfRangeError(
        absl::StrCat("sample '", record.id, "' (", Where(manifest_, record), ") has ",
                     record.images.size(), " images; asked for image ", k));
  }
  if (options_.blank_images) {
    return std::vector<float>(static_cast<size_t>(options_.image_size) * options_.image_size * 3,
                              0.0f);
  }
  return LoadImage(record, static_cast<size_t>(k));
}

absl::StatusOr<LoadedSample> DataLoader::LoadById(const std::string& id) const {
  absl::StatusOr<int64_t> ordinal = Ordinal(id);
  if (!ordinal.ok()) return ordinal.status();
  return Load(*ordinal);
}

}  // namespace hetpar::data
