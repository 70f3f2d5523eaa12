// Sharded, resumable checkpoints of the modules' parameters and AdamW state, written from one
// parallel layout and loaded into any other.
//
// A checkpoint of step N (N committed steps) is one directory, e.g. <checkpoint.dir>/step-000004:
//
//   llm-pp0-tp0.hpar    one shard per writing rank: the rank's parameter slices, each under its
//   llm-pp0-tp0.json    name, and their AdamW moments under "<name>@exp_avg" and
//   llm-pp1-tp0.hpar    "<name>@exp_avg_sq" (the .hpar format of common/nn/export.h); and its
//   ...                 sidecar, saying what the shard holds, how each slice lies in the
//   encoder-pp0-tp0.*   full tensor, where each entry lies in the shard file and the CRC-32s
//                       of its tensor data in 1 MiB blocks
//   manifest.json       written last, once every shard's sidecar is there: the checkpoint is
//                       complete when, and only when, it exists
//
// Only one DP replica (and CP rank 0) of each module writes, one shard per (PP stage, TP rank):
// the other replicas hold the same values. Every file is written atomically (temporary file,
// fsync, rename), a sidecar after its shard, so a sidecar always names a complete shard and a
// manifest complete sidecars.
//
//   // each writer, after the optimizer step of step N-1:
//   HETPAR_RETURN_IF_ERROR(WriteShard(dir, id, N, params, optimizer.get()));
//   HETPAR_ASSIGN_OR_RETURN(bool complete, CompleteIfAllWritten(dir, writers, N, extra));
//   if (complete) HETPAR_RETURN_IF_ERROR(PruneCheckpoints(parent, keep));
//   // on resume, at any layout:
//   HETPAR_ASSIGN_OR_RETURN(CheckpointInfo info, ReadCheckpointInfo(dir));
//   HETPAR_RETURN_IF_ERROR(LoadModuleState(dir, "llm", params, optimizer.get()));
//
// The functions are thread-safe: several ranks (processes or threads) write their shards and may
// complete the same checkpoint at once.
#ifndef HETPAR_COMMON_TRAIN_CHECKPOINT_H_
#define HETPAR_COMMON_TRAIN_CHECKPOINT_H_

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/nn/export.h"
#include "common/nn/parameters.h"
#include "common/train/optimizer.h"
#include "nlohmann/json.hpp"

