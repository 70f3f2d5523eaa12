// BpeTokenizer against its oracle, the Hugging Face libraries: tests/data/bpe_oracle.py trains
// byte-level BPE tokenizers with `tokenizers` and records what transformers encodes and decodes;
// every record must come out of hetpar identically. Also the refusals and their messages.
#include "common/data/bpe_tokenizer.h"

#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/data/tokenizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

#ifndef HETPAR_PYTHON
#error "HETPAR_PYTHON must name the project's Python (common/data/CMakeLists.txt)"
#endif
#ifndef HETPAR_SOURCE_DIR
#error "HETPAR_SOURCE_DIR must name the source tree (common/data/CMakeLists.txt)"
#endif

namespace hetpar::data {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;
using ::testing::HasSubstr;

// Text for failure messages: JSON-escaped, so that "\r\n" and U+180E are visible.
std::string Quoted(const std::string& text) {
  return Json(text).dump(-1, ' ', false, Json::error_handler_t::replace);
}

std::string IdsText(const std::vector<int32_t>& ids) { return Json(ids).dump(); }

std::vector<Json> ReadJsonLines(const fs::path& path) {
  std::vector<Json> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) out.push_back(Json::parse(line));
  return out;
}

// Runs tests/data/bpe_oracle.py once for the whole binary, into a fresh temporary directory.
class OracleOutput {
 public:
  static const OracleOutput& Get() {
    static const OracleOutput* const output = new OracleOutput();
    return *output;
  }
  // Empty when the oracle ran; else why not, for the assertion message.
  const std::string& error() const { return error_; }
  fs::path Folder(const std::string& name) const { return fs::path(dir_) / name; }
  double seconds() const { return seconds_; }

 private:
  OracleOutput() {
    dir_ = (fs::temp_directory_path() / "hetpar_bpe_oracle_XXXXXX").string();
    if (::mkdtemp(dir_.data()) == nullptr) {
      error_ = absl::StrCat("mkdtemp: ", std::strerror(errno));
      return;
    }
    std::atexit([] { fs::remove_all(Get().dir_); });
    const std::string python = HETPAR_PYTHON;
    const std::string script = absl::StrCat(HETPAR_SOURCE_DIR, "/tests/data/bpe_oracle.py");
    if (!fs::exists(python)) {
      error_ = absl::StrCat("HETPAR_PYTHON (", python,
                            ") does not exist: the Hugging Face oracle of this test needs the "
                            "project's Python with transformers; run deploy/install-deps.sh");
      return;
    }
    const std::string command = absl::StrCat("'", python, "' '", script, "' '", dir_, "' 2>&1");
    const auto start = std::chrono::steady_clock::now();
    FILE* pipe = ::popen(command.c_str(), "r");
    if (pipe == nullptr) {
      error_ = absl::StrCat("popen(", command, "): ", std::strerror(errno));
      return;
    }
    std::string output;
    char buffer[4096];
    size_t n;
    while ((n = ::fread(buffer, 1, sizeof(buffer), pipe)) > 0) output.append(buffer, n);
    const int status = ::pclose(pipe);
    seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      error_ = absl::StrCat("the oracle ", script, " failed (status ", status,
                            "); it needs transformers and tokenizers in ", python,
                            " (run deploy/install-deps.sh). It said:\n", output);
    }
  }

  std::string dir_;
  std::string error_;
  double seconds_ = 0;
};

class BpeOracleTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const OracleOutput& oracle = OracleOutput::Get();
    ASSERT_TRUE(oracle.error().empty()) << oracle.error();
    folder_ = oracle.Folder(GetParam());
    absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer =
        Tokenizer::Load((folder_ / "tokenizer.json").string());
    ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
    tokenizer_ = *std::move(tokenizer);
    absl::StatusOr<std::unique_ptr<BpeTokenizer>> bpe =
        BpeTokenizer::Load((folder_ / "tokenizer.json").string());
    ASSERT_TRUE(bpe.ok()) << bpe.status();
    bpe_ = *std::move(bpe);
  }

  fs::path folder_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<BpeTokenizer> bpe_;
};

