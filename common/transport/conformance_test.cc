// The conformance suite every data-plane backend must pass: one parameterised suite over
// backends x message sizes x peer counts. Ranks are transports in this process (for UCX each
// has its own context, worker and progress thread, talking over UCX's loopback transports).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/transport/factory.h"
#include "common/transport/nccl/nccl_transport.h"
#include "common/transport/transport.h"
#include "common/transport/ucx/ucx_transport.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hetpar::transport {
namespace {

using ::testing::HasSubstr;

constexpr absl::Duration kWait = absl::Seconds(30);
constexpr size_t kMiB = size_t{1} << 20;

// The backends under test. UCX runs twice: with its same-host zero copy (large messages are
// copied straight out of the sender's buffer) and without (UCX's own protocols carry them).
// nccl_protocol is the NCCL backend's tag-matching protocol with host memory routed through it
// and its bytes moved over UCX's service tags instead of NCCL (no GPU needed).
enum class Flavor { kInproc, kUcx, kUcxWithoutZeroCopy, kNcclProtocol };

std::string FlavorName(Flavor flavor) {
  switch (flavor) {
    case Flavor::kInproc:
      return "inproc";
    case Flavor::kUcx:
      return "ucx";
    case Flavor::kUcxWithoutZeroCopy:
      return "ucx_nozerocopy";
    case Flavor::kNcclProtocol:
      return "nccl_protocol";
  }
  return "unknown";
}

absl::StatusOr<std::unique_ptr<Transport>> Create(Flavor flavor, const std::string& name) {
  switch (flavor) {
    case Flavor::kInproc:
      return CreateTransport(Backend::kInproc, name);
    case Flavor::kUcx:
      return CreateTransport(Backend::kUcx, name);
    case Flavor::kUcxWithoutZeroCopy: {
      ucx::UcxTransport::Options options;
      options.name = name;
      options.same_host_zero_copy = false;
      auto transport = ucx::UcxTransport::Create(options);
      if (!transport.ok()) return transport.status();
      return std::unique_ptr<Transport>(std::move(transport).value());
    }
    case Flavor::kNcclProtocol: {
      ucx::UcxTransport::Options options;
      options.name = name;
      auto ucx = ucx::UcxTransport::Create(options);
      if (!ucx.ok()) return ucx.status();
      nccl::NcclTransport::Options nccl_options;
      nccl_options.host_through_protocol_for_testing = true;
      auto transport = nccl::NcclTransport::Wrap(std::move(ucx).value(), nccl_options);
      if (!transport.ok()) return transport.status();
      return std::unique_ptr<Transport>(std::move(transport).value());
    }
  }
  return absl::InvalidArgumentError("unknown flavor");
}

struct Param {
  Flavor flavor;
  size_t size;  // message size in bytes
  int peers;    // number of ranks
};

void PrintTo(const Param& param, std::ostream* os) {
  *os << FlavorName(param.flavor) << ", " << param.size << " B, " << param.peers << " ranks";
}

std::string ParamName(const ::testing::TestParamInfo<Param>& info) {
  return absl::StrCat(FlavorName(info.param.flavor), "_", info.param.size, "B_", info.param.peers,
                      "ranks");
}

// Deterministic bytes of message `seed`, different for every (seed, offset).
void Fill(uint64_t seed, uint8_t* data, size_t size) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  size_t i = 0;
  for (; i + 8 <= size; i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::memcpy(data + i, &x, 8);
  }
  for (; i < size; ++i) data[i] = static_cast<uint8_t>((x >> (8 * (i % 8))) ^ i ^ seed);
}

std::vector<uint8_t> Message(uint64_t seed, size_t size) {
  std::vector<uint8_t> bytes(size);
  Fill(seed, bytes.data(), size);
  return bytes;
}

