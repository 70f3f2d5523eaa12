#include "common/nn/communicator.h"

#include <ATen/ATen.h>

#include <chrono>
#include <cstdlib>
#include <future>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/nn/test_ranks.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hetpar::nn {
namespace {

using ::testing::HasSubstr;
using testing::RunRanks;

// Rank r's input: element i is (r + 1) * (i + 1) / 8, exact in every dtype used here.
at::Tensor RankValues(int rank, int64_t rows, int64_t cols, at::ScalarType dtype) {
  return (at::arange(rows * cols, at::kDouble).add(1).mul(rank + 1).div(8))
      .view({rows, cols})
      .to(dtype);
}

class CommunicatorSizeTest : public ::testing::TestWithParam<int> {};

TEST_P(CommunicatorSizeTest, AllReduceSumsEveryElementInEachDtype) {
  const int size = GetParam();
  for (at::ScalarType dtype : {at::kFloat, at::kDouble, at::kBFloat16}) {
    absl::Status status = RunRanks(size, [&](int rank, Communicator& comm) {
      at::Tensor t = RankValues(rank, 3, 5, dtype);
      if (auto s = comm.AllReduce(t); !s.ok()) return s;
      EXPECT_EQ(t.scalar_type(), dtype);
      const double factor = size * (size + 1) / 2.0;  // sum of (r + 1)
      at::Tensor expected = RankValues(0, 3, 5, at::kDouble).mul(factor);
      at::Tensor got = t.to(at::kDouble);
      for (int64_t i = 0; i < 15; ++i) {
        EXPECT_EQ(got.view({-1})[i].item<double>(), expected.view({-1})[i].item<double>())
            << "element " << i << " dtype " << dtype << " rank " << rank;
      }
      return absl::OkStatus();
    });
    ASSERT_TRUE(status.ok()) << status;
  }
}

TEST_P(CommunicatorSizeTest, AllReduceMax) {
  const int size = GetParam();
  absl::Status status = RunRanks(size, [&](int rank, Communicator& comm) {
    // Element i is largest on rank (i % size).
    at::Tensor t = at::zeros({8}, at::kDouble);
    for (int64_t i = 0; i < 8; ++i) t[i] = (i % size == rank) ? 100.0 + i : -1.0 * rank;
    if (auto s = comm.AllReduce(t, ReduceOp::kMax); !s.ok()) return s;
    for (int64_t i = 0; i < 8; ++i) {
      EXPECT_EQ(t[i].item<double>(), 100.0 + i) << "element " << i;
    }
    return absl::OkStatus();
  });
  ASSERT_TRUE(status.ok()) << status;
}

TEST_P(CommunicatorSizeTest, AllGatherRowsConcatenatesInRankOrder) {
  const int size = GetParam();
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    absl::Status status = RunRanks(size, [&](int rank, Communicator& comm) {
      at::Tensor mine = RankValues(rank, 2, 3, dtype);
      auto gathered = comm.AllGatherRows(mine);
      if (!gathered.ok()) return gathered.status();
      EXPECT_EQ(gathered->scalar_type(), dtype);
      EXPECT_EQ(gathered->sizes(), at::IntArrayRef({2 * size, 3}));
      for (int r = 0; r < size; ++r) {
        EXPECT_TRUE(at::equal(gathered->narrow(0, 2 * r, 2), RankValues(r, 2, 3, dtype)))
            << "block of rank " << r << " seen on rank " << rank;
      }
      return absl::OkStatus();
    });
    ASSERT_TRUE(status.ok()) << status;
  }
}

TEST_P(CommunicatorSizeTest, ReduceScatterRowsSumsThisRanksBlock) {
  const int size = GetParam();
  absl::Status status = RunRanks(size, [&](int rank, Communicator& comm) {
    at::Tensor full = RankValues(rank, 3 * size, 2, at::kDouble);
    auto mine = comm.ReduceScatterRows(full);
    if (!mine.ok()) return mine.status();
    at::Tensor expected = at::zeros({3, 2}, at::kDouble);
    for (int r = 0; r < size; ++r) {
      expected += RankValues(r, 3 * size, 2, at::kDouble).narrow(0, 3 * rank, 3);
    }
    EXPECT_TRUE(at::equal(*mine, expected)) << "rank " << rank << "\n" << *mine << expected;
    return absl::OkStatus();
  });
  ASSERT_TRUE(status.ok()) << status;
}

