// WorkerContext::Bootstrap with three workers (an encoder replica at tp 2, one LLM rank) against an
// in-process coordinator on loopback: each gets its own coordinates and boundary peers, the
// encoder ranks form their TP group through the rendezvous store and all-reduce over it, and a
// wrong token or a role the placement has no slot for is refused.
#include "common/worker/bootstrap.h"

#include <ATen/ATen.h>
#include <stdlib.h>

#include <algorithm>
#include <filesystem>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "common/data/file_util.h"
#include "common/data/synth.h"
#include "coordinator/server.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hetpar::worker {
namespace {

using ::testing::HasSubstr;
using ::testing::UnorderedElementsAre;

constexpr char kToken[] = "bootstrap-test-token";

v1::RunSpec Spec(v1::Placement placement) {
  v1::RunSpec spec;
  spec.mutable_run()->set_name("bootstrap");
  spec.mutable_run()->set_steps(1);
  spec.set_placement(placement);
  for (v1::Layout* layout :
       {spec.mutable_encoder()->mutable_layout(), spec.mutable_llm()->mutable_layout()}) {
    layout->set_dp(1);
    layout->set_tp(1);
    layout->set_cp(1);
    layout->set_pp(1);
  }
  spec.mutable_encoder()->mutable_layout()->set_tp(2);
  spec.mutable_coordinator()->set_heartbeat_timeout_s(30);
  spec.mutable_coordinator()->set_register_timeout_s(120);
  spec.mutable_failure()->set_peer_timeout_s(77);
  spec.mutable_failure()->set_coordinator_timeout_s(88);
  return spec;
}

class BootstrapTest : public ::testing::Test {
 protected:
  void Start(v1::Placement placement) { Start(Spec(placement)); }
  // An in-process coordinator of `spec` on loopback.
  void Start(const v1::RunSpec& spec) {
    coordinator::ServerOptions options;
    options.listen_address = "127.0.0.1:0";
    options.token = kToken;
    auto server = coordinator::CoordinatorServer::Create(spec, options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }

  // A fresh directory under /tmp (mkdtemp's template), removed when the test ends.
  std::string TempDir() {
    char pattern[] = "/tmp/hetpar-bootstrap-test-XXXXXX";
    if (::mkdtemp(pattern) == nullptr) return "";
    temp_dirs_.emplace_back(pattern);
    return pattern;
  }
  void TearDown() override {
    for (const std::string& dir : temp_dirs_) std::filesystem::remove_all(dir);
  }

  // Two encoder ranks (one replica at tp 2) and one LLM rank, bootstrapped at once.
  std::vector<absl::StatusOr<std::unique_ptr<WorkerContext>>> BootstrapAll() const {
    const std::vector<Role> roles = {Role::kEncoder, Role::kEncoder, Role::kLlm};
    std::vector<absl::StatusOr<std::unique_ptr<WorkerContext>>> contexts(roles.size());
    std::vector<std::thread> threads;
    for (size_t i = 0; i < roles.size(); ++i) {
      threads.emplace_back([&, i] { contexts[i] = WorkerContext::Bootstrap(Options(roles[i])); });
    }
    for (auto& t : threads) t.join();
    return contexts;
  }

  WorkerOptions Options(Role role, const std::string& token = kToken) const {
    WorkerOptions options;
    options.role = role;
    options.coordinator = server_->address();
    options.token = token;
    options.timeout = absl::Seconds(60);
    return options;
  }

  std::unique_ptr<coordinator::CoordinatorServer> server_;
  std::vector<std::string> temp_dirs_;
};

// A worker that registered and then fails to start (here: run.device cuda with a GPU index no
// machine has) tells the coordinator why: the run's record of it names its error, not only
// "closed by the worker".
TEST_F(BootstrapTest, AWorkerThatFailsAfterRegisteringTellsTheCoordinatorWhy) {
  v1::RunSpec spec = Spec(v1::PLACEMENT_NON_COLOCATED);
  spec.mutable_run()->set_device("cuda");
  Start(spec);
  WorkerOptions options = Options(Role::kLlm);
  options.cuda_device = 4096;
  auto context = WorkerContext::Bootstrap(options);
  ASSERT_FALSE(context.ok());
  EXPECT_THAT(std::string(context.status().message()), HasSubstr("run.device=\"cuda\""));
  const v1::StatusResponse status = server_->Status();
  ASSERT_EQ(status.workers_size(), 1);
  EXPECT_FALSE(status.workers(0).alive());
  EXPECT_THAT(status.workers(0).dead_reason(), HasSubstr("failed: run.device=\"cuda\""));
}

TEST_F(BootstrapTest, EveryWorkerGetsItsRankPeersAndGroups) {
  Start(v1::PLACEMENT_NON_COLOCATED);
  const std::vector<Role> roles = {Role::kEncoder, Role::kEncoder, Role::kLlm};
  std::vector<absl::StatusOr<std::unique_ptr<WorkerContext>>> contexts(roles.size());
  {
    std::vector<std::thread> threads;
    for (size_t i = 0; i < roles.size(); ++i) {
      threads.emplace_back([&, i] {
        WorkerOptions options = Options(roles[i]);
        // The LLM worker has no --timeout: its deadlines come from the spec's failure section.
        if (i == 2) options.timeout = absl::ZeroDuration();
        contexts[i] = WorkerContext::Bootstrap(options);
      });
    }
    for (auto& t : threads) t.join();
  }
  for (const auto& c : contexts) ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ((*contexts[0])->peer_timeout(), absl::Seconds(60));
  EXPECT_EQ((*contexts[0])->coordinator_timeout(), absl::Seconds(60));
  EXPECT_EQ((*contexts[2])->peer_timeout(), absl::Seconds(77));
  EXPECT_EQ((*contexts[2])->coordinator_timeout(), absl::Seconds(88));
  std::vector<int64_t> world_ranks;
  for (const auto& c : contexts) world_ranks.push_back((*c)->world_rank());
  // Encoder ranks come first in the world (encoder world 2, then the LLM).
  EXPECT_THAT(world_ranks, UnorderedElementsAre(0, 1, 2));
  std::vector<int64_t> encoder_tp;
  for (size_t i = 0; i < 2; ++i) {
    WorkerContext& c = **contexts[i];
    ASSERT_NE(c.Coordinates(v1::MODULE_ENCODER), nullptr);
    EXPECT_EQ(c.Coordinates(v1::MODULE_LLM), nullptr);
    encoder_tp.push_back(c.Coordinates(v1::MODULE_ENCODER)->tp());
    EXPECT_LT(c.world_rank(), 2);
    // Each encoder rank's boundary peer is the LLM rank.
    ASSERT_EQ(c.assignment().peers_size(), 1);
    EXPECT_EQ(c.assignment().peers(0).world_rank(), 2);
    EXPECT_EQ(c.spec().run().name(), "bootstrap");
  }
  EXPECT_THAT(encoder_tp, UnorderedElementsAre(0, 1));
  WorkerContext& llm = **contexts[2];
  ASSERT_NE(llm.Coordinates(v1::MODULE_LLM), nullptr);
  EXPECT_EQ(llm.Coordinates(v1::MODULE_ENCODER), nullptr);
  EXPECT_EQ(llm.world_rank(), 2);
  std::vector<int64_t> llm_peers;
  for (const auto& peer : llm.assignment().peers()) llm_peers.push_back(peer.world_rank());
  EXPECT_THAT(llm_peers, UnorderedElementsAre(0, 1));

  // The encoder replica's TP group forms through the coordinator and sums over both ranks.
  std::vector<at::Tensor> sums(2);
  {
    std::vector<std::thread> threads;
    for (size_t i = 0; i < 2; ++i) {
      threads.emplace_back([&, i] {
        WorkerContext& c = **contexts[i];
        const int64_t tp = c.Coordinates(v1::MODULE_ENCODER)->tp();
        auto group = c.Group("encoder/dp0/tp", tp, 2);
        ASSERT_TRUE(group.ok()) << group.status();
        at::Tensor t = at::full({3}, static_cast<double>(tp + 1), at::kDouble);
        ASSERT_TRUE((*group)->AllReduce(t).ok());
        sums[i] = t;
      });
    }
    for (auto& t : threads) t.join();
  }
  for (const at::Tensor& s : sums) {
    ASSERT_TRUE(s.defined());
    EXPECT_TRUE(at::equal(s, at::full({3}, 3.0, at::kDouble))) << s;
  }
  // A group of one needs no store.
  auto single = llm.Group("llm/dp0/tp", 0, 1);
  ASSERT_TRUE(single.ok()) << single.status();
  EXPECT_EQ((*single)->size(), 1);
}

// A worker opens its data set from the start, beside its wait for the run's start, and its first
// Data() waits for what is left. Here the data index is missing and another process (the test)
// holds its lock, so every worker's opening waits: an abort of the step ends Data()'s wait (not
// the opening), a worker that ends meanwhile does not wait for its opening, and once the lock is
// let go the opening builds the index and Data() returns it.
TEST_F(BootstrapTest, TheDataSetOpensFromTheStartAndAnAbortEndsTheWaitForIt) {
  const std::string dir = TempDir();
  ASSERT_FALSE(dir.empty());
  data::SynthOptions synth = data::SynthOptionsForDirectory(dir);
  synth.samples = 12;
  synth.val_samples = 0;
  synth.val_manifest.clear();
  synth.image_size = 32;
  synth.tokens_per_image = 16;
  synth.seq_len = 128;
  synth.vocab_size = 256;
  ASSERT_TRUE(data::GenerateSyntheticDataset(synth).ok());
  const std::string index = synth.train_manifest + ".index";
  std::filesystem::remove(index);  // the generator's
  v1::RunSpec spec = Spec(v1::PLACEMENT_NON_COLOCATED);
  spec.mutable_encoder()->mutable_model()->set_image_size(32);
  spec.mutable_encoder()->mutable_model()->set_patch(8);
  spec.mutable_llm()->mutable_model()->set_seq_len(128);
  spec.mutable_llm()->mutable_model()->set_vocab(256);
  spec.mutable_data()->set_manifest(synth.train_manifest);
  spec.mutable_data()->set_tokenizer(synth.tokenizer);
  spec.mutable_data()->set_index(index);
  const std::string lock = dir + "/.train.jsonl.index.lock";
  // A coordinator of `spec` and its three workers, bootstrapped.
  const auto start = [&](std::vector<absl::StatusOr<std::unique_ptr<WorkerContext>>>* contexts) {
    Start(spec);
    *contexts = BootstrapAll();
    for (const auto& c : *contexts) ASSERT_TRUE(c.ok()) << c.status();
  };

  // The lock held by "another process" (this test) while `held` has it.
  std::optional<data::WaitedFileLock> held;
  const auto hold = [&] {
    absl::StatusOr<data::WaitedFileLock> taken =
        data::WaitedFileLock::Take(lock, "holding the lock in a test", absl::Seconds(10));
    ASSERT_TRUE(taken.ok()) << taken.status();
    ASSERT_TRUE(taken->held());
    held.emplace(*std::move(taken));
  };
  hold();
  std::vector<absl::StatusOr<std::unique_ptr<WorkerContext>>> contexts;
  start(&contexts);
  WorkerContext& llm = **contexts[2];
  // The step is aborted while the opening waits for the lock.
  llm.interrupt().Raise(1);
  absl::StatusOr<const data::BatchSource*> aborted = llm.Data();
  EXPECT_TRUE(absl::IsAborted(aborted.status())) << aborted.status();
  EXPECT_FALSE(std::filesystem::exists(index));
  // The next attempt; the other process lets go of the lock.
  llm.interrupt().Arm(2);
  held.reset();
  absl::StatusOr<const data::BatchSource*> opened = llm.Data();
  ASSERT_TRUE(opened.ok()) << opened.status();
  EXPECT_EQ((*opened)->index().records.size(), 12u);
  EXPECT_TRUE(std::filesystem::exists(index));
  // Opened once: the same data set at every later call.
  absl::StatusOr<const data::BatchSource*> again = llm.Data();
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*again, *opened);
  contexts.clear();
  server_.reset();

