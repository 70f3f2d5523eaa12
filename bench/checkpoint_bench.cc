// checkpoint_bench: what a sharded checkpoint costs a run. Two JSON lines on stdout.
//
// 1. In a run. `hetpar run` trains --config for --steps steps twice, as a user would: once
//    without checkpoints (the baseline) and once with one every --every steps
//    (checkpoint.keep=100, so every one stays). From the second run's worker logs, every line
//    "checkpoint shard <name> of step <n>: <bytes> bytes copied in <copy> s (the step's wait),
//    written in <write> s":
//
//    {"bench":"checkpoint_in_run","steps_measured","step_time_s","step_time_s_no_checkpoint",
//     "step_time_overhead"       step_time_s / step_time_s_no_checkpoint - 1
//     "copy_s"                   median SnapshotShard time: what a step waits for a save
//     "write_s"                  median background write (shard, sidecar, manifest, prune)
//     "copy_vs_step"             copy_s / step_time_s; the goal is <= "goal" (0.10): the save time
//                                that blocks a step against the step time
//     "meets_goal", "checkpoint_bytes" (mean over checkpoints of their shards' bytes),
//     "shard_writes", "checkpoints_expected", "checkpoints_completed" (step dirs with a
//     manifest.json), "log_resolution_s"}
//
//    The logs print times to the millisecond: a copy_s of 0 means under half a millisecond.
//    The first --warmup steps are left out of the step times.
//
// 2. In-process, the library on its own at a size a real model shard has: a ParameterSet of
//    --mib MiB of float32 parameters (four [16 x mib, 4096] tensors, tp 1) after one AdamW step,
//    so the shard holds 3 x --mib MiB (values and both moments). Each of --reps repetitions times
//    SnapshotShard (copy), WriteShardSnapshot (write: the .hpar with its fsync, its CRC-32
//    summed as it is written, and the sidecar), CompleteIfAllWritten for the one shard
//    (complete: the manifest) and LoadModuleState into a fresh ParameterSet and optimizer (load:
//    the resume, which at tp 1 reads every entry of the shard once, each checked by its own
//    CRC-32; then checked element for element against what was saved). The baselines, in the same
//    directory and run: a plain sequential write of the same bytes (open, 8 MiB writes, fsync,
//    close), and a plain sequential read of that file. Before the load and the plain read their
//    files are dropped from the page cache (posix_fadvise DONTNEED after the fsync), so both read
//    the device as a resume on a fresh machine does. The reps alternate which write goes first.
//
//    {"bench":"checkpoint_write","mib","bytes","reps","copy_s","copy_gbps","write_s",
//     "write_gbps","plain_write_s","plain_write_gbps","ratio" (write_gbps / plain_write_gbps),
//     "complete_s","load_s","load_gbps","plain_read_gbps","load_vs_plain_read"}
//
//    Medians over the reps; GB/s = 1e9 bytes/s of the shard's tensor bytes.
//
// Everything lives under one mkdtemp directory in the system's temporary directory, removed at
// the end; after a failure the run's logs stay there and the message names them.
#include <ATen/ATen.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "bench/hetpar_run_util.h"
#include "common/nn/parameters.h"
#include "common/nn/torch_status.h"
#include "common/status.h"
#include "common/train/checkpoint.h"
#include "common/train/optimizer.h"
#include "nlohmann/json.hpp"

using hetpar::bench::Median;
using hetpar::bench::Quote;

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr double kGoal = 0.10;  // copy_s / step_time_s
constexpr int kTensors = 4;     // of the synthetic shard
constexpr int64_t kColumns = 4096;
constexpr size_t kPlainChunk = size_t{8} << 20;

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

double Gbps(int64_t bytes, double seconds) { return seconds > 0 ? bytes / seconds / 1e9 : 0; }

absl::Status ErrnoError(const std::string& what) {
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(errno)));
}

// ---- 1. In a run ----------------------------------------------------------------------------

struct ShardLine {
  int64_t step = 0;
  int64_t bytes = 0;
  double copy_s = 0;
  double write_s = 0;
};

