// Replays the config fuzz target over its seed corpus and over deterministic mutations of it
// (byte flips, truncations, insertions, splices), so `make test` exercises the loader on
// malformed input even where libFuzzer is not available.
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

namespace fs = std::filesystem;

std::vector<std::string> ReadCorpus() {
  std::vector<std::string> inputs;
  for (const auto& entry : fs::directory_iterator(HETPAR_FUZZ_CORPUS_DIR)) {
    std::ifstream in(entry.path(), std::ios::binary);
    std::stringstream buffer;
    buffer << in.rdbuf();
    inputs.push_back(buffer.str());
  }
  return inputs;
}

void RunInput(const std::string& input) {
  LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(input.data()), input.size());
}

TEST(ConfigFuzzTest, SeedCorpus) {
  auto corpus = ReadCorpus();
  ASSERT_GE(corpus.size(), 5u) << "corpus at " << HETPAR_FUZZ_CORPUS_DIR;
  for (const auto& input : corpus) RunInput(input);
}

TEST(ConfigFuzzTest, MutatedCorpus) {
  auto corpus = ReadCorpus();
  std::mt19937_64 rng(20261129);
  const std::string alphabet = ":{}[]-,#&*!|>'\"%@` \n\t0123456789.eE+xyz";
  int runs = 0;
  for (int round = 0; round < 400; ++round) {
    for (const auto& seed : corpus) {
      std::string input = seed;
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
            const std::string& other = corpus[rng() % corpus.size()];
            if (!other.empty()) input.insert(pos, other.substr(rng() % other.size(), 40));
            break;
          }
        }
      }
      RunInput(input);
      ++runs;
    }
  }
  EXPECT_GT(runs, 0);
}

}  // namespace
