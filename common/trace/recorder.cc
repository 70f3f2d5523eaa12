#include "common/trace/recorder.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "nlohmann/json.hpp"

namespace hetpar::trace {
namespace {

std::string JsonString(std::string_view text) { return nlohmann::json(std::string(text)).dump(); }

}  // namespace

const char* LaneName(Lane lane) {
  switch (lane) {
    case kStepLane:
      return "step";
    case kEncoderLane:
      return "encoder";
    case kLlmLane:
      return "llm";
    case kBridgeLane:
      return "bridge";
  }
  return "other";
}

Recorder& Recorder::Process() {
  static Recorder* recorder = new Recorder();
  return *recorder;
}

void Recorder::Configure(int64_t first, int64_t last) {
  std::lock_guard<std::mutex> lock(mutex_);
  first_ = first;
  last_ = last;
  offset_us_.store(
      NowMicros() -
          std::chrono::duration<double, std::micro>(Clock::now().time_since_epoch()).count(),
      std::memory_order_relaxed);
  on_.store(false, std::memory_order_relaxed);
}

void Recorder::BeginStep(int64_t step) {
  std::lock_guard<std::mutex> lock(mutex_);
  step_ = step;
  on_.store(first_ >= 0 && step >= first_ && step <= last_, std::memory_order_relaxed);
}

double NowMicros() {
  return std::chrono::duration<double, std::micro>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

void Recorder::Complete(Lane lane, std::string_view name, std::string_view category,
                        Clock::time_point start, Args args) {
  // Both ends through one steady-to-system offset, so events in sequence never overlap by the
  // jitter between two clock reads.
  auto micros = [](Clock::time_point t) {
    return std::chrono::duration<double, std::micro>(t.time_since_epoch()).count();
  };
  const double offset = offset_us_.load(std::memory_order_relaxed);
  CompleteAt(lane, name, category, offset + micros(start), offset + micros(Clock::now()), args);
}

void Recorder::CompleteAt(Lane lane, std::string_view name, std::string_view category,
                          double start_us, double end_us, Args args) {
  if (!on()) return;
  Event e{lane,
          std::string(name),
          std::string(category),
          start_us,
          std::max(0.0, end_us - start_us),
          -1,
          {}};
  for (const auto& [key, value] : args) e.args.emplace_back(key, value);
  std::lock_guard<std::mutex> lock(mutex_);
  e.step = step_;
  events_.push_back(std::move(e));
}

std::vector<std::string> Recorder::TakeJson(int64_t pid) {
  std::vector<Event> events;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    events.swap(events_);
  }
  std::vector<std::string> out;
  out.reserve(events.size());
  for (const Event& e : events) {
    std::string args = absl::StrCat("\"step\":", e.step);
    for (const auto& [key, value] : e.args)
      absl::StrAppend(&args, ",", JsonString(key), ":", value);
    out.push_back(
        absl::StrCat("{\"name\":", JsonString(e.name), ",\"cat\":", JsonString(e.category),
                     ",\"ph\":\"X\",\"ts\":", absl::StrFormat("%.3f", e.start_us),
                     ",\"dur\":", absl::StrFormat("%.3f", e.duration_us), ",\"pid\":", pid,
                     ",\"tid\":", static_cast<int>(e.lane), ",\"args\":{", args, "}}"));
  }
  return out;
}

std::string ProcessNameEvent(int64_t pid, const std::string& name) {
  return absl::StrCat("{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":", pid,
                      ",\"tid\":0,\"args\":{\"name\":", JsonString(name), "}}");
}

absl::StatusOr<std::pair<int64_t, int64_t>> ParseStepRange(const std::string& text) {
  std::vector<std::string> parts = absl::StrSplit(text, ':');
  int64_t first = -1, last = -1;
  const bool ok =
      (parts.size() == 1 && absl::SimpleAtoi(parts[0], &first) && (last = first, true)) ||
      (parts.size() == 2 && absl::SimpleAtoi(parts[0], &first) &&
       absl::SimpleAtoi(parts[1], &last));
  if (!ok || first < 0 || last < first) {
    return absl::InvalidArgumentError(absl::StrCat(
        "trace steps '", text, "': expected FIRST:LAST or STEP (0-based, FIRST <= LAST)"));
  }
  return std::make_pair(first, last);
}

absl::Status AppendEvents(const std::string& path, const std::vector<std::string>& events) {
  if (events.empty()) return absl::OkStatus();
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
  std::ofstream out(path, std::ios::app);
  for (const std::string& e : events) out << e << "\n";
  out.flush();
  if (!out) {
    return absl::DataLossError(
        absl::StrCat("cannot append to '", path, "': ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> MergeTraceFiles(const std::string& dir, const std::string& out_path) {
  std::vector<nlohmann::json> metadata, events;
  std::set<int64_t> pids;
  std::error_code ec;
  bool any = false;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    if (entry.path().extension() != ".jsonl") continue;
    any = true;
    std::ifstream in(entry.path());
    std::string line;
    int line_number = 0;
    while (std::getline(in, line)) {
      ++line_number;
      if (line.empty()) continue;
      nlohmann::json e = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (e.is_discarded() || !e.is_object()) {
        return absl::DataLossError(
            absl::StrCat(entry.path().string(), ":", line_number, ": not a JSON object"));
      }
      pids.insert(e.value("pid", int64_t{0}));
      (e.value("ph", "") == "M" ? metadata : events).push_back(std::move(e));
    }
  }
  if (!any) return absl::NotFoundError(absl::StrCat("no trace files under '", dir, "'"));
  std::stable_sort(events.begin(), events.end(),
                   [](const nlohmann::json& a, const nlohmann::json& b) {
                     return a["ts"].get<double>() < b["ts"].get<double>();
                   });
  nlohmann::json trace = {{"displayTimeUnit", "ms"}, {"traceEvents", nlohmann::json::array()}};
  for (nlohmann::json& m : metadata) trace["traceEvents"].push_back(std::move(m));
  for (int64_t pid : pids) {
    for (Lane lane : {kStepLane, kEncoderLane, kLlmLane, kBridgeLane}) {
      trace["traceEvents"].push_back({{"name", "thread_name"},
                                      {"ph", "M"},
                                      {"pid", pid},
                                      {"tid", static_cast<int>(lane)},
                                      {"args", {{"name", LaneName(lane)}}}});
    }
  }
  const int64_t count = static_cast<int64_t>(events.size());
  for (nlohmann::json& e : events) trace["traceEvents"].push_back(std::move(e));
  std::ofstream out(out_path);
  out << trace.dump() << "\n";
  out.flush();
  if (!out) return absl::DataLossError(absl::StrCat("cannot write '", out_path, "'"));
  return count;
}

}  // namespace hetpar::trace