TEST_P(CommunicatorSizeTest, BroadcastCopiesRootValues) {
  const int size = GetParam();
  absl::Status status = RunRanks(size, [&](int rank, Communicator& comm) {
    const int root = size - 1;
    at::Tensor t = RankValues(rank, 4, 4, at::kFloat);
    if (auto s = comm.Broadcast(t, root); !s.ok()) return s;
    EXPECT_TRUE(at::equal(t, RankValues(root, 4, 4, at::kFloat))) << "rank " << rank;
    return comm.Barrier();
  });
  ASSERT_TRUE(status.ok()) << status;
}

INSTANTIATE_TEST_SUITE_P(Sizes, CommunicatorSizeTest, ::testing::Values(1, 2, 4));

TEST(CommunicatorTest, ReduceScatterRejectsRowsThatDoNotSplit) {
  absl::Status status = RunRanks(2, [&](int, Communicator& comm) {
    auto result = comm.ReduceScatterRows(at::ones({3, 2}));
    EXPECT_FALSE(result.ok());
    EXPECT_THAT(std::string(result.status().message()), HasSubstr("3 rows do not split into 2"));
    return absl::OkStatus();
  });
  ASSERT_TRUE(status.ok()) << status;
}

TEST(CommunicatorTest, InvalidRankIsRejectedWithValues) {
  CommunicatorOptions options;
  options.prefix = "bad";
  options.rank = 2;
  options.size = 2;
  auto created = Communicator::Create(OpenHashStore(), options);
  ASSERT_FALSE(created.ok());
  EXPECT_EQ(created.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(created.status().message()), HasSubstr("rank=2 size=2"));
}

TEST(CommunicatorTest, NcclWithoutNcclBuildIsUnimplemented) {
#ifdef USE_C10D_NCCL
  GTEST_SKIP() << "this libtorch has NCCL";
#else
  CommunicatorOptions options;
  options.prefix = "nccl";
  options.rank = 0;
  options.size = 2;
  options.backend = Backend::kNccl;
  auto created = Communicator::Create(OpenHashStore(), options);
  ASSERT_FALSE(created.ok());
  EXPECT_EQ(created.status().code(), absl::StatusCode::kUnimplemented);
#endif
}

// Before its first process group hetpar sets ProcessGroupNCCL's handling of a communicator
// error to CleanUpOnly (2: abort the communicator, keep the process), so that a worker outlives
// its peers' failures, and turns off the flight-recorder dump whose signal would end healthy
// ranks; a value the environment set is kept instead.
TEST(CommunicatorTest, FormingAGroupSetsNcclErrorHandlingToCleanUpOnly) {
  struct Setting {
    const char* name;
    const char* hetpar;                 // what hetpar sets where the environment does not
    std::optional<std::string> before;  // the environment's value, if it set one
  };
  std::vector<Setting> settings = {{"TORCH_NCCL_ASYNC_ERROR_HANDLING", "2", std::nullopt},
                                   {"TORCH_NCCL_DUMP_ON_TIMEOUT", "0", std::nullopt},
                                   {"TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC", "250", std::nullopt}};
  for (Setting& s : settings) {
    if (const char* value = std::getenv(s.name)) s.before = value;
  }
  CommunicatorOptions options;
  options.prefix = "error-handling";
  options.rank = 0;
  options.size = 2;
  options.timeout = absl::Milliseconds(100);
  (void)Communicator::Create(OpenHashStore(), options);  // no peer: only the set-up matters
  for (const Setting& s : settings) {
    const char* after = std::getenv(s.name);
    ASSERT_NE(after, nullptr) << s.name;
    EXPECT_EQ(std::string(after), s.before.value_or(s.hetpar)) << s.name;
  }
}

