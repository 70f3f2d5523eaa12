#include "common/rendezvous/c10d_store.h"

#include <c10/util/Exception.h>

#include <utility>

#include "absl/strings/str_cat.h"

namespace hetpar::rendezvous {
namespace {

// The one place where the key-value client's statuses become c10d's exceptions.
void ThrowIfError(const absl::Status& status) {
  if (status.ok()) return;
  TORCH_CHECK(false, "rendezvous store: ", std::string(status.message()), " (",
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

C10dStore::C10dStore(std::shared_ptr<const KeyValueStore> store, std::chrono::milliseconds timeout)
    : c10d::Store(timeout), store_(std::move(store)) {}

absl::Duration C10dStore::WaitTimeout(std::chrono::milliseconds timeout) const {
  if (timeout == kNoTimeout) timeout = timeout_;
  if (timeout == kNoTimeout) timeout = kDefaultTimeout;
  return absl::Milliseconds(timeout.count());
}

c10::intrusive_ptr<c10d::Store> C10dStore::clone() {
  return c10::make_intrusive<C10dStore>(store_, timeout_);
}

void C10dStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  ThrowIfError(store_->Set(key, ToString(value)));
}

std::vector<uint8_t> C10dStore::compareSet(const std::string& key,
                                           const std::vector<uint8_t>& expected_value,
                                           const std::vector<uint8_t>& desired_value) {
  return ToBytes(
      ValueOrThrow(store_->CompareSet(key, ToString(expected_value), ToString(desired_value))));
}

std::vector<uint8_t> C10dStore::get(const std::string& key) {
  return ToBytes(ValueOrThrow(store_->Get(key, WaitTimeout(timeout_))));
}

int64_t C10dStore::add(const std::string& key, int64_t value) {
  return ValueOrThrow(store_->Add(key, value));
}

bool C10dStore::deleteKey(const std::string& key) { return ValueOrThrow(store_->Delete(key)); }

bool C10dStore::check(const std::vector<std::string>& keys) {
  return ValueOrThrow(store_->Check(keys));
}

int64_t C10dStore::getNumKeys() { return ValueOrThrow(store_->NumKeys()); }

void C10dStore::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void C10dStore::wait(const std::vector<std::string>& keys,
                     const std::chrono::milliseconds& timeout) {
  ThrowIfError(store_->Wait(keys, WaitTimeout(timeout)));
}

absl::StatusOr<c10::intrusive_ptr<c10d::Store>> OpenC10dStore(
    std::shared_ptr<const KeyValueStore> store, absl::Duration timeout) {
  if (store == nullptr) {
    return absl::InvalidArgumentError("OpenC10dStore needs a key-value store");
  }
  if (timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("rendezvous store timeout ",
                                                   absl::FormatDuration(timeout),
                                                   "; expected > 0 (every wait has a deadline)"));
  }
  return c10::intrusive_ptr<c10d::Store>(c10::make_intrusive<C10dStore>(
      std::move(store), std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout))));
}

}  // namespace hetpar::rendezvous
