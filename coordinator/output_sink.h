// The coordinator's end of PutOutput: the workers' final output files (owned-parameter sums,
// model files) written into the run directory, so that a run needs no disk shared between the
// coordinator and its workers.
//
//   OutputSink sink(spec.run().out_dir(), spec.llm().layout().pp());
//   HETPAR_ASSIGN_OR_RETURN(std::unique_ptr<OutputSink::Upload> upload,
//                           sink.Begin("model/llm.hpar.stage-1", total_bytes));
//   HETPAR_RETURN_IF_ERROR(upload->Append(chunk));  // in order, as the chunks come
//   HETPAR_RETURN_IF_ERROR(upload->Finish(crc32));   // commits the file, joins the stages
//
// A file is written atomically (common/atomic_file.h): it appears whole, with the size and
// CRC-32 its sender announced, or not at all. Pipeline stages' parts of a module's file
// ("model/<module>.hpar.stage-<s>") are joined, once every stage's part is in, into
// model/<module>.hpar (the parameter files' entries in stage order, under one header: the file
// the model's whole ParameterSet saves) and the parts are removed. Thread-safe: uploads of
// different files may run at once.
#ifndef HETPAR_COORDINATOR_OUTPUT_SINK_H_
#define HETPAR_COORDINATOR_OUTPUT_SINK_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/atomic_file.h"

namespace hetpar::coordinator {

class OutputSink {
 public:
  // `run_dir`: where the files go. `llm_stages`: the LLM's pipeline stages (llm.layout.pp).
  OutputSink(std::string run_dir, int64_t llm_stages)
      : run_dir_(std::move(run_dir)), llm_stages_(llm_stages) {}

  // One file arriving.
  class Upload {
   public:
    // The next bytes. DataLoss once more than the announced size arrived.
    absl::Status Append(std::string_view data);
    // The sender's last word: commits the file when its size and CRC-32 are the announced ones
    // (DataLoss naming the file and both values otherwise), then joins the pipeline stages'
    // parts when this was the last of them. Dropped without a successful Finish, the upload
    // leaves nothing behind.
    absl::Status Finish(uint32_t crc32);
    const std::string& name() const { return name_; }

   private:
    friend class OutputSink;
    Upload(OutputSink* sink, std::string name, uint64_t total_bytes,
           std::unique_ptr<AtomicFileWriter> file)
        : sink_(sink), name_(std::move(name)), total_bytes_(total_bytes), file_(std::move(file)) {}
    OutputSink* sink_;
    std::string name_;
    uint64_t total_bytes_;
    std::unique_ptr<AtomicFileWriter> file_;
  };

  // Starts the upload of `name` (a path relative to the run directory, as OutputChunk.name
  // documents it) of `total_bytes` bytes. InvalidArgument naming it for any other name, or a
  // stage out of range; errors creating the file name it.
  absl::StatusOr<std::unique_ptr<Upload>> Begin(const std::string& name, uint64_t total_bytes);

  const std::string& run_dir() const { return run_dir_; }

 private:
  // After a stage part of `module` was committed: joins the parts when all are in.
  absl::Status MaybeJoinStages(const std::string& module);

  const std::string run_dir_;
  const int64_t llm_stages_;
  absl::Mutex join_mu_;  // one join at a time
};

// Joins parameter files (common/nn/export.h, version 1) into `path`, in order: one header
// counting every entry, then each part's entries as they are. Each part's header is checked
// (magic, version, its CRC-32); DataLoss naming the part otherwise. Torch-free: the entries are
// copied as bytes, their own checksums intact.
absl::Status JoinParameterFiles(const std::vector<std::string>& parts, const std::string& path);

}  // namespace hetpar::coordinator

#endif  // HETPAR_COORDINATOR_OUTPUT_SINK_H_