namespace hetpar::train {

// The rank that writes a shard: its module ("encoder" or "llm"), TP rank and size, pipeline
// stage and stage count. Only one DP replica (and one CP rank) writes: they all hold the same.
struct ShardId {
  std::string module;
  int64_t tp = 0;
  int64_t tp_size = 1;
  int64_t pp = 0;
  int64_t pp_size = 1;
};
// "llm-pp0-tp1": the shard file is <name>.hpar, its sidecar <name>.json.
std::string ShardName(const ShardId& id);

// The name of the directory of the checkpoint of step `step` under checkpoint.dir:
// "step-000004" (PruneCheckpoints reads it back).
std::string CheckpointDirName(int64_t step);

// Writes this rank's shard of a checkpoint of step `step` into `dir` (created if missing):
// <name>.hpar holding, for every parameter of `params`, its local slice under its name, and for a
// parameter with optimizer state (optimizer != nullptr and StateOf has a value) the moments under
// "<name>@exp_avg" and "<name>@exp_avg_sq"; then <name>.json, the sidecar: {"format": 1,
// "module", "step", "tp", "tp_size", "pp", "pp_size", "file": "<name>.hpar", "bytes", "crc32"
// (zlib CRC-32 of the whole .hpar file), "params": [{"name", "full_shape", "split_dim",
// "offset", "length", "adam_step" (absent without state), "entries": {"value", "exp_avg",
// "exp_avg_sq" (the last two with "adam_step" only): {"offset", "bytes", "data_offset", "dtype",
// "block_bytes", "block_crc32"}}}]}. "entries" says where the parameter's entries lie in the
// .hpar file: each whole entry, from its name-length field through its own trailing CRC-32, is
// bytes [offset, offset + bytes); its tensor data (row-major) starts at file byte "data_offset"
// and ends at the entry's CRC-32, its dtype is "dtype" ("float64", as nn::DtypeName names it),
// and "block_crc32" holds the zlib CRC-32 of each "block_bytes" (1 MiB) block of the data in
// order, the last block possibly short (none for empty data), summed from the snapshot's tensors
// (the file is not read back). Sidecars written before "entries", or before the block fields,
// lack them; LoadModuleState still reads them. A stale sidecar of the same shard is removed
// first. InvalidArgument for an id out of range or not matching the ParameterSet's
// TP rank and size; I/O errors name the file.
absl::Status WriteShard(const std::string& dir, const ShardId& id, int64_t step,
                        const nn::ParameterSet& params, const ModuleOptimizer* optimizer);

// WriteShard in two parts, so the write can run off the training thread: SnapshotShard copies
// what the shard holds out of the live parameters and optimizer (the only part that must happen
// between two steps), WriteShardSnapshot writes the copy (any thread; the model may train on).
// The same checks and errors as WriteShard, the argument checks in SnapshotShard.
struct ShardSnapshot {
  ShardId id;
  int64_t step = 0;
  // The write this shard belongs to: every writer of one checkpoint gives the same id (the
  // coordinator's StepCommit.commit_id), another write of the same step (a resumed or restarted
  // run training it again) another one. 0: none given.
  uint64_t write_id = 0;
  std::vector<nn::FullParameter> entries;  // the slices and moments, copied
  nlohmann::json params;                   // the sidecar's "params"
  int64_t bytes() const;                   // of the copied tensors
};
absl::StatusOr<ShardSnapshot> SnapshotShard(const ShardId& id, int64_t step,
                                            const nn::ParameterSet& params,
                                            const ModuleOptimizer* optimizer);
// Before anything else, a manifest of another write (write_id) of the same step is removed (and
// the removal made durable): until this write completes, `dir` is incomplete, not the old
// checkpoint with some of its shards replaced. The sidecar records "write_id".
absl::Status WriteShardSnapshot(const std::string& dir, const ShardSnapshot& snapshot);

// Called by each writer after its WriteShard: when the sidecars of all `expected` shards (the
// writers of every module) are in `dir`, writes <dir>/manifest.json atomically: {"format": 1,
// "step", "shards": [{"name", "file", "bytes", "crc32"}, ...] (in the order of `expected`),
// "extra": `extra`} and returns true; false while some are missing. Several writers may finish
// at once and each write the same manifest (the rename makes that safe). `extra` is a JSON
// object the caller gives (e.g. the data position; null counts as {}). InvalidArgument for an
// empty or repeated `expected` or an `extra` that is not an object; FailedPrecondition naming
// the file for a sidecar of another step or layout; DataLoss for a malformed sidecar or a shard
// whose size is not its sidecar's.
// Only sidecars of the write `write_id` count: another write's (of the same step) is a shard not
// written yet. The manifest records "write_id".
absl::StatusOr<bool> CompleteIfAllWritten(const std::string& dir,
                                          const std::vector<ShardId>& expected, int64_t step,
                                          const nlohmann::json& extra, uint64_t write_id = 0);

// What a complete checkpoint says of itself (its manifest.json).
struct CheckpointInfo {
  int64_t step = 0;
  nlohmann::json extra;  // the object given to CompleteIfAllWritten
};
// NotFound naming the directory when it has no manifest (an incomplete checkpoint, or none);
// DataLoss naming the file for a malformed one.
absl::StatusOr<CheckpointInfo> ReadCheckpointInfo(const std::string& dir);

// Loads this rank's slices of module `module`'s parameters, and with optimizer != nullptr their
// AdamW state, from the complete checkpoint `dir`, whatever TP and PP layout wrote it.
//
// What is read: from the sidecars alone (no tensor data), each parameter's saved slices that
// overlap this rank's `slice` are chosen: of a replicated parameter the first shard's copy; of a
// split one the saved TP slices whose range of split_dim overlaps the rank's (all of them when the
// rank keeps the whole tensor). Only those entries are read, each once, and the moments only when
// they are set (optimizer != nullptr, a trainable parameter with saved state). Of a saved slice
// the rank keeps only part of along split_dim (a tp1 -> tp2 resume: half of each saved tensor),
// only the 1 MiB blocks of the entry's data that hold that part are read, with one read, each
// verified by its CRC-32 from the sidecar; the entry's name, dtype and shape then come from the
// sidecar, not the file. The part is contiguous in the data when split_dim is 0 (or the dims
// before it have size 1); otherwise the blocks from its first to its last element are read, the
// other ranks' elements between them included. An entry the rank needs all of, or all of whose
// blocks it would read, or whose sidecar lacks the block CRC-32s or the dtype (older sidecars), is
// read whole with one read of its byte range, its own CRC-32 (the .hpar format's per-entry
// checksum) verified as it is parsed. A pipeline stage so reads only its own parameters' entries,
// and a TP rank only the blocks of the saved slices that hold its own. The parts read are
// concatenated along split_dim in offset order, narrowed to this rank's slice and converted to
// the parameter's dtype.
//
// Errors: an entry that fails its CRC-32 is DataLoss naming the shard file, the entry, the
// computed and the stored CRC-32, and so is a block that fails its CRC-32 (naming also the block
// index and its file byte range); a shard file read from that is missing, or whose size is not
// the manifest's "bytes" (a stat, no read), is DataLoss naming the file; so is an entry read whole
// whose name, dtype or shape is not what the sidecar says, and a sidecar whose block CRC-32s do
// not fit their entry. The manifest's whole-file "crc32" is still written (other tools use it)
// but not recomputed on load: the entries' and blocks' CRC-32s cover every byte read, and the
// bytes not read cannot harm the load. (A shard whose sidecar predates "entries" is read whole
// instead, its size and whole-file CRC-32 checked against the manifest.)
// A parameter of `params` that no shard holds is NotFound naming it and the directory;
// InvalidArgument for one whose full shape differs from the checkpoint's. A trainable parameter
// with saved state gets it (SetState); one without saved state (e.g. it was frozen, or the run
// was at step 0) gets none; a frozen one never gets any. Everything is read and checked before
// the first change: on any error nothing of `params` or the optimizer changes. Gradients are
// untouched.
absl::Status LoadModuleState(const std::string& dir, const std::string& module,
                             nn::ParameterSet& params, ModuleOptimizer* optimizer);

// Removes the step-* directories of `parent` (named "step-%06d") except the `keep` newest
// complete ones (with a readable manifest); incomplete ones older than the newest complete one go
// too, newer ones (being written) stay. Other entries of `parent` are left alone; a missing
// `parent` has nothing to prune. Directories of steps after `newest_step` (the checkpoint just
// completed) are left alone and not counted: they are of another run that went further (this one
// resumed from an earlier step), not this run's to remove. A complete checkpoint pinned by a
// restarted coordinator (common/checkpoint_pin.h) is neither removed nor counted. InvalidArgument
// for keep < 1.
absl::Status PruneCheckpoints(const std::string& parent, int64_t keep,
                              int64_t newest_step = std::numeric_limits<int64_t>::max());

}  // namespace hetpar::train

#endif  // HETPAR_COMMON_TRAIN_CHECKPOINT_H_
