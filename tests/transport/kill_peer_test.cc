// Peer death with real processes: a peer process is killed with SIGKILL in the middle of a
// 64 MiB transfer. The surviving side (this test process) must see its wait fail with
// kUnavailable naming the peer within twice its deadline, never hang, and after Disconnect and
// destruction hold no more file descriptors or threads than before.
#include <dirent.h>
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/atomic_file.h"
#include "common/transport/inproc/inproc_transport.h"
#include "common/transport/ucx/ucx_transport.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/transport/fault_message.h"
#include "tests/util/subprocess.h"

namespace hetpar::transport {
namespace {

using ::hetpar::testing::ChildProcess;
using ::testing::HasSubstr;

constexpr size_t kMessageSize = size_t{64} << 20;
// The deadline each wait gets; the failure must be reported within twice this.
constexpr absl::Duration kDeadline = absl::Seconds(3);

int CountEntries(const char* path) {
  DIR* dir = opendir(path);
  if (dir == nullptr) return -1;
  int count = 0;
  while (dirent* entry = readdir(dir)) {
    if (entry->d_name[0] != '.') ++count;
  }
  closedir(dir);
  return count - (std::string(path) == "/proc/self/fd" ? 1 : 0);  // opendir's own fd
}

struct ResourceCount {
  int fds = CountEntries("/proc/self/fd");
  int threads = CountEntries("/proc/self/task");
};

// fd -> what it refers to ("socket:[123]", "/dev/shm/ucx_shm_posix_...", "anon_inode:[timerfd]").
std::map<int, std::string> OpenFds() {
  std::map<int, std::string> fds;
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return fds;
  const int own = dirfd(dir);
  while (dirent* entry = readdir(dir)) {
    if (entry->d_name[0] == '.') continue;
    const int fd = std::atoi(entry->d_name);
    if (fd == own) continue;
    char target[512];
    const ssize_t n = readlink(absl::StrCat("/proc/self/fd/", fd).c_str(), target, sizeof(target));
    fds[fd] = n > 0 ? std::string(target, n) : "?";
  }
  closedir(dir);
  return fds;
}

// The fds in `after` that are not in `before`, as "fd -> target" lines.
std::vector<std::string> NewFds(const std::map<int, std::string>& before,
                                const std::map<int, std::string>& after) {
  std::vector<std::string> added;
  for (const auto& [fd, target] : after) {
    auto it = before.find(fd);
    if (it == before.end() || it->second != target)
      added.push_back(absl::StrCat(fd, " -> ", target));
  }
  return added;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream content;
  content << in.rdbuf();
  return content.str();
}

bool WaitForLogLine(const std::string& path, const std::string& line, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (ReadFile(path).find(line) != std::string::npos) return true;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return false;
}

class KillPeerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/hetpar-transport-fault-XXXXXX";
    ASSERT_NE(mkdtemp(pattern), nullptr);
    dir_ = pattern;
    // UCX sets up process-wide state (its async thread, topology caches) on first use; count
    // resources after one transport has come and gone so only per-connection leaks show.
    ucx::UcxTransport::Options options;
    options.name = "warm-up";
    ASSERT_TRUE(ucx::UcxTransport::Create(options).ok());
  }

  void TearDown() override {
    for (const char* file : {"peer.addr", "test.addr", "peer.log", "test.addr.tmp"}) {
      std::remove(absl::StrCat(dir_, "/", file).c_str());
    }
    rmdir(dir_.c_str());
  }

  // Creates this side's transport, starts the peer process in `role` and connects both ways.
  void StartPeer(const std::string& role) {
    ucx::UcxTransport::Options options;
    options.name = "survivor";
    auto transport = ucx::UcxTransport::Create(options);
    ASSERT_TRUE(transport.ok()) << transport.status();
    transport_ = std::move(transport).value();
    idle_ = ResourceCount();
    idle_fds_ = OpenFds();
    ASSERT_TRUE(WriteFileAtomically(dir_ + "/test.addr", transport_->LocalAddress()).ok());
    auto child = ChildProcess::Start({HETPAR_TRANSPORT_FAULT_PEER, "--role", role, "--size",
                                      std::to_string(kMessageSize), "--dir", dir_},
                                     dir_ + "/peer.log");
    ASSERT_TRUE(child.ok()) << child.status();
    child_ = std::make_unique<ChildProcess>(std::move(child).value());
    std::string peer_address;
    ASSERT_TRUE(testing::WaitForFile(dir_ + "/peer.addr", absl::Seconds(30), &peer_address))
        << "the peer process wrote no address; its log:\n"
        << ReadFile(dir_ + "/peer.log");
    auto peer = transport_->Connect(peer_address, absl::Now() + absl::Seconds(30));
    ASSERT_TRUE(peer.ok()) << peer.status();
    peer_ = *peer;
  }