// Compares every byte; names the first mismatch.
::testing::AssertionResult SameBytes(const std::vector<uint8_t>& expected,
                                     const std::vector<uint8_t>& actual, const std::string& what) {
  if (expected.size() != actual.size()) {
    return ::testing::AssertionFailure()
           << what << ": size " << actual.size() << ", expected " << expected.size();
  }
  if (std::memcmp(expected.data(), actual.data(), expected.size()) == 0) {
    return ::testing::AssertionSuccess();
  }
  for (size_t i = 0; i < expected.size(); ++i) {
    if (expected[i] != actual[i]) {
      return ::testing::AssertionFailure() << what << ": mismatch at byte " << i << ": got "
                                           << int{actual[i]} << ", expected " << int{expected[i]};
    }
  }
  return ::testing::AssertionFailure() << what << ": memcmp and byte loop disagree";
}

uint64_t Seed(int src, int dst, uint64_t tag, int seq) {
  return (uint64_t(src) << 48) ^ (uint64_t(dst) << 40) ^ (tag << 16) ^ uint64_t(seq);
}

class ConformanceTest : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override {
    const Param& p = GetParam();
    for (int i = 0; i < p.peers; ++i) {
      auto transport = Create(p.flavor, absl::StrCat("rank", i));
      ASSERT_TRUE(transport.ok()) << transport.status();
      ranks_.push_back(std::move(transport).value());
    }
    peer_.assign(p.peers, std::vector<PeerId>(p.peers, 0));
    const absl::Time deadline = absl::Now() + kWait;
    for (int i = 0; i < p.peers; ++i) {
      for (int j = 0; j < p.peers; ++j) {
        if (i == j) continue;
        auto peer = ranks_[i]->Connect(ranks_[j]->LocalAddress(), deadline);
        ASSERT_TRUE(peer.ok()) << peer.status();
        peer_[i][j] = *peer;
      }
    }
  }

  absl::Time Deadline() const { return absl::Now() + kWait; }

  // Sends one message i -> j and checks every byte on arrival.
  // Also checks completed_at: unset while pending, then a time between the post and the wait.
  void ExpectRoundTrip(int i, int j, Tag tag, size_t size, uint64_t seed) {
    std::vector<uint8_t> out = Message(seed, size), in(size, 0xEE);
    const absl::Time posted = absl::Now();
    auto recv = ranks_[j]->Recv(peer_[j][i], tag, MutableBuffer::Host(in.data(), in.size()));
    ASSERT_TRUE(recv.ok()) << recv.status();
    EXPECT_EQ((*recv)->completed_at(), absl::InfinitePast());
    auto send = ranks_[i]->Send(peer_[i][j], tag, ConstBuffer::Host(out.data(), out.size()));
    ASSERT_TRUE(send.ok()) << send.status();
    ASSERT_TRUE((*recv)->Wait(Deadline()).ok());
    ASSERT_TRUE((*send)->Wait(Deadline()).ok());
    const absl::Time waited = absl::Now();
    EXPECT_EQ((*recv)->bytes(), size);
    for (const auto* op : {&*recv, &*send}) {
      EXPECT_GE((*op)->completed_at(), posted);
      EXPECT_LE((*op)->completed_at(), waited);
    }
    EXPECT_TRUE(SameBytes(out, in, absl::StrCat("rank", i, "->rank", j, " tag ", tag)));
  }

  std::vector<std::unique_ptr<Transport>> ranks_;
  std::vector<std::vector<PeerId>> peer_;  // peer_[i][j]: rank j as seen from rank i
};

