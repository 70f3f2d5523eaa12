// transport_bw: data-plane bandwidth between one pair of processes over loopback.
//
// For each message size it measures, in the same run:
//   hetpar     the UCX backend of hetpar's Transport, one way and both ways at once
//   ucx_raw    `ucx_perftest -t tag_bw` (server and client processes, same size), and as
//              ucx_raw_peer the same with `-e`: endpoints in UCP_ERR_HANDLING_MODE_PEER like
//              hetpar's, where UCX (1.13 and 1.22 alike) has no shared-memory or CMA lanes (TCP
//              only)
//   gloo       c10d ProcessGroupGloo send/recv (libtorch), one way and both ways
//   memcpy     a single-process memcpy of the same size
// and prints one JSON object per size:
//   {"bench":"transport_bw","memory":"host","size":33554432,"hetpar_gbps":...,
//    "ucx_raw_gbps":...,"gloo_gbps":...,"memcpy_gbps":...,"hetpar_bidir_gbps":...,
//    "gloo_bidir_gbps":...,"ucx_raw_peer_gbps":...,"hetpar_vs_ucx_raw":...,"hetpar_vs_gloo":...}
// Rates are GB/s (1e9 bytes per second). One-way rates count the bytes of one direction;
// "bidir" rates count the bytes moved in both directions together. Every rate is the best of
// --reps repetitions of --budget bytes (at least 8 and at most 8192 messages) after a warm-up,
// with --window messages in flight; each repetition measures every system at that size in turn
// (fresh process pairs), so they see the same machine load.
//
// --memory cuda puts both hetpar workers' send and receive buffers in CUDA memory on the one GPU
// --cuda-device (both processes on the same device; UCX moves them with cuda_ipc/cuda_copy), runs
// ucx_perftest with `-m cuda,cuda` on that device, skips Gloo (host memory only), and replaces
// memcpy with d2d: at::Tensor::copy_ between two CUDA tensors of the same size in one process,
// synchronised (bytes copied per second, as gpu_bench's d2d_copy). Its line:
//   {"bench":"transport_bw","memory":"cuda","device":0,"size":33554432,"hetpar_gbps":...,
//    "hetpar_bidir_gbps":...,"ucx_raw_gbps":...,"ucx_raw_peer_gbps":...,"d2d_gbps":...,
//    "hetpar_vs_d2d":...,"hetpar_vs_ucx_raw":...,"gloo":"skipped: host memory only"}
// Without a CUDA device it prints {"bench":"transport_bw","skipped":"no CUDA device: ..."} and
// exits 0; when hetpar's UCX transport cannot move CUDA memory (CanMove(kCuda) false: a UCX
// without CUDA, or its CUDA module did not load) it prints
// {"bench":"transport_bw","memory":"cuda","error":...} and exits 1.
//
// The data is checked in both modes: each window slot of each sender has its own byte pattern;
// the receiver checks every byte of every warm-up message and, after each timed run (outside the
// timing), every byte of the run's last --window messages (the last one included), its receive
// buffers zeroed before the run. CUDA buffers are copied to the host to be checked. A mismatch
// fails the worker, naming the message, the byte and both values.
//
// A ucx_perftest that fails leaves its figure at 0 with "ucx_raw_error" in the line, and the exit
// status 1 (one past --limit is not tried again; one that failed otherwise, up to 3 times). A
// failing hetpar or Gloo pair ends that size's repetitions: its line carries "error" (its figures
// are those of the repetitions before, 0 where none), the next size is still measured, and the
// exit status is 1. A pair or a ucx_perftest run past --limit is not run at the later sizes
// either (it would hang there too): their lines say so.
//
//   transport_bw [--sizes 65536,1048576,...] [--budget BYTES] [--reps N] [--window N]
//                [--skip ucx_raw,gloo,hetpar,memcpy] [--zero-copy on|off]
//                [--zero-copy-threshold BYTES] [--memory host|cuda] [--cuda-device N]
//                [--limit SECONDS]
//
// --limit (default 600) bounds each worker pair (both ranks together) and each ucx_perftest
// client; a server whose client failed is ended at once.
//
// (--skip memcpy skips the d2d baseline under --memory cuda.)
// The same binary is the worker process of each pair (--role hetpar|gloo --rank 0|1 --dir D).
// The usual UCX_* environment reaches hetpar's workers and ucx_perftest alike; ucx_perftest is the
// one of the UCX hetpar links (HETPAR_UCX_PERFTEST; the environment variables HETPAR_UCX_PERFTEST
// and HETPAR_UCX_LIBDIR replace it and its libraries), so both run the same UCX.
#include <ATen/ATen.h>
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <torch/cuda.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "bench/built_path.h"
#include "common/atomic_file.h"
#include "common/nn/device_copy.h"
#include "common/nn/torch_status.h"
#include "common/nn/ucx_progress_device.h"
#include "common/transport/ucx/ucx_transport.h"
#include "nlohmann/json.hpp"

namespace hetpar::bench {
namespace {

using transport::ConstBuffer;
using transport::MemoryKind;
using transport::MutableBuffer;
using transport::Operation;
using transport::PeerId;

constexpr transport::Tag kDataTag = 1;
constexpr transport::Tag kAckTag = 2;
constexpr int kGlooDataTag = 1;
constexpr int kGlooAckTag = 2;
constexpr absl::Duration kWait = absl::Seconds(120);

struct Config {
  std::vector<size_t> sizes = {size_t{64} << 10, size_t{256} << 10, size_t{1} << 20,
                               size_t{4} << 20,  size_t{16} << 20,  size_t{32} << 20,
                               size_t{64} << 20};
  size_t budget = size_t{512} << 20;
  int reps = 3;
  int window = 4;
  std::vector<std::string> skip;
  // hetpar's same-host zero copy (UcxTransport::Options) and its threshold in bytes.
  bool zero_copy = true;
  size_t zero_copy_threshold = transport::ucx::UcxTransport::Options().zero_copy_threshold;
  // Where the hetpar workers' send and receive buffers live (--memory), and the GPU for kCuda.
  MemoryKind memory = MemoryKind::kHost;
  int cuda_device = 0;
  // Each pair's and each ucx_perftest client's time limit.
  absl::Duration limit = absl::Seconds(600);
  bool help = false;  // --help: print the usage and exit
  // worker mode
  std::string role;
  int rank = -1;
  std::string dir;