  void KillPeer() {
    ASSERT_TRUE(child_->Signal(SIGKILL));
    auto code = child_->Wait(10);
    ASSERT_TRUE(code.ok()) << code.status();
    EXPECT_EQ(*code, 128 + SIGKILL);
  }

  // Checks the failed wait and the clean-up: Disconnect, then resources as before.
  void ExpectPeerFailureAndCleanUp(const absl::Status& status, absl::Duration waited) {
    EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr("peer 'fault-peer'"));
    EXPECT_LT(waited, 2 * kDeadline) << status;
    std::cout << "peer failure reported " << absl::FormatDuration(waited)
              << " after the kill: " << status << std::endl;
    // Later operations fail too, at once.
    std::vector<uint8_t> small(16);
    auto later = transport_->Recv(peer_, kFaultTag, MutableBuffer::Host(small.data(), 16));
    EXPECT_EQ(later.status().code(), absl::StatusCode::kUnavailable);
    ASSERT_TRUE(transport_->Disconnect(peer_, absl::Now() + kDeadline).ok());
    // Every socket and shared-memory mapping of the connection is gone. UCX's async timer
    // (one timerfd per process, made when the first endpoint arms a keepalive timer) may
    // remain until the transport is destroyed; nothing else may.
    std::vector<std::string> added = NewFds(idle_fds_, OpenFds());
    added.erase(std::remove_if(added.begin(), added.end(),
                               [](const std::string& fd) {
                                 return fd.find("anon_inode:[timerfd]") != std::string::npos;
                               }),
                added.end());
    EXPECT_THAT(added, ::testing::IsEmpty()) << "file descriptors leaked by the connection";
    EXPECT_EQ(ResourceCount().threads, idle_.threads) << "threads leaked by the connection";
    transport_.reset();
  }

  std::string dir_;
  std::unique_ptr<ucx::UcxTransport> transport_;
  std::unique_ptr<ChildProcess> child_;
  PeerId peer_ = 0;
  ResourceCount idle_;
  std::map<int, std::string> idle_fds_;
};

TEST_F(KillPeerTest, SenderKilledDuringALargeTransfer) {
  const ResourceCount before;
  StartPeer("send");
  std::vector<uint8_t> buffer(kMessageSize);
  // Message 0 arrives whole.
  auto first = transport_->Recv(peer_, kFaultTag, MutableBuffer::Host(buffer.data(), kMessageSize));
  ASSERT_TRUE(first.ok());
  ASSERT_TRUE((*first)->Wait(absl::Now() + absl::Seconds(30)).ok());
  EXPECT_EQ(FirstBadByte(0, buffer.data(), kMessageSize), -1);
  // Both processes are on this host: the bytes came straight out of the peer's buffer.
  EXPECT_EQ(transport_->stats().zero_copy_receives, 1u);
  // The peer is already sending message 1: kill it a few milliseconds into that transfer, then
  // keep receiving until the failure shows (a message may have been complete at the kill).
  auto next = transport_->Recv(peer_, kFaultTag, MutableBuffer::Host(buffer.data(), kMessageSize));
  ASSERT_TRUE(next.ok());
  absl::SleepFor(absl::Milliseconds(5));
  const absl::Time killed = absl::Now();
  KillPeer();
  absl::Status status;
  absl::Duration waited;  // from the kill to the failure report
  for (int attempt = 0; attempt < 3; ++attempt) {
    status = (*next)->Wait(killed + 2 * kDeadline);  // the bound the failure must meet
    waited = absl::Now() - killed;
    if (!status.ok()) break;
    auto again =
        transport_->Recv(peer_, kFaultTag, MutableBuffer::Host(buffer.data(), kMessageSize));
    if (!again.ok()) {
      status = again.status();
      waited = absl::Now() - killed;
      break;
    }
    next = std::move(again);
  }
  next->reset();
  first->reset();
  ExpectPeerFailureAndCleanUp(status, waited);
  const ResourceCount after;
  EXPECT_EQ(after.fds, before.fds) << "file descriptors leaked by the transport";
  EXPECT_EQ(after.threads, before.threads) << "threads leaked by the transport";
}

