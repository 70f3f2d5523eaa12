// A c10d::Store on the coordinator's key-value service, so that workers form their Gloo and NCCL
// groups through the coordinator instead of a separate TCP store:
//
//   HETPAR_ASSIGN_OR_RETURN(auto store, rendezvous::OpenCoordinatorStore(connection,
//                                                                         generation, timeout));
//   nn::CommunicatorOptions options;  // prefix "llm/replica0/tp", rank, size
//   HETPAR_ASSIGN_OR_RETURN(auto tp, nn::Communicator::Create(store, options));
//
// Keys live in the coordinator's keyspace of one generation (Assignment.generation); after a
// membership change the old generation's keys are gone and its calls fail, so groups are formed
// again with a store of the new generation. get() and wait() wait at most the store's timeout
// (c10d's kNoTimeout means the store's timeout here: every wait has a deadline).
//
// Errors are thrown as c10::Error (c10d's convention for stores; ProcessGroupGloo and friends
// expect it) with the coordinator's message, e.g. a wait that timed out names the missing keys.
// Thread-safe: each call is one RPC on a shared channel.
#ifndef HETPAR_COMMON_RENDEZVOUS_COORDINATOR_STORE_H_
#define HETPAR_COMMON_RENDEZVOUS_COORDINATOR_STORE_H_

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "coordinator/client.h"

namespace hetpar::rendezvous {

class CoordinatorStore : public c10d::Store {
 public:
  // Prefer OpenCoordinatorStore; public for c10::make_intrusive.
  CoordinatorStore(std::shared_ptr<coordinator::CoordinatorConnection> connection,
                   int64_t generation, std::chrono::milliseconds timeout);

  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> compareSet(const std::string& key,
                                  const std::vector<uint8_t>& expected_value,
                                  const std::vector<uint8_t>& desired_value) override;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t value) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t getNumKeys() override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;

  int64_t generation() const { return client_.generation(); }

 private:
  // The deadline for a wait of `timeout` (kNoTimeout: the store's own timeout).
  absl::Duration WaitTimeout(std::chrono::milliseconds timeout) const;

  coordinator::KeyValueClient client_;
};

// A store for `generation` over `connection`; get() and wait() wait at most `timeout`.
// InvalidArgument for a non-positive timeout.
absl::StatusOr<c10::intrusive_ptr<c10d::Store>> OpenCoordinatorStore(
    std::shared_ptr<coordinator::CoordinatorConnection> connection, int64_t generation,
    absl::Duration timeout);

}  // namespace hetpar::rendezvous

#endif  // HETPAR_COMMON_RENDEZVOUS_COORDINATOR_STORE_H_