// Every checkpoint shard line of the worker logs <out>/log/*.log.
std::vector<ShardLine> ShardLines(const std::string& out) {
  static const std::regex kLine(
      R"(checkpoint shard \S+ of step (\d+): (\d+) bytes copied in ([0-9.]+) s \(the step's )"
      R"(wait\), written in ([0-9.]+) s)");
  std::vector<ShardLine> lines;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(fs::path(out) / "log", ec)) {
    if (entry.path().extension() != ".log") continue;
    std::ifstream in(entry.path());
    std::string text;
    std::smatch m;
    while (std::getline(in, text)) {
      if (!std::regex_search(text, m, kLine)) continue;
      lines.push_back({std::stoll(m[1]), std::stoll(m[2]), std::stod(m[3]), std::stod(m[4])});
    }
  }
  return lines;
}

// The step directories of `parent` that hold a manifest.json.
int CompleteCheckpoints(const std::string& parent) {
  int complete = 0;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(parent, ec)) {
    if (entry.path().filename().string().rfind("step-", 0) == 0 &&
        fs::exists(entry.path() / "manifest.json")) {
      ++complete;
    }
  }
  return complete;
}

// The median step time of a finished run from step `warmup` on.
absl::StatusOr<double> MedianStepTime(const std::string& out, int warmup) {
  std::vector<double> times;
  for (const json& j : hetpar::bench::StepLines(out, warmup)) {
    times.push_back(j["step_time_s"].get<double>());
  }
  if (times.empty()) {
    return absl::NotFoundError(
        absl::StrCat("no step lines from step ", warmup, " on in ", out, "/metrics.jsonl"));
  }
  return Median(times);
}

struct RunOptions {
  std::string config;
  int steps = 12;
  int warmup = 2;
  int threads = 1;
  int every = 2;
};

absl::StatusOr<json> InRun(const RunOptions& o, const std::string& dir) {
  const std::string base = "--config " + Quote(o.config) + " --steps " + std::to_string(o.steps) +
                           " --threads " + std::to_string(o.threads);
  std::fprintf(stderr, "checkpoint_bench: hetpar run, %d steps without checkpoints ...\n", o.steps);
  const std::string plain_out = dir + "/run_no_checkpoint";
  if (!hetpar::bench::RunHetpar(HETPAR_BIN, base, plain_out)) {
    return absl::InternalError(absl::StrCat("hetpar run failed; see ", plain_out, ".log"));
  }
  HETPAR_ASSIGN_OR_RETURN(const double plain_step, MedianStepTime(plain_out, o.warmup));

  std::fprintf(stderr, "checkpoint_bench: hetpar run, %d steps with a checkpoint every %d ...\n",
               o.steps, o.every);
  const std::string ckpt = dir + "/ckpt";
  const std::string out = dir + "/run";
  if (!hetpar::bench::RunHetpar(HETPAR_BIN,
                                base + " --set checkpoint.dir=" + Quote(ckpt) +
                                    " --set checkpoint.every=" + std::to_string(o.every) +
                                    " --set checkpoint.keep=100",
                                out)) {
    return absl::InternalError(absl::StrCat("hetpar run failed; see ", out, ".log"));
  }
  HETPAR_ASSIGN_OR_RETURN(const double step, MedianStepTime(out, o.warmup));
  const std::vector<ShardLine> lines = ShardLines(out);
  if (lines.empty()) {
    return absl::NotFoundError(
        absl::StrCat("no \"checkpoint shard ... bytes copied in ... written in ...\" lines in ",
                     out, "/log/*.log: the run wrote no checkpoints, or logs them differently"));
  }
  std::vector<double> copy, write;
  std::set<int64_t> steps;
  int64_t bytes = 0;
  for (const ShardLine& l : lines) {
    copy.push_back(l.copy_s);
    write.push_back(l.write_s);
    steps.insert(l.step);
    bytes += l.bytes;
  }
  // One after every `every` committed steps, and one after the last.
  const int expected = o.steps / o.every + (o.steps % o.every != 0 ? 1 : 0);
  const int complete = CompleteCheckpoints(ckpt);
  const double ratio = step > 0 ? Median(copy) / step : 0;
  json result = {{"bench", "checkpoint_in_run"},
                 {"config", o.config},
                 {"steps", o.steps},
                 {"every", o.every},
                 {"steps_measured", hetpar::bench::StepLines(out, o.warmup).size()},
                 {"step_time_s", step},
                 {"step_time_s_no_checkpoint", plain_step},
                 {"step_time_overhead", plain_step > 0 ? step / plain_step - 1 : 0},
                 {"copy_s", Median(copy)},
                 {"write_s", Median(write)},
                 {"copy_vs_step", ratio},
                 {"goal", kGoal},
                 {"meets_goal", ratio <= kGoal},
                 {"checkpoint_bytes", bytes / static_cast<int64_t>(steps.size())},
                 {"shard_writes", lines.size()},
                 {"checkpoints_expected", expected},
                 {"checkpoints_completed", complete},
                 {"log_resolution_s", 0.001}};
  if (complete != expected) {
    std::printf("%s\n", result.dump().c_str());
    return absl::DataLossError(absl::StrCat(complete, " complete checkpoints under ", ckpt,
                                            ", expected ", expected, "; see ", out, "/log"));
  }
  return result;
}

