#include "coordinator/kv_store.h"

#include <limits>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "coordinator/limits.h"

namespace hetpar::coordinator {

void KeyValueStore::SetGeneration(int64_t generation) {
  std::vector<WaitCallback> aborted;
  {
    absl::MutexLock lock(&mu_);
    // Generations only grow: a late move to an older one (two callers racing) changes nothing.
    if (generation <= generation_) return;
    generation_ = generation;
    values_.clear();
    for (auto it = waiters_.begin(); it != waiters_.end();) {
      if (it->second.generation != generation) {
        aborted.push_back(std::move(it->second.done));
        it = waiters_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& done : aborted) {
    done(
        absl::AbortedError(absl::StrCat("the run moved to generation ", generation,
                                        " while waiting; re-form groups with the new generation")));
  }
}

int64_t KeyValueStore::generation() const {
  absl::MutexLock lock(&mu_);
  return generation_;
}

absl::Status KeyValueStore::CheckGeneration(int64_t generation) const {
  if (generation == generation_) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "key-value request for generation ", generation, " but the run is in generation ",
      generation_, generation < generation_ ? " (stale: re-register)" : ""));
}

bool KeyValueStore::AllExist(const std::vector<std::string>& keys) const {
  for (const auto& key : keys) {
    if (!values_.contains(key)) return false;
  }
  return true;
}

std::vector<KeyValueStore::WaitCallback> KeyValueStore::TakeSatisfied() {
  std::vector<WaitCallback> ready;
  for (auto it = waiters_.begin(); it != waiters_.end();) {
    if (it->second.generation == generation_ && AllExist(it->second.keys)) {
      ready.push_back(std::move(it->second.done));
      it = waiters_.erase(it);
    } else {
      ++it;
    }
  }
  return ready;
}

absl::Status KeyValueStore::Set(int64_t generation, const std::string& key, std::string value) {
  HETPAR_RETURN_IF_ERROR(CheckKey(key));
  HETPAR_RETURN_IF_ERROR(CheckValue("rendezvous value", value));
  std::vector<WaitCallback> ready;
  {
    absl::MutexLock lock(&mu_);
    if (absl::Status s = CheckGeneration(generation); !s.ok()) return s;
    values_[key] = std::move(value);
    ready = TakeSatisfied();
  }
  for (auto& done : ready) done(absl::OkStatus());
  return absl::OkStatus();
}

absl::StatusOr<std::string> KeyValueStore::Get(int64_t generation, const std::string& key) const {
  HETPAR_RETURN_IF_ERROR(CheckKey(key));
  absl::MutexLock lock(&mu_);
  if (absl::Status s = CheckGeneration(generation); !s.ok()) return s;
  auto it = values_.find(key);
  if (it == values_.end()) {
    return absl::NotFoundError(
        absl::StrCat("key '", key, "' is not set in generation ", generation));
  }
  return it->second;
}

absl::StatusOr<int64_t> KeyValueStore::Add(int64_t generation, const std::string& key,
                                           int64_t delta) {
  HETPAR_RETURN_IF_ERROR(CheckKey(key));
  std::vector<WaitCallback> ready;
  int64_t sum = 0;
  {
    absl::MutexLock lock(&mu_);
    if (absl::Status s = CheckGeneration(generation); !s.ok()) return s;
    int64_t current = 0;
    auto it = values_.find(key);
    if (it != values_.end() && !absl::SimpleAtoi(it->second, &current)) {
      return absl::InvalidArgumentError(
          absl::StrCat("add to key '", key, "': its value is not a decimal integer (",
                       it->second.size(), " bytes); expected a key written only by add"));
    }
    if ((delta > 0 && current > std::numeric_limits<int64_t>::max() - delta) ||
        (delta < 0 && current < std::numeric_limits<int64_t>::min() - delta)) {
      return absl::InvalidArgumentError(
          absl::StrCat("add ", delta, " to key '", key, "'=", current, " overflows int64"));
    }
    sum = current + delta;
    values_[key] = absl::StrCat(sum);
    ready = TakeSatisfied();
  }
  for (auto& done : ready) done(absl::OkStatus());
  return sum;
}

absl::StatusOr<std::string> KeyValueStore::CompareSet(int64_t generation, const std::string& key,
                                                      const std::string& expected,
                                                      std::string desired) {
  HETPAR_RETURN_IF_ERROR(CheckKey(key));
  HETPAR_RETURN_IF_ERROR(CheckValue("rendezvous expected value", expected));
  HETPAR_RETURN_IF_ERROR(CheckValue("rendezvous value", desired));
  std::vector<WaitCallback> ready;
  std::string result;
  {
    absl::MutexLock lock(&mu_);
    if (absl::Status s = CheckGeneration(generation); !s.ok()) return s;
    auto it = values_.find(key);
    if (it == values_.end()) {
      if (!expected.empty()) return expected;
      result = desired;
      values_[key] = std::move(desired);
      ready = TakeSatisfied();
    } else {
      if (it->second == expected) it->second = std::move(desired);
      result = it->second;
    }
  }
  for (auto& done : ready) done(absl::OkStatus());
  return result;
}

absl::StatusOr<bool> KeyValueStore::Check(int64_t generation,
                                          const std::vector<std::string>& keys) const {
  HETPAR_RETURN_IF_ERROR(CheckKeys(keys));
  absl::MutexLock lock(&mu_);
  if (absl::Status s = CheckGeneration(generation); !s.ok()) return s;
  return AllExist(keys);
}

absl::StatusOr<bool> KeyValueStore::Delete(int64_t generation, const std::string& key) {
  HETPAR_RETURN_IF_ERROR(CheckKey(key));
  absl::MutexLock lock(&mu_);
  if (absl::Status s = CheckGeneration(generation); !s.ok()) return s;
  return values_.erase(key) > 0;
}

absl::StatusOr<int64_t> KeyValueStore::NumKeys(int64_t generation) const {
  absl::MutexLock lock(&mu_);
  if (absl::Status s = CheckGeneration(generation); !s.ok()) return s;
  return static_cast<int64_t>(values_.size());
}

KeyValueStore::WaitId KeyValueStore::NewWaitId() {
  absl::MutexLock lock(&mu_);
  return next_wait_id_++;
}

void KeyValueStore::Wait(WaitId id, int64_t generation, std::vector<std::string> keys,
                         absl::Time deadline, WaitCallback done) {
  absl::Status immediate = CheckKeys(keys);
  if (immediate.ok()) {
    absl::MutexLock lock(&mu_);
    immediate = CheckGeneration(generation);
    if (immediate.ok() && !AllExist(keys)) {
      waiters_[id] = Waiter{generation, std::move(keys), deadline, std::move(done)};
      return;
    }
  }
  done(immediate);
}

void KeyValueStore::GetAsync(WaitId id, int64_t generation, const std::string& key,
                             absl::Time deadline, GetCallback done) {
  Wait(id, generation, {key}, deadline,
       [this, generation, key, done = std::move(done)](absl::Status status) {
         if (!status.ok()) {
           done(status);
           return;
         }
         // The key may have been deleted again in between; that is reported as NotFound.
         done(Get(generation, key));
       });
}

void KeyValueStore::Cancel(WaitId id) {
  WaitCallback done;
  {
    absl::MutexLock lock(&mu_);
    auto it = waiters_.find(id);
    if (it == waiters_.end()) return;
    done = std::move(it->second.done);
    waiters_.erase(it);
  }
  done(absl::CancelledError("wait cancelled by the caller"));
}

absl::Time KeyValueStore::ExpireWaits(absl::Time now) {
  std::vector<std::pair<WaitCallback, std::vector<std::string>>> expired;
  absl::Time next = absl::InfiniteFuture();
  {
    absl::MutexLock lock(&mu_);
    for (auto it = waiters_.begin(); it != waiters_.end();) {
      if (it->second.deadline <= now) {
        expired.emplace_back(std::move(it->second.done), std::move(it->second.keys));
        it = waiters_.erase(it);
      } else {
        next = std::min(next, it->second.deadline);
        ++it;
      }
    }
  }
  for (auto& [done, keys] : expired) {
    std::string missing;
    for (const auto& key : keys) {
      if (!missing.empty()) missing += ", ";
      missing += "'" + key + "'";
    }
    done(absl::DeadlineExceededError(
        absl::StrCat("timed out waiting for key(s) ", missing, " in the rendezvous store")));
  }
  return next;
}

int64_t KeyValueStore::pending_waits() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(waiters_.size());
}

}  // namespace hetpar::coordinator
