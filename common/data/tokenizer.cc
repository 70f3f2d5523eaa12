#include "common/data/tokenizer.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <set>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/data/bpe_tokenizer.h"
#include "common/data/file_util.h"
#include "common/data/sentencepiece_bridge.h"

namespace hetpar::data {
namespace {

constexpr char kModuleName[] = "libhetpar_sentencepiece.so";
constexpr char kModuleEnv[] = "HETPAR_SENTENCEPIECE_MODULE";

// Reserved ids: <unk> 0, <s> 1, </s> 2, <pad> 3.
constexpr int kReservedPieces = 4;

// The one translation of the module's (sentencepiece's) errors into absl::Status.
absl::Status ModuleStatus(const HetparSpmApi* api, int code, char* error,
                          std::string_view context) {
  std::string message = error != nullptr ? error : "unknown error";
  if (error != nullptr) api->release(error);
  if (code == 0) return absl::OkStatus();
  absl::StatusCode status_code = absl::StatusCode::kUnknown;
  if (code > 0 && code <= static_cast<int>(absl::StatusCode::kUnauthenticated)) {
    status_code = static_cast<absl::StatusCode>(code);
  }
  return absl::Status(status_code, absl::StrCat(std::string(context), ": ", message));
}

absl::StatusOr<const HetparSpmApi*> LoadModule() {
  std::vector<std::string> candidates;
  if (const char* env = std::getenv(kModuleEnv); env != nullptr && env[0] != '\0') {
    candidates.push_back(env);
  }
#ifdef HETPAR_SENTENCEPIECE_MODULE_PATH
  candidates.push_back(HETPAR_SENTENCEPIECE_MODULE_PATH);
#endif
  std::error_code ec;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) candidates.push_back((exe.parent_path() / kModuleName).string());
  std::string tried;
  for (const std::string& path : candidates) {
    void* handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
    if (handle == nullptr) {
      const char* why = ::dlerror();
      absl::StrAppend(&tried, "\n  ", path, ": ", why != nullptr ? why : "cannot load");
      continue;
    }
    auto entry = reinterpret_cast<HetparSpmApiFn>(::dlsym(handle, "hetpar_spm_api"));
    const HetparSpmApi* api = entry != nullptr ? entry() : nullptr;
    if (api == nullptr || api->version != kHetparSpmApiVersion) {
      absl::StrAppend(&tried, "\n  ", path, ": not a hetpar sentencepiece module of version ",
                      kHetparSpmApiVersion);
      ::dlclose(handle);
      continue;
    }
    return api;  // stays loaded for the life of the process
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "cannot load the sentencepiece module ", kModuleName,
      " (build target hetpar_sentencepiece; or set ", kModuleEnv, " to its path); tried:", tried));
}

absl::StatusOr<const HetparSpmApi*> SentencePieceApi() {
  static std::once_flag once;
  static absl::StatusOr<const HetparSpmApi*>* api = nullptr;
  std::call_once(once, [] { api = new absl::StatusOr<const HetparSpmApi*>(LoadModule()); });
  return *api;
}

}  // namespace

Tokenizer::Tokenizer(const HetparSpmApi* api, HetparSpmProcessor* processor, std::string source)
    : api_(api), processor_(processor), source_(std::move(source)) {
  unk_id_ = api_->special_id(processor_, 0);
  bos_id_ = api_->special_id(processor_, 1);
  eos_id_ = api_->special_id(processor_, 2);
  pad_id_ = api_->special_id(processor_, 3);
  const int size = api_->piece_size(processor_);
  pieces_.reserve(static_cast<size_t>(size));
  for (int id = 0; id < size; ++id) {
    char* piece = nullptr;
    size_t piece_size = 0;
    if (api_->id_to_piece(processor_, id, &piece, &piece_size) == 0) {
      pieces_.emplace_back(piece, piece_size);
      api_->release(piece);
    } else {
      pieces_.emplace_back();
    }
    piece_ids_.emplace(pieces_.back(), id);
  }
}

Tokenizer::Tokenizer(std::unique_ptr<BpeTokenizer> bpe) : bpe_(std::move(bpe)) {
  source_ = bpe_->source();
  unk_id_ = bpe_->unk_id();
  bos_id_ = bpe_->bos_id();
  eos_id_ = bpe_->eos_id();
  pad_id_ = bpe_->pad_id();
}

