// Failures across processes: a worker killed with SIGKILL is lost at once (its connection drops;
// an LLM rank's loss fails the run), a hung one (SIGSTOP: connection open, no heartbeats) is
// declared dead once heartbeat_timeout has passed without a message from it, never before (an
// encoder's loss takes its replica out, and the others are told). A hung coordinator is noticed by
// every worker, which then ends instead of waiting. Upper bounds on how soon something happens are
// generous (the timeout plus 30 s): they only have to tell a missed timeout from a loaded machine.
#include <signal.h>
#include <stdlib.h>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/coordinator/coordinator_test_util.h"

namespace hetpar::testing {
namespace {

using ::testing::HasSubstr;

const std::string kTiny = kSourceDir + "/configs/tiny.yaml";
// How late past a timeout an event may be seen on a loaded machine.
constexpr absl::Duration kSlack = absl::Seconds(30);

class CoordinatorFaultTest : public ::testing::Test {
 protected:
  void SetUp() override { setenv("HETPAR_TOKEN", "fault-test-token", 1); }

  // A running tiny run (synthetic batches, steps paced by the workers) with four workers.
  void StartRun(double heartbeat_timeout_s) {
    auto coordinator = StartCoordinator(
        {"--config", kTiny, "--synthetic-batches", "--set", "run.steps=100000", "--set",
         absl::StrCat("coordinator.heartbeat_timeout_s=", heartbeat_timeout_s), "--set",
         "coordinator.register_timeout_s=60"},
        dir_.File("coordinator.log"));
    ASSERT_TRUE(coordinator.ok()) << coordinator.status();
    coordinator_.emplace(*std::move(coordinator));
    for (const auto& [role, host] : roles_) {
      auto w = StartSimWorker(coordinator_->address, role, host, dir_.File(host + ".log"),
                              /*step_delay_ms=*/50);
      ASSERT_TRUE(w.ok());
      workers_.push_back(*std::move(w));
    }
    // Steps are being committed.
    ASSERT_TRUE(AwaitInFile(dir_.File("enc-a.log"), "(commit step 1 )", absl::Seconds(30)).ok())
        << ReadFile(coordinator_->log);
  }