// ---- 2. In-process --------------------------------------------------------------------------

hetpar::v1::Optimizer AdamW() {
  hetpar::v1::Optimizer o;
  o.set_lr(1e-3);
  o.set_weight_decay(0.01);
  o.set_beta1(0.9);
  o.set_beta2(0.999);
  o.set_eps(1e-8);
  return o;
}

// A module: its parameters and their optimizer (which keeps a pointer to the parameters).
struct Module {
  std::unique_ptr<hetpar::nn::ParameterSet> params;
  std::unique_ptr<hetpar::train::ModuleOptimizer> optimizer;
};

// kTensors float32 tensors "w<i>" of [16 x mib, kColumns] (mib MiB in all), at tp 1, drawn at
// random with `random` (the values to save) or zero (a model to load into).
absl::StatusOr<Module> MakeModule(int64_t mib, bool random) {
  Module m;
  m.params = std::make_unique<hetpar::nn::ParameterSet>(/*run_seed=*/1, at::kFloat, 0, 1,
                                                        hetpar::nn::InitStyle::kTraining);
  const int64_t rows = mib * (int64_t{1} << 20) / 4 / kTensors / kColumns;
  for (int i = 0; i < kTensors; ++i) {
    HETPAR_RETURN_IF_ERROR(
        m.params
            ->Add(absl::StrCat("w", i), {rows, kColumns}, /*split_dim=*/0,
                  random ? hetpar::nn::InitRule::Normal(0.02) : hetpar::nn::InitRule::Constant(0))
            .status());
  }
  HETPAR_ASSIGN_OR_RETURN(m.optimizer,
                          hetpar::train::ModuleOptimizer::Create(m.params.get(), AdamW()));
  return m;
}

// Every parameter and AdamW state of `loaded` equal to `saved`'s.
absl::Status CheckLoaded(const Module& saved, const Module& loaded) {
  for (const hetpar::nn::NamedParameter& p : saved.params->parameters()) {
    const hetpar::nn::NamedParameter* q = loaded.params->Find(p.name);
    const auto s = saved.optimizer->StateOf(p.name);
    const auto l = loaded.optimizer->StateOf(p.name);
    bool same = false;
    HETPAR_RETURN_IF_ERROR(hetpar::nn::RunTorch("comparing the loaded state", [&] {
      same = q != nullptr && at::equal(q->tensor, p.tensor) && s.has_value() && l.has_value() &&
             s->step == l->step && at::equal(s->exp_avg, l->exp_avg) &&
             at::equal(s->exp_avg_sq, l->exp_avg_sq);
    }));
    if (!same) {
      return absl::DataLossError(absl::StrCat(
          "parameter ", p.name, " or its AdamW state as loaded differs from what was saved"));
    }
  }
  return absl::OkStatus();
}

// Writes `bytes` bytes to `path` as a plain program does: open, kPlainChunk writes of `chunk`,
// fsync, close.
absl::Status PlainWrite(const std::string& path, const std::vector<char>& chunk, int64_t bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoError("opening " + path);
  int64_t left = bytes;
  while (left > 0) {
    const ssize_t n = ::write(fd, chunk.data(), std::min<int64_t>(left, chunk.size()));
    if (n < 0) {
      if (errno == EINTR) continue;
      const absl::Status status = ErrnoError("writing " + path);
      ::close(fd);
      return status;
    }
    left -= n;
  }
  if (::fsync(fd) != 0) {
    const absl::Status status = ErrnoError("syncing " + path);
    ::close(fd);
    return status;
  }
  if (::close(fd) != 0) return ErrnoError("closing " + path);
  return absl::OkStatus();
}

// Reads `path` whole in kPlainChunk reads; returns the bytes read.
absl::StatusOr<int64_t> PlainRead(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoError("opening " + path);
  std::vector<char> buffer(kPlainChunk);
  int64_t total = 0;
  while (true) {
    const ssize_t n = ::read(fd, buffer.data(), buffer.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      const absl::Status status = ErrnoError("reading " + path);
      ::close(fd);
      return status;
    }
    if (n == 0) break;
    total += n;
  }
  ::close(fd);
  return total;
}

