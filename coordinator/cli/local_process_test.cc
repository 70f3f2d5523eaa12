// LocalProcess against real children: what they inherit and where their signals come from.
#include "coordinator/cli/local_process.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hetpar::cli {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

class LocalProcessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/hetpar-local-process-XXXXXX";
    ASSERT_NE(::mkdtemp(pattern), nullptr);
    dir_ = pattern;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // The log of `command` run by /bin/sh as a LocalProcess with `options`.
  std::string Run(const std::string& command, const LocalProcess::Options& options = {},
                  const std::map<std::string, std::string>& env = {}) {
    auto process =
        LocalProcess::Spawn("sh", {"/bin/sh", "-c", command}, env, dir_ + "/sh.log", options);
    EXPECT_TRUE(process.ok()) << process.status();
    if (!process.ok()) return "";
    EXPECT_EQ((*process)->WaitOrKill(absl::Seconds(60)), 0);
    std::ifstream in(dir_ + "/sh.log");
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  }

  std::string dir_;
};

// A descriptor the parent left open without O_CLOEXEC (a library's socket, a file) does not
// reach the child: only its standard streams do.
TEST_F(LocalProcessTest, AChildInheritsOnlyItsStandardStreams) {
  const int leaked = ::open((dir_ + "/held").c_str(), O_WRONLY | O_CREAT, 0644);
  ASSERT_GE(leaked, 3);
  const std::string fds = Run("ls /proc/$$/fd");
  ::close(leaked);
  std::istringstream lines(fds);
  std::vector<std::string> open;
  for (std::string line; std::getline(lines, line);) open.push_back(line);
  // 0, 1, 2 and the descriptor ls itself reads /proc with (none of the shell's).
  EXPECT_THAT(open, Not(::testing::Contains(std::to_string(leaked)))) << fds;
  EXPECT_THAT(open, ::testing::IsSupersetOf({"0", "1", "2"})) << fds;
}

// A run's worker takes its settings from the run: the parent's HETPAR_* are not passed on (but
// the log level), while the variables the run gives are.
TEST_F(LocalProcessTest, ARunsWorkerGetsNoneOfTheParentsHetparSettings) {
  ASSERT_EQ(::setenv("HETPAR_TOKEN_FILE", "/elsewhere/token", 1), 0);
  ASSERT_EQ(::setenv("HETPAR_LOG_LEVEL", "warning", 1), 0);
  LocalProcess::Options worker;
  worker.drop_hetpar_env = true;
  const std::string env =
      Run("env | grep ^HETPAR_ | sort", worker, {{"HETPAR_TOKEN", "the-runs-token"}});
  EXPECT_THAT(env, Not(HasSubstr("HETPAR_TOKEN_FILE")));
  EXPECT_THAT(env, HasSubstr("HETPAR_LOG_LEVEL=warning"));
  EXPECT_THAT(env, HasSubstr("HETPAR_TOKEN=the-runs-token"));
  EXPECT_THAT(Run("env | grep ^HETPAR_ | sort"), HasSubstr("HETPAR_TOKEN_FILE=/elsewhere/token"));
  ::unsetenv("HETPAR_TOKEN_FILE");
  ::unsetenv("HETPAR_LOG_LEVEL");
}

// A run's worker is in a process group of its own (a terminal's Ctrl-C does not reach it); other
// children stay in the parent's.
TEST_F(LocalProcessTest, ARunsWorkerIsInAProcessGroupOfItsOwn) {
  LocalProcess::Options worker;
  worker.own_group = true;
  const std::string own = Run("cut -d' ' -f5 /proc/$$/stat; echo $$", worker);
  std::istringstream own_lines(own);
  std::string pgid, pid;
  own_lines >> pgid >> pid;
  EXPECT_EQ(pgid, pid) << own;
  const std::string shared = Run("cut -d' ' -f5 /proc/$$/stat");
  EXPECT_EQ(std::stol(shared), static_cast<long>(::getpgrp())) << shared;
}

}  // namespace
}  // namespace hetpar::cli
