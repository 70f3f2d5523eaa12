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
//   {"size": 33554432, "hetpar_gbps": ..., "ucx_raw_gbps": ..., "gloo_gbps": ...,
//    "memcpy_gbps": ..., "hetpar_bidir_gbps": ..., "gloo_bidir_gbps": ...,
//    "ucx_raw_peer_gbps": ..., "hetpar_vs_ucx_raw": ..., "hetpar_vs_gloo": ...}
// Rates are GB/s (1e9 bytes per second). One-way rates count the bytes of one direction;
// "bidir" rates count the bytes moved in both directions together. Every rate is the best of
// --reps repetitions of --budget bytes (at least 8 and at most 8192 messages) after a warm-up,
// with --window messages in flight; each repetition measures every system at that size in turn
// (fresh process pairs), so they see the same machine load.
//
//   transport_bw [--sizes 65536,1048576,...] [--budget BYTES] [--reps N] [--window N]
//                [--skip ucx_raw,gloo,hetpar,memcpy] [--zero-copy on|off]
//                [--zero-copy-threshold BYTES]
//
// The same binary is the worker process of each pair (--role hetpar|gloo --rank 0|1 --dir D).
// The usual UCX_* environment reaches hetpar's workers and ucx_perftest alike; ucx_perftest is the
// one of the UCX hetpar links (HETPAR_UCX_PERFTEST), so both run the same UCX.
#include <ATen/ATen.h>
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/wait.h>
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
#include "common/transport/ucx/ucx_transport.h"

namespace hetpar::bench {
namespace {

using transport::ConstBuffer;
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
  // worker mode
  std::string role;
  int rank = -1;
  std::string dir;

  bool Skipped(const std::string& what) const {
    return std::find(skip.begin(), skip.end(), what) != skip.end();
  }
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

bool WriteFileAtomically(const std::string& path, const std::string& bytes) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary);
    out << bytes;
    if (!out) return false;
  }
  return std::rename(tmp.c_str(), path.c_str()) == 0;
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

// ------------------------------------------------------------------------------------------
// hetpar worker

class HetparPair {
 public:
  static absl::StatusOr<std::unique_ptr<HetparPair>> Create(const Config& config) {
    transport::ucx::UcxTransport::Options options;
    options.name = absl::StrCat("bench r", config.rank);
    options.same_host_zero_copy = config.zero_copy;
    options.zero_copy_threshold = config.zero_copy_threshold;
    auto transport = transport::ucx::UcxTransport::Create(options);
    if (!transport.ok()) return transport.status();
    auto pair = std::unique_ptr<HetparPair>(new HetparPair(config));
    pair->transport_ = std::move(transport).value();
    const std::string mine = absl::StrCat(config.dir, "/hetpar.", config.rank, ".addr");
    const std::string theirs = absl::StrCat(config.dir, "/hetpar.", 1 - config.rank, ".addr");
    if (!WriteFileAtomically(mine, pair->transport_->LocalAddress())) {
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
  // choose the directions of this rank. Returns the seconds from start to the peer's ack.
  absl::StatusOr<double> Run(size_t size, int64_t count, bool send, bool recv) {
    Buffers(size);
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
        auto op = transport_->Recv(peer_, kDataTag,
                                   MutableBuffer::Host(in_[received % window_].data(), size));
        if (!op.ok()) return op.status();
        recvs.push_back(std::move(op).value());
        ++received;
      }
      while (sent < send_total && static_cast<int>(sends.size()) < window_) {
        auto op =
            transport_->Send(peer_, kDataTag, ConstBuffer::Host(out_[sent % window_].data(), size));
        if (!op.ok()) return op.status();
        sends.push_back(std::move(op).value());
        ++sent;
      }
      // Wait for the oldest receive, then the oldest send (the same discipline as the Gloo
      // baseline); the progress thread moves every posted operation meanwhile.
      for (auto* oldest : {&recvs, &sends}) {
        if (oldest->empty()) continue;
        if (absl::Status s = oldest->front()->Wait(absl::Now() + kWait); !s.ok()) return s;
        oldest->pop_front();
      }
    }
    auto done = transport_->Send(peer_, kAckTag, ConstBuffer::Host(&ack_out, 1));
    if (!done.ok()) return done.status();
    if (absl::Status s = (*ack)->Wait(absl::Now() + kWait); !s.ok()) return s;
    const double seconds = Seconds(std::chrono::steady_clock::now() - start);
    if (absl::Status s = (*done)->Wait(absl::Now() + kWait); !s.ok()) return s;
    return seconds;
  }