// Every rank sends `count` messages to every other rank, from its own thread, all posted before
// any wait (receives first, then sends); every byte of every message is checked.
TEST_P(ConformanceTest, AllToAllEveryByteArrives) {
  const Param& p = GetParam();
  const size_t size = p.size;
  const int count = size >= 16 * kMiB ? 1 : size >= kMiB ? 2 : 4;
  std::vector<std::thread> threads;
  for (int me = 0; me < p.peers; ++me) {
    threads.emplace_back([&, me] {
      std::vector<std::vector<uint8_t>> outs, ins, expected;
      std::vector<std::unique_ptr<Operation>> recvs, sends;
      std::vector<std::string> names;
      for (int other = 0; other < p.peers; ++other) {
        if (other == me) continue;
        for (int seq = 0; seq < count; ++seq) {
          const Tag tag = 100 + seq;
          ins.emplace_back(size, 0xEE);
          expected.push_back(Message(Seed(other, me, tag, seq), size));
          names.push_back(absl::StrCat("rank", other, "->rank", me, " tag ", tag));
          auto recv =
              ranks_[me]->Recv(peer_[me][other], tag, MutableBuffer::Host(ins.back().data(), size));
          ASSERT_TRUE(recv.ok()) << recv.status();
          recvs.push_back(std::move(recv).value());
        }
      }
      outs.reserve((p.peers - 1) * count);
      for (int other = 0; other < p.peers; ++other) {
        if (other == me) continue;
        for (int seq = 0; seq < count; ++seq) {
          const Tag tag = 100 + seq;
          outs.push_back(Message(Seed(me, other, tag, seq), size));
          auto send =
              ranks_[me]->Send(peer_[me][other], tag, ConstBuffer::Host(outs.back().data(), size));
          ASSERT_TRUE(send.ok()) << send.status();
          sends.push_back(std::move(send).value());
        }
      }
      const absl::Time deadline = Deadline();
      for (size_t k = 0; k < recvs.size(); ++k) {
        ASSERT_TRUE(recvs[k]->Wait(deadline).ok()) << names[k];
        EXPECT_EQ(recvs[k]->bytes(), size) << names[k];
        EXPECT_TRUE(SameBytes(expected[k], ins[k], names[k]));
      }
      for (auto& send : sends) {
        absl::Status status = send->Wait(deadline);
        EXPECT_TRUE(status.ok()) << status;
        EXPECT_EQ(send->bytes(), size);
      }
    });
  }
  for (auto& thread : threads) thread.join();
}

// Messages of one sender with one tag arrive in send order, also when interleaved with another
// tag and when some arrive before their receive is posted.
TEST_P(ConformanceTest, MessagesOfOneTagStayInOrder) {
  const Param& p = GetParam();
  const size_t size = std::max<size_t>(p.size, 8);
  const int per_tag = size >= 16 * kMiB ? 2 : 6;
  const int src = p.peers - 1, dst = 0;
  const Tag tags[2] = {7, 9};
  std::vector<std::vector<uint8_t>> outs;
  std::vector<std::unique_ptr<Operation>> sends;
  std::vector<std::vector<uint8_t>> ins(2 * per_tag, std::vector<uint8_t>(size, 0));
  std::vector<std::unique_ptr<Operation>> recvs(2 * per_tag);
  // First half of the receives is posted before the sends, the rest after.
  auto post_recv = [&](int k) {
    const Tag tag = tags[k % 2];
    auto recv = ranks_[dst]->Recv(peer_[dst][src], tag, MutableBuffer::Host(ins[k].data(), size));
    ASSERT_TRUE(recv.ok()) << recv.status();
    recvs[k] = std::move(recv).value();
  };
  for (int k = 0; k < per_tag; ++k) post_recv(k);
  outs.reserve(2 * per_tag);
  for (int k = 0; k < 2 * per_tag; ++k) {
    const Tag tag = tags[k % 2];
    outs.push_back(Message(Seed(src, dst, tag, k / 2), size));
    auto send =
        ranks_[src]->Send(peer_[src][dst], tag, ConstBuffer::Host(outs.back().data(), size));
    ASSERT_TRUE(send.ok()) << send.status();
    sends.push_back(std::move(send).value());
  }
  for (int k = per_tag; k < 2 * per_tag; ++k) post_recv(k);
  ASSERT_TRUE(WaitAll(recvs, Deadline()).ok());
  ASSERT_TRUE(WaitAll(sends, Deadline()).ok());
  for (int k = 0; k < 2 * per_tag; ++k) {
    // Receive k is the (k / 2)-th receive of tag k % 2, so it must hold that tag's (k / 2)-th
    // message.
    EXPECT_TRUE(SameBytes(outs[k], ins[k], absl::StrCat("tag ", tags[k % 2], " message ", k / 2)));
  }
}