TEST_P(BpeOracleTest, EncodesAndDecodesEveryLineAsTransformers) {
  const std::vector<Json> records = ReadJsonLines(folder_ / "encode.jsonl");
  ASSERT_GT(records.size(), 3000u);
  int encode_mismatches = 0;
  int decode_mismatches = 0;
  size_t tokens = 0;
  std::chrono::duration<double> encode_time{0};
  for (const Json& record : records) {
    const std::string text = record["text"].get<std::string>();
    const std::vector<int32_t> expected = record["ids"].get<std::vector<int32_t>>();
    const auto start = std::chrono::steady_clock::now();
    absl::StatusOr<std::vector<int32_t>> ids = tokenizer_->Encode(text);
    encode_time += std::chrono::steady_clock::now() - start;
    ASSERT_TRUE(ids.ok()) << ids.status() << " for " << Quoted(text);
    tokens += ids->size();
    if (*ids != expected && ++encode_mismatches <= 5) {
      size_t at = 0;
      while (at < ids->size() && at < expected.size() && (*ids)[at] == expected[at]) ++at;
      ADD_FAILURE() << GetParam() << ": Encode(" << Quoted(text)
                    << ")\n  hetpar:       " << IdsText(*ids)
                    << "\n  transformers: " << IdsText(expected) << "\n  first difference at index "
                    << at;
    }
    // Decode the oracle's ids, so that a decode difference shows even where encode differs.
    absl::StatusOr<std::string> decoded = tokenizer_->Decode(expected);
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    absl::StatusOr<std::string> skipped = bpe_->Decode(expected, /*skip_special_tokens=*/true);
    ASSERT_TRUE(skipped.ok()) << skipped.status();
    if ((*decoded != record["decoded"] || *skipped != record["decoded_skip"]) &&
        ++decode_mismatches <= 5) {
      ADD_FAILURE() << GetParam() << ": Decode(" << IdsText(expected) << ") of " << Quoted(text)
                    << "\n  hetpar:       " << Quoted(*decoded) << " / skipping "
                    << Quoted(*skipped) << "\n  transformers: " << record["decoded"].dump()
                    << " / skipping " << record["decoded_skip"].dump();
    }
  }
  EXPECT_EQ(encode_mismatches, 0) << "of " << records.size() << " texts";
  EXPECT_EQ(decode_mismatches, 0) << "of " << records.size() << " texts";
  std::cout << GetParam() << ": " << records.size() << " texts, " << tokens << " tokens encoded in "
            << encode_time.count() * 1e3 << " ms (oracle script: " << OracleOutput::Get().seconds()
            << " s)\n";
}

TEST_P(BpeOracleTest, DecodesRandomIdsAsTransformers) {
  const std::vector<Json> records = ReadJsonLines(folder_ / "decode.jsonl");
  ASSERT_GE(records.size(), 400u);
  int mismatches = 0;
  for (const Json& record : records) {
    const std::vector<int32_t> ids = record["ids"].get<std::vector<int32_t>>();
    absl::StatusOr<std::string> decoded = bpe_->Decode(ids);
    absl::StatusOr<std::string> skipped = bpe_->Decode(ids, /*skip_special_tokens=*/true);
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    ASSERT_TRUE(skipped.ok()) << skipped.status();
    if ((*decoded != record["decoded"] || *skipped != record["decoded_skip"]) &&
        ++mismatches <= 5) {
      ADD_FAILURE() << GetParam() << ": Decode(" << IdsText(ids)
                    << ")\n  hetpar:       " << Quoted(*decoded) << " / skipping "
                    << Quoted(*skipped) << "\n  transformers: " << record["decoded"].dump()
                    << " / skipping " << record["decoded_skip"].dump();
    }
  }
  EXPECT_EQ(mismatches, 0) << "of " << records.size() << " id lists";
}

