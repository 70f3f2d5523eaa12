// The dependency rules of the house, checked on the sources and on the built binaries, so that a
// change that breaks a layer fails here instead of silently growing a cycle:
//
//   common/        includes nothing from coordinator/, encoder_service/ or llm_trainer/
//   encoder_service/ includes nothing from llm_trainer/ or coordinator/
//   llm_trainer/   includes nothing from coordinator/
//   coordinator/   includes nothing from encoder_service/ or llm_trainer/, and no libtorch header
//   the torch-free core of common/ includes no libtorch header
//   hetpar         does not link libtorch; hetpar-encoder holds no LLM code
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/util/subprocess.h"

namespace hetpar {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;

const fs::path kSource = HETPAR_SOURCE_DIR;

struct Include {
  std::string file;  // relative to the source root
  int line;
  std::string target;
};

// Every quoted or angled #include of every .h/.cc file under `folder` (relative to the root).
std::vector<Include> IncludesUnder(const std::string& folder) {
  static const std::regex kInclude(R"(^\s*#\s*include\s*[<"]([^>"]+)[>"])");
  std::vector<Include> out;
  for (const auto& entry : fs::recursive_directory_iterator(kSource / folder)) {
    const std::string ext = entry.path().extension().string();
    if (!entry.is_regular_file() || (ext != ".h" && ext != ".cc")) continue;
    std::ifstream in(entry.path());
    int n = 0;
    for (std::string line; std::getline(in, line);) {
      ++n;
      std::smatch m;
      if (std::regex_search(line, m, kInclude)) {
        out.push_back({fs::relative(entry.path(), kSource).string(), n, m[1]});
      }
    }
  }
  return out;
}

bool StartsWithAny(const std::string& s, const std::vector<std::string>& prefixes) {
  for (const auto& p : prefixes) {
    if (s.rfind(p, 0) == 0) return true;
  }
  return false;
}

// "file:line includes target" for each include of `folder` whose target starts with a forbidden
// prefix (files matching `only` when given).
std::vector<std::string> Violations(const std::string& folder,
                                    const std::vector<std::string>& forbidden,
                                    const std::vector<std::string>& only_files = {}) {
  std::vector<std::string> bad;
  for (const Include& inc : IncludesUnder(folder)) {
    if (!only_files.empty() && !StartsWithAny(inc.file, only_files)) continue;
    if (StartsWithAny(inc.target, forbidden)) {
      bad.push_back(inc.file + ":" + std::to_string(inc.line) + " includes " + inc.target);
    }
  }
  return bad;
}

const std::vector<std::string> kTorchHeaders = {"ATen/", "torch/", "c10/", "c10d/"};

TEST(LayeringTest, TheSourcesThatThisTestReadsExist) {
  // Guards the checks below against reading an empty tree.
  EXPECT_GT(IncludesUnder("common").size(), 100u);
  EXPECT_GT(IncludesUnder("coordinator").size(), 50u);
  EXPECT_TRUE(fs::exists(kSource / "common/worker/step_driver.h"));
}

TEST(LayeringTest, CommonIncludesNoServiceFolder) {
  EXPECT_THAT(Violations("common", {"coordinator/", "encoder_service/", "llm_trainer/"}),
              ::testing::IsEmpty());
}

TEST(LayeringTest, TheEncoderServiceIncludesNoLlmOrCoordinatorCode) {
  EXPECT_THAT(Violations("encoder_service", {"llm_trainer/", "coordinator/"}),
              ::testing::IsEmpty());
  EXPECT_THAT(Violations("llm_trainer", {"coordinator/"}), ::testing::IsEmpty());
}

TEST(LayeringTest, TheCoordinatorIncludesNoWorkerCodeAndNoLibtorch) {
  std::vector<std::string> forbidden = {"encoder_service/",
                                        "llm_trainer/",
                                        "common/nn/",
                                        "common/train/",
                                        "common/rendezvous/c10d_store.h",
                                        "common/worker/bootstrap.h"};
  forbidden.insert(forbidden.end(), kTorchHeaders.begin(), kTorchHeaders.end());
  EXPECT_THAT(Violations("coordinator", forbidden), ::testing::IsEmpty());
}

TEST(LayeringTest, TheTorchFreeCoreIncludesNoLibtorch) {
  const std::vector<std::string> core = {"common/config/",
                                         "common/plan/",
                                         "common/data/",
                                         "common/transport/",
                                         "common/control/",
                                         "common/status.h",
                                         "common/logging",
                                         "common/run_directory",
                                         "common/rendezvous/key_value_store.h",
                                         "common/worker/step_driver",
                                         "common/worker/module_runtime.h"};
  EXPECT_THAT(Violations("common", kTorchHeaders, core), ::testing::IsEmpty());
  // ...nor a header of the torch layer, which would bring libtorch in with it.
  EXPECT_THAT(Violations("common",
                         {"common/nn/", "common/train/", "common/rendezvous/c10d_store.h",
                          "common/worker/bootstrap.h", "common/worker/outputs.h",
                          "common/worker/worker_main.h"},
                         core),
              ::testing::IsEmpty());
}

std::string Output(const std::vector<std::string>& argv) {
  auto result = hetpar::testing::RunCommand(argv, 60);
  EXPECT_TRUE(result.ok()) << result.status();
  if (!result.ok()) return "";
  EXPECT_EQ(result->exit_code, 0) << argv[0] << ": " << result->stderr_text;
  return result->stdout_text;
}

TEST(LayeringTest, TheCoordinatorBinaryDoesNotLinkLibtorch) {
  const std::string needed = Output({"readelf", "-d", HETPAR_BIN});
  ASSERT_THAT(needed, HasSubstr("NEEDED"));
  EXPECT_THAT(needed, Not(HasSubstr("libtorch")));
  EXPECT_THAT(needed, Not(HasSubstr("libc10")));
  // The worker binaries do, so the check above can tell the difference.
  EXPECT_THAT(Output({"readelf", "-d", HETPAR_ENCODER_BIN}), HasSubstr("libc10"));
}

TEST(LayeringTest, TheEncoderBinaryHoldsNoLlmCode) {
  const std::string encoder = Output({"nm", "-C", HETPAR_ENCODER_BIN});
  ASSERT_THAT(encoder, HasSubstr("hetpar::encoder::EncoderModule"));
  EXPECT_THAT(encoder, Not(HasSubstr("hetpar::llm::")));
  // The LLM binary has both: a colocated LLM worker hosts the encoder too.
  const std::string llm = Output({"nm", "-C", HETPAR_LLM_BIN});
  EXPECT_THAT(llm, HasSubstr("hetpar::llm::LanguageModel"));
  EXPECT_THAT(llm, HasSubstr("hetpar::encoder::VisionEncoder"));
}

}  // namespace
}  // namespace hetpar
