// c10d::Store semantics of the coordinator's key-value service, and Gloo groups formed through
// it, against an in-process coordinator.
#include "common/rendezvous/coordinator_store.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <thread>

#include "absl/time/clock.h"
#include "common/nn/communicator.h"
#include "coordinator/server.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hetpar::rendezvous {
namespace {

using ::testing::HasSubstr;

constexpr char kToken[] = "rendezvous-test-token";

class CoordinatorStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    v1::RunSpec spec;
    spec.mutable_run()->set_name("rendezvous");
    spec.mutable_run()->set_steps(1);
    spec.mutable_encoder()->mutable_layout()->set_dp(1);
    spec.mutable_llm()->mutable_layout()->set_dp(1);
    spec.mutable_coordinator()->set_heartbeat_timeout_s(10);
    spec.mutable_coordinator()->set_register_timeout_s(60);
    coordinator::ServerOptions options;
    options.listen_address = "127.0.0.1:0";
    options.token = kToken;
    auto server = coordinator::CoordinatorServer::Create(spec, options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }

  c10::intrusive_ptr<c10d::Store> Open(int64_t generation = 1,
                                       absl::Duration timeout = absl::Seconds(30)) {
    coordinator::ClientOptions options;
    options.address = server_->address();
    options.token = kToken;
    options.dedicated_connection = true;
    auto connection = coordinator::CoordinatorConnection::Create(options);
    EXPECT_TRUE(connection.ok()) << connection.status();
    auto store = OpenCoordinatorStore(*connection, generation, timeout);
    EXPECT_TRUE(store.ok()) << store.status();
    return *store;
  }

  static std::vector<uint8_t> Bytes(const std::string& s) {
    return std::vector<uint8_t>(s.begin(), s.end());
  }

  std::unique_ptr<coordinator::CoordinatorServer> server_;
};

TEST_F(CoordinatorStoreTest, StoreSemantics) {
  auto store = Open();
  const std::vector<uint8_t> binary = {0, 1, 2, 255, 0, 7};
  store->set("bin", binary);
  EXPECT_EQ(store->get("bin"), binary);
  EXPECT_TRUE(store->check({"bin"}));
  EXPECT_FALSE(store->check({"bin", "other"}));
  EXPECT_EQ(store->getNumKeys(), 1);
  EXPECT_EQ(store->add("n", 5), 5);
  EXPECT_EQ(store->add("n", -2), 3);
  EXPECT_EQ(store->get("n"), Bytes("3"));
  EXPECT_EQ(store->compareSet("cas", Bytes(""), Bytes("first")), Bytes("first"));
  EXPECT_EQ(store->compareSet("cas", Bytes("wrong"), Bytes("second")), Bytes("first"));
  EXPECT_EQ(store->compareSet("cas", Bytes("first"), Bytes("second")), Bytes("second"));
  EXPECT_TRUE(store->deleteKey("cas"));
  EXPECT_FALSE(store->deleteKey("cas"));
  EXPECT_EQ(store->getNumKeys(), 2);
  // Another client of the same generation sees the same keys.
  EXPECT_EQ(Open()->get("bin"), binary);
}

TEST_F(CoordinatorStoreTest, GetAndWaitBlockUntilAnotherClientSets) {
  auto reader = Open();
  std::thread writer([&] {
    absl::SleepFor(absl::Milliseconds(200));
    Open()->set("ready", Bytes("yes"));
  });
  EXPECT_EQ(reader->get("ready"), Bytes("yes"));
  writer.join();
  reader->wait({"ready"});
  reader->wait({"ready"}, std::chrono::milliseconds(10));
}

TEST_F(CoordinatorStoreTest, WaitTimesOut) {
  auto store = Open(1, absl::Milliseconds(300));
  store->set("a", Bytes("1"));
  const absl::Time start = absl::Now();
  try {
    store->wait({"a", "missing"});
    FAIL() << "wait returned without the key";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("'missing'"));
    EXPECT_THAT(e.what(), HasSubstr("DEADLINE_EXCEEDED"));
  }
  const absl::Duration waited = absl::Now() - start;
  EXPECT_GE(waited, absl::Milliseconds(300));
  EXPECT_LT(waited, absl::Milliseconds(300) + absl::Seconds(1));
  EXPECT_THROW(store->get("missing"), c10::Error);
  // An explicit timeout wins over the store's.
  const absl::Time again = absl::Now();
  EXPECT_THROW(store->wait({"missing"}, std::chrono::milliseconds(100)), c10::Error);
  EXPECT_LT(absl::Now() - again, absl::Milliseconds(100) + absl::Seconds(1));
}

TEST_F(CoordinatorStoreTest, AddIsAtomicUnder32ConcurrentClients) {
  constexpr int kClients = 32;
  constexpr int kAdds = 20;
  std::vector<c10::intrusive_ptr<c10d::Store>> stores;
  for (int c = 0; c < kClients; ++c) stores.push_back(Open());
  std::vector<std::vector<int64_t>> seen(kClients);
  std::vector<std::thread> threads;
  for (int c = 0; c < kClients; ++c) {
    threads.emplace_back([&, c] {
      for (int i = 0; i < kAdds; ++i) seen[c].push_back(stores[c]->add("counter", 1));
    });
  }
  for (auto& t : threads) t.join();
  std::vector<int64_t> all;
  for (const auto& s : seen) all.insert(all.end(), s.begin(), s.end());
  std::sort(all.begin(), all.end());
  ASSERT_EQ(all.size(), static_cast<size_t>(kClients * kAdds));
  for (size_t i = 0; i < all.size(); ++i) ASSERT_EQ(all[i], static_cast<int64_t>(i) + 1);
}

TEST_F(CoordinatorStoreTest, OtherGenerationsAreRefused) {
  auto stale = Open(/*generation=*/2);
  try {
    stale->set("k", Bytes("v"));
    FAIL() << "a store of another generation wrote a key";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("generation 2"));
  }
  EXPECT_EQ(OpenCoordinatorStore(nullptr, 1, absl::Seconds(1)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(CoordinatorStoreTest, GlooGroupFormsThroughTheCoordinator) {
  constexpr int kRanks = 4;
  std::vector<at::Tensor> results(kRanks);
  std::vector<absl::Status> statuses(kRanks);
  std::vector<std::thread> ranks;
  for (int r = 0; r < kRanks; ++r) {
    ranks.emplace_back([&, r, store = Open()] {
      nn::CommunicatorOptions options;
      options.prefix = "gen1/test/group";
      options.rank = r;
      options.size = kRanks;
      options.timeout = absl::Seconds(60);
      auto communicator = nn::Communicator::Create(store, options);
      if (!communicator.ok()) {
        statuses[r] = communicator.status();
        return;
      }
      // Rank r contributes (r + 1) * [1, 2, ..., 6].
      at::Tensor t = at::arange(1, 7, at::kDouble) * (r + 1);
      statuses[r] = (*communicator)->AllReduce(t);
      results[r] = t;
    });
  }
  for (auto& t : ranks) t.join();
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_TRUE(statuses[r].ok()) << "rank " << r << ": " << statuses[r];
    ASSERT_EQ(results[r].numel(), 6);
    for (int i = 0; i < 6; ++i) {
      // sum over ranks of (r + 1) * (i + 1) = 10 * (i + 1)
      EXPECT_DOUBLE_EQ(results[r][i].item<double>(), 10.0 * (i + 1)) << "rank " << r << " i " << i;
    }
  }
}

}  // namespace
}  // namespace hetpar::rendezvous