  bool Skipped(const std::string& what) const {
    return std::find(skip.begin(), skip.end(), what) != skip.end();
  }
  bool cuda() const { return memory == MemoryKind::kCuda; }
};

int64_t Messages(const Config& config, size_t size) {
  return std::clamp<int64_t>(static_cast<int64_t>(config.budget / size), 8, 8192);
}

double Seconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

double Gbps(double bytes, double seconds) { return bytes / seconds / 1e9; }

// Worker output: "<size> <oneway_gbps> <bidir_gbps>" lines from rank 0.
void Report(size_t size, double oneway, double bidir) {
  std::cout << "result " << size << " " << oneway << " " << bidir << std::endl;
}

absl::StatusOr<std::string> ReadFileWithin(const std::string& path, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    std::ifstream in(path, std::ios::binary);
    if (in) {
      std::stringstream content;
      content << in.rdbuf();
      return content.str();
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  return absl::DeadlineExceededError(
      absl::StrCat(path, " did not appear within ", absl::FormatDuration(timeout)));
}

// The byte at `index` of the message that rank `sender` sends from window slot `slot`: it differs
// per slot, per sender and along the message (not only with period 256), so a receiver sees a
// message from the wrong slot or direction, a stale buffer or a shifted range.
uint8_t PatternByte(size_t index, int slot, int sender) {
  return static_cast<uint8_t>(index * 7 + (index >> 8) * 13 + static_cast<size_t>(slot) * 29 +
                              static_cast<size_t>(sender) * 101 + 1);
}

// Checks every byte of a received message against the pattern of (`slot`, `sender`).
absl::Status CheckPattern(const uint8_t* data, size_t size, int slot, int sender, int64_t message) {
  for (size_t i = 0; i < size; ++i) {
    if (data[i] != PatternByte(i, slot, sender)) {
      return absl::DataLossError(absl::StrCat(
          "message ", message, " from rank ", sender, " (", size, " bytes, window slot ", slot,
          "): mismatch at byte ", i, ": got ", static_cast<int>(data[i]), ", expected ",
          static_cast<int>(PatternByte(i, slot, sender))));
    }
  }
  return absl::OkStatus();
}

// ------------------------------------------------------------------------------------------
// hetpar worker

// One rank of a hetpar pair: a UcxTransport connected to the other rank, and --window send and
// receive buffers per rank in host memory or, under --memory cuda, CUDA memory on --cuda-device.
// Used by the worker's main thread only.
class HetparPair {
 public:
  static absl::StatusOr<std::unique_ptr<HetparPair>> Create(const Config& config) {
    transport::ucx::UcxTransport::Options options;
    options.name = absl::StrCat("bench r", config.rank);
    options.same_host_zero_copy = config.zero_copy;
    options.zero_copy_threshold = config.zero_copy_threshold;
    auto transport = transport::ucx::UcxTransport::Create(options);
    if (!transport.ok()) return transport.status();
    if (!(*transport)->CanMove(config.memory)) {
      return absl::FailedPreconditionError(
          absl::StrCat("hetpar's UCX transport cannot move ",
                       std::string(transport::MemoryKindName(config.memory)),
                       " memory (CanMove is false): its CUDA transport module did not load"));
    }
    if (config.cuda()) {
      // As a hetpar worker does (bootstrap.cc): this thread and UCX's progress thread, which
      // drives its CUDA transports, compute on --cuda-device, each with its context bound.
      const c10::Device device(c10::kCUDA, static_cast<c10::DeviceIndex>(config.cuda_device));
      if (absl::Status s = nn::RunTorch(absl::StrCat("selecting ", device.str()),
                                        [&] { nn::MakeDeviceCurrent(device); });
          !s.ok()) {
        return s;
      }
      if (absl::Status s = nn::SelectProgressThreadDevice(**transport, device, absl::Now() + kWait);
          !s.ok()) {
        return s;
      }
    }
    auto pair = std::unique_ptr<HetparPair>(new HetparPair(config));
    pair->transport_ = std::move(transport).value();
    const std::string mine = absl::StrCat(config.dir, "/hetpar.", config.rank, ".addr");
    const std::string theirs = absl::StrCat(config.dir, "/hetpar.", 1 - config.rank, ".addr");
    if (!WriteFileAtomically(mine, pair->transport_->LocalAddress()).ok()) {
      return absl::InternalError(absl::StrCat("cannot write ", mine));
    }
    auto address = ReadFileWithin(theirs, absl::Seconds(60));
    if (!address.ok()) return address.status();
    auto peer = pair->transport_->Connect(*address, absl::Now() + kWait);
    if (!peer.ok()) return peer.status();
    pair->peer_ = *peer;
    return pair;
  }

  // Both ranks exchange a one-byte message.
  absl::Status Sync() {
    uint8_t out = 1, in = 0;
    auto recv = transport_->Recv(peer_, kAckTag, MutableBuffer::Host(&in, 1));
    if (!recv.ok()) return recv.status();
    auto send = transport_->Send(peer_, kAckTag, ConstBuffer::Host(&out, 1));
    if (!send.ok()) return send.status();
    absl::Status status = (*recv)->Wait(absl::Now() + kWait);
    if (!status.ok()) return status;
    return (*send)->Wait(absl::Now() + kWait);
  }

  // Moves `count` messages of `size` with `window` in flight per direction; `send` and `recv`
  // choose the directions of this rank. Returns the seconds from start to the peer's ack. The
  // received bytes are checked (outside the timing): with `check_every`, every message as it
  // arrives (for the warm-up: it delays the next receive); always the last `window` messages.
  absl::StatusOr<double> Run(size_t size, int64_t count, bool send, bool recv, bool check_every) {
    Buffers(size);
    for (at::Tensor& buffer : in_) buffer.zero_();
    Synchronize();
    if (absl::Status s = Sync(); !s.ok()) return s;
    uint8_t ack_in = 0, ack_out = 1;
    auto ack = transport_->Recv(peer_, kAckTag, MutableBuffer::Host(&ack_in, 1));
    if (!ack.ok()) return ack.status();
    const auto start = std::chrono::steady_clock::now();
    std::deque<std::unique_ptr<Operation>> sends, recvs;
    int64_t sent = 0, received = 0;
    const int64_t send_total = send ? count : 0, recv_total = recv ? count : 0;
    while (sent < send_total || received < recv_total || !sends.empty() || !recvs.empty()) {
      while (received < recv_total && static_cast<int>(recvs.size()) < window_) {
        auto op = transport_->Recv(
            peer_, kDataTag,
            MutableBuffer{in_[received % window_].data_ptr(), size, memory_, device_});
        if (!op.ok()) return op.status();
        recvs.push_back(std::move(op).value());
        ++received;
      }
      while (sent < send_total && static_cast<int>(sends.size()) < window_) {
        auto op = transport_->Send(
            peer_, kDataTag, ConstBuffer{out_[sent % window_].data_ptr(), size, memory_, device_});
        if (!op.ok()) return op.status();
        sends.push_back(std::move(op).value());
        ++sent;
      }
      // Wait for the oldest receive, then the oldest send (the same discipline as the Gloo
      // baseline); the progress thread moves every posted operation meanwhile.
      if (!recvs.empty()) {
        const int64_t message = received - static_cast<int64_t>(recvs.size());
        if (absl::Status s = recvs.front()->Wait(absl::Now() + kWait); !s.ok()) return s;
        recvs.pop_front();
        if (check_every) {
          if (absl::Status s = Check(message, size); !s.ok()) return s;
        }
      }
      if (!sends.empty()) {
        if (absl::Status s = sends.front()->Wait(absl::Now() + kWait); !s.ok()) return s;
        sends.pop_front();
      }
    }
    auto done = transport_->Send(peer_, kAckTag, ConstBuffer::Host(&ack_out, 1));
    if (!done.ok()) return done.status();
    if (absl::Status s = (*ack)->Wait(absl::Now() + kWait); !s.ok()) return s;
    const double seconds = Seconds(std::chrono::steady_clock::now() - start);
    if (absl::Status s = (*done)->Wait(absl::Now() + kWait); !s.ok()) return s;
    for (int64_t message = std::max<int64_t>(0, recv_total - window_); message < recv_total;
         ++message) {
      if (absl::Status s = Check(message, size); !s.ok()) return s;
    }
    return seconds;
  }

 private:
  explicit HetparPair(const Config& config)
      : rank_(config.rank),
        window_(config.window),
        memory_(config.memory),
        device_(config.cuda() ? config.cuda_device : -1) {}

  at::TensorOptions Options() const {
    at::TensorOptions options = at::TensorOptions().dtype(at::kByte);
    return memory_ == MemoryKind::kCuda
               ? options.device(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device_)))
               : options;
  }