Tokenizer::~Tokenizer() {
  if (api_ != nullptr) api_->destroy(processor_);
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::Load(const std::string& path) {
  if (absl::EndsWith(path, ".json")) {
    absl::StatusOr<std::unique_ptr<BpeTokenizer>> bpe = BpeTokenizer::Load(path);
    if (!bpe.ok()) return bpe.status();
    return std::unique_ptr<Tokenizer>(new Tokenizer(*std::move(bpe)));
  }
  absl::StatusOr<std::string> model = ReadFileToString(path);
  if (!model.ok()) {
    return absl::Status(model.status().code(),
                        absl::StrCat("tokenizer: ", model.status().message()));
  }
  return FromSerialized(*model, path);
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromSerialized(const std::string& model,
                                                                     std::string_view source) {
  absl::StatusOr<const HetparSpmApi*> api = SentencePieceApi();
  if (!api.ok()) return api.status();
  HetparSpmProcessor* processor = nullptr;
  char* error = nullptr;
  const int code = (*api)->load(model.data(), model.size(), &processor, &error);
  if (code != 0) {
    absl::Status s = ModuleStatus(*api, code, error, "sentencepiece");
    return absl::InvalidArgumentError(absl::StrCat("tokenizer ", std::string(source),
                                                   " is not a sentencepiece model (", model.size(),
                                                   " bytes): ", s.message()));
  }
  if ((*api)->piece_size(processor) <= 0) {
    (*api)->destroy(processor);
    return absl::InvalidArgumentError(
        absl::StrCat("tokenizer ", std::string(source), " has an empty vocabulary"));
  }
  return std::unique_ptr<Tokenizer>(new Tokenizer(*api, processor, std::string(source)));
}

absl::StatusOr<std::vector<int32_t>> Tokenizer::Encode(std::string_view text) const {
  if (bpe_ != nullptr) return bpe_->Encode(text);
  int* ids = nullptr;
  size_t count = 0;
  char* error = nullptr;
  const int code = api_->encode(processor_, text.data(), text.size(), &ids, &count, &error);
  if (code != 0) return ModuleStatus(api_, code, error, "tokenizer " + source_);
  std::vector<int32_t> out(ids, ids + count);
  api_->release(ids);
  return out;
}

absl::StatusOr<std::string> Tokenizer::Decode(const std::vector<int32_t>& ids) const {
  if (bpe_ != nullptr) return bpe_->Decode(ids, /*skip_special_tokens=*/false);
  const int32_t size = vocab_size();
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= size) {
      return absl::InvalidArgumentError(absl::StrCat("token id ", ids[i], " at position ", i,
                                                     " is outside the vocabulary [0, ", size,
                                                     ") of tokenizer ", source_));
    }
  }
  const std::vector<int> as_int(ids.begin(), ids.end());
  char* text = nullptr;
  size_t text_size = 0;
  char* error = nullptr;
  const int code =
      api_->decode(processor_, as_int.data(), as_int.size(), &text, &text_size, &error);
  if (code != 0) return ModuleStatus(api_, code, error, "tokenizer " + source_);
  std::string out(text, text_size);
  api_->release(text);
  return out;
}

int32_t Tokenizer::vocab_size() const {
  if (bpe_ != nullptr) return bpe_->vocab_size();
  return static_cast<int32_t>(pieces_.size());
}

std::optional<int32_t> Tokenizer::PieceId(std::string_view piece) const {
  if (bpe_ != nullptr) return bpe_->PieceId(piece);
  auto it = piece_ids_.find(std::string(piece));
  if (it == piece_ids_.end()) return std::nullopt;
  return it->second;
}

std::string Tokenizer::Piece(int32_t id) const {
  if (bpe_ != nullptr) return bpe_->Piece(id);
  if (id < 0 || id >= vocab_size()) return "";
  return pieces_[static_cast<size_t>(id)];
}

absl::StatusOr<std::string> TrainTokenizer(const std::vector<std::string>& sentences,
                                           const TokenizerTrainOptions& options) {
  if (sentences.empty()) {
    return absl::InvalidArgumentError("tokenizer training needs at least one sentence; got none");
  }
  if (options.model_type != "bpe" && options.model_type != "unigram") {
    return absl::InvalidArgumentError(absl::StrCat("tokenizer model_type '", options.model_type,
                                                   "' is not supported; expected bpe or unigram"));
  }
  std::set<unsigned char> characters;
  for (const std::string& s : sentences) {
    for (unsigned char c : s) {
      // Count code points by their lead bytes; continuation bytes (10xxxxxx) are skipped.
      if ((c & 0xc0) != 0x80 && c != ' ') characters.insert(c);
    }
  }
  // Every character is a piece, plus the word-start marker, the reserved and the user pieces.
  const int32_t reserved = kReservedPieces + static_cast<int32_t>(options.user_symbols.size());
  const int32_t minimum = static_cast<int32_t>(characters.size()) + 1 + reserved;
  if (options.vocab_size < minimum) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tokenizer vocab_size=", options.vocab_size, " is too small: the sentences have ",
        characters.size(), " distinct characters and there are ", reserved,
        " reserved/user pieces; expected vocab_size >= ", minimum));
  }
  std::string user_symbols;
  for (const std::string& symbol : options.user_symbols) {
    if (symbol.empty() || symbol.find_first_of(", \t\n") != std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tokenizer user symbol '", symbol, "' must be non-empty without ',' or whitespace"));
    }
    if (!user_symbols.empty()) user_symbols += ",";
    user_symbols += symbol;
  }
  std::vector<std::pair<std::string, std::string>> flags = {
      {"model_type", options.model_type},
      {"vocab_size", std::to_string(options.vocab_size)},
      {"hard_vocab_limit", "false"},
      {"character_coverage", "1.0"},
      {"num_threads", "1"},
      {"input_sentence_size", "0"},
      {"shuffle_input_sentence", "false"},
      {"normalization_rule_name", "identity"},
      {"unk_id", "0"},
      {"bos_id", "1"},
      {"eos_id", "2"},
      {"pad_id", "3"},
      {"minloglevel", "2"},
  };
  if (!user_symbols.empty()) flags.emplace_back("user_defined_symbols", user_symbols);

  absl::StatusOr<const HetparSpmApi*> api = SentencePieceApi();
  if (!api.ok()) return api.status();
  std::vector<const char*> data;
  std::vector<size_t> sizes;
  for (const std::string& s : sentences) {
    data.push_back(s.data());
    sizes.push_back(s.size());
  }
  std::vector<const char*> keys, values;
  for (const auto& [key, value] : flags) {
    keys.push_back(key.c_str());
    values.push_back(value.c_str());
  }
  char* model = nullptr;
  size_t model_size = 0;
  char* error = nullptr;
  const int code = (*api)->train(data.data(), sizes.data(), data.size(), keys.data(), values.data(),
                                 keys.size(), &model, &model_size, &error);
  if (code != 0) return ModuleStatus(*api, code, error, "training the tokenizer");
  std::string out(model, model_size);
  (*api)->release(model);
  return out;
}

}  // namespace hetpar::data