TEST(CommunicatorTest, MissingPeerFailsRendezvousWithinDeadline) {
  CommunicatorOptions options;
  options.prefix = "lonely";
  options.rank = 0;
  options.size = 2;
  options.timeout = absl::Milliseconds(800);
  const auto start = std::chrono::steady_clock::now();
  auto created = Communicator::Create(OpenHashStore(), options);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_FALSE(created.ok());
  EXPECT_EQ(created.status().code(), absl::StatusCode::kDeadlineExceeded) << created.status();
  EXPECT_THAT(std::string(created.status().message()), HasSubstr("group 'lonely'"));
  EXPECT_LT(seconds, 10.0);
}

// Once a step's attempt is armed, a rendezvous waiting on a peer that will not come ends when
// the coordinator's abort raises the interrupt, not at its timeout (a peer that never started
// stands here for one that died after publishing its address).
TEST(CommunicatorTest, AnArmedInterruptEndsARendezvousThatWaitsOnAMissingPeer) {
  auto store = OpenHashStore();
  StepInterrupt interrupt;
  interrupt.Arm(3);
  std::thread abort([&] {
    // Rank 0 has published its address: it now waits on rank 1.
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (store->getNumKeys() < 1 && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    interrupt.Raise(3);
  });
  CommunicatorOptions options;
  options.prefix = "abandoned";
  options.rank = 0;
  options.size = 2;
  options.timeout = absl::Seconds(300);
  options.interrupt = &interrupt;
  auto created = Communicator::Create(store, options);
  abort.join();
  ASSERT_FALSE(created.ok());
  EXPECT_EQ(created.status().code(), absl::StatusCode::kAborted) << created.status();
  EXPECT_THAT(std::string(created.status().message()),
              HasSubstr("group 'abandoned': rendezvous of rank 0 of 2 given up: interrupted"));
  // Still waiting for rank 1 on its own thread (for up to the 300 s timeout).
  EXPECT_GE(RendezvousThreadsRunning(), 1);
}

// The groups a worker forms as it starts (before any attempt is armed) are not given up, even
// with an abort raised; and an armed interrupt that is not raised forms a working group.
TEST(CommunicatorTest, ARendezvousIsGivenUpOnlyWhenArmedAndRaised) {
  for (const bool armed : {false, true}) {
    SCOPED_TRACE(armed ? "armed, not raised" : "raised before the first arm");
    StepInterrupt interrupt;
    if (armed) {
      interrupt.Arm(1);
    } else {
      interrupt.Raise(1);
    }
    auto store = OpenHashStore();
    std::vector<absl::StatusOr<std::unique_ptr<Communicator>>> groups(2);
    std::vector<std::thread> ranks;
    for (int rank = 0; rank < 2; ++rank) {
      ranks.emplace_back([&, rank] {
        CommunicatorOptions options;
        options.prefix = armed ? "armed" : "unarmed";
        options.rank = rank;
        options.size = 2;
        options.timeout = absl::Seconds(60);
        options.interrupt = &interrupt;
        groups[rank] = Communicator::Create(store, options);
      });
    }
    for (auto& t : ranks) t.join();
    for (int rank = 0; rank < 2; ++rank) {
      ASSERT_TRUE(groups[rank].ok()) << groups[rank].status();
      EXPECT_EQ((*groups[rank])->rank(), rank);
    }
    if (!armed) continue;
    std::vector<at::Tensor> values = {RankValues(0, 2, 3, at::kFloat),
                                      RankValues(1, 2, 3, at::kFloat)};
    std::vector<absl::Status> reduced(2);
    ranks.clear();
    for (int rank = 0; rank < 2; ++rank) {
      ranks.emplace_back([&, rank] { reduced[rank] = (*groups[rank])->AllReduce(values[rank]); });
    }
    for (auto& t : ranks) t.join();
    for (int rank = 0; rank < 2; ++rank) {
      ASSERT_TRUE(reduced[rank].ok()) << reduced[rank];
      // (1 + 2) * (i + 1) / 8 for element i.
      EXPECT_TRUE(at::equal(values[rank], RankValues(2, 2, 3, at::kFloat))) << rank;
    }
  }
}

// Without an interrupt (one wait) and with one that is never raised (waits in slices): a
// collective past its deadline fails DeadlineExceeded. (Whether its group is then abandoned
// depends on whether Gloo's own timeout, the same, ended the collective first.)
TEST(CommunicatorTest, PeerThatSkipsACollectiveFailsItWithinDeadline) {
  // Also the group's formation's (the rendezvous and its closing barrier, which both ranks'
  // threads must reach): long enough for a loaded machine, short enough for the bound below.
  constexpr absl::Duration kTimeout = absl::Seconds(3);
  for (const bool with_interrupt : {false, true}) {
    SCOPED_TRACE(with_interrupt ? "with an interrupt" : "without an interrupt");
    const std::string prefix = with_interrupt ? "skipper-interruptible" : "skipper";
    auto store = OpenHashStore();
    StepInterrupt interrupt;
    std::promise<void> given_up;  // rank 0's all-reduce returned
    std::thread rank1([&, done = given_up.get_future()] {
      CommunicatorOptions options;
      options.prefix = prefix;
      options.rank = 1;
      options.size = 2;
      options.timeout = kTimeout;
      auto comm = Communicator::Create(store, options);
      ASSERT_TRUE(comm.ok()) << comm.status();
      // Never joins the all-reduce; stays alive until rank 0 has given up.
      done.wait_for(std::chrono::seconds(60));
    });
    CommunicatorOptions options;
    options.prefix = prefix;
    options.rank = 0;
    options.size = 2;
    options.timeout = kTimeout;
    if (with_interrupt) options.interrupt = &interrupt;
    auto comm = Communicator::Create(store, options);
    ASSERT_TRUE(comm.ok()) << comm.status();
    at::Tensor t = at::ones({4});
    const auto start = std::chrono::steady_clock::now();
    absl::Status status = (*comm)->AllReduce(t);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    given_up.set_value();
    rank1.join();
    EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr("all-reduce in group '" + prefix + "'"));
    EXPECT_LT(seconds, 10.0);
  }
}