 private:
  explicit HetparPair(const Config& config) : window_(config.window) {}

  void Buffers(size_t size) {
    if (!out_.empty() && out_[0].size() == size) return;
    out_.assign(window_, std::vector<uint8_t>(size));
    in_.assign(window_, std::vector<uint8_t>(size));
    for (auto& buffer : out_) {
      for (size_t i = 0; i < size; ++i) buffer[i] = static_cast<uint8_t>(i * 7);
    }
  }

  std::unique_ptr<transport::ucx::UcxTransport> transport_;
  PeerId peer_ = 0;
  int window_;
  std::vector<std::vector<uint8_t>> out_, in_;
};

absl::Status RunHetparWorker(const Config& config) {
  auto pair = HetparPair::Create(config);
  if (!pair.ok()) return pair.status();
  const bool sender = config.rank == 0;
  for (size_t size : config.sizes) {
    const int64_t count = Messages(config, size);
    auto warm = (*pair)->Run(size, count / 4 + 1, sender, !sender);
    if (!warm.ok()) return warm.status();
    double best_oneway = 0, best_bidir = 0;
    for (int rep = 0; rep < config.reps; ++rep) {
      auto oneway = (*pair)->Run(size, count, sender, !sender);
      if (!oneway.ok()) return oneway.status();
      best_oneway = std::max(best_oneway, Gbps(double(size) * count, *oneway));
      auto bidir = (*pair)->Run(size, count, true, true);
      if (!bidir.ok()) return bidir.status();
      best_bidir = std::max(best_bidir, Gbps(2.0 * size * count, *bidir));
    }
    if (config.rank == 0) Report(size, best_oneway, best_bidir);
  }
  return absl::OkStatus();
}

// ------------------------------------------------------------------------------------------
// Gloo worker (libtorch c10d). c10::Error is translated to Status here and only here.

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

