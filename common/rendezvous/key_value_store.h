// The rendezvous key-value store that workers form their process groups through, as an abstract
// interface: the torch-free core implements it (common/control/client.h, KeyValueClient on the
// coordinator's key-value service), and the torch layer adapts it to c10d (c10d_store.h). So
// neither the core nor the adapter depends on the other, and tests can run the adapter over any
// implementation.
//
// Semantics follow c10d::Store: values are byte strings; Get and Wait wait for keys to appear up
// to a deadline (every wait has one); Add treats a missing key as 0. Implementations are
// thread-safe.
#ifndef HETPAR_COMMON_RENDEZVOUS_KEY_VALUE_STORE_H_
#define HETPAR_COMMON_RENDEZVOUS_KEY_VALUE_STORE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace hetpar::rendezvous {

class KeyValueStore {
 public:
  virtual ~KeyValueStore() = default;

  virtual absl::Status Set(const std::string& key, const std::string& value) const = 0;
  // Waits up to `timeout` for the key to appear; DeadlineExceeded naming it otherwise.
  virtual absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) const = 0;
  // Adds `delta` to the integer at `key` (0 when absent) and returns the new value.
  virtual absl::StatusOr<int64_t> Add(const std::string& key, int64_t delta) const = 0;
  // Sets `desired` when the current value is `expected` (or the key is absent and `expected` is
  // empty); returns the value after the call.
  virtual absl::StatusOr<std::string> CompareSet(const std::string& key,
                                                 const std::string& expected,
                                                 const std::string& desired) const = 0;
  // OK once every key exists; DeadlineExceeded naming the missing keys after `timeout`.
  virtual absl::Status Wait(const std::vector<std::string>& keys, absl::Duration timeout) const = 0;
  virtual absl::StatusOr<bool> Check(const std::vector<std::string>& keys) const = 0;
  virtual absl::StatusOr<bool> Delete(const std::string& key) const = 0;
  virtual absl::StatusOr<int64_t> NumKeys() const = 0;
};

}  // namespace hetpar::rendezvous

#endif  // HETPAR_COMMON_RENDEZVOUS_KEY_VALUE_STORE_H_
