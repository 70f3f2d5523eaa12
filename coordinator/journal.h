// The coordinator's journal: <run dir>/journal.json, rewritten atomically whenever the run moves
// on (a step commits, the generation or the state changes), so that a coordinator restarted on
// the same run directory continues the run instead of starting it over:
//
//   {"format": 1, "run": "tiny", "state": "running", "generation": 3, "committed_steps": 7,
//    "total_steps": 10, "checkpoint_dir": "/shared/ckpt",
//    "last_checkpoint": "/shared/ckpt/step-000006", "last_checkpoint_step": 6, "restarts": 0}
//
//   HETPAR_ASSIGN_OR_RETURN(std::optional<Journal> journal, ReadJournal(run_dir));
//   if (journal.has_value() && journal->Unfinished()) { ... resume from the newest checkpoint ... }
//   HETPAR_RETURN_IF_ERROR(WriteJournal(run_dir, journal));
//
// The run is "done" in the journal only once every step committed and the run directory is
// complete (outputs, evaluation); until then (and after a failure or an early stop) a coordinator
// started on the run directory continues the run. The journal records where the run was; the
// checkpoints hold what it had learned. A restarted coordinator resumes from the newest complete
// checkpoint under checkpoint.dir (it may be newer than the journal's, written while the
// coordinator was down), at a generation past the journal's.
#ifndef HETPAR_COORDINATOR_JOURNAL_H_
#define HETPAR_COORDINATOR_JOURNAL_H_

#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/run_directory.h"
#include "hetpar/v1/coordinator.pb.h"
#include "hetpar/v1/run_spec.pb.h"

namespace hetpar::coordinator {

// A complete checkpoint named by its step and the write id its manifest records: a later write
// of the same step (another id) is another checkpoint.
struct CheckpointWrite {
  int64_t step = 0;
  uint64_t write_id = 0;
  bool operator==(const CheckpointWrite& o) const {
    return step == o.step && write_id == o.write_id;
  }
};

struct Journal {
  std::string run;  // run.name
  v1::RunState state = v1::RUN_STATE_WAITING;
  int64_t generation = 1;
  int64_t committed_steps = 0;
  int64_t total_steps = 0;
  std::string checkpoint_dir;   // checkpoint.dir; empty: the run writes none
  std::string last_checkpoint;  // the newest complete checkpoint; empty: none yet
  int64_t last_checkpoint_step = -1;
  int64_t restarts = 0;  // times a coordinator continued this run from the journal
  // The step the run started at (its checkpoint.resume_from's, else 0); -1: not recorded (a
  // journal written before it was). A restart needs it when that checkpoint is gone.
  int64_t first_step = -1;
  // The complete checkpoints checkpoint.dir held past the run's first step when it started: those
  // of a run it resumed from that went further, with its run.name. Never this run's to continue
  // from.
  std::vector<CheckpointWrite> foreign_checkpoints;

  // The run has not trained all its steps and written its outputs: it was lost, stopped early
  // or failed. A coordinator that starts on its run directory continues it.
  bool Unfinished() const { return state != v1::RUN_STATE_DONE || committed_steps < total_steps; }
  bool operator==(const Journal& other) const;
};

// <run_dir>/journal.json
std::string JournalPath(const std::string& run_dir);

// Writes the journal atomically (common/atomic_file.h). Errors name the file.
absl::Status WriteJournal(const std::string& run_dir, const Journal& journal);

// The journal of `run_dir`; nullopt when there is none. DataLoss naming the file and the field for
// a malformed one.
absl::StatusOr<std::optional<Journal>> ReadJournal(const std::string& run_dir);

// The newest complete checkpoint (a step-NNNNNN directory with a manifest, train/checkpoint.h)
// under `checkpoint_dir` whose step is at most `at_most`: its path and step; nullopt when there is
// none (or no such directory). Incomplete ones (no manifest yet) are passed over.
struct FoundCheckpoint {
  std::string path;
  int64_t step = 0;
  std::string run;        // the run.name its manifest records; empty: it does not say
  uint64_t write_id = 0;  // 0: its manifest records none
};
// With `run`, only the checkpoints that run wrote (or whose manifest names no run) count: a
// directory may also hold the checkpoints of a run this one resumed from. Those in `foreign`
// (Journal::foreign_checkpoints: such a run's, with the same run.name) never count.
std::optional<FoundCheckpoint> NewestCompleteCheckpoint(
    const std::string& checkpoint_dir, int64_t at_most = std::numeric_limits<int64_t>::max(),
    const std::string& run = "", const std::vector<CheckpointWrite>& foreign = {});

// The complete checkpoints under `checkpoint_dir` past step `after`, as a new run that starts at
// that step finds them (Journal::foreign_checkpoints).
std::vector<CheckpointWrite> CompleteCheckpointsAfter(const std::string& checkpoint_dir,
                                                      int64_t after);

// Claims the RunSpec's checkpoint.dir for this process's run while the returned lock lives (an
// flock on `.hetpar-checkpoint.lock` in it; nullptr without a checkpoint.dir). `create`: a new
// run creates the directory; a continued one claims it only where it exists (one not mounted
// now must not be replaced by an empty directory). Two live runs writing one checkpoint.dir (a
// sweep of one config over several run directories) would overwrite and prune each other's
// checkpoints: the second is refused with FailedPrecondition naming the first's pid and run
// directory.
absl::StatusOr<std::unique_ptr<DirectoryLock>> ClaimCheckpointDir(const v1::RunSpec& spec,
                                                                  bool create = true);

// A run started afresh (not continued from its journal) writes into checkpoint.dir only when the
// directory holds no complete checkpoint, or when the run resumes from one of them: the
// checkpoints of another run there would be overwritten step by step and pruned with this run's
// (checkpoint.keep). FailedPrecondition naming the newest one and what to do otherwise.
absl::Status CheckCheckpointDirForNewRun(const v1::RunSpec& spec);

}  // namespace hetpar::coordinator

#endif  // HETPAR_COORDINATOR_JOURNAL_H_