TEST_P(BpeOracleTest, PiecesVocabularySizeAndSpecialIds) {
  std::ifstream in(folder_ / "meta.json");
  const Json meta = Json::parse(in);
  EXPECT_EQ(tokenizer_->vocab_size(), meta["vocab_size"].get<int32_t>());
  int mismatches = 0;
  for (const Json& entry : meta["pieces"]) {
    const auto id = entry[0].get<int32_t>();
    const auto piece = entry[1].get<std::string>();
    const std::optional<int32_t> found = tokenizer_->PieceId(piece);
    if ((tokenizer_->Piece(id) != piece || found != id) && ++mismatches <= 5) {
      ADD_FAILURE() << "id " << id << ": Piece " << Quoted(tokenizer_->Piece(id)) << ", PieceId("
                    << Quoted(piece) << ") " << (found.has_value() ? *found : -1)
                    << "; transformers: " << Quoted(piece);
    }
  }
  EXPECT_EQ(mismatches, 0);
  EXPECT_GT(meta["pieces"].size(), 1000u);
  EXPECT_EQ(tokenizer_->Piece(-1), "");
  EXPECT_EQ(tokenizer_->Piece(tokenizer_->vocab_size()), "");
  EXPECT_EQ(tokenizer_->PieceId("no such piece"), std::nullopt);

  const Json& special = meta["special_ids"];
  SCOPED_TRACE(meta["special_ids_from"].get<std::string>());
  EXPECT_EQ(tokenizer_->bos_id(), special["bos"].get<int32_t>());
  EXPECT_EQ(tokenizer_->eos_id(), special["eos"].get<int32_t>());
  EXPECT_EQ(tokenizer_->pad_id(), special["pad"].get<int32_t>());
  EXPECT_EQ(tokenizer_->unk_id(), special["unk"].get<int32_t>());
  EXPECT_EQ(tokenizer_->source(), (folder_ / "tokenizer.json").string());
}