// Waits for the child until `timeout`, then kills it. Returns its output.
absl::StatusOr<std::string> Finish(const Child& child, absl::Duration timeout,
                                   const std::string& what) {
  const absl::Time deadline = absl::Now() + timeout;
  int status = 0;
  while (true) {
    pid_t done = waitpid(child.pid, &status, WNOHANG);
    if (done == child.pid) break;
    if (absl::Now() >= deadline) {
      kill(child.pid, SIGKILL);
      waitpid(child.pid, &status, 0);
      return absl::DeadlineExceededError(absl::StrCat(what, " did not finish within ",
                                                      absl::FormatDuration(timeout), "; output:\n",
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
    auto child = Spawn(
        {self, "--role", role, "--rank", std::to_string(rank), "--dir", dir, "--sizes", sizes,
         "--budget", std::to_string(config.budget), "--reps", std::to_string(config.reps),
         "--window", std::to_string(config.window), "--zero-copy", config.zero_copy ? "on" : "off",
         "--zero-copy-threshold", std::to_string(config.zero_copy_threshold)},
        absl::StrCat(dir, "/", role, ".", rank, ".out"));
    if (!child.ok()) return child.status();
    children.push_back(*child);
  }
  PairResults results;
  absl::Status first_error;
  for (int rank = 0; rank < 2; ++rank) {
    auto output = Finish(children[rank], absl::Minutes(10), absl::StrCat(role, " rank ", rank));
    if (!output.ok()) {
      if (first_error.ok()) first_error = output.status();
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
  if (!first_error.ok()) return first_error;
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

// One ucx_perftest tag_bw run; returns GB/s from the client's final "overall" bandwidth
// (ucx_perftest prints MB/s with MB = 2^20 bytes).
absl::StatusOr<double> UcxPerftest(size_t size, int64_t count, bool error_handling,
                                   const std::string& dir) {
  for (int attempt = 0; attempt < 3; ++attempt) {
    const std::string port = std::to_string(FreePort());
    const std::string n = std::to_string(count), s = std::to_string(size);
    const std::string warmup = std::to_string(std::max<int64_t>(2, count / 4));
    // The ucx_perftest of the UCX hetpar links, its own libraries first (a wheel's binaries would
    // otherwise find the system's UCX of the same soname).
    const char* library_path = std::getenv("LD_LIBRARY_PATH");
    std::vector<std::string> server_argv = {
        "/usr/bin/env",
        absl::StrCat("LD_LIBRARY_PATH=", HETPAR_UCX_LIBDIR,
                     library_path != nullptr && *library_path != '\0'
                         ? absl::StrCat(":", library_path)
                         : std::string()),
        HETPAR_UCX_PERFTEST,
        "-t",
        "tag_bw",
        "-s",
        s,
        "-n",
        n,
        "-w",
        warmup,
        "-p",
        port,
        "-f"};
    if (error_handling) server_argv.push_back("-e");
    std::vector<std::string> client_argv = server_argv;
    client_argv.insert(client_argv.begin() + 3, "127.0.0.1");
    auto server = Spawn(server_argv, dir + "/perftest.server.out");
    if (!server.ok()) return server.status();
    absl::SleepFor(absl::Milliseconds(300));
    auto client = Spawn(client_argv, dir + "/perftest.client.out");
    if (!client.ok()) return client.status();
    auto client_output = Finish(*client, absl::Minutes(5), "ucx_perftest client");
    auto server_output = Finish(*server, absl::Seconds(30), "ucx_perftest server");
    if (!client_output.ok() || !server_output.ok()) continue;  // e.g. the port was taken
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
  return absl::UnavailableError("ucx_perftest failed 3 times; see " + dir + "/perftest.*.out");
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

std::string Json(double value) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%.3f", value);
  return buffer;
}

int RunDriver(const std::string& self, const Config& config) {
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
  // Every system is measured once per repetition, size by size, so all see the same load.
  for (size_t size : config.sizes) {
    const int64_t count = Messages(config, size);
    Config one = config;
    one.sizes = {size};
    one.reps = 1;
    double h = 0, hb = 0, g = 0, gb = 0, ucx_raw = 0, ucx_raw_peer = 0;
    for (int rep = 0; rep < config.reps; ++rep) {
      for (const char* role : {"hetpar", "gloo"}) {
        if (config.Skipped(role)) continue;
        clear();
        auto results = RunPair(self, role, one, dir);
        if (!results.ok()) {
          std::cerr << "transport_bw: " << role << " pair: " << results.status() << "\n";
          return 1;
        }
        const auto [oneway, bidir] = (*results)[size];
        double& best_oneway = std::string(role) == "hetpar" ? h : g;
        double& best_bidir = std::string(role) == "hetpar" ? hb : gb;
        best_oneway = std::max(best_oneway, oneway);
        best_bidir = std::max(best_bidir, bidir);
      }
      if (!config.Skipped("ucx_raw")) {
        for (bool error_handling : {false, true}) {
          auto gbps = UcxPerftest(size, count, error_handling, dir);
          if (!gbps.ok()) {
            std::cerr << "transport_bw: " << gbps.status() << "\n";
            return 1;
          }
          double& best = error_handling ? ucx_raw_peer : ucx_raw;
          best = std::max(best, *gbps);
        }
      }
    }
    const double memcpy_gbps = config.Skipped("memcpy") ? 0 : MemcpyGbps(size, count, config.reps);
    std::cout << "{\"size\": " << size << ", \"hetpar_gbps\": " << Json(h)
              << ", \"ucx_raw_gbps\": " << Json(ucx_raw) << ", \"gloo_gbps\": " << Json(g)
              << ", \"memcpy_gbps\": " << Json(memcpy_gbps)
              << ", \"hetpar_bidir_gbps\": " << Json(hb) << ", \"gloo_bidir_gbps\": " << Json(gb)
              << ", \"ucx_raw_peer_gbps\": " << Json(ucx_raw_peer)
              << ", \"hetpar_vs_ucx_raw\": " << Json(ucx_raw > 0 ? h / ucx_raw : 0)
              << ", \"hetpar_vs_gloo\": " << Json(g > 0 ? h / g : 0) << "}" << std::endl;
  }
  for (const char* file :
       {"hetpar.0.addr", "hetpar.1.addr", "hetpar.0.out", "hetpar.1.out", "gloo.0.out",
        "gloo.1.out", "gloo.store", "perftest.server.out", "perftest.client.out"}) {
    std::remove(absl::StrCat(dir, "/", file).c_str());
  }
  rmdir(dir.c_str());
  return 0;
}

absl::StatusOr<Config> ParseFlags(int argc, char** argv) {
  Config config;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
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
