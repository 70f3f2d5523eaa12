// An exactly-once check on the samples a run trains: which positions of the sampler's stream
// (common/data/sampler.h: (epoch, offset into that epoch's order)) the committed steps trained,
// how many of them a step trained again, and how many the stream moved past without training.
//
// The batch sources only ever move forward from the committed cursor, so in a healthy run every
// step's batch starts where the last committed one ended, and `repeated` and `lost` stay 0. A
// non-zero count means a step was committed twice, an aborted step's samples were committed
// without being trained, or a source moved its cursor wrongly.
#ifndef HETPAR_COORDINATOR_SAMPLE_LEDGER_H_
#define HETPAR_COORDINATOR_SAMPLE_LEDGER_H_

#include <cstdint>
#include <map>

#include "common/data/sampler.h"

namespace hetpar::coordinator {

struct LedgerCounts {
  int64_t trained = 0;   // samples of the recorded steps
  int64_t repeated = 0;  // of those, samples at a position an earlier record had trained
  int64_t lost = 0;      // positions the stream moved past without training them
};

// Which positions of the sample stream the committed steps trained, as merged offset intervals
// per epoch: a run that trains contiguously keeps one interval per epoch whatever its length.
//
// `lost` counts, per epoch, the positions between the run's first recorded position and the
// furthest one that no record covers. An epoch's size is not known here, so:
//   - a batch that crossed from epoch e into e+1 locates its samples exactly: the last
//     count - to.offset of them are offsets [from.offset, from.offset + count - to.offset) of e,
//     which also tells where e ended;
//   - a batch that crossed more than one epoch locates only its samples in to.epoch,
//     [0, to.offset); the others (the tail of from.epoch and the whole epochs between) count as
//     trained but are never repeated or lost;
//   - the tail of an epoch the stream left without a batch crossing out of it (the next record
//     starts in a later epoch) is not counted as lost: only the offsets it skipped at the start of
//     the later epoch are.
//
// Memory: only the newest epoch and the one before it are kept; an older epoch is final (its
// lost positions are counted when it is dropped). A record that places samples in a dropped
// epoch (the stream went back by more than an epoch; no batch source does) counts them all as
// repeated, as the ledger no longer knows which of them were trained.
//
// Not thread-safe: its owner (PlanLibraryPlanner) is called under the RunController's lock.
class SampleLedger {
 public:
  // A committed step trained the `count` samples from cursor `from` up to cursor `to` (the cursor
  // after them). Inconsistent input is clamped rather than trusted, and never fails:
  //   - a negative count counts as 0, a negative epoch or offset as 0;
  //   - a `to` before `from` counts as {from.epoch, from.offset + count} (the samples follow
  //     `from`);
  //   - a `to` within from.epoch short of count samples: [from.offset, from.offset + count) is
  //     trained and the rest up to `to` lost; beyond count samples: the positions [from, to) are
  //     trained and the surplus samples count as trained but are not located;
  //   - a crossing batch with fewer than to.offset samples: they are [0, count) of to.epoch and
  //     the rest up to to.offset is lost.
  void Record(const data::SamplerCursor& from, const data::SamplerCursor& to, int64_t count);

  LedgerCounts counts() const;

 private:
  struct Epoch {
    std::map<int64_t, int64_t> covered;  // start -> end of disjoint, non-touching intervals
    int64_t covered_samples = 0;         // the size of `covered`
    int64_t first = 0;                   // the lowest offset reached (a cursor or a record)
    int64_t furthest = 0;                // the highest offset reached
  };

  // Whether `epoch` is older than the epochs kept (then nothing of it is recorded).
  bool Dropped(int64_t epoch) const;
  // The state of a kept epoch, created at `offset` if new.
  Epoch& Reach(int64_t epoch, int64_t offset);
  // Offsets [start, end) of `epoch` were trained; counts those trained before as repeated.
  void Cover(int64_t epoch, int64_t start, int64_t end);
  // The positions of `epoch` passed without training.
  int64_t Lost(int64_t epoch, const Epoch& state) const;
  // Counts the lost positions of the epochs older than the newest but one, and drops them.
  void DropOldEpochs();

  int64_t trained_ = 0;
  int64_t repeated_ = 0;
  int64_t lost_in_dropped_ = 0;  // lost positions of epochs already dropped
  std::map<int64_t, Epoch> epochs_;
  // The lowest epoch recorded (its positions before the run's first are not lost) and the highest
  // one; meaningful once epochs_ is not empty.
  int64_t first_epoch_ = 0;
  int64_t newest_epoch_ = 0;
};

}  // namespace hetpar::coordinator

#endif  // HETPAR_COORDINATOR_SAMPLE_LEDGER_H_