  // Waits for the device's queued work (the buffers' fills) before UCX reads or writes them on
  // its own streams.
  void Synchronize() const {
    if (memory_ == MemoryKind::kCuda) torch::cuda::synchronize(device_);
  }

  void Buffers(size_t size) {
    if (!out_.empty() && static_cast<size_t>(out_[0].numel()) == size) return;
    out_.clear();
    in_.clear();
    for (int slot = 0; slot < window_; ++slot) {
      at::Tensor pattern = at::empty({static_cast<int64_t>(size)}, at::kByte);
      uint8_t* bytes = pattern.data_ptr<uint8_t>();
      for (size_t i = 0; i < size; ++i) bytes[i] = PatternByte(i, slot, rank_);
      out_.push_back(memory_ == MemoryKind::kCuda ? pattern.to(Options()) : pattern);
      in_.push_back(at::empty({static_cast<int64_t>(size)}, Options()));
    }
    Synchronize();
  }

  // Checks received message `message` (0-based), which sits in its window slot (copied to the
  // host first when it is in CUDA memory).
  absl::Status Check(int64_t message, size_t size) const {
    const int slot = static_cast<int>(message % window_);
    at::Tensor host = in_[slot].is_cuda() ? in_[slot].cpu() : in_[slot];
    return CheckPattern(host.data_ptr<uint8_t>(), size, slot, 1 - rank_, message);
  }