  TempDir dir_;
  std::optional<CoordinatorProcess> coordinator_;
  const std::vector<std::pair<std::string, std::string>> roles_ = {
      {"encoder", "enc-a"}, {"encoder", "enc-b"}, {"llm", "llm-a"}, {"llm", "llm-b"}};
  std::vector<ChildProcess> workers_;
};

TEST_F(CoordinatorFaultTest, KilledLlmWorkerFailsTheRunAtOnceSayingHowToResume) {
  StartRun(/*heartbeat_timeout_s=*/30);
  auto victim = AwaitInFile(dir_.File("llm-b.log"), "registered (\\S+)", absl::Seconds(1));
  ASSERT_TRUE(victim.ok());
  const absl::Time killed = absl::Now();
  ASSERT_TRUE(workers_[3].Signal(SIGKILL));
  // Its shard is held by no other worker: the run stops, and the others are told.
  auto stop =
      AwaitInFile(dir_.File("enc-a.log"), "stop: (run failed: worker \\S+)", absl::Seconds(10));
  ASSERT_TRUE(stop.ok()) << stop.status() << "\n" << ReadFile(coordinator_->log);
  // Far sooner than the 30 s heartbeat timeout.
  EXPECT_LT(absl::Now() - killed, absl::Seconds(10));
  EXPECT_THAT(*stop, HasSubstr(*victim));
  auto coordinator_exit = coordinator_->process.Wait(30);
  ASSERT_TRUE(coordinator_exit.ok());
  EXPECT_EQ(*coordinator_exit, 1);
  const std::string coordinator_log = ReadFile(coordinator_->log);
  EXPECT_THAT(coordinator_log, HasSubstr(absl::StrCat("worker ", *victim, " (llm rank ")));
  EXPECT_THAT(coordinator_log, HasSubstr("is dead: session ended"));
  EXPECT_THAT(coordinator_log, HasSubstr("held by no other worker"));
  EXPECT_THAT(coordinator_log, HasSubstr("must start over"));
  for (int i = 0; i < 3; ++i) (void)workers_[i].Wait(20);
}

// The heartbeat timeouts below hold for every worker: long enough that none of the others, slowed
// by a loaded machine, is taken for the hung one.
TEST_F(CoordinatorFaultTest, HungWorkerIsDeclaredDeadAfterTheHeartbeatTimeout) {
  constexpr absl::Duration kTimeout = absl::Seconds(6);
  StartRun(absl::ToDoubleSeconds(kTimeout));
  auto victim = AwaitInFile(dir_.File("enc-b.log"), "registered (\\S+)", absl::Seconds(1));
  ASSERT_TRUE(victim.ok());
  // The coordinator last heard from the victim no earlier than `asked - age`: its clock read
  // `asked` or later when it answered. Whatever the victim sends afterwards only moves that on,
  // so the victim cannot be declared dead before `asked - age + kTimeout`.
  const absl::Time asked = absl::Now();
  auto status =
      RunCommand({kHetparBin, "status", "--json", "--coordinator", coordinator_->address});
  ASSERT_TRUE(status.ok()) << status.status();
  ASSERT_EQ(status->exit_code, 0) << status->stderr_text;
  const nlohmann::json parsed = nlohmann::json::parse(status->stdout_text);
  double age_s = -1;
  for (const auto& w : parsed.at("workers")) {
    if (w.at("workerId") != *victim) continue;
    ASSERT_TRUE(w.at("alive").get<bool>()) << status->stdout_text;
    age_s = w.at("lastHeartbeatAgeS").get<double>();
  }
  ASSERT_GE(age_s, 0) << status->stdout_text;
  const absl::Time earliest_loss = asked - absl::Seconds(age_s) + kTimeout;
  const absl::Time stopped = absl::Now();
  ASSERT_TRUE(workers_[1].Signal(SIGSTOP));
  auto change = AwaitInFile(dir_.File("llm-a.log"), "membership_change generation 2 lost (\\S+)",
                            kTimeout + kSlack);
  const absl::Time seen = absl::Now();
  ASSERT_TRUE(change.ok()) << change.status();
  EXPECT_EQ(*change, *victim);
  EXPECT_GE(seen, earliest_loss) << "declared dead " << (earliest_loss - seen)
                                 << " before the heartbeat timeout ran out";
  EXPECT_LE(seen - stopped, kTimeout + kSlack);
  EXPECT_THAT(ReadFile(coordinator_->log), HasSubstr("is dead: no heartbeat for"));
  workers_[1].Signal(SIGKILL);
  workers_[1].Signal(SIGCONT);
  auto stop =
      RunCommand({kHetparBin, "stop", "--wait", "20", "--coordinator", coordinator_->address});
  ASSERT_TRUE(stop.ok());
  EXPECT_EQ(stop->exit_code, 0) << stop->stderr_text;
  auto coordinator_exit = coordinator_->process.Wait(20);
  ASSERT_TRUE(coordinator_exit.ok());
  EXPECT_EQ(*coordinator_exit, 0);
}

TEST_F(CoordinatorFaultTest, HungCoordinatorIsNoticedByTheWorkers) {
  constexpr double kTimeout = 6.0;
  StartRun(kTimeout);
  const absl::Time stopped = absl::Now();
  ASSERT_TRUE(coordinator_->process.Signal(SIGSTOP));
  // Heartbeats every second, an ack asked for every 5th: the silence shows within 5 s + 6 s.
  const absl::Duration bound = absl::Seconds(2 * kTimeout) + kSlack;
  for (size_t i = 0; i < workers_.size(); ++i) {
    auto exit_code = workers_[i].Wait(absl::ToDoubleSeconds(bound));
    ASSERT_TRUE(exit_code.ok()) << exit_code.status();
    EXPECT_EQ(*exit_code, 1);
    const std::string log = ReadFile(dir_.File(roles_[i].second + ".log"));
    EXPECT_THAT(log, HasSubstr("session ended: DEADLINE_EXCEEDED: the coordinator at "));
    EXPECT_THAT(log, HasSubstr("stopped answering"));
  }
  EXPECT_LT(absl::Now() - stopped, bound);
  coordinator_->process.Signal(SIGKILL);
}

}  // namespace
}  // namespace hetpar::testing