// Many operations in flight at once between two ranks, receives posted in reverse order of the
// sends, over many tags and repeated tags.
TEST_P(ConformanceTest, ManyOutstandingOperations) {
  const Param& p = GetParam();
  const size_t size = p.size;
  const int count =
      static_cast<int>(std::clamp<size_t>(64 * kMiB / std::max<size_t>(size, 1), 4, 256));
  std::vector<std::vector<uint8_t>> outs(count), ins(count, std::vector<uint8_t>(size, 0xEE));
  std::vector<std::unique_ptr<Operation>> recvs(count), sends(count);
  auto tag_of = [](int k) { return Tag(1000 + k % 16); };
  // Receive k is the (k / 16)-th of its tag; post them in reverse order of tag groups but in
  // order within a tag.
  for (int group = 15; group >= 0; --group) {
    for (int k = group; k < count; k += 16) {
      auto recv = ranks_[1]->Recv(peer_[1][0], tag_of(k), MutableBuffer::Host(ins[k].data(), size));
      ASSERT_TRUE(recv.ok()) << recv.status();
      recvs[k] = std::move(recv).value();
    }
  }
  for (int k = 0; k < count; ++k) {
    outs[k] = Message(Seed(0, 1, tag_of(k), k), size);
    auto send = ranks_[0]->Send(peer_[0][1], tag_of(k), ConstBuffer::Host(outs[k].data(), size));
    ASSERT_TRUE(send.ok()) << send.status();
    sends[k] = std::move(send).value();
  }
  ASSERT_TRUE(WaitAll(recvs, Deadline()).ok());
  ASSERT_TRUE(WaitAll(sends, Deadline()).ok());
  for (int k = 0; k < count; ++k) {
    EXPECT_EQ(recvs[k]->bytes(), size);
    EXPECT_TRUE(SameBytes(outs[k], ins[k], absl::StrCat("message ", k, " tag ", tag_of(k))));
  }
}

// Two ranks stream messages at each other at the same time, each keeping a window of sends and
// receives in flight and waiting on the oldest, the way a pipeline of waves runs.
TEST_P(ConformanceTest, BothDirectionsAtOnceWithAWindow) {
  const Param& p = GetParam();
  const size_t size = p.size;
  const int count =
      static_cast<int>(std::clamp<size_t>(128 * kMiB / std::max<size_t>(size, 1), 2, 64));
  constexpr int kWindow = 4;
  std::vector<std::thread> threads;
  for (int me = 0; me < 2; ++me) {
    threads.emplace_back([&, me] {
      const int other = 1 - me;
      std::vector<std::vector<uint8_t>> outs(kWindow, std::vector<uint8_t>(size));
      std::vector<std::vector<uint8_t>> ins(kWindow, std::vector<uint8_t>(size));
      std::deque<std::pair<int, std::unique_ptr<Operation>>> sends, recvs;
      int sent = 0, received = 0;
      while (sent < count || received < count || !sends.empty() || !recvs.empty()) {
        while (received < count && recvs.size() < kWindow) {
          auto recv = ranks_[me]->Recv(peer_[me][other], 21,
                                       MutableBuffer::Host(ins[received % kWindow].data(), size));
          ASSERT_TRUE(recv.ok()) << recv.status();
          recvs.emplace_back(received++, std::move(recv).value());
        }
        while (sent < count && sends.size() < kWindow) {
          Fill(Seed(me, other, 21, sent), outs[sent % kWindow].data(), size);
          auto send = ranks_[me]->Send(peer_[me][other], 21,
                                       ConstBuffer::Host(outs[sent % kWindow].data(), size));
          ASSERT_TRUE(send.ok()) << send.status();
          sends.emplace_back(sent++, std::move(send).value());
        }
        // The oldest receive, then the oldest send: each side's k-th send meets the other
        // side's k-th receive, which is already posted, so neither waits on the other.
        if (!recvs.empty()) {
          absl::Status status = recvs.front().second->Wait(Deadline());
          ASSERT_TRUE(status.ok()) << status;
          const int seq = recvs.front().first;
          ASSERT_TRUE(SameBytes(Message(Seed(other, me, 21, seq), size), ins[seq % kWindow],
                                absl::StrCat("rank", other, "->rank", me, " message ", seq)));
          recvs.pop_front();
        }
        if (!sends.empty()) {
          absl::Status status = sends.front().second->Wait(Deadline());
          ASSERT_TRUE(status.ok()) << status;
          sends.pop_front();
        }
      }
    });
  }
  for (auto& thread : threads) thread.join();
}

