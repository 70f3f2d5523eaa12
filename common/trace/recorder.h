// Step timelines: while a traced step runs, a worker records what each of its lanes did (the
// step protocol, the encoder's jobs, the LLM's waves, boundary transfers, collectives) as Chrome
// trace events on the system clock. The worker appends them to <out>/trace/rank-<r>.jsonl, and
// `hetpar run` (or the coordinator, for a cluster run with a shared run directory) merges every
// rank's file into <out>/trace.json, which opens in the Perfetto UI (one process per rank, one
// thread per lane).
//
//   trace::Recorder::Process().Configure(2, 3);      // trace steps 2 and 3
//   trace::Recorder::Process().BeginStep(step);      // the step driver, at each plan
//   auto t0 = trace::Clock::now();
//   ... forward ...
//   trace::Record(trace::kLlmLane, "forward", "compute", t0, {{"wave", wave}});
//
// Off (no step configured, or the step outside the range) a record costs one relaxed atomic
// load. One recorder per process (a worker process is one rank); thread-safe.
#ifndef HETPAR_COMMON_TRACE_RECORDER_H_
#define HETPAR_COMMON_TRACE_RECORDER_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <initializer_list>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace hetpar::trace {

using Clock = std::chrono::steady_clock;

// The thread (track) of a rank's process an event goes on.
enum Lane : int {
  kStepLane = 0,     // the step protocol: compute, gradient-norm wait, commit wait, optimizer
  kEncoderLane = 1,  // encoder jobs, their waits and collectives
  kLlmLane = 2,      // LLM waves, their waits and collectives
  kBridgeLane = 3,   // boundary messages (these may overlap: several are in flight at once)
};
const char* LaneName(Lane lane);

using Args = std::initializer_list<std::pair<const char*, int64_t>>;

class Recorder {
 public:
  static Recorder& Process();

  // Records steps first..last (inclusive). first < 0 records nothing (the default).
  void Configure(int64_t first, int64_t last);
  // A step begins: recording is on while it is in the configured range.
  void BeginStep(int64_t step);
  bool on() const { return on_.load(std::memory_order_relaxed); }

  // One complete event from `start` (steady clock) to now, tagged with the current step.
  void Complete(Lane lane, std::string_view name, std::string_view category,
                Clock::time_point start, Args args);
  // The same for an interval already measured on the system clock (microseconds since the epoch).
  void CompleteAt(Lane lane, std::string_view name, std::string_view category, double start_us,
                  double end_us, Args args);

  // The events recorded since the last call, as Chrome trace-event JSON objects of process
  // `pid`, one per string; clears them.
  std::vector<std::string> TakeJson(int64_t pid);

 private:
  struct Event {
    Lane lane;
    std::string name;
    std::string category;
    double start_us;
    double duration_us;
    int64_t step;
    std::vector<std::pair<std::string, int64_t>> args;
  };
  std::atomic<bool> on_{false};
  // System minus steady clock in microseconds, fixed at Configure.
  std::atomic<double> offset_us_{0};
  std::mutex mutex_;
  int64_t first_ = -1;
  int64_t last_ = -1;
  int64_t step_ = -1;
  std::vector<Event> events_;
};

// Records on the process's recorder when it is on.
inline void Record(Lane lane, std::string_view name, std::string_view category,
                   Clock::time_point start, Args args = {}) {
  Recorder& r = Recorder::Process();
  if (r.on()) r.Complete(lane, name, category, start, args);
}

// The system clock in microseconds since the epoch (the traces' common clock).
double NowMicros();

// "a:b" (steps a to b) or "a" (step a alone), 0-based, a <= b.
absl::StatusOr<std::pair<int64_t, int64_t>> ParseStepRange(const std::string& text);

// The metadata event naming process `pid` in the trace viewer (e.g. "rank 2: llm dp 0 tp 0").
std::string ProcessNameEvent(int64_t pid, const std::string& name);

// Appends `events` (JSON objects) to `path`, one per line, creating its directory.
absl::Status AppendEvents(const std::string& path, const std::vector<std::string>& events);

// Merges every rank-*.jsonl under `dir` into one Chrome trace file `out_path`
// ({"traceEvents": [...]}, events sorted by time, process and thread names added). Returns the
// number of events. NotFound when `dir` holds no trace file.
absl::StatusOr<int64_t> MergeTraceFiles(const std::string& dir, const std::string& out_path);

}  // namespace hetpar::trace

#endif  // HETPAR_COMMON_TRACE_RECORDER_H_
