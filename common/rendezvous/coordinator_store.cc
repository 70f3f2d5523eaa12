#include "common/rendezvous/coordinator_store.h"

#include <c10/util/Exception.h>

#include <utility>

#include "absl/strings/str_cat.h"

namespace hetpar::rendezvous {
namespace {

// The one place where the key-value client's statuses become c10d's exceptions.
void ThrowIfError(const absl::Status& status) {
  if (status.ok()) return;
  TORCH_CHECK(false, "rendezvous store on the coordinator: ", std::string(status.message()), " (",
              absl::StatusCodeToString(status.code()), ")");
}

template <typename T>
T ValueOrThrow(absl::StatusOr<T> value) {
  ThrowIfError(value.status());
  return *std::move(value);
}

std::string ToString(const std::vector<uint8_t>& bytes) {
  return std::string(bytes.begin(), bytes.end());
}

std::vector<uint8_t> ToBytes(const std::string& text) {
  return std::vector<uint8_t>(text.begin(), text.end());
}

}  // namespace

CoordinatorStore::CoordinatorStore(std::shared_ptr<coordinator::CoordinatorConnection> connection,
                                   int64_t generation, std::chrono::milliseconds timeout)
    : c10d::Store(timeout), client_(std::move(connection), generation) {}

absl::Duration CoordinatorStore::WaitTimeout(std::chrono::milliseconds timeout) const {
  if (timeout == kNoTimeout) timeout = timeout_;
  if (timeout == kNoTimeout) timeout = kDefaultTimeout;
  return absl::Milliseconds(timeout.count());
}

void CoordinatorStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  ThrowIfError(client_.Set(key, ToString(value)));
}

std::vector<uint8_t> CoordinatorStore::compareSet(const std::string& key,
                                                  const std::vector<uint8_t>& expected_value,
                                                  const std::vector<uint8_t>& desired_value) {
  return ToBytes(
      ValueOrThrow(client_.CompareSet(key, ToString(expected_value), ToString(desired_value))));
}

std::vector<uint8_t> CoordinatorStore::get(const std::string& key) {
  return ToBytes(ValueOrThrow(client_.Get(key, WaitTimeout(timeout_))));
}

int64_t CoordinatorStore::add(const std::string& key, int64_t value) {
  return ValueOrThrow(client_.Add(key, value));
}

bool CoordinatorStore::deleteKey(const std::string& key) {
  return ValueOrThrow(client_.Delete(key));
}

bool CoordinatorStore::check(const std::vector<std::string>& keys) {
  return ValueOrThrow(client_.Check(keys));
}

int64_t CoordinatorStore::getNumKeys() { return ValueOrThrow(client_.NumKeys()); }

void CoordinatorStore::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void CoordinatorStore::wait(const std::vector<std::string>& keys,
                            const std::chrono::milliseconds& timeout) {
  ThrowIfError(client_.Wait(keys, WaitTimeout(timeout)));
}

absl::StatusOr<c10::intrusive_ptr<c10d::Store>> OpenCoordinatorStore(
    std::shared_ptr<coordinator::CoordinatorConnection> connection, int64_t generation,
    absl::Duration timeout) {
  if (connection == nullptr) {
    return absl::InvalidArgumentError("OpenCoordinatorStore needs a coordinator connection");
  }
  if (timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("rendezvous store timeout ",
                                                   absl::FormatDuration(timeout),
                                                   "; expected > 0 (every wait has a deadline)"));
  }
  return c10::intrusive_ptr<c10d::Store>(c10::make_intrusive<CoordinatorStore>(
      std::move(connection), generation,
      std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout))));
}

}  // namespace hetpar::rendezvous