TEST_P(ConformanceTest, ZeroLengthMessages) {
  // Null buffers of size 0 are valid on both sides.
  auto recv = ranks_[1]->Recv(peer_[1][0], 3, MutableBuffer::Host(nullptr, 0));
  ASSERT_TRUE(recv.ok()) << recv.status();
  auto send = ranks_[0]->Send(peer_[0][1], 3, ConstBuffer::Host(nullptr, 0));
  ASSERT_TRUE(send.ok()) << send.status();
  ASSERT_TRUE((*recv)->Wait(Deadline()).ok());
  ASSERT_TRUE((*send)->Wait(Deadline()).ok());
  EXPECT_EQ((*recv)->bytes(), 0u);
  // An empty message into a non-empty buffer leaves the buffer untouched.
  std::vector<uint8_t> buffer(64, 0x5A);
  auto recv2 = ranks_[1]->Recv(peer_[1][0], 4, MutableBuffer::Host(buffer.data(), buffer.size()));
  ASSERT_TRUE(recv2.ok());
  auto send2 = ranks_[0]->Send(peer_[0][1], 4, ConstBuffer::Host(buffer.data(), 0));
  ASSERT_TRUE(send2.ok());
  ASSERT_TRUE((*recv2)->Wait(Deadline()).ok());
  ASSERT_TRUE((*send2)->Wait(Deadline()).ok());
  EXPECT_EQ((*recv2)->bytes(), 0u);
  EXPECT_TRUE(SameBytes(std::vector<uint8_t>(64, 0x5A), buffer, "untouched buffer"));
}

TEST_P(ConformanceTest, TruncationIsReportedClearly) {
  const size_t size = std::max<size_t>(GetParam().size, 2);
  std::vector<uint8_t> out = Message(11, size), in(size - 1, 0);
  auto recv = ranks_[1]->Recv(peer_[1][0], 5, MutableBuffer::Host(in.data(), in.size()));
  ASSERT_TRUE(recv.ok());
  auto send = ranks_[0]->Send(peer_[0][1], 5, ConstBuffer::Host(out.data(), out.size()));
  ASSERT_TRUE(send.ok());
  absl::Status status = (*recv)->Wait(Deadline());
  EXPECT_EQ(status.code(), absl::StatusCode::kOutOfRange) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("rank0"));
  EXPECT_THAT(std::string(status.message()),
              HasSubstr(absl::StrCat("larger than the ", size - 1, "-byte receive buffer")));
  EXPECT_THAT(std::string(status.message()), HasSubstr("truncated"));
  EXPECT_EQ((*recv)->bytes(), 0u);
  // The send finishes (it does not hang), and the connection still works afterwards.
  absl::Status send_status = (*send)->Wait(Deadline());
  EXPECT_NE(send_status.code(), absl::StatusCode::kDeadlineExceeded) << send_status;
  ExpectRoundTrip(0, 1, 5, size, 12);
}

