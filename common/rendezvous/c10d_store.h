// A c10d::Store over a rendezvous key-value store (key_value_store.h), so that workers form their
// Gloo and NCCL groups through the coordinator instead of a separate TCP store:
//
//   auto kv = std::make_shared<coordinator::KeyValueClient>(connection, generation);
//   HETPAR_ASSIGN_OR_RETURN(auto store, rendezvous::OpenC10dStore(kv, timeout));
//   nn::CommunicatorOptions options;  // prefix "llm/replica0/tp", rank, size
//   HETPAR_ASSIGN_OR_RETURN(auto tp, nn::Communicator::Create(store, options));
//
// With the coordinator's store, keys live in the keyspace of one generation
// (Assignment.generation); after a membership change the old generation's keys are gone and its
// calls fail, so groups are formed again with a store of the new generation. get() and wait()
// wait at most the store's timeout (c10d's kNoTimeout means the store's timeout here: every wait
// has a deadline).
//
// Errors are thrown as c10::Error (c10d's convention for stores; ProcessGroupGloo and friends
// expect it) with the key-value store's message, e.g. a wait that timed out names the missing
// keys. Thread-safe when the key-value store is.
#ifndef HETPAR_COMMON_RENDEZVOUS_C10D_STORE_H_
#define HETPAR_COMMON_RENDEZVOUS_C10D_STORE_H_

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/rendezvous/key_value_store.h"

namespace hetpar::rendezvous {

class C10dStore : public c10d::Store {
 public:
  // Prefer OpenC10dStore; public for c10::make_intrusive.
  C10dStore(std::shared_ptr<const KeyValueStore> store, std::chrono::milliseconds timeout);

  // Another handle on the same key-value store, with this one's timeout (libtorch 2.x clones a
  // store for each thread that uses it).
  c10::intrusive_ptr<c10d::Store> clone() override;
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

 private:
  // The deadline for a wait of `timeout` (kNoTimeout: the store's own timeout).
  absl::Duration WaitTimeout(std::chrono::milliseconds timeout) const;

  std::shared_ptr<const KeyValueStore> store_;
};

// A c10d store over `store`; get() and wait() wait at most `timeout`. InvalidArgument for a null
// store or a non-positive timeout.
absl::StatusOr<c10::intrusive_ptr<c10d::Store>> OpenC10dStore(
    std::shared_ptr<const KeyValueStore> store, absl::Duration timeout);

}  // namespace hetpar::rendezvous

#endif  // HETPAR_COMMON_RENDEZVOUS_C10D_STORE_H_
