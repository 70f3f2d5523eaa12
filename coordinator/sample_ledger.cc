#include "coordinator/sample_ledger.h"

#include <algorithm>
#include <iterator>
#include <limits>

namespace hetpar::coordinator {

void SampleLedger::Record(const data::SamplerCursor& from_cursor,
                          const data::SamplerCursor& to_cursor, int64_t count) {
  const data::SamplerCursor from = {std::max<int64_t>(from_cursor.epoch, 0),
                                    std::max<int64_t>(from_cursor.offset, 0)};
  data::SamplerCursor to = {std::max<int64_t>(to_cursor.epoch, 0),
                            std::max<int64_t>(to_cursor.offset, 0)};
  // Bounded so that from.offset + count cannot overflow; no real batch comes near.
  count = std::clamp<int64_t>(count, 0, std::numeric_limits<int64_t>::max() - from.offset);
  if (to.epoch < from.epoch || (to.epoch == from.epoch && to.offset < from.offset)) {
    to = {from.epoch, from.offset + count};
  }
  trained_ += count;

  // In stream order, so that whether an epoch is dropped is judged against the epochs before this
  // record.
  if (!Dropped(from.epoch)) Reach(from.epoch, from.offset);
  if (to.epoch == from.epoch) {
    Cover(from.epoch, from.offset, from.offset + std::min(count, to.offset - from.offset));
  } else {
    const int64_t head = std::min(count, to.offset);  // the samples in to.epoch
    // Only a batch that crossed into the very next epoch says which of from.epoch's offsets the
    // rest are; across more epochs they are spread over epochs of unknown size.
    if (to.epoch == from.epoch + 1) Cover(from.epoch, from.offset, from.offset + (count - head));
    Cover(to.epoch, 0, head);
  }
  if (!Dropped(to.epoch)) Reach(to.epoch, to.offset);
  DropOldEpochs();
}

LedgerCounts SampleLedger::counts() const {
  LedgerCounts counts;
  counts.trained = trained_;
  counts.repeated = repeated_;
  counts.lost = lost_in_dropped_;
  for (const auto& [epoch, state] : epochs_) counts.lost += Lost(epoch, state);
  return counts;
}

bool SampleLedger::Dropped(int64_t epoch) const {
  return !epochs_.empty() && epoch < newest_epoch_ - 1;
}

SampleLedger::Epoch& SampleLedger::Reach(int64_t epoch, int64_t offset) {
  if (epochs_.empty()) {
    first_epoch_ = epoch;
    newest_epoch_ = epoch;
  }
  first_epoch_ = std::min(first_epoch_, epoch);
  newest_epoch_ = std::max(newest_epoch_, epoch);
  auto [it, inserted] = epochs_.try_emplace(epoch);
  Epoch& state = it->second;
  if (inserted) {
    state.first = offset;
    state.furthest = offset;
  }
  state.first = std::min(state.first, offset);
  state.furthest = std::max(state.furthest, offset);
  return state;
}

void SampleLedger::Cover(int64_t epoch, int64_t start, int64_t end) {
  if (start >= end) return;
  if (Dropped(epoch)) {
    repeated_ += end - start;
    return;
  }
  Epoch& state = Reach(epoch, start);
  state.furthest = std::max(state.furthest, end);
  // Merges [start, end) with every interval it overlaps or touches (touching ones too, so that
  // contiguous training stays one interval), counting the overlap.
  std::map<int64_t, int64_t>& covered = state.covered;
  auto it = covered.upper_bound(start);
  if (it != covered.begin() && std::prev(it)->second >= start) --it;
  int64_t merged_start = start;
  int64_t merged_end = end;
  int64_t overlap = 0;
  while (it != covered.end() && it->first <= end) {
    overlap += std::max<int64_t>(0, std::min(end, it->second) - std::max(start, it->first));
    merged_start = std::min(merged_start, it->first);
    merged_end = std::max(merged_end, it->second);
    it = covered.erase(it);
  }
  covered.emplace(merged_start, merged_end);
  repeated_ += overlap;
  state.covered_samples += (end - start) - overlap;
}

int64_t SampleLedger::Lost(int64_t epoch, const Epoch& state) const {
  // The run's first epoch starts at the run's first position; a later one at its offset 0.
  const int64_t start = epoch == first_epoch_ ? state.first : 0;
  return std::max<int64_t>(0, state.furthest - start - state.covered_samples);
}

void SampleLedger::DropOldEpochs() {
  while (!epochs_.empty() && epochs_.begin()->first < newest_epoch_ - 1) {
    lost_in_dropped_ += Lost(epochs_.begin()->first, epochs_.begin()->second);
    epochs_.erase(epochs_.begin());
  }
}

}  // namespace hetpar::coordinator