TEST_P(BpeOracleTest, EncodesConcurrentlyFromManyThreads) {
  const std::vector<Json> records = ReadJsonLines(folder_ / "encode.jsonl");
  std::vector<int> mismatches(4, 0);
  std::vector<std::thread> threads;
  for (size_t t = 0; t < mismatches.size(); ++t) {
    threads.emplace_back([&, t] {
      for (size_t i = t; i < records.size(); i += 2) {  // overlapping halves
        absl::StatusOr<std::vector<int32_t>> ids =
            tokenizer_->Encode(records[i]["text"].get<std::string>());
        if (!ids.ok() || *ids != records[i]["ids"].get<std::vector<int32_t>>()) ++mismatches[t];
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_THAT(mismatches, ::testing::Each(0));
}

INSTANTIATE_TEST_SUITE_P(HuggingFace, BpeOracleTest,
                         ::testing::Values("llama3", "gpt2", "gpt2_prefix_space", "gpt2_escapes",
                                           "gpt2_unk"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

// ---- Without the oracle: hand-made files, refusals and their messages ----

// The byte-level character of `byte` (GPT-2's bytes_to_unicode).
std::string ByteChar(int byte) {
  int code = byte;
  if (!((byte >= 0x21 && byte <= 0x7E) || (byte >= 0xA1 && byte <= 0xAC) || byte >= 0xAE)) {
    code = 256;
    for (int b = 0; b < byte; ++b) {
      if (!((b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE)) ++code;
    }
  }
  std::string out;
  if (code < 0x80) {
    out.push_back(static_cast<char>(code));
  } else {
    out.push_back(static_cast<char>(0xC0 | (code >> 6)));
    out.push_back(static_cast<char>(0x80 | (code & 0x3F)));
  }
  return out;
}

// Every byte (ids 0..255 in byte order), then "ab" (256), "Ġab" (257), and <s> (258) added.
Json HandMade() {
  Json vocab = Json::object();
  for (int b = 0; b < 256; ++b) vocab[ByteChar(b)] = b;
  vocab["ab"] = 256;
  vocab["Ġab"] = 257;
  return {
      {"version", "1.0"},
      {"added_tokens",
       {{{"id", 258},
         {"content", "<s>"},
         {"single_word", false},
         {"lstrip", false},
         {"rstrip", false},
         {"normalized", false},
         {"special", true}}}},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
      {"post_processor", nullptr},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", nullptr},
        {"byte_fallback", false},
        {"ignore_merges", false},
        {"vocab", vocab},
        {"merges", {"a b", "Ġ ab"}}}},
  };
}

class BpeTokenizerFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (fs::temp_directory_path() / "hetpar_bpe_tokenizer_XXXXXX").string();
    ASSERT_NE(::mkdtemp(dir_.data()), nullptr);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string Write(const std::string& name, const std::string& contents) {
    std::string path = (fs::path(dir_) / name).string();
    fs::create_directories(fs::path(path).parent_path());
    std::ofstream(path) << contents;
    return path;
  }
  // Loads HandMade() after `edit`; the status.
  absl::Status LoadEdited(const std::function<void(Json&)>& edit) {
    Json json = HandMade();
    edit(json);
    return Tokenizer::Load(Write("edited/tokenizer.json", json.dump())).status();
  }

  std::string dir_;
};

TEST_F(BpeTokenizerFileTest, HandMadeFileEncodesMergesAndAddedTokens) {
  const std::string path = Write("tokenizer.json", HandMade().dump());
  absl::StatusOr<std::unique_ptr<Tokenizer>> t = Tokenizer::Load(path);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ((*t)->vocab_size(), 259);
  absl::StatusOr<std::vector<int32_t>> ids = (*t)->Encode("<s>ab abc\xC3\xA9");
  ASSERT_TRUE(ids.ok()) << ids.status();
  // <s> | "ab" | " abcé" -> Ġab, c, then the two bytes of é.
  EXPECT_EQ(*ids, (std::vector<int32_t>{258, 256, 257, 'c', 0xC3, 0xA9}));
  EXPECT_EQ(*(*t)->Decode(*ids), "<s>ab abc\xC3\xA9");
  // A cut character decodes to U+FFFD, as Rust's from_utf8_lossy.
  EXPECT_EQ(*(*t)->Decode({'a', 0xC3, 'b'}),
            "a\xEF\xBF\xBD"
            "b");
  // No tokenizer_config.json: bos is the added <s>, eos the first well-known name (none here).
  EXPECT_EQ((*t)->bos_id(), 258);
  EXPECT_EQ((*t)->eos_id(), -1);
  EXPECT_EQ((*t)->pad_id(), -1);
  EXPECT_EQ((*t)->unk_id(), -1);
  EXPECT_EQ((*t)->PieceId("Ġab"), 257);
  EXPECT_EQ((*t)->Piece(32), ByteChar(32));
  EXPECT_EQ(ByteChar(32), "Ġ");
}

// Long runs of one class (one huge pre-token, or a regex that backtracks over the whole run)
// must neither overflow PCRE2's JIT stack nor take quadratic time; byte-level BPE round-trips.
TEST_F(BpeTokenizerFileTest, LongRunsEncodeQuicklyAndRoundTrip) {
  Json llama_style = HandMade();
  llama_style["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers",
       {{{"type", "Split"},
         {"pattern",
          {{"Regex",
            R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"}}},
         {"behavior", "Isolated"},
         {"invert", false}},
        {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}};
  std::string chinese, emoji, letters;
  for (int i = 0; i < 50000; ++i) {
    chinese += "\xE4\xB8\xAD";    // 中
    emoji += "\xF0\x9F\x91\x8D";  // 👍
    letters += (i % 2 == 0) ? "ab" : "a";
  }
  const std::string texts[] = {std::string(200000, ' ') + "x",
                               std::string(200000, '\n'),
                               std::string(100000, ' ') + "\t\n" + std::string(100000, ' '),
                               chinese,
                               emoji,
                               letters,
                               std::string(200000, '7')};
  for (const Json& json : {HandMade(), llama_style}) {
    absl::StatusOr<std::unique_ptr<BpeTokenizer>> t =
        BpeTokenizer::FromJson(json.dump(), "", "long.json");
    ASSERT_TRUE(t.ok()) << t.status();
    for (const std::string& text : texts) {
      const auto start = std::chrono::steady_clock::now();
      absl::StatusOr<std::vector<int32_t>> ids = (*t)->Encode(text);
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      ASSERT_TRUE(ids.ok()) << ids.status();
      // Printed, not asserted (timings belong in benchmarks): a pre-token or merge loop that
      // went quadratic on these 200 KB inputs would show here, and hit the test's timeout.
      std::cout << text.size() << " bytes starting " << Quoted(text.substr(0, 8)) << ": "
                << seconds * 1e3 << " ms\n";
      absl::StatusOr<std::string> back = (*t)->Decode(*ids);
      ASSERT_TRUE(back.ok()) << back.status();
      EXPECT_TRUE(*back == text) << "round trip of " << text.size() << " bytes starting "
                                 << Quoted(text.substr(0, 8));
    }
  }
}

TEST_F(BpeTokenizerFileTest, MissingFileIsNotFound) {
  const std::string path = (fs::path(dir_) / "absent" / "tokenizer.json").string();
  absl::StatusOr<std::unique_ptr<Tokenizer>> t = Tokenizer::Load(path);
  ASSERT_EQ(t.status().code(), absl::StatusCode::kNotFound) << t.status();
  EXPECT_THAT(t.status().message(), HasSubstr(path));
}

TEST_F(BpeTokenizerFileTest, MalformedJsonNamesTheFile) {
  const std::string path = Write("tokenizer.json", "{\"model\": {\"type\": \"BPE\",");
  absl::StatusOr<std::unique_ptr<Tokenizer>> t = Tokenizer::Load(path);
  ASSERT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << t.status();
  EXPECT_THAT(t.status().message(), HasSubstr(path));
  EXPECT_THAT(t.status().message(), HasSubstr("not valid JSON"));
}

// A value nested 100000 levels deep parses, but printing it in a message would overflow the stack:
// the file is refused before.
TEST_F(BpeTokenizerFileTest, DeeplyNestedJsonIsRefusedNotPrinted) {
  Json j = HandMade();
  j.erase("normalizer");
  std::string text = j.dump();
  text.insert(1, "\"normalizer\": " + std::string(100000, '[') + std::string(100000, ']') + ", ");
  const std::string path = Write("tokenizer.json", text);
  absl::StatusOr<std::unique_ptr<Tokenizer>> t = Tokenizer::Load(path);
  ASSERT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << t.status();
  EXPECT_THAT(t.status().message(), HasSubstr(path));
  EXPECT_THAT(t.status().message(), HasSubstr("nests JSON values deeper than 64 levels"));
}

TEST_F(BpeTokenizerFileTest, RefusesWhatItDoesNotImplementNamingKeyAndValue) {
  struct Case {
    std::function<void(Json&)> edit;
    std::string message;
  };
  const Case cases[] = {
      {[](Json& j) { j["model"]["type"] = "WordPiece"; },
       "model.type='WordPiece' is not supported"},
      {[](Json& j) { j["model"]["merges"].push_back("a zz"); },
       "model.merges[2]='a zz' names the token 'zz', which is not in model.vocab"},
      {[](Json& j) {
         j["model"]["merges"].push_back({"b", "c"});
       },
       "merges into 'bc', which is not in model.vocab"},
      {[](Json& j) { j["model"]["merges"].push_back("a b c"); },
       "model.merges[2]='a b c' must be two tokens separated by one space"},
      {[](Json& j) { j["model"]["byte_fallback"] = true; }, "model.byte_fallback=true"},
      {[](Json& j) { j["model"]["dropout"] = 0.1; }, "model.dropout=0.1"},
      {[](Json& j) { j["model"]["continuing_subword_prefix"] = "##"; },
       "model.continuing_subword_prefix='##'"},
      {[](Json& j) {
         j["normalizer"] = {{"type", "NFC"}};
       },
       "normalizer.type='NFC' is not supported"},
      {[](Json& j) {
         j["decoder"] = {{"type", "Metaspace"}};
       },
       "decoder.type='Metaspace' is not supported"},
      {[](Json& j) { j["pre_tokenizer"] = nullptr; }, "pre_tokenizer=null is not supported"},
      {[](Json& j) {
         j["pre_tokenizer"] = {{"type", "Sequence"},
                               {"pretokenizers",
                                {{{"type", "Split"},
                                  {"pattern", {{"Regex", "\\s+"}}},
                                  {"behavior", "Removed"},
                                  {"invert", false}},
                                 {{"type", "ByteLevel"}, {"use_regex", false}}}}};
       },
       "pre_tokenizer.pretokenizers[0].behavior='Removed' is not supported"},
      {[](Json& j) {
         j["pre_tokenizer"] = {
             {"type", "Sequence"},
             {"pretokenizers",
              {{{"type", "Digits"}, {"individual_digits", true}}, {{"type", "ByteLevel"}}}}};
       },
       "pre_tokenizer.pretokenizers[0].type='Digits' is not supported"},
      {[](Json& j) {
         j["pre_tokenizer"] = {{"type", "Sequence"},
                               {"pretokenizers",
                                {{{"type", "Split"},
                                  {"pattern", {{"Regex", "(unclosed"}}},
                                  {"behavior", "Isolated"},
                                  {"invert", false}},
                                 {{"type", "ByteLevel"}}}}};
       },
       "pre_tokenizer.pretokenizers[0].pattern.Regex='(unclosed' does not compile"},
      {[](Json& j) { j["added_tokens"][0]["id"] = 300; },
       "added_tokens[0] ('<s>') has id 300, but the tokenizers library assigns it id 258"},
  };
  for (const Case& c : cases) {
    const absl::Status status = LoadEdited(c.edit);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_THAT(status.message(), HasSubstr(c.message));
    EXPECT_THAT(status.message(), HasSubstr("edited/tokenizer.json"));
  }
}

TEST_F(BpeTokenizerFileTest, TokenizerConfigNamesTheSpecialTokens) {
  Write("config/tokenizer.json", HandMade().dump());
  Write("config/tokenizer_config.json",
        R"({"bos_token": null, "eos_token": {"content": "<s>"}, "pad_token": "Ġab"})");
  absl::StatusOr<std::unique_ptr<Tokenizer>> t =
      Tokenizer::Load((fs::path(dir_) / "config" / "tokenizer.json").string());
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ((*t)->bos_id(), -1);  // null, not the fallback <s>
  EXPECT_EQ((*t)->eos_id(), 258);
  EXPECT_EQ((*t)->pad_id(), 257);
  EXPECT_EQ((*t)->unk_id(), -1);

  Write("config/tokenizer_config.json", R"({"bos_token": "<|begin_of_text|>"})");
  t = Tokenizer::Load((fs::path(dir_) / "config" / "tokenizer.json").string());
  ASSERT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << t.status();
  EXPECT_THAT(t.status().message(), HasSubstr("config/tokenizer_config.json: bos_token="
                                              "'<|begin_of_text|>' is not a token of"));
  // The config's added tokens must be the file's, flags included.
  Write(
      "config/tokenizer_config.json",
      R"({"added_tokens_decoder": {"258": {"content": "<s>", "special": true, "lstrip": false}}})");
  t = Tokenizer::Load((fs::path(dir_) / "config" / "tokenizer.json").string());
  ASSERT_TRUE(t.ok()) << t.status();
  Write(
      "config/tokenizer_config.json",
      R"({"added_tokens_decoder": {"258": {"content": "<s>", "special": true, "lstrip": true}}})");
  t = Tokenizer::Load((fs::path(dir_) / "config" / "tokenizer.json").string());
  ASSERT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << t.status();
  EXPECT_THAT(t.status().message(), HasSubstr("added_tokens_decoder['258']="));
  Write("config/tokenizer_config.json",
        R"({"added_tokens_decoder": {"259": {"content": "<pad>", "special": true}}})");
  t = Tokenizer::Load((fs::path(dir_) / "config" / "tokenizer.json").string());
  ASSERT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << t.status();
  EXPECT_THAT(t.status().message(), HasSubstr("transformers would add or change it"));

  Write("config/tokenizer_config.json", R"({"eos_token": 7})");
  t = Tokenizer::Load((fs::path(dir_) / "config" / "tokenizer.json").string());
  ASSERT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << t.status();
  EXPECT_THAT(t.status().message(), HasSubstr("eos_token=7 must be a string"));
}

TEST_F(BpeTokenizerFileTest, RefusesInvalidUtf8AndIdsOutsideTheVocabulary) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> t =
      Tokenizer::Load(Write("tokenizer.json", HandMade().dump()));
  ASSERT_TRUE(t.ok()) << t.status();
  absl::StatusOr<std::vector<int32_t>> ids = (*t)->Encode("ok \xC3(");
  ASSERT_EQ(ids.status().code(), absl::StatusCode::kInvalidArgument) << ids.status();
  EXPECT_THAT(ids.status().message(), HasSubstr("not valid UTF-8 at byte 3"));
  absl::StatusOr<std::string> text = (*t)->Decode({1, 259});
  ASSERT_EQ(text.status().code(), absl::StatusCode::kInvalidArgument) << text.status();
  EXPECT_THAT(text.status().message(), HasSubstr("token id 259 at position 1"));
}

}  // namespace
}  // namespace hetpar::data