TEST_P(ConformanceTest, ScatterReceivesPlaceEachPartInItsSegment) {
  const size_t size = GetParam().size;
  // Four separate buffers (one empty); the last has 7 bytes more than the message needs.
  const size_t a = size / 3, c = size / 4;
  std::vector<std::vector<uint8_t>> parts = {std::vector<uint8_t>(a, 0xEE),
                                             {},
                                             std::vector<uint8_t>(c, 0xEE),
                                             std::vector<uint8_t>(size - a - c + 7, 0xEE)};
  std::vector<MutableBuffer> segments;
  for (auto& part : parts) segments.push_back(MutableBuffer::Host(part.data(), part.size()));
  std::vector<uint8_t> out = Message(17, size);
  auto recv = ranks_[1]->RecvScatter(peer_[1][0], 6, segments);
  ASSERT_TRUE(recv.ok()) << recv.status();
  auto send = ranks_[0]->Send(peer_[0][1], 6, ConstBuffer::Host(out.data(), out.size()));
  ASSERT_TRUE(send.ok()) << send.status();
  ASSERT_TRUE((*recv)->Wait(Deadline()).ok());
  ASSERT_TRUE((*send)->Wait(Deadline()).ok());
  EXPECT_EQ((*recv)->bytes(), size);
  std::vector<uint8_t> joined;
  for (const auto& part : parts) joined.insert(joined.end(), part.begin(), part.end());
  std::vector<uint8_t> expected = out;
  expected.insert(expected.end(), 7, 0xEE);  // the unused tail is untouched
  EXPECT_TRUE(SameBytes(expected, joined, "scattered message"));

  // A message longer than the segments is a truncation, as for Recv.
  if (size >= 2) {
    std::vector<uint8_t> first(size / 2), second(size - size / 2 - 1);
    auto short_recv = ranks_[1]->RecvScatter(peer_[1][0], 7,
                                             {MutableBuffer::Host(first.data(), first.size()),
                                              MutableBuffer::Host(second.data(), second.size())});
    ASSERT_TRUE(short_recv.ok());
    auto send2 = ranks_[0]->Send(peer_[0][1], 7, ConstBuffer::Host(out.data(), out.size()));
    ASSERT_TRUE(send2.ok());
    absl::Status status = (*short_recv)->Wait(Deadline());
    EXPECT_EQ(status.code(), absl::StatusCode::kOutOfRange) << status;
    EXPECT_NE((*send2)->Wait(Deadline()).code(), absl::StatusCode::kDeadlineExceeded);
  }
  // Segments must be host memory.
  auto cuda = ranks_[1]->RecvScatter(peer_[1][0], 8,
                                     {MutableBuffer{parts[0].data(), a, MemoryKind::kCuda, 0}});
  EXPECT_EQ(cuda.status().code(), absl::StatusCode::kUnimplemented) << cuda.status();
}

TEST_P(ConformanceTest, WaitReturnsAtTheDeadlineAndTheOperationStaysPending) {
  std::vector<uint8_t> in(std::max<size_t>(GetParam().size, 1), 0);
  auto recv = ranks_[1]->Recv(peer_[1][0], 6, MutableBuffer::Host(in.data(), in.size()));
  ASSERT_TRUE(recv.ok());
  const absl::Time start = absl::Now();
  absl::Status status = (*recv)->Wait(start + absl::Milliseconds(100));
  const absl::Duration waited = absl::Now() - start;
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("receive from peer 'rank0' tag 6"));
  // Not before the deadline. The wait's clock and absl::Now() here can disagree by tens of
  // microseconds (seen: 99.96 ms), so "before" means by more than a millisecond.
  EXPECT_GE(waited, absl::Milliseconds(99));
  EXPECT_LT(waited, absl::Seconds(2));
  EXPECT_FALSE((*recv)->Done());
  // Still pending: a later message completes it.
  std::vector<uint8_t> out = Message(13, in.size());
  auto send = ranks_[0]->Send(peer_[0][1], 6, ConstBuffer::Host(out.data(), out.size()));
  ASSERT_TRUE(send.ok());
  ASSERT_TRUE((*recv)->Wait(Deadline()).ok());
  ASSERT_TRUE((*send)->Wait(Deadline()).ok());
  EXPECT_TRUE(SameBytes(out, in, "message after a timed-out wait"));
}

