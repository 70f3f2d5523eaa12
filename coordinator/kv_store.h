// The rendezvous key-value store behind the KeyValue service (what c10d::Store needs).
//
// Keys live in a keyspace per generation. Only the current generation is served: a request for
// any other fails with FailedPrecondition, and moving to a new generation drops the old keyspace
// and aborts the waits on it. Values are bytes; Add keeps an int64 as decimal text, as c10d's
// TCPStore does.
//
// Waits are asynchronous: Wait/Get register a callback that runs exactly once, when every key
// exists, at the deadline (DeadlineExceeded), on Cancel (Cancelled) or when the generation moves
// on (Aborted). Callbacks run on the thread that caused them (a Set, ExpireWaits, Cancel,
// SetGeneration), never under the store's lock. Thread-safe.
#ifndef HETPAR_COORDINATOR_KV_STORE_H_
#define HETPAR_COORDINATOR_KV_STORE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace hetpar::coordinator {

class KeyValueStore {
 public:
  using WaitId = int64_t;
  // For Wait: OK, DeadlineExceeded, Cancelled or Aborted.
  using WaitCallback = std::function<void(absl::Status)>;
  // For GetAsync: the value, or the status of a failed wait.
  using GetCallback = std::function<void(absl::StatusOr<std::string>)>;

  explicit KeyValueStore(int64_t generation = 1) : generation_(generation) {}
  KeyValueStore(const KeyValueStore&) = delete;
  KeyValueStore& operator=(const KeyValueStore&) = delete;

  // Moves to `generation`: drops every key and aborts every pending wait of older generations.
  // A generation at or below the current one changes nothing.
  void SetGeneration(int64_t generation);
  int64_t generation() const;

  absl::Status Set(int64_t generation, const std::string& key, std::string value);
  // NotFound when absent.
  absl::StatusOr<std::string> Get(int64_t generation, const std::string& key) const;
  // The new value. InvalidArgument when the stored value is not a decimal int64 or the sum
  // overflows.
  absl::StatusOr<int64_t> Add(int64_t generation, const std::string& key, int64_t delta);
  // c10d's compareSet: a present key whose value equals `expected` is set to `desired`; an
  // absent key is set to `desired` only when `expected` is empty. Returns the value after the
  // call, or `expected` when the key is absent and stays absent.
  absl::StatusOr<std::string> CompareSet(int64_t generation, const std::string& key,
                                         const std::string& expected, std::string desired);
  absl::StatusOr<bool> Check(int64_t generation, const std::vector<std::string>& keys) const;
  absl::StatusOr<bool> Delete(int64_t generation, const std::string& key);
  absl::StatusOr<int64_t> NumKeys(int64_t generation) const;

  // An id for a Wait or GetAsync. Taken before the wait starts, so a caller that the callback
  // may destroy never has to touch itself after starting the wait.
  WaitId NewWaitId();
  // Calls `done` once every key exists (possibly right away, on this thread) or with an error
  // as described above. `id` (from NewWaitId) identifies the wait for Cancel.
  void Wait(WaitId id, int64_t generation, std::vector<std::string> keys, absl::Time deadline,
            WaitCallback done);
  // Wait for one key, then pass its value.
  void GetAsync(WaitId id, int64_t generation, const std::string& key, absl::Time deadline,
                GetCallback done);
  // Ends a pending wait with Cancelled; no-op when it already ended.
  void Cancel(WaitId id);

  // Ends the waits whose deadline is <= now with DeadlineExceeded; returns the earliest deadline
  // still pending (InfiniteFuture when none).
  absl::Time ExpireWaits(absl::Time now);
  int64_t pending_waits() const;

 private:
  struct Waiter {
    int64_t generation;
    std::vector<std::string> keys;
    absl::Time deadline;
    WaitCallback done;
  };
  absl::Status CheckGeneration(int64_t generation) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Removes the waiters satisfied by the current keys and returns their callbacks.
  std::vector<WaitCallback> TakeSatisfied() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool AllExist(const std::vector<std::string>& keys) const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  int64_t generation_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::string> values_ ABSL_GUARDED_BY(mu_);
  std::map<WaitId, Waiter> waiters_ ABSL_GUARDED_BY(mu_);
  WaitId next_wait_id_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace hetpar::coordinator

#endif  // HETPAR_COORDINATOR_KV_STORE_H_