  std::unique_ptr<transport::ucx::UcxTransport> transport_;
  PeerId peer_ = 0;
  const int rank_;
  const int window_;
  const MemoryKind memory_;
  const int device_;  // CUDA device ordinal for kCuda; -1 for host memory
  std::vector<at::Tensor> out_, in_;
};

absl::Status RunHetparWorker(const Config& config) {
  auto pair = HetparPair::Create(config);
  if (!pair.ok()) return pair.status();
  const bool sender = config.rank == 0;
  for (size_t size : config.sizes) {
    const int64_t count = Messages(config, size);
    auto warm = (*pair)->Run(size, count / 4 + 1, sender, !sender, /*check_every=*/true);
    if (!warm.ok()) return warm.status();
    double best_oneway = 0, best_bidir = 0;
    for (int rep = 0; rep < config.reps; ++rep) {
      auto oneway = (*pair)->Run(size, count, sender, !sender, /*check_every=*/false);
      if (!oneway.ok()) return oneway.status();
      best_oneway = std::max(best_oneway, Gbps(double(size) * count, *oneway));
      auto bidir = (*pair)->Run(size, count, true, true, /*check_every=*/false);
      if (!bidir.ok()) return bidir.status();
      best_bidir = std::max(best_bidir, Gbps(2.0 * size * count, *bidir));
    }
    if (config.rank == 0) Report(size, best_oneway, best_bidir);
  }
  return absl::OkStatus();
}

// ------------------------------------------------------------------------------------------
// Gloo worker (libtorch c10d). Its c10::Error is translated to Status here (the CUDA set-up
// above goes through nn::RunTorch).

absl::Status RunGlooWorkerOrThrow(const Config& config) {
  auto store = c10::make_intrusive<c10d::FileStore>(config.dir + "/gloo.store", 2);
  auto options = c10d::ProcessGroupGloo::Options::create();
  options->timeout = std::chrono::milliseconds(absl::ToInt64Milliseconds(kWait));
  options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  c10d::ProcessGroupGloo group(store, config.rank, 2, options);
  const int peer = 1 - config.rank;
  auto ack_exchange = [&]() {
    std::vector<at::Tensor> in = {at::zeros({1}, at::kByte)}, out = {at::ones({1}, at::kByte)};
    auto recv = group.recv(in, peer, kGlooAckTag);
    auto send = group.send(out, peer, kGlooAckTag);
    recv->wait();
    send->wait();
  };
  // Returns seconds from start to the peer's ack; the same window discipline as hetpar.
  auto run = [&](size_t size, int64_t count, bool send, bool recv) {
    std::vector<at::Tensor> outs, ins;
    for (int w = 0; w < config.window; ++w) {
      outs.push_back(at::full({static_cast<int64_t>(size)}, 7, at::kByte));
      ins.push_back(at::empty({static_cast<int64_t>(size)}, at::kByte));
    }
    ack_exchange();
    const auto start = std::chrono::steady_clock::now();
    std::deque<c10::intrusive_ptr<c10d::Work>> sends, recvs;
    int64_t sent = 0, received = 0;
    const int64_t send_total = send ? count : 0, recv_total = recv ? count : 0;
    while (sent < send_total || received < recv_total || !sends.empty() || !recvs.empty()) {
      while (received < recv_total && static_cast<int>(recvs.size()) < config.window) {
        std::vector<at::Tensor> one = {ins[received % config.window]};
        recvs.push_back(group.recv(one, peer, kGlooDataTag));
        ++received;
      }
      while (sent < send_total && static_cast<int>(sends.size()) < config.window) {
        std::vector<at::Tensor> one = {outs[sent % config.window]};
        sends.push_back(group.send(one, peer, kGlooDataTag));
        ++sent;
      }
      // A Gloo send or receive completes only inside wait(), and may be waited on once: wait
      // for the oldest receive, then the oldest send, dropping each. Gloo's own thread moves
      // the data of every posted operation meanwhile, so both directions stay busy.
      for (auto* oldest : {&recvs, &sends}) {
        if (oldest->empty()) continue;
        oldest->front()->wait();
        oldest->pop_front();
      }
    }
    ack_exchange();
    return Seconds(std::chrono::steady_clock::now() - start);
  };
  const bool sender = config.rank == 0;
  for (size_t size : config.sizes) {
    const int64_t count = Messages(config, size);
    run(size, count / 4 + 1, sender, !sender);
    double best_oneway = 0, best_bidir = 0;
    for (int rep = 0; rep < config.reps; ++rep) {
      best_oneway =
          std::max(best_oneway, Gbps(double(size) * count, run(size, count, sender, !sender)));
      best_bidir = std::max(best_bidir, Gbps(2.0 * size * count, run(size, count, true, true)));
    }
    if (config.rank == 0) Report(size, best_oneway, best_bidir);
  }
  return absl::OkStatus();
}

absl::Status RunGlooWorker(const Config& config) {
  try {
    return RunGlooWorkerOrThrow(config);
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("c10d ProcessGroupGloo: ", e.what_without_backtrace()));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("c10d ProcessGroupGloo: ", e.what()));
  }
}

// ------------------------------------------------------------------------------------------
// Driver

struct Child {
  pid_t pid = -1;
  std::string output_path;
};

absl::StatusOr<Child> Spawn(const std::vector<std::string>& argv, const std::string& output_path) {
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = fork();
  if (pid < 0) return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  if (pid == 0) {
    int fd = open(output_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      dup2(fd, STDOUT_FILENO);
      dup2(fd, STDERR_FILENO);
      close(fd);
    }
    execvp(args[0], args.data());
    _exit(127);
  }
  return Child{pid, output_path};
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream content;
  content << in.rdbuf();
  return content.str();
}