TEST_F(KillPeerTest, ReceiverKilledDuringALargeTransfer) {
  const ResourceCount before;
  StartPeer("recv");
  std::vector<uint8_t> buffer(kMessageSize);
  FillMessage(0, buffer.data(), kMessageSize);
  auto first = transport_->Send(peer_, kFaultTag, ConstBuffer::Host(buffer.data(), kMessageSize));
  ASSERT_TRUE(first.ok());
  ASSERT_TRUE((*first)->Wait(absl::Now() + absl::Seconds(30)).ok());
  // The peer checked every byte of message 0.
  ASSERT_TRUE(WaitForLogLine(dir_ + "/peer.log", "verified message 0", absl::Seconds(30)))
      << ReadFile(dir_ + "/peer.log");
  std::vector<uint8_t> second(kMessageSize);
  FillMessage(1, second.data(), kMessageSize);
  auto next = transport_->Send(peer_, kFaultTag, ConstBuffer::Host(second.data(), kMessageSize));
  ASSERT_TRUE(next.ok());
  absl::SleepFor(absl::Milliseconds(5));
  const absl::Time killed = absl::Now();
  KillPeer();
  absl::Status status;
  absl::Duration waited;  // from the kill to the failure report
  for (int attempt = 0; attempt < 3; ++attempt) {
    status = (*next)->Wait(killed + 2 * kDeadline);  // the bound the failure must meet
    waited = absl::Now() - killed;
    if (!status.ok()) break;
    auto again = transport_->Send(peer_, kFaultTag, ConstBuffer::Host(second.data(), kMessageSize));
    if (!again.ok()) {
      status = again.status();
      waited = absl::Now() - killed;
      break;
    }
    next = std::move(again);
  }
  next->reset();
  first->reset();
  ExpectPeerFailureAndCleanUp(status, waited);
  const ResourceCount after;
  EXPECT_EQ(after.fds, before.fds) << "file descriptors leaked by the transport";
  EXPECT_EQ(after.threads, before.threads) << "threads leaked by the transport";
}

// The in-process counterpart: a rank's transport is destroyed while it has a 64 MiB message in
// flight to the survivor, and while the survivor's 64 MiB message to it waits for its receive.
TEST(InprocPeerDeathTest, PeerDestroyedWithLargeTransfersInFlight) {
  const ResourceCount before;
  std::vector<uint8_t> to_survivor(kMessageSize), to_doomed(kMessageSize), in(kMessageSize);
  FillMessage(5, to_survivor.data(), kMessageSize);
  FillMessage(6, to_doomed.data(), kMessageSize);
  {
    auto survivor = inproc::InprocTransport::Create({"survivor"});
    auto doomed = inproc::InprocTransport::Create({"doomed"});
    ASSERT_TRUE(survivor.ok() && doomed.ok());
    auto doomed_at_survivor =
        (*survivor)->Connect((*doomed)->LocalAddress(), absl::Now() + kDeadline);
    auto survivor_at_doomed =
        (*doomed)->Connect((*survivor)->LocalAddress(), absl::Now() + kDeadline);
    ASSERT_TRUE(doomed_at_survivor.ok() && survivor_at_doomed.ok());
    // Message 5 reaches the survivor whole, copied by the doomed rank's thread.
    auto first = (*survivor)->Recv(*doomed_at_survivor, kFaultTag,
                                   MutableBuffer::Host(in.data(), kMessageSize));
    ASSERT_TRUE(first.ok());
    std::thread sender([&] {
      auto send = (*doomed)->Send(*survivor_at_doomed, kFaultTag,
                                  ConstBuffer::Host(to_survivor.data(), kMessageSize));
      ASSERT_TRUE(send.ok());
      EXPECT_TRUE((*send)->Wait(absl::Now() + kDeadline).ok());
    });
    sender.join();
    ASSERT_TRUE((*first)->Wait(absl::Now() + kDeadline).ok());
    EXPECT_EQ(FirstBadByte(5, in.data(), kMessageSize), -1);
    // Then a receive and a large send are pending with the doomed rank when it dies.
    auto pending_recv = (*survivor)->Recv(*doomed_at_survivor, kFaultTag,
                                          MutableBuffer::Host(in.data(), kMessageSize));
    auto pending_send = (*survivor)->Send(*doomed_at_survivor, kFaultTag,
                                          ConstBuffer::Host(to_doomed.data(), kMessageSize));
    ASSERT_TRUE(pending_recv.ok() && pending_send.ok());
    doomed->reset();
    for (auto* op : {&*pending_recv, &*pending_send}) {
      const absl::Time start = absl::Now();
      absl::Status status = (*op)->Wait(start + kDeadline);
      EXPECT_LT(absl::Now() - start, 2 * kDeadline);
      EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
      EXPECT_THAT(std::string(status.message()), HasSubstr("peer 'doomed'"));
    }
    auto later =
        (*survivor)->Recv(*doomed_at_survivor, kFaultTag, MutableBuffer::Host(in.data(), 16));
    EXPECT_EQ(later.status().code(), absl::StatusCode::kUnavailable);
    EXPECT_TRUE((*survivor)->Disconnect(*doomed_at_survivor, absl::Now() + kDeadline).ok());
  }
  const ResourceCount after;
  EXPECT_EQ(after.fds, before.fds);
  EXPECT_EQ(after.threads, before.threads);
}

}  // namespace
}  // namespace hetpar::transport
