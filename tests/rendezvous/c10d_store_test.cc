// The c10d adapter (common/rendezvous/c10d_store.h) over the coordinator's key-value service:
// c10d::Store semantics, and Gloo groups formed through it, against an in-process coordinator.
#include "common/rendezvous/c10d_store.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/control/client.h"
#include "common/nn/communicator.h"
#include "coordinator/server.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hetpar::rendezvous {
namespace {

using ::testing::HasSubstr;

constexpr char kToken[] = "rendezvous-test-token";

class C10dStoreTest : public ::testing::Test {
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

  std::shared_ptr<coordinator::KeyValueClient> Client(int64_t generation = 1) {
    coordinator::ClientOptions options;
    options.address = server_->address();
    options.token = kToken;
    options.dedicated_connection = true;
    auto connection = coordinator::CoordinatorConnection::Create(options);
    EXPECT_TRUE(connection.ok()) << connection.status();
    return std::make_shared<coordinator::KeyValueClient>(*connection, generation);
  }

  c10::intrusive_ptr<c10d::Store> Open(int64_t generation = 1,
                                       absl::Duration timeout = absl::Seconds(30)) {
    auto store = OpenC10dStore(Client(generation), timeout);
    EXPECT_TRUE(store.ok()) << store.status();
    return *store;
  }

  static std::vector<uint8_t> Bytes(const std::string& s) {
    return std::vector<uint8_t>(s.begin(), s.end());
  }

  std::unique_ptr<coordinator::CoordinatorServer> server_;
};

TEST_F(C10dStoreTest, StoreSemantics) {
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

// Tells when a Get has been issued, so a writer can start only once the reader is waiting.
class GetObserver : public KeyValueStore {
 public:
  explicit GetObserver(std::shared_ptr<const KeyValueStore> inner) : inner_(std::move(inner)) {}
  absl::Status Set(const std::string& k, const std::string& v) const override {
    return inner_->Set(k, v);
  }
  absl::StatusOr<std::string> Get(const std::string& k, absl::Duration t) const override {
    if (!get_issued.HasBeenNotified()) get_issued.Notify();
    return inner_->Get(k, t);
  }
  absl::StatusOr<int64_t> Add(const std::string& k, int64_t d) const override {
    return inner_->Add(k, d);
  }
  absl::StatusOr<std::string> CompareSet(const std::string& k, const std::string& e,
                                         const std::string& d) const override {
    return inner_->CompareSet(k, e, d);
  }
  absl::Status Wait(const std::vector<std::string>& k, absl::Duration t) const override {
    return inner_->Wait(k, t);
  }
  absl::StatusOr<bool> Check(const std::vector<std::string>& k) const override {
    return inner_->Check(k);
  }
  absl::StatusOr<bool> Delete(const std::string& k) const override { return inner_->Delete(k); }
  absl::StatusOr<int64_t> NumKeys() const override { return inner_->NumKeys(); }

  mutable absl::Notification get_issued;

 private:
  std::shared_ptr<const KeyValueStore> inner_;
};

TEST_F(C10dStoreTest, GetAndWaitBlockUntilAnotherClientSets) {
  auto observer = std::make_shared<GetObserver>(Client());
  auto reader = OpenC10dStore(observer, absl::Seconds(60));
  ASSERT_TRUE(reader.ok()) << reader.status();
  std::thread writer([&] {
    // The key is written only after the reader asked for it.
    observer->get_issued.WaitForNotification();
    Open()->set("ready", Bytes("yes"));
  });
  EXPECT_EQ((*reader)->get("ready"), Bytes("yes"));
  writer.join();
  auto& reader_store = *reader;
  reader_store->wait({"ready"});
  reader_store->wait({"ready"}, std::chrono::milliseconds(10));
}

TEST_F(C10dStoreTest, WaitTimesOut) {
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
  EXPECT_LT(waited, absl::Milliseconds(300) + absl::Seconds(30));
  EXPECT_THROW(store->get("missing"), c10::Error);
  // An explicit timeout wins over the store's.
  const absl::Time again = absl::Now();
  EXPECT_THROW(store->wait({"missing"}, std::chrono::milliseconds(100)), c10::Error);
  // Well below the store's own 300 ms would be a tighter window than a loaded machine holds;
  // the bound only says the explicit timeout ended the wait, not an endless one.
  EXPECT_LT(absl::Now() - again, absl::Seconds(30));
}

TEST_F(C10dStoreTest, AddIsAtomicUnder32ConcurrentClients) {
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

TEST_F(C10dStoreTest, OtherGenerationsAreRefused) {
  auto stale = Open(/*generation=*/2);
  try {
    stale->set("k", Bytes("v"));
    FAIL() << "a store of another generation wrote a key";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("generation 2"));
  }
  EXPECT_EQ(OpenC10dStore(nullptr, absl::Seconds(1)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(C10dStoreTest, GlooGroupFormsThroughTheCoordinator) {
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