// Waits for the child until `deadline` (the end of a `limit` that may have started before), then
// kills it. Returns its output.
absl::StatusOr<std::string> Finish(const Child& child, absl::Time deadline, absl::Duration limit,
                                   const std::string& what) {
  int status = 0;
  while (true) {
    pid_t done = waitpid(child.pid, &status, WNOHANG);
    if (done == child.pid) break;
    if (absl::Now() >= deadline) {
      kill(child.pid, SIGKILL);
      waitpid(child.pid, &status, 0);
      return absl::DeadlineExceededError(absl::StrCat(what, " did not finish within ",
                                                      absl::FormatDuration(limit), "; output:\n",
                                                      ReadFile(child.output_path)));
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  std::string output = ReadFile(child.output_path);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return absl::InternalError(
        absl::StrCat(what, " failed (status ", status, "); output:\n", output));
  }
  return output;
}

// size -> (one-way, both-ways) GB/s from a worker pair.
using PairResults = std::map<size_t, std::pair<double, double>>;

absl::StatusOr<PairResults> RunPair(const std::string& self, const std::string& role,
                                    const Config& config, const std::string& dir) {
  std::string sizes;
  for (size_t size : config.sizes) absl::StrAppend(&sizes, sizes.empty() ? "" : ",", size);
  std::vector<Child> children;
  for (int rank = 0; rank < 2; ++rank) {
    std::vector<std::string> argv(
        {self, "--role", role, "--rank", std::to_string(rank), "--dir", dir, "--sizes", sizes,
         "--budget", std::to_string(config.budget), "--reps", std::to_string(config.reps),
         "--window", std::to_string(config.window), "--zero-copy", config.zero_copy ? "on" : "off",
         "--zero-copy-threshold", std::to_string(config.zero_copy_threshold)});
    argv.push_back("--memory");
    argv.push_back(std::string(transport::MemoryKindName(config.memory)));
    argv.push_back("--cuda-device");
    argv.push_back(std::to_string(config.cuda_device));
    auto child = Spawn(argv, absl::StrCat(dir, "/", role, ".", rank, ".out"));
    if (!child.ok()) return child.status();
    children.push_back(*child);
  }
  PairResults results;
  // Both ranks' failures: the one that saw the cause (a wrong byte) may not be the first rank.
  // `failure` is the pair's: its code says whether the pair hung.
  absl::Status failure;
  std::string errors;
  // One limit for the pair: a rank still running once the other ended is given what is left.
  const absl::Time deadline = absl::Now() + config.limit;
  for (int rank = 0; rank < 2; ++rank) {
    auto output = Finish(children[rank], deadline, config.limit,
                         absl::StrCat(role, " rank ", rank, " (both ranks together)"));
    if (!output.ok()) {
      // A rank that failed otherwise names the pair's failure: its peer past the limit was only
      // waiting for it, and the pair would not hang at the next size.
      if (failure.ok() ||
          (absl::IsDeadlineExceeded(failure) && !absl::IsDeadlineExceeded(output.status()))) {
        failure = output.status();
      }
      absl::StrAppend(&errors, errors.empty() ? "" : "\n", output.status().message());
      continue;
    }
    for (absl::string_view line : absl::StrSplit(*output, '\n')) {
      std::vector<std::string> fields = absl::StrSplit(line, ' ');
      if (fields.size() != 4 || fields[0] != "result") continue;
      size_t size = 0;
      double oneway = 0, bidir = 0;
      if (absl::SimpleAtoi(fields[1], &size) && absl::SimpleAtod(fields[2], &oneway) &&
          absl::SimpleAtod(fields[3], &bidir)) {
        results[size] = {oneway, bidir};
      }
    }
  }
  if (!failure.ok()) return absl::Status(failure.code(), errors);
  return results;
}

int FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t length = sizeof(addr);
  int port = 13337;
  if (fd >= 0 && bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &length) == 0) {
    port = ntohs(addr.sin_port);
  }
  if (fd >= 0) close(fd);
  return port;
}

// The CUDA_VISIBLE_DEVICES that shows a child process this process's CUDA device `device` as its
// device 0: the device-th entry of ours when it is set, else `device`.
std::string VisibleDevice(int device) {
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  if (visible != nullptr && *visible != '\0') {
    std::vector<std::string> entries = absl::StrSplit(visible, ',');
    if (device < static_cast<int>(entries.size())) return entries[device];
  }
  return std::to_string(device);
}