TEST(CommunicatorTest, TcpStoreFormsAGroup) {
  auto server = OpenTcpStore("127.0.0.1", 0, /*is_server=*/true, 2, absl::Seconds(20));
  ASSERT_TRUE(server.ok()) << server.status();
  auto port = TcpStorePort(*server);
  ASSERT_TRUE(port.ok()) << port.status();
  ASSERT_GT(*port, 0);
  absl::Status client_status;
  std::thread client([&] {
    auto store = OpenTcpStore("127.0.0.1", *port, /*is_server=*/false, 2, absl::Seconds(20));
    if (!store.ok()) {
      client_status = store.status();
      return;
    }
    CommunicatorOptions options;
    options.prefix = "tcp";
    options.rank = 1;
    options.size = 2;
    auto comm = Communicator::Create(*store, options);
    if (!comm.ok()) {
      client_status = comm.status();
      return;
    }
    at::Tensor t = at::full({3}, 2.0);
    client_status = (*comm)->AllReduce(t);
    EXPECT_TRUE(at::equal(t, at::full({3}, 3.0)));
  });
  CommunicatorOptions options;
  options.prefix = "tcp";
  options.rank = 0;
  options.size = 2;
  auto comm = Communicator::Create(*server, options);
  ASSERT_TRUE(comm.ok()) << comm.status();
  at::Tensor t = at::full({3}, 1.0);
  ASSERT_TRUE((*comm)->AllReduce(t).ok());
  client.join();
  ASSERT_TRUE(client_status.ok()) << client_status;
  EXPECT_TRUE(at::equal(t, at::full({3}, 3.0)));
}

TEST(CommunicatorTest, TcpClientWithoutServerFailsWithinDeadline) {
  const auto start = std::chrono::steady_clock::now();
  // Port 1 on loopback: nothing listens there for an unprivileged test.
  auto store = OpenTcpStore("127.0.0.1", 1, /*is_server=*/false, 2, absl::Seconds(1));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_FALSE(store.ok());
  EXPECT_THAT(std::string(store.status().message()), HasSubstr("127.0.0.1:1"));
  EXPECT_LT(seconds, 10.0);
}

}  // namespace
}  // namespace hetpar::nn