TEST_P(ConformanceTest, CancelWithdrawsAnUnmatchedReceive) {
  const size_t size = GetParam().size;
  std::vector<uint8_t> stale(size, 0x11);
  auto cancelled = ranks_[1]->Recv(peer_[1][0], 8, MutableBuffer::Host(stale.data(), stale.size()));
  ASSERT_TRUE(cancelled.ok());
  (*cancelled)->Cancel();
  absl::Status status = (*cancelled)->Wait(Deadline());
  EXPECT_EQ(status.code(), absl::StatusCode::kCancelled) << status;
  EXPECT_TRUE((*cancelled)->Done());
  // The next message with that tag goes to the next receive, not the cancelled one.
  ExpectRoundTrip(0, 1, 8, size, 14);
  EXPECT_TRUE(SameBytes(std::vector<uint8_t>(size, 0x11), stale, "cancelled receive's buffer"));
  // Cancelling a finished operation keeps its result.
  std::vector<uint8_t> out = Message(15, size), in(size, 0);
  auto recv = ranks_[1]->Recv(peer_[1][0], 9, MutableBuffer::Host(in.data(), in.size()));
  auto send = ranks_[0]->Send(peer_[0][1], 9, ConstBuffer::Host(out.data(), out.size()));
  ASSERT_TRUE(recv.ok() && send.ok());
  ASSERT_TRUE((*recv)->Wait(Deadline()).ok());
  (*recv)->Cancel();
  EXPECT_TRUE((*recv)->Wait(Deadline()).ok());
  EXPECT_EQ((*recv)->bytes(), size);
  ASSERT_TRUE((*send)->Wait(Deadline()).ok());
}

TEST_P(ConformanceTest, DestroyedPeerFailsPendingAndLaterOperations) {
  const Param& p = GetParam();
  std::vector<uint8_t> in(std::max<size_t>(p.size, 1), 0);
  auto pending = ranks_[0]->Recv(peer_[0][1], 10, MutableBuffer::Host(in.data(), in.size()));
  ASSERT_TRUE(pending.ok());
  ranks_[1].reset();
  const absl::Time start = absl::Now();
  absl::Status status = (*pending)->Wait(start + absl::Seconds(5));
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("peer 'rank1'"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  // A later operation with the dead peer fails too, when posted or when waited on.
  std::vector<uint8_t> out(16, 1);
  auto later = ranks_[0]->Send(peer_[0][1], 10, ConstBuffer::Host(out.data(), out.size()));
  absl::Status later_status = later.ok() ? (*later)->Wait(Deadline()) : later.status();
  EXPECT_EQ(later_status.code(), absl::StatusCode::kUnavailable) << later_status;
  EXPECT_THAT(std::string(later_status.message()), HasSubstr("peer 'rank1'"));
  // The other peers carry on.
  if (p.peers > 2) ExpectRoundTrip(2, 0, 10, 1024, 16);
}

TEST_P(ConformanceTest, DisconnectCancelsHereAndFailsThePeer) {
  std::vector<uint8_t> in0(32, 0), in1(32, 0);
  auto mine = ranks_[0]->Recv(peer_[0][1], 11, MutableBuffer::Host(in0.data(), in0.size()));
  auto theirs = ranks_[1]->Recv(peer_[1][0], 11, MutableBuffer::Host(in1.data(), in1.size()));
  ASSERT_TRUE(mine.ok() && theirs.ok());
  ASSERT_TRUE(ranks_[0]->Disconnect(peer_[0][1], Deadline()).ok());
  absl::Status status = (*mine)->Wait(Deadline());
  EXPECT_EQ(status.code(), absl::StatusCode::kCancelled) << status;
  absl::Status peer_status = (*theirs)->Wait(absl::Now() + absl::Seconds(5));
  EXPECT_EQ(peer_status.code(), absl::StatusCode::kUnavailable) << peer_status;
  EXPECT_THAT(std::string(peer_status.message()), HasSubstr("peer 'rank0'"));
  auto after = ranks_[0]->Send(peer_[0][1], 11, ConstBuffer::Host(in0.data(), in0.size()));
  EXPECT_EQ(after.status().code(), absl::StatusCode::kFailedPrecondition) << after.status();
  auto peer_after = ranks_[1]->Send(peer_[1][0], 11, ConstBuffer::Host(in1.data(), in1.size()));
  absl::Status peer_after_status =
      peer_after.ok() ? (*peer_after)->Wait(Deadline()) : peer_after.status();
  EXPECT_EQ(peer_after_status.code(), absl::StatusCode::kUnavailable) << peer_after_status;
  // Disconnecting twice is fine.
  EXPECT_TRUE(ranks_[0]->Disconnect(peer_[0][1], Deadline()).ok());
}

TEST_P(ConformanceTest, TagsUseTheirWholeRange) {
  ExpectRoundTrip(0, 1, 0, 24, 17);
  ExpectRoundTrip(0, 1, kMaxTag, 24, 18);
  ExpectRoundTrip(1, 0, kMaxTag - 1, 24, 19);
}

TEST_P(ConformanceTest, BadArgumentsAreRejectedWithClearErrors) {
  std::vector<uint8_t> buffer(8, 0);
  auto unknown = ranks_[0]->Send(9999, 1, ConstBuffer::Host(buffer.data(), buffer.size()));
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(unknown.status().message()), HasSubstr("no peer 9999"));
  auto big_tag =
      ranks_[0]->Recv(peer_[0][1], kMaxTag + 1, MutableBuffer::Host(buffer.data(), buffer.size()));
  EXPECT_EQ(big_tag.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(big_tag.status().message()), HasSubstr("does not fit in 40 bits"));
  auto null_data = ranks_[0]->Send(peer_[0][1], 1, ConstBuffer::Host(nullptr, 8));
  EXPECT_EQ(null_data.status().code(), absl::StatusCode::kInvalidArgument);
  // A memory kind the transport cannot move is refused when posted (what CanMove says).
  EXPECT_TRUE(ranks_[0]->CanMove(MemoryKind::kHost));
  if (!ranks_[0]->CanMove(MemoryKind::kCuda)) {
    ConstBuffer cuda{buffer.data(), buffer.size(), MemoryKind::kCuda, 0};
    auto on_gpu = ranks_[0]->Send(peer_[0][1], 1, cuda);
    EXPECT_EQ(on_gpu.status().code(), absl::StatusCode::kUnimplemented) << on_gpu.status();
  }
  auto garbage = ranks_[0]->Connect("not an address", Deadline());
  EXPECT_EQ(garbage.status().code(), absl::StatusCode::kInvalidArgument);
  auto again = ranks_[0]->Connect(ranks_[1]->LocalAddress(), Deadline());
  EXPECT_EQ(again.status().code(), absl::StatusCode::kAlreadyExists) << again.status();
  auto foreign = CreateTransport(
      GetParam().flavor == Flavor::kInproc ? Backend::kUcx : Backend::kInproc, "foreign");
  ASSERT_TRUE(foreign.ok()) << foreign.status();
  auto mixed = ranks_[0]->Connect((*foreign)->LocalAddress(), Deadline());
  EXPECT_EQ(mixed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(mixed.status().message()), HasSubstr("same backend"));
  EXPECT_EQ(ranks_[0]->PeerName(peer_[0][1]), "rank1");
}

