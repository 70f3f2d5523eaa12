// A restarted coordinator's hold on the checkpoint it resumes from. The workers of the coordinator
// it replaces may still be completing a later checkpoint when it picks one; with checkpoint.keep
// they then prune the older ones, the picked one among them, before the restart's workers have
// read it. PruneCheckpoints (train/checkpoint.h) leaves a pinned checkpoint in place, without
// counting it toward `keep`; the coordinator lets go once every worker has read it (its first
// commit) and, when it starts, of the pins an earlier coordinator left.
//
//   PinCheckpoint(resume_from, "coordinator generation 3");  // before any worker starts
//   UnpinCheckpoints(checkpoint_dir, resume_from);          // every other pin goes
//   ...the first step commits...
//   UnpinCheckpoints(checkpoint_dir);
#ifndef HETPAR_COMMON_CHECKPOINT_PIN_H_
#define HETPAR_COMMON_CHECKPOINT_PIN_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace hetpar {

// The names of the checkpoints in checkpoint.dir: step-NNNNNN; a complete checkpoint that the
// pruner (train/checkpoint.h) took out of sight, and puts back if it finds it pinned:
// .pruned-step-NNNNNN-<16 hex digits>; and then one it removes, never put back:
// .removing-step-NNNNNN-<16 hex digits>.
inline constexpr char kCheckpointDirPrefix[] = "step-";
inline constexpr char kPrunedCheckpointPrefix[] = ".pruned-";
inline constexpr char kRemovedCheckpointPrefix[] = ".removing-";

// The step directory name a .pruned-* directory was taken from ("step-000004" for
// ".pruned-step-000004-0123456789abcdef"); "" for any other name.
std::string PrunedCheckpointOrigin(const std::string& name);

// The file in a checkpoint directory (step-NNNNNN) that pins it; it holds who pinned it.
inline constexpr char kCheckpointPinFile[] = "resume-pin";

// Writes the pin into the checkpoint directory `dir`, saying `holder`, and syncs it; NotFound
// when `dir` is gone (it is never made again). A checkpoint pruned as it was pinned may still
// look complete right after: read it again after the pin to be sure it stays.
absl::Status PinCheckpoint(const std::string& dir, const std::string& holder);

// Whether `dir` holds a pin: kUnknown when a stat fails otherwise than with ENOENT.
enum class PinState { kPinned, kNotPinned, kUnknown };
PinState CheckpointPinState(const std::string& dir);

// Whether `dir` may hold a pin (kPinned or kUnknown): a checkpoint is kept rather than risk
// removing one a restart reads.
bool IsCheckpointPinned(const std::string& dir);

// Renames the checkpoint `taken` (a .pruned-* directory) back to `origin`, never onto a directory
// there (a step written again, or being written). OK also when `taken` is gone (another process
// put it back or removes it) or `origin` exists: the copy then stays where it is.
absl::Status PutBackCheckpoint(const std::string& taken, const std::string& origin);

// Puts the pinned checkpoint `dir` back where it was when the pruner has taken it out of sight (a
// .pruned-* directory beside it holding the pin) and not yet put it back: it does so on seeing the
// pin, unless it was killed first. True when `dir` is there afterwards.
absl::StatusOr<bool> PutBackPinnedCheckpoint(const std::string& dir);

// Removes the pins of the step-* directories of `parent`, except that of the directory named like
// `except`'s last component (a checkpoint path, or "" for none), and those of the .pruned-*
// directories not taken from that one. A missing `parent` holds none.
absl::Status UnpinCheckpoints(const std::string& parent, const std::string& except = "");

}  // namespace hetpar

#endif  // HETPAR_COMMON_CHECKPOINT_PIN_H_