// One ucx_perftest tag_bw run; returns GB/s from the client's final "overall" bandwidth
// (ucx_perftest prints MB/s with MB = 2^20 bytes). With config.cuda(), both sides' buffers are
// CUDA memory (`-m cuda,cuda`) on config.cuda_device (shown to ucx_perftest as its device 0).
absl::StatusOr<double> UcxPerftest(size_t size, int64_t count, bool error_handling,
                                   const Config& config, const std::string& dir) {
  absl::Status last_error;
  for (int attempt = 0; attempt < 3; ++attempt) {
    const std::string port = std::to_string(FreePort());
    const std::string n = std::to_string(count), s = std::to_string(size);
    const std::string warmup = std::to_string(std::max<int64_t>(2, count / 4));
    // The ucx_perftest of the UCX hetpar links, its own libraries first (a wheel's binaries would
    // otherwise find the system's UCX of the same soname).
    const char* library_path = std::getenv("LD_LIBRARY_PATH");
    std::vector<std::string> server_argv = {
        "/usr/bin/env",
        absl::StrCat(
            "LD_LIBRARY_PATH=", hetpar::bench::BuiltPath("HETPAR_UCX_LIBDIR", HETPAR_UCX_LIBDIR),
            library_path != nullptr && *library_path != '\0' ? absl::StrCat(":", library_path)
                                                             : std::string())};
    if (config.cuda()) {
      server_argv.push_back(
          absl::StrCat("CUDA_VISIBLE_DEVICES=", VisibleDevice(config.cuda_device)));
    }
    const size_t program = server_argv.size();
    server_argv.insert(server_argv.end(),
                       {hetpar::bench::BuiltPath("HETPAR_UCX_PERFTEST", HETPAR_UCX_PERFTEST), "-t",
                        "tag_bw", "-s", s, "-n", n, "-w", warmup, "-p", port, "-f"});
    if (error_handling) server_argv.push_back("-e");
    if (config.cuda()) {
      server_argv.push_back("-m");
      server_argv.push_back("cuda,cuda");
    }
    // The client names the server's address right after the program.
    std::vector<std::string> client_argv = server_argv;
    client_argv.insert(client_argv.begin() + program + 1, "127.0.0.1");
    auto server = Spawn(server_argv, dir + "/perftest.server.out");
    if (!server.ok()) return server.status();
    absl::SleepFor(absl::Milliseconds(300));
    auto client = Spawn(client_argv, dir + "/perftest.client.out");
    if (!client.ok()) return client.status();
    auto client_output =
        Finish(*client, absl::Now() + config.limit, config.limit, "ucx_perftest client");
    // A server whose client failed would wait for it: ended at once.
    auto server_output = Finish(
        *server, absl::Now() + (client_output.ok() ? absl::Seconds(30) : absl::ZeroDuration()),
        absl::Seconds(30), "ucx_perftest server");
    if (!client_output.ok() || !server_output.ok()) {  // e.g. the port was taken
      last_error = !client_output.ok() ? client_output.status() : server_output.status();
      // A client past its limit hangs rather than lost a port race: another try would only
      // spend the limit again.
      if (absl::IsDeadlineExceeded(last_error)) return last_error;
      continue;
    }
    // The final line: iterations, latency 50%ile/average/overall, bandwidth average/overall,
    // message rate average/overall.
    for (absl::string_view line : absl::StrSplit(*client_output, '\n')) {
      std::vector<std::string> fields = absl::StrSplit(line, ' ', absl::SkipWhitespace());
      if (!fields.empty() && fields[0] == "Final:") fields.erase(fields.begin());
      int64_t iterations = 0;
      double overall_mb = 0;
      if (fields.size() == 8 && absl::SimpleAtoi(fields[0], &iterations) && iterations == count &&
          absl::SimpleAtod(fields[5], &overall_mb)) {
        return overall_mb * 1048576.0 / 1e9;
      }
    }
    return absl::InternalError(absl::StrCat("cannot parse ucx_perftest output:\n", *client_output));
  }
  return absl::UnavailableError(absl::StrCat("ucx_perftest", error_handling ? " -e" : "",
                                             " failed 3 times; the last: ", last_error.message()));
}

double MemcpyGbps(size_t size, int64_t count, int reps) {
  std::vector<uint8_t> src(size, 3), dst(size, 0);
  std::memcpy(dst.data(), src.data(), size);  // fault the pages in
  double best = 0;
  for (int rep = 0; rep < reps; ++rep) {
    const auto start = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < count; ++i) {
      src[i % size] = static_cast<uint8_t>(i);
      std::memcpy(dst.data(), src.data(), size);
    }
    const double seconds = Seconds(std::chrono::steady_clock::now() - start);
    best = std::max(best, Gbps(double(size) * count, seconds));
  }
  if (dst[0] == 0xFF && dst[size - 1] == 0xFF) std::cerr << "";  // keep the copies observable
  return best;
}

// GB/s of at::Tensor::copy_ between two CUDA tensors of `size` bytes on `device` in this process
// (bytes copied per second: each byte read once and written once, as gpu_bench's d2d_copy), the
// best of `reps` loops of `count` copies, each loop between two device synchronisations.
double DeviceCopyGbps(size_t size, int64_t count, int reps, int device) {
  const auto options = at::TensorOptions().dtype(at::kByte).device(
      at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device)));
  at::Tensor src = at::full({static_cast<int64_t>(size)}, 3, options);
  at::Tensor dst = at::empty({static_cast<int64_t>(size)}, options);
  for (int i = 0; i < 3; ++i) dst.copy_(src);  // warm-up
  torch::cuda::synchronize(device);
  double best = 0;
  for (int rep = 0; rep < reps; ++rep) {
    const auto start = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < count; ++i) dst.copy_(src);
    torch::cuda::synchronize(device);
    const double seconds = Seconds(std::chrono::steady_clock::now() - start);
    best = std::max(best, Gbps(double(size) * count, seconds));
  }
  return best;
}

std::string Json(double value) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%.3f", value);
  return buffer;
}

std::string JsonString(const std::string& text) { return nlohmann::json(text).dump(); }

// Why --memory cuda has nothing to measure here; empty when a CUDA device is visible.
std::string NoCudaReason() {
  if (torch::cuda::is_available()) return "";
  std::string reason = absl::StrCat(
      "no CUDA device: torch::cuda::is_available() is false, torch::cuda::device_count() = ",
      static_cast<int>(torch::cuda::device_count()));
  if (const char* visible = std::getenv("CUDA_VISIBLE_DEVICES")) {
    absl::StrAppend(&reason, " (CUDA_VISIBLE_DEVICES=\"", visible, "\")");
  }
  return reason;
}

// Before any pair runs under --memory cuda: the device exists and hetpar's UCX transport can move
// CUDA memory. The transport is destroyed (its progress thread ended) before the driver forks.
absl::Status CheckCudaTransport(const Config& config) {
  const int devices = static_cast<int>(torch::cuda::device_count());
  if (config.cuda_device >= devices) {
    return absl::InvalidArgumentError(absl::StrCat("--cuda-device ", config.cuda_device, ": only ",
                                                   devices, " CUDA device(s) are visible"));
  }
  transport::ucx::UcxTransport::Options options;
  options.name = "transport_bw check";
  auto transport = transport::ucx::UcxTransport::Create(options);
  if (!transport.ok()) return transport.status();
  if (!(*transport)->CanMove(MemoryKind::kCuda)) {
    return absl::FailedPreconditionError(
        "--memory cuda: hetpar's UCX transport cannot move CUDA memory "
        "(UcxTransport::CanMove(kCuda) is false): the UCX it loaded has no CUDA memory type, "
        "either built without CUDA or its CUDA transport module (libuct_cuda, which needs the "
        "GPU driver's libcuda.so.1 and libnvidia-ml.so.1) did not load; build against the "
        "libucx-cu13 wheel (docs/transport.md, \"Which UCX\") and check with "
        "UCX_LOG_LEVEL=debug");
  }
  return absl::OkStatus();
}

