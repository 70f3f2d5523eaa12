#include "common/data/sampler.h"

#include <numeric>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace hetpar::data {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

uint64_t DeterministicRng::Next() {
  state_ += 0x9e3779b97f4a7c15ULL;
  uint64_t z = state_;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

uint64_t DeterministicRng::Below(uint64_t bound) {
  // Lemire, "Fast Random Integer Generation in an Interval" (2019).
  unsigned __int128 m = static_cast<unsigned __int128>(Next()) * bound;
  uint64_t low = static_cast<uint64_t>(m);
  if (low < bound) {
    const uint64_t threshold = (0 - bound) % bound;
    while (low < threshold) {
      m = static_cast<unsigned __int128>(Next()) * bound;
      low = static_cast<uint64_t>(m);
    }
  }
  return static_cast<uint64_t>(m >> 64);
}

double DeterministicRng::Uniform() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }

std::string SamplerCursor::ToString() const {
  return absl::StrCat("epoch=", epoch, ",offset=", offset);
}

absl::StatusOr<SamplerCursor> SamplerCursor::Parse(std::string_view text) {
  SamplerCursor cursor;
  const std::string input(text);
  std::vector<std::string> parts = absl::StrSplit(input, ',');
  bool have_epoch = false;
  bool have_offset = false;
  for (const std::string& part : parts) {
    std::vector<std::string> kv = absl::StrSplit(part, absl::MaxSplits('=', 1));
    int64_t value = 0;
    if (kv.size() != 2 || !absl::SimpleAtoi(kv[1], &value)) {
      have_epoch = have_offset = false;
      break;
    }
    if (kv[0] == "epoch") {
      cursor.epoch = value;
      have_epoch = true;
    } else if (kv[0] == "offset") {
      cursor.offset = value;
      have_offset = true;
    }
  }
  if (!have_epoch || !have_offset || parts.size() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampler cursor '", input, "' is not of the form epoch=E,offset=O"));
  }
  return cursor;
}

absl::StatusOr<std::unique_ptr<EpochSampler>> EpochSampler::Create(int64_t num_samples,
                                                                   uint64_t seed) {
  if (num_samples < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampler needs at least one sample; got num_samples=", num_samples));
  }
  return std::unique_ptr<EpochSampler>(new EpochSampler(num_samples, seed));
}

std::vector<int64_t> EpochSampler::EpochOrder(int64_t epoch) const {
  std::vector<int64_t> order(static_cast<size_t>(num_samples_));
  std::iota(order.begin(), order.end(), int64_t{0});
  DeterministicRng rng(SplitMix64(seed_ ^ SplitMix64(static_cast<uint64_t>(epoch))));
  for (int64_t i = num_samples_ - 1; i > 0; --i) {
    const int64_t j = static_cast<int64_t>(rng.Below(static_cast<uint64_t>(i) + 1));
    std::swap(order[static_cast<size_t>(i)], order[static_cast<size_t>(j)]);
  }
  return order;
}

std::shared_ptr<const std::vector<int64_t>> EpochSampler::Order(int64_t epoch) const {
  {
    absl::MutexLock lock(&mu_);
    if (cached_epoch_ == epoch) return cached_order_;
  }
  auto order = std::make_shared<const std::vector<int64_t>>(EpochOrder(epoch));
  absl::MutexLock lock(&mu_);
  cached_epoch_ = epoch;
  cached_order_ = order;
  return order;
}

absl::StatusOr<SamplerBatch> EpochSampler::Take(const SamplerCursor& from, int64_t count) const {
  if (count < 0) {
    return absl::InvalidArgumentError(absl::StrCat("sampler count=", count, "; expected >= 0"));
  }
  if (from.epoch < 0 || from.offset < 0 || from.offset > num_samples_) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampler cursor ", from.ToString(), " does not fit a data set of ",
                     num_samples_, " samples (expected epoch >= 0 and offset in [0, ", num_samples_,
                     "]); was it saved for a different data set?"));
  }
  SamplerBatch batch;
  batch.samples.reserve(static_cast<size_t>(count));
  SamplerCursor cursor = from;
  while (static_cast<int64_t>(batch.samples.size()) < count) {
    if (cursor.offset == num_samples_) {
      ++cursor.epoch;
      cursor.offset = 0;
    }
    std::shared_ptr<const std::vector<int64_t>> order = Order(cursor.epoch);
    const int64_t take =
        std::min(count - static_cast<int64_t>(batch.samples.size()), num_samples_ - cursor.offset);
    batch.samples.insert(batch.samples.end(), order->begin() + cursor.offset,
                         order->begin() + cursor.offset + take);
    cursor.offset += take;
  }
  batch.next = cursor;
  return batch;
}

}  // namespace hetpar::data