// Drops the (clean, fsynced) pages of `path`, or of every file under it, from the page cache.
absl::Status Evict(const fs::path& path) {
  std::vector<fs::path> files;
  if (fs::is_directory(path)) {
    for (const auto& entry : fs::directory_iterator(path)) files.push_back(entry.path());
  } else {
    files.push_back(path);
  }
  for (const fs::path& file : files) {
    const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return ErrnoError("opening " + file.string());
    const int err = ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
    if (err != 0) {
      errno = err;
      return ErrnoError("dropping " + file.string() + " from the page cache");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<json> WriteBench(int64_t mib, int reps, const std::string& dir) {
  std::fprintf(stderr, "checkpoint_bench: a model of %lld MiB after one AdamW step ...\n",
               static_cast<long long>(mib));
  HETPAR_ASSIGN_OR_RETURN(Module saved, MakeModule(mib, /*random=*/true));
  HETPAR_RETURN_IF_ERROR(hetpar::nn::RunTorch("the gradients", [&] {
    for (const hetpar::nn::NamedParameter& p : saved.params->parameters()) {
      p.tensor.mutable_grad() = p.tensor.detach().mul(0.5);
    }
  }));
  HETPAR_RETURN_IF_ERROR(saved.optimizer->Step(/*step=*/0, /*clip_coefficient=*/1.0));

  const hetpar::train::ShardId id{"llm", 0, 1, 0, 1};
  constexpr int64_t kStep = 1;
  // The plain write's data: the first bytes of the parameters (random floats).
  std::vector<char> chunk(kPlainChunk);
  {
    const at::Tensor& w0 = saved.params->parameters().front().tensor;
    const size_t n = std::min(chunk.size(), static_cast<size_t>(w0.nbytes()));
    std::memcpy(chunk.data(), w0.data_ptr(), n);
  }

  std::vector<double> copy, write, plain_write, complete, load, plain_read;
  int64_t bytes = 0;
  for (int rep = 0; rep < reps; ++rep) {
    const fs::path rep_dir = fs::path(dir) / "write";
    fs::remove_all(rep_dir);
    fs::create_directories(rep_dir);
    const std::string step_dir = (rep_dir / hetpar::train::CheckpointDirName(kStep)).string();
    const std::string plain = (rep_dir / "plain.bin").string();

    auto start = std::chrono::steady_clock::now();
    HETPAR_ASSIGN_OR_RETURN(
        hetpar::train::ShardSnapshot snapshot,
        hetpar::train::SnapshotShard(id, kStep, *saved.params, saved.optimizer.get()));
    copy.push_back(SecondsSince(start));
    bytes = snapshot.bytes();
    std::fprintf(stderr, "checkpoint_bench: writing %lld MiB (rep %d of %d) ...\n",
                 static_cast<long long>(bytes >> 20), rep + 1, reps);
    // Odd reps write the plain file first, so neither write always finds the disk fresh.
    const auto plain_write_once = [&]() -> absl::Status {
      const auto t = std::chrono::steady_clock::now();
      HETPAR_RETURN_IF_ERROR(PlainWrite(plain, chunk, bytes));
      plain_write.push_back(SecondsSince(t));
      return absl::OkStatus();
    };
    if (rep % 2 == 1) HETPAR_RETURN_IF_ERROR(plain_write_once());
    start = std::chrono::steady_clock::now();
    HETPAR_RETURN_IF_ERROR(hetpar::train::WriteShardSnapshot(step_dir, snapshot));
    write.push_back(SecondsSince(start));
    if (rep % 2 == 0) HETPAR_RETURN_IF_ERROR(plain_write_once());
    snapshot = {};  // frees the copy before the load allocates

    start = std::chrono::steady_clock::now();
    HETPAR_ASSIGN_OR_RETURN(const bool done,
                            hetpar::train::CompleteIfAllWritten(step_dir, {id}, kStep, json{}));
    complete.push_back(SecondsSince(start));
    if (!done) {
      return absl::InternalError(
          absl::StrCat("CompleteIfAllWritten found the one shard of ", step_dir, " missing"));
    }

    HETPAR_RETURN_IF_ERROR(Evict(step_dir));
    HETPAR_RETURN_IF_ERROR(Evict(plain));
    start = std::chrono::steady_clock::now();
    HETPAR_ASSIGN_OR_RETURN(const int64_t read, PlainRead(plain));
    plain_read.push_back(SecondsSince(start));
    if (read != bytes) {
      return absl::DataLossError(
          absl::StrCat("read ", read, " bytes back from ", plain, ", wrote ", bytes));
    }
    HETPAR_ASSIGN_OR_RETURN(Module loaded, MakeModule(mib, /*random=*/false));
    start = std::chrono::steady_clock::now();
    HETPAR_RETURN_IF_ERROR(hetpar::train::LoadModuleState(step_dir, id.module, *loaded.params,
                                                          loaded.optimizer.get()));
    load.push_back(SecondsSince(start));
    HETPAR_RETURN_IF_ERROR(CheckLoaded(saved, loaded));
  }
  fs::remove_all(fs::path(dir) / "write");
  const double write_gbps = Gbps(bytes, Median(write));
  const double plain_write_gbps = Gbps(bytes, Median(plain_write));
  const double load_gbps = Gbps(bytes, Median(load));
  const double plain_read_gbps = Gbps(bytes, Median(plain_read));
  return json{{"bench", "checkpoint_write"},
              {"mib", mib},
              {"bytes", bytes},
              {"reps", reps},
              {"copy_s", Median(copy)},
              {"copy_gbps", Gbps(bytes, Median(copy))},
              {"write_s", Median(write)},
              {"write_gbps", write_gbps},
              {"plain_write_s", Median(plain_write)},
              {"plain_write_gbps", plain_write_gbps},
              {"ratio", plain_write_gbps > 0 ? write_gbps / plain_write_gbps : 0},
              {"complete_s", Median(complete)},
              {"load_s", Median(load)},
              {"load_gbps", load_gbps},
              {"plain_read_gbps", plain_read_gbps},
              {"load_vs_plain_read", plain_read_gbps > 0 ? load_gbps / plain_read_gbps : 0}};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"checkpoint_bench: what a sharded checkpoint costs a run"};
  RunOptions run;
  run.config = std::string(HETPAR_SOURCE_DIR) + "/configs/tiny.yaml";
  int64_t mib = 256;
  int reps = 3;
  std::vector<std::string> skip;
  app.add_option("--config", run.config, "RunSpec to train")->capture_default_str();
  app.add_option("--steps", run.steps, "Steps of each run")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--warmup", run.warmup, "Leading steps left out")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--threads", run.threads, "Intra-op threads per worker")->capture_default_str();
  app.add_option("--every", run.every, "Steps between checkpoints in the run")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--mib", mib, "Parameter MiB of the in-process shard (it holds 3x that)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--reps", reps, "Repetitions of the in-process write and load")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--skip", skip, "Parts left out: in_run, write")
      ->check(CLI::IsMember({"in_run", "write"}))
      ->delimiter(',');
  CLI11_PARSE(app, argc, argv);
  if (run.warmup >= run.steps) {
    std::fprintf(stderr, "checkpoint_bench: --warmup=%d leaves none of --steps=%d to measure\n",
                 run.warmup, run.steps);
    return 2;
  }
  const auto skipped = [&](const std::string& part) {
    return std::find(skip.begin(), skip.end(), part) != skip.end();
  };

  std::string dir = (fs::temp_directory_path() / "hetpar_checkpoint_bench_XXXXXX").string();
  if (::mkdtemp(dir.data()) == nullptr) {
    std::fprintf(stderr, "checkpoint_bench: creating %s: %s\n", dir.c_str(), std::strerror(errno));
    return 1;
  }
  const auto fail = [&](const absl::Status& status) {
    std::fflush(stdout);
    // The large files go; the run's logs stay for the message to point at.
    std::error_code ec;
    fs::remove_all(fs::path(dir) / "write", ec);
    std::fprintf(stderr, "checkpoint_bench: %s (logs left in %s)\n",
                 std::string(status.message()).c_str(), dir.c_str());
    return 1;
  };
  if (!skipped("in_run")) {
    absl::StatusOr<json> line = InRun(run, dir);
    if (!line.ok()) return fail(line.status());
    std::printf("%s\n", line->dump().c_str());
    std::fflush(stdout);
  }
  if (!skipped("write")) {
    absl::StatusOr<json> line = WriteBench(mib, reps, dir);
    if (!line.ok()) return fail(line.status());
    std::printf("%s\n", line->dump().c_str());
    std::fflush(stdout);
  }
  std::error_code ec;
  fs::remove_all(dir, ec);
  return 0;
}