int RunDriver(const std::string& self, const Config& config) {
  if (config.cuda()) {
    if (const std::string reason = NoCudaReason(); !reason.empty()) {
      std::cout << "{\"bench\":\"transport_bw\",\"skipped\":" << JsonString(reason) << "}"
                << std::endl;
      return 0;
    }
    if (absl::Status s = CheckCudaTransport(config); !s.ok()) {
      std::cout << "{\"bench\":\"transport_bw\",\"memory\":\"cuda\",\"error\":"
                << JsonString(std::string(s.message())) << "}" << std::endl;
      std::cerr << "transport_bw: " << s.message() << "\n";
      return 1;
    }
  }
  char pattern[] = "/tmp/hetpar-transport-bw-XXXXXX";
  if (mkdtemp(pattern) == nullptr) {
    std::cerr << "transport_bw: mkdtemp: " << std::strerror(errno) << "\n";
    return 1;
  }
  const std::string dir = pattern;
  auto clear = [&dir]() {
    for (const char* file : {"hetpar.0.addr", "hetpar.1.addr", "gloo.store"}) {
      std::remove(absl::StrCat(dir, "/", file).c_str());
    }
  };
  // Gloo moves host memory only.
  const bool gloo = !config.cuda() && !config.Skipped("gloo");
  int exit_code = 0;
  // A system that ran past --limit at one size would hang at the next as well: the size it hung
  // at, by system, and it is not run again.
  std::map<std::string, size_t> hung;
  const auto hung_error = [&hung](const std::string& system) {
    return absl::StrCat("not run: the ", system, " run past --limit at ", hung.at(system),
                        " bytes");
  };
  // Every system is measured once per repetition, size by size, so all see the same load.
  for (size_t size : config.sizes) {
    const int64_t count = Messages(config, size);
    Config one = config;
    one.sizes = {size};
    one.reps = 1;
    double h = 0, hb = 0, g = 0, gb = 0, ucx_raw = 0, ucx_raw_peer = 0;
    std::string ucx_raw_error, pair_error;
    for (int rep = 0; rep < config.reps && pair_error.empty(); ++rep) {
      for (const char* role : {"hetpar", "gloo"}) {
        if (std::string(role) == "gloo" ? !gloo : config.Skipped(role)) continue;
        const std::string pair = absl::StrCat(role, " pair");
        if (hung.count(pair) > 0) {
          pair_error = absl::StrCat(pair, ": ", hung_error(pair));
          break;
        }
        clear();
        auto results = RunPair(self, role, one, dir);
        if (!results.ok()) {
          // This size has no figure; the next size is still measured, unless the pair hung.
          std::cerr << "transport_bw: " << pair << ": " << results.status() << "\n";
          pair_error = absl::StrCat(pair, ": ", results.status().message());
          if (absl::IsDeadlineExceeded(results.status())) hung.emplace(pair, size);
          break;
        }
        const auto [oneway, bidir] = (*results)[size];
        double& best_oneway = std::string(role) == "hetpar" ? h : g;
        double& best_bidir = std::string(role) == "hetpar" ? hb : gb;
        best_oneway = std::max(best_oneway, oneway);
        best_bidir = std::max(best_bidir, bidir);
      }
      if (!config.Skipped("ucx_raw")) {
        for (bool error_handling : {false, true}) {
          const std::string perftest = error_handling ? "ucx_perftest -e" : "ucx_perftest";
          absl::StatusOr<double> gbps =
              hung.count(perftest) > 0 ? absl::StatusOr<double>(absl::UnavailableError(
                                             absl::StrCat(perftest, ": ", hung_error(perftest))))
                                       : UcxPerftest(size, count, error_handling, config, dir);
          if (!gbps.ok()) {
            std::cerr << "transport_bw: " << gbps.status() << "\n";
            if (ucx_raw_error.empty()) ucx_raw_error = std::string(gbps.status().message());
            if (absl::IsDeadlineExceeded(gbps.status())) hung.emplace(perftest, size);
            exit_code = 1;
            continue;
          }
          double& best = error_handling ? ucx_raw_peer : ucx_raw;
          best = std::max(best, *gbps);
        }
      }
    }
    // The single-process baseline: d2d for CUDA memory, memcpy for host memory.
    const double baseline =
        config.Skipped("memcpy")
            ? 0
            : (config.cuda() ? DeviceCopyGbps(size, count, config.reps, config.cuda_device)
                             : MemcpyGbps(size, count, config.reps));
    std::cout << "{\"bench\":\"transport_bw\",\"memory\":"
              << JsonString(std::string(transport::MemoryKindName(config.memory)));
    if (config.cuda()) {
      const double d2d = baseline;
      std::cout << ",\"device\":" << config.cuda_device << ",\"size\":" << size
                << ",\"hetpar_gbps\":" << Json(h) << ",\"hetpar_bidir_gbps\":" << Json(hb)
                << ",\"ucx_raw_gbps\":" << Json(ucx_raw)
                << ",\"ucx_raw_peer_gbps\":" << Json(ucx_raw_peer) << ",\"d2d_gbps\":" << Json(d2d)
                << ",\"hetpar_vs_d2d\":" << Json(d2d > 0 ? h / d2d : 0)
                << ",\"hetpar_vs_ucx_raw\":" << Json(ucx_raw > 0 ? h / ucx_raw : 0)
                << ",\"gloo\":\"skipped: host memory only\"";
    } else {
      const double memcpy_gbps = baseline;
      std::cout << ",\"size\":" << size << ",\"hetpar_gbps\":" << Json(h)
                << ",\"ucx_raw_gbps\":" << Json(ucx_raw) << ",\"gloo_gbps\":" << Json(g)
                << ",\"memcpy_gbps\":" << Json(memcpy_gbps) << ",\"hetpar_bidir_gbps\":" << Json(hb)
                << ",\"gloo_bidir_gbps\":" << Json(gb)
                << ",\"ucx_raw_peer_gbps\":" << Json(ucx_raw_peer)
                << ",\"hetpar_vs_ucx_raw\":" << Json(ucx_raw > 0 ? h / ucx_raw : 0)
                << ",\"hetpar_vs_gloo\":" << Json(g > 0 ? h / g : 0);
    }
    if (!ucx_raw_error.empty()) std::cout << ",\"ucx_raw_error\":" << JsonString(ucx_raw_error);
    if (!pair_error.empty()) {  // the figures above are of the repetitions before it, if any
      std::cout << ",\"error\":" << JsonString(pair_error);
      exit_code = 1;
    }
    std::cout << "}" << std::endl;
  }
  for (const char* file :
       {"hetpar.0.addr", "hetpar.1.addr", "hetpar.0.out", "hetpar.1.out", "gloo.0.out",
        "gloo.1.out", "gloo.store", "perftest.server.out", "perftest.client.out"}) {
    std::remove(absl::StrCat(dir, "/", file).c_str());
  }
  rmdir(dir.c_str());
  return exit_code;
}