std::vector<Param> Params() {
  std::vector<Param> params;
  for (Flavor flavor : {Flavor::kInproc, Flavor::kUcx}) {
    params.push_back({flavor, 0, 2});
    params.push_back({flavor, 1, 2});
    params.push_back({flavor, 4097, 3});
    params.push_back({flavor, 256 * 1024 + 5, 8});
    params.push_back({flavor, kMiB + 3, 4});
    params.push_back({flavor, 64 * kMiB, 2});
  }
  // UCX's own large-message path: sizes above the zero-copy threshold.
  params.push_back({Flavor::kUcxWithoutZeroCopy, 256 * 1024 + 5, 3});
  params.push_back({Flavor::kUcxWithoutZeroCopy, 64 * kMiB, 2});
  // The NCCL backend's protocol: few sizes, as each message takes three control hops.
  params.push_back({Flavor::kNcclProtocol, 0, 2});
  params.push_back({Flavor::kNcclProtocol, 4097, 3});
  params.push_back({Flavor::kNcclProtocol, 256 * 1024 + 5, 4});
  params.push_back({Flavor::kNcclProtocol, kMiB + 3, 2});
  return params;
}

INSTANTIATE_TEST_SUITE_P(Backends, ConformanceTest, ::testing::ValuesIn(Params()), ParamName);

}  // namespace
}  // namespace hetpar::transport