  // Workers that end while their openings wait for the lock do not wait for them (the test would
  // hang otherwise), and leave no index behind.
  std::filesystem::remove(index);
  hold();
  start(&contexts);
  contexts.clear();
  EXPECT_FALSE(std::filesystem::exists(index));
  held.reset();
}

// A synthetic data set is the coordinator's to make: one not there yet when the workers start is
// opened at the first Data(), after the coordinator made it, on the opener's thread like any
// other. So an abort of the step ends the wait for an index another process is building (here:
// the test holds its lock), and so does the end of the coordinator's session.
TEST_F(BootstrapTest, ASyntheticDataSetMadeAfterTheStartOpensWhereAnAbortEndsTheWait) {
  const std::string dir = TempDir();
  ASSERT_FALSE(dir.empty());
  v1::RunSpec spec = Spec(v1::PLACEMENT_NON_COLOCATED);
  spec.mutable_encoder()->mutable_model()->set_image_size(32);
  spec.mutable_encoder()->mutable_model()->set_patch(8);
  spec.mutable_llm()->mutable_model()->set_seq_len(128);
  spec.mutable_llm()->mutable_model()->set_vocab(256);
  spec.mutable_data()->set_manifest(dir + "/train.jsonl");
  spec.mutable_data()->set_tokenizer(dir + "/tokenizer.model");
  spec.mutable_data()->set_index(dir + "/train.jsonl.index");
  spec.mutable_data()->mutable_synth()->set_samples(12);
  Start(spec);
  std::vector<absl::StatusOr<std::unique_ptr<WorkerContext>>> contexts = BootstrapAll();
  for (const auto& c : contexts) ASSERT_TRUE(c.ok()) << c.status();
  WorkerContext& llm = **contexts[2];

  // The coordinator makes the data set; another process holds the index's lock.
  absl::StatusOr<data::SynthOptions> synth = data::SynthOptionsFromRunSpec(spec);
  ASSERT_TRUE(synth.ok()) << synth.status();
  absl::StatusOr<data::SynthReport> made = data::GenerateSyntheticDataset(*synth);
  ASSERT_TRUE(made.ok()) << made.status();
  std::filesystem::remove(spec.data().index());  // the generator's
  absl::StatusOr<data::WaitedFileLock> taken = data::WaitedFileLock::Take(
      dir + "/.train.jsonl.index.lock", "holding the lock in a test", absl::Seconds(10));
  ASSERT_TRUE(taken.ok()) << taken.status();
  ASSERT_TRUE(taken->held());
  std::optional<data::WaitedFileLock> held(*std::move(taken));

  llm.interrupt().Raise(1);
  absl::StatusOr<const data::BatchSource*> aborted = llm.Data();
  EXPECT_TRUE(absl::IsAborted(aborted.status())) << aborted.status();
  EXPECT_FALSE(std::filesystem::exists(spec.data().index()));
  // The next attempt, and the coordinator goes away while the opening still waits.
  llm.interrupt().Arm(2);
  server_.reset();
  absl::StatusOr<const data::BatchSource*> lost = llm.Data();
  EXPECT_TRUE(absl::IsUnavailable(lost.status())) << lost.status();
  EXPECT_THAT(std::string(lost.status().message()), HasSubstr("session ended"));
  // The workers end without waiting for their openings, and leave no index behind.
  contexts.clear();
  EXPECT_FALSE(std::filesystem::exists(spec.data().index()));
  held.reset();
}

TEST_F(BootstrapTest, AWrongTokenIsRefused) {
  Start(v1::PLACEMENT_NON_COLOCATED);
  auto context = WorkerContext::Bootstrap(Options(Role::kLlm, "not-the-token"));
  ASSERT_FALSE(context.ok());
  EXPECT_EQ(context.status().code(), absl::StatusCode::kUnauthenticated) << context.status();
}

TEST_F(BootstrapTest, ARoleThePlacementHasNoSlotForIsRefused) {
  Start(v1::PLACEMENT_NON_COLOCATED);
  auto context = WorkerContext::Bootstrap(Options(Role::kColocated));
  ASSERT_FALSE(context.ok());
  EXPECT_EQ(context.status().code(), absl::StatusCode::kInvalidArgument) << context.status();
  EXPECT_THAT(std::string(context.status().message()), HasSubstr("expected role encoder or llm"));
}

}  // namespace
}  // namespace hetpar::worker