absl::StatusOr<Config> ParseFlags(int argc, char** argv) {
  Config config;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      config.help = true;
      return config;
    }
    if (i + 1 >= argc) return absl::InvalidArgumentError(absl::StrCat(flag, " needs a value"));
    const std::string value = argv[++i];
    bool ok = true;
    if (flag == "--sizes") {
      config.sizes.clear();
      for (absl::string_view part : absl::StrSplit(value, ',')) {
        size_t size = 0;
        ok = ok && absl::SimpleAtoi(part, &size) && size > 0;
        config.sizes.push_back(size);
      }
    } else if (flag == "--budget") {
      ok = absl::SimpleAtoi(value, &config.budget) && config.budget > 0;
    } else if (flag == "--reps") {
      ok = absl::SimpleAtoi(value, &config.reps) && config.reps > 0;
    } else if (flag == "--window") {
      ok = absl::SimpleAtoi(value, &config.window) && config.window > 0;
    } else if (flag == "--zero-copy") {
      ok = value == "on" || value == "off";
      config.zero_copy = value == "on";
    } else if (flag == "--zero-copy-threshold") {
      ok = absl::SimpleAtoi(value, &config.zero_copy_threshold);
    } else if (flag == "--memory") {
      ok = value == "host" || value == "cuda";
      config.memory = value == "cuda" ? MemoryKind::kCuda : MemoryKind::kHost;
    } else if (flag == "--limit") {
      double seconds = 0;
      ok = absl::SimpleAtod(value, &seconds) && seconds > 0;
      config.limit = absl::Seconds(seconds);
    } else if (flag == "--cuda-device") {
      ok = absl::SimpleAtoi(value, &config.cuda_device) && config.cuda_device >= 0;
    } else if (flag == "--skip") {
      config.skip = absl::StrSplit(value, ',');
    } else if (flag == "--role") {
      config.role = value;
      ok = value == "hetpar" || value == "gloo";
    } else if (flag == "--rank") {
      ok = absl::SimpleAtoi(value, &config.rank) && (config.rank == 0 || config.rank == 1);
    } else if (flag == "--dir") {
      config.dir = value;
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag ", flag,
                                                     "; see the comment at the top of "
                                                     "bench/transport_bw.cc"));
    }
    if (!ok) {
      return absl::InvalidArgumentError(absl::StrCat("bad value '", value, "' for ", flag));
    }
  }
  if (!config.role.empty() && (config.rank < 0 || config.dir.empty())) {
    return absl::InvalidArgumentError("--role needs --rank 0|1 and --dir");
  }
  return config;
}

}  // namespace
}  // namespace hetpar::bench

int main(int argc, char** argv) {
  auto config = hetpar::bench::ParseFlags(argc, argv);
  if (!config.ok()) {
    std::cerr << "transport_bw: " << config.status().message() << "\n";
    return 2;
  }
  if (config->help) {
    std::cout << "usage: transport_bw [--sizes 65536,1048576,...] [--budget BYTES] [--reps N] "
                 "[--window N] [--skip ucx_raw,gloo,hetpar,memcpy] [--zero-copy on|off] "
                 "[--zero-copy-threshold BYTES] [--memory host|cuda] [--cuda-device N] "
                 "[--limit SECONDS]\n"
                 "hetpar's UCX data plane between two processes against ucx_perftest, c10d Gloo "
                 "and memcpy (or, with --memory cuda, a device-to-device copy); one JSON line per "
                 "size (see the comment at the top of bench/transport_bw.cc).\n";
    return 0;
  }
  if (config->role.empty()) return hetpar::bench::RunDriver("/proc/self/exe", *config);
  absl::Status status = config->role == "hetpar" ? hetpar::bench::RunHetparWorker(*config)
                                                 : hetpar::bench::RunGlooWorker(*config);
  if (!status.ok()) {
    std::cerr << "transport_bw " << config->role << " rank " << config->rank << ": " << status
              << "\n";
    return 1;
  }
  return 0;
}
