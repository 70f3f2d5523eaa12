// Replays the config fuzz target over its seed corpus and over deterministic mutations of it
// (byte flips, truncations, insertions, splices), so `make test` exercises the loader on
// malformed input even where libFuzzer is not available. The test counts what it replays itself
// and checks that both of the target's paths run: specs that load (and must round-trip) and
// inputs the loader rejects.
#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "common/config/config.h"
#include "gtest/gtest.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

namespace fs = std::filesystem;

struct CorpusFile {
  std::string name;
  std::string bytes;
};

// Every regular file of the seed corpus, read whole, by name (so the mutations below do not
// depend on the directory's order).
std::vector<CorpusFile> ReadCorpus() {
  std::vector<CorpusFile> files;
  for (const auto& entry : fs::directory_iterator(HETPAR_FUZZ_CORPUS_DIR)) {
    if (!entry.is_regular_file()) continue;
    std::ifstream in(entry.path(), std::ios::binary);
    std::stringstream buffer;
    buffer << in.rdbuf();
    files.push_back({entry.path().filename().string(), buffer.str()});
  }
  std::sort(files.begin(), files.end(),
            [](const CorpusFile& a, const CorpusFile& b) { return a.name < b.name; });
  return files;
}

// The corpus's regular files and their sizes, from the file system rather than from reading them.
std::vector<std::pair<std::string, uintmax_t>> ListCorpus() {
  std::vector<std::pair<std::string, uintmax_t>> files;
  for (const auto& entry : fs::directory_iterator(HETPAR_FUZZ_CORPUS_DIR)) {
    if (entry.is_regular_file())
      files.emplace_back(entry.path().filename().string(), entry.file_size());
  }
  std::sort(files.begin(), files.end());
  return files;
}

// Calls of the fuzz target so far.
int64_t fuzz_calls = 0;

void RunInput(const std::string& input) {
  ++fuzz_calls;
  LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(input.data()), input.size());
}

// Whether the loader accepts `input` as the fuzz target loads it.
bool Loads(const std::string& input) {
  hetpar::config::LoadOptions options;
  options.check_files = false;
  return hetpar::config::LoadRunSpecFromString(input, "fuzz.yaml", options).ok();
}

TEST(ConfigFuzzTest, SeedCorpus) {
  const auto listed = ListCorpus();
  ASSERT_GE(listed.size(), 5u) << "corpus at " << HETPAR_FUZZ_CORPUS_DIR;
  const auto corpus = ReadCorpus();
  ASSERT_EQ(corpus.size(), listed.size());
  for (size_t i = 0; i < corpus.size(); ++i) {
    EXPECT_EQ(corpus[i].name, listed[i].first);
    EXPECT_EQ(corpus[i].bytes.size(), listed[i].second) << corpus[i].name << " was not read whole";
  }
  const int64_t calls_before = fuzz_calls;
  int loaded = 0;
  for (const auto& file : corpus) {
    RunInput(file.bytes);
    loaded += Loads(file.bytes) ? 1 : 0;
  }
  EXPECT_EQ(fuzz_calls - calls_before, static_cast<int64_t>(listed.size()));
  // The real configs load, so the target's round trip runs on them.
  for (const char* name : {"tiny.yaml", "large.yaml"}) {
    auto it = std::find_if(corpus.begin(), corpus.end(),
                           [&](const CorpusFile& f) { return f.name == name; });
    ASSERT_NE(it, corpus.end()) << name << " is missing from the corpus";
    EXPECT_TRUE(Loads(it->bytes)) << name;
  }
  EXPECT_LT(loaded, static_cast<int>(corpus.size())) << "no seed exercises a rejection";
}

TEST(ConfigFuzzTest, MutatedCorpus) {
  constexpr int kRounds = 400;
  const auto corpus = ReadCorpus();
  ASSERT_FALSE(corpus.empty()) << "corpus at " << HETPAR_FUZZ_CORPUS_DIR;
  std::mt19937_64 rng(20261129);
  const std::string alphabet = ":{}[]-,#&*!|>'\"%@` \n\t0123456789.eE+xyz";
  const int64_t calls_before = fuzz_calls;
  int64_t changed = 0;
  int64_t loaded = 0;
  std::set<std::string> distinct;
  for (int round = 0; round < kRounds; ++round) {
    for (const auto& seed : corpus) {
      std::string input = seed.bytes;
      const int edits = 1 + static_cast<int>(rng() % 8);
      for (int e = 0; e < edits && !input.empty(); ++e) {
        const size_t pos = rng() % input.size();
        switch (rng() % 5) {
          case 0:
            input[pos] = static_cast<char>(rng() % 256);
            break;
          case 1:
            input[pos] = alphabet[rng() % alphabet.size()];
            break;
          case 2:
            input.insert(pos, 1, alphabet[rng() % alphabet.size()]);
            break;
          case 3:
            input.resize(pos);
            break;
          case 4: {
            const std::string& other = corpus[rng() % corpus.size()].bytes;
            if (!other.empty()) input.insert(pos, other.substr(rng() % other.size(), 40));
            break;
          }
        }
      }
      RunInput(input);
      changed += input != seed.bytes ? 1 : 0;
      loaded += Loads(input) ? 1 : 0;
      distinct.insert(std::move(input));
    }
  }
  const int64_t runs = static_cast<int64_t>(kRounds) * static_cast<int64_t>(corpus.size());
  EXPECT_EQ(fuzz_calls - calls_before, runs);
  // An edit can leave its input as it was (a byte replaced by itself), but nearly every mutant
  // differs from its seed and from the others.
  EXPECT_GE(changed, runs * 95 / 100);
  EXPECT_GE(static_cast<int64_t>(distinct.size()), runs * 90 / 100);
  // The mutants reach both of the target's paths.
  EXPECT_GT(loaded, 0);
  EXPECT_LT(loaded, runs);
}

}  // namespace
