// Behaviour specific to the UCX backend; the shared semantics are in the conformance suite
// (common/transport/conformance_test.cc) and peer death by kill -9 in tests/transport/.
#include "common/transport/ucx/ucx_transport.h"

#include <cstdlib>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/util/scoped_env.h"

namespace hetpar::transport::ucx {
namespace {

using ::hetpar::testing::ScopedEnv;

using ::testing::HasSubstr;

constexpr absl::Duration kWait = absl::Seconds(20);

std::vector<uint8_t> Bytes(uint8_t seed, size_t size) {
  std::vector<uint8_t> bytes(size);
  for (size_t i = 0; i < size; ++i) bytes[i] = static_cast<uint8_t>(seed + i * 7 + (i >> 12));
  return bytes;
}

UcxTransport::Options Named(const std::string& name) {
  UcxTransport::Options options;
  options.name = name;
  return options;
}

TEST(UcxTransportTest, HonoursUcxTls) {
  {
    ScopedEnv tls("UCX_TLS", "tcp");
    auto a = UcxTransport::Create(Named("a"));
    auto b = UcxTransport::Create(Named("b"));
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    auto b_at_a = (*a)->Connect((*b)->LocalAddress(), absl::Now() + kWait);
    auto a_at_b = (*b)->Connect((*a)->LocalAddress(), absl::Now() + kWait);
    ASSERT_TRUE(b_at_a.ok() && a_at_b.ok());
    std::vector<uint8_t> out = Bytes(3, (1 << 20) + 7), in(out.size(), 0);
    auto recv = (*b)->Recv(*a_at_b, 1, MutableBuffer::Host(in.data(), in.size()));
    auto send = (*a)->Send(*b_at_a, 1, ConstBuffer::Host(out.data(), out.size()));
    ASSERT_TRUE(recv.ok() && send.ok());
    ASSERT_TRUE((*recv)->Wait(absl::Now() + kWait).ok());
    ASSERT_TRUE((*send)->Wait(absl::Now() + kWait).ok());
    EXPECT_EQ(in, out);
  }
  {
    ScopedEnv tls("UCX_TLS", "no_such_transport");
    auto broken = UcxTransport::Create(Named("broken"));
    ASSERT_FALSE(broken.ok());
    EXPECT_THAT(std::string(broken.status().message()), HasSubstr("ucx transport 'broken'"));
  }
}

TEST(UcxTransportTest, SendWaitsForThePeerToConnectBack) {
  auto a = UcxTransport::Create(Named("a"));
  auto b = UcxTransport::Create(Named("b"));
  ASSERT_TRUE(a.ok() && b.ok());
  auto b_at_a = (*a)->Connect((*b)->LocalAddress(), absl::Now() + kWait);
  ASSERT_TRUE(b_at_a.ok());
  std::vector<uint8_t> out = Bytes(9, 300000), in(out.size(), 0);
  auto send = (*a)->Send(*b_at_a, 2, ConstBuffer::Host(out.data(), out.size()));
  ASSERT_TRUE(send.ok());
  EXPECT_EQ((*send)->Wait(absl::Now() + absl::Milliseconds(100)).code(),
            absl::StatusCode::kDeadlineExceeded);
  auto a_at_b = (*b)->Connect((*a)->LocalAddress(), absl::Now() + kWait);
  ASSERT_TRUE(a_at_b.ok());
  auto recv = (*b)->Recv(*a_at_b, 2, MutableBuffer::Host(in.data(), in.size()));
  ASSERT_TRUE(recv.ok());
  ASSERT_TRUE((*recv)->Wait(absl::Now() + kWait).ok());
  ASSERT_TRUE((*send)->Wait(absl::Now() + kWait).ok());
  EXPECT_EQ(in, out);
}

TEST(UcxTransportTest, AbandonedSendTearsDownItsConnection) {
  UcxTransport::Options options = Named("a");
  options.abandon_timeout = absl::Milliseconds(200);
  auto a = UcxTransport::Create(options);
  auto b = UcxTransport::Create(Named("b"));
  ASSERT_TRUE(a.ok() && b.ok());
  auto b_at_a = (*a)->Connect((*b)->LocalAddress(), absl::Now() + kWait);
  auto a_at_b = (*b)->Connect((*a)->LocalAddress(), absl::Now() + kWait);
  ASSERT_TRUE(b_at_a.ok() && a_at_b.ok());
  std::vector<uint8_t> in(16);
  auto b_pending = (*b)->Recv(*a_at_b, 99, MutableBuffer::Host(in.data(), in.size()));
  ASSERT_TRUE(b_pending.ok());
  {
    // 8 MiB goes by rendezvous: UCX holds the send until b posts a matching receive (never).
    std::vector<uint8_t> out = Bytes(1, 8 << 20);
    auto send = (*a)->Send(*b_at_a, 3, ConstBuffer::Host(out.data(), out.size()));
    ASSERT_TRUE(send.ok());
    EXPECT_EQ((*send)->Wait(absl::Now() + absl::Milliseconds(50)).code(),
              absl::StatusCode::kDeadlineExceeded);
    const absl::Time start = absl::Now();
    send->reset();  // must return (buffer released) before `out` goes away
    EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  }
  auto later = (*a)->Send(*b_at_a, 3, ConstBuffer::Host(in.data(), in.size()));
  EXPECT_EQ(later.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(later.status().message()), HasSubstr("torn down"));
  absl::Status peer_side = (*b_pending)->Wait(absl::Now() + kWait);
  EXPECT_EQ(peer_side.code(), absl::StatusCode::kUnavailable) << peer_side;
  EXPECT_THAT(std::string(peer_side.message()), HasSubstr("peer 'a'"));
}

TEST(UcxTransportTest, DestructionCancelsPendingOperations) {
  auto a = UcxTransport::Create(Named("a"));
  auto b = UcxTransport::Create(Named("b"));
  ASSERT_TRUE(a.ok() && b.ok());
  auto b_at_a = (*a)->Connect((*b)->LocalAddress(), absl::Now() + kWait);
  ASSERT_TRUE(b_at_a.ok());
  std::vector<uint8_t> in(64);
  auto pending = (*a)->Recv(*b_at_a, 4, MutableBuffer::Host(in.data(), in.size()));
  auto waiting = (*a)->Send(*b_at_a, 4, ConstBuffer::Host(in.data(), in.size()));  // no hello yet
  ASSERT_TRUE(pending.ok() && waiting.ok());
  a->reset();
  for (auto* op : {&*pending, &*waiting}) {
    absl::Status status = (*op)->Wait(absl::Now() + kWait);
    EXPECT_EQ(status.code(), absl::StatusCode::kCancelled) << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr("transport was destroyed"));
  }
}

TEST(UcxTransportTest, ReportsWhetherItCanMoveCudaMemory) {
  auto a = UcxTransport::Create(Named("a"));
  ASSERT_TRUE(a.ok());
  auto peer = (*a)->Connect((*a)->LocalAddress(), absl::Now() + kWait);  // loopback to itself
  ASSERT_TRUE(peer.ok());
  int dummy = 0;
  auto send = (*a)->Send(*peer, 1, ConstBuffer{&dummy, sizeof(dummy), MemoryKind::kCuda, 0});
  EXPECT_TRUE((*a)->CanMove(MemoryKind::kHost));
  if ((*a)->CanMove(MemoryKind::kCuda)) {
    GTEST_SKIP() << "this UCX has CUDA support; host memory tagged as CUDA is not a valid test";
  }
  EXPECT_EQ(send.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(send.status().message()), HasSubstr("no CUDA memory support"));
}

// Set-up calls run on the progress thread, one thread for all of them, not the caller's, and
// in the order given.
TEST(UcxTransportTest, RunOnProgressThreadRunsOnItsOneThreadBeforeReturning) {
  std::vector<std::thread::id> ran;  // outlives the transport, whose thread writes it
  auto a = UcxTransport::Create(Named("a"));
  ASSERT_TRUE(a.ok()) << a.status();
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE((*a)->RunOnProgressThread([&ran] { ran.push_back(std::this_thread::get_id()); },
                                          absl::Now() + kWait)
                    .ok());
    ASSERT_EQ(ran.size(), static_cast<size_t>(i + 1));  // it ran before the call returned
  }
  EXPECT_NE(ran[0], std::this_thread::get_id());
  EXPECT_EQ(ran[1], ran[0]);
  EXPECT_EQ(ran[2], ran[0]);
  // The transport still works after them: a loopback message arrives.
  auto peer = (*a)->Connect((*a)->LocalAddress(), absl::Now() + kWait);
  ASSERT_TRUE(peer.ok()) << peer.status();
  const std::vector<uint8_t> sent = Bytes(5, 1000);
  std::vector<uint8_t> got(sent.size());
  auto recv = (*a)->Recv(*peer, 9, MutableBuffer::Host(got.data(), got.size()));
  ASSERT_TRUE(recv.ok()) << recv.status();
  auto send = (*a)->Send(*peer, 9, ConstBuffer::Host(sent.data(), sent.size()));
  ASSERT_TRUE(send.ok()) << send.status();
  ASSERT_TRUE((*recv)->Wait(absl::Now() + kWait).ok());
  EXPECT_EQ(got, sent);
}

// Two transports wired both ways, with a small ping-pong done so both hellos (and the zero-copy
// offers that follow them) have arrived.
struct Pair {
  std::unique_ptr<UcxTransport> a, b;
  PeerId b_at_a = 0, a_at_b = 0;
};

Pair Connected(const UcxTransport::Options& a_options, const UcxTransport::Options& b_options) {
  Pair pair;
  auto a = UcxTransport::Create(a_options);
  auto b = UcxTransport::Create(b_options);
  EXPECT_TRUE(a.ok() && b.ok());
  if (!a.ok() || !b.ok()) return pair;
  pair.a = std::move(a).value();
  pair.b = std::move(b).value();
  pair.b_at_a = *pair.a->Connect(pair.b->LocalAddress(), absl::Now() + kWait);
  pair.a_at_b = *pair.b->Connect(pair.a->LocalAddress(), absl::Now() + kWait);
  for (auto [from, to, peer_at_from, peer_at_to] :
       {std::tuple{pair.a.get(), pair.b.get(), pair.b_at_a, pair.a_at_b},
        std::tuple{pair.b.get(), pair.a.get(), pair.a_at_b, pair.b_at_a}}) {
    uint8_t out = 1, in = 0;
    auto recv = to->Recv(peer_at_to, 0, MutableBuffer::Host(&in, 1));
    auto send = from->Send(peer_at_from, 0, ConstBuffer::Host(&out, 1));
    EXPECT_TRUE(recv.ok() && send.ok());
    EXPECT_TRUE((*recv)->Wait(absl::Now() + kWait).ok());
    EXPECT_TRUE((*send)->Wait(absl::Now() + kWait).ok());
  }
  return pair;
}

// A peer that stops answering (its progress thread held) leaves UCX holding a's rendezvous
// send: destroying a still ends within its shutdown deadline, and its pending operations end
// Cancelled, also for a thread that lets go of them the moment they end (while the transport is
// still releasing UCX's worker).
TEST(UcxTransportTest, DestructionEndsInTimeWhenThePeerStopsAnswering) {
  // Outlive the transports: b's progress thread holds on to them.
  absl::Notification held, release;
  std::vector<uint8_t> out = Bytes(2, 8 << 20), in(16);
  UcxTransport::Options a_options = Named("a"), b_options = Named("b");
  // The large send stays UCX's own rendezvous, which waits for b.
  a_options.same_host_zero_copy = b_options.same_host_zero_copy = false;
  a_options.shutdown_timeout = absl::Milliseconds(500);
  Pair pair = Connected(a_options, b_options);
  ASSERT_NE(pair.a, nullptr);
  absl::Cleanup unblock = [&release] { release.Notify(); };
  // b's progress thread stops in here until the test ends: b answers nothing.
  (void)pair.b->RunOnProgressThread(
      [&] {
        held.Notify();
        release.WaitForNotification();
      },
      absl::Now() + absl::Milliseconds(1));
  ASSERT_TRUE(held.WaitForNotificationWithTimeout(kWait));
  auto send = pair.a->Send(pair.b_at_a, 5, ConstBuffer::Host(out.data(), out.size()));
  auto recv = pair.a->Recv(pair.b_at_a, 6, MutableBuffer::Host(in.data(), in.size()));
  ASSERT_TRUE(send.ok() && recv.ok());
  EXPECT_EQ((*send)->Wait(absl::Now() + absl::Milliseconds(100)).code(),
            absl::StatusCode::kDeadlineExceeded);
  absl::Status send_status, recv_status;
  std::thread waiter([&] {
    send_status = (*send)->Wait(absl::Now() + kWait);
    send->reset();
    recv_status = (*recv)->Wait(absl::Now() + kWait);
    recv->reset();
  });
  const absl::Time start = absl::Now();
  pair.a.reset();
  const absl::Duration took = absl::Now() - start;
  waiter.join();
  EXPECT_LT(took, absl::Seconds(10)) << "a 500 ms shutdown deadline";
  for (const absl::Status& status : {send_status, recv_status}) {
    EXPECT_EQ(status.code(), absl::StatusCode::kCancelled) << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr("transport was destroyed"));
  }
}

// Sends `size` bytes a -> b and checks them.
void Transfer(Pair& pair, size_t size, Tag tag) {
  std::vector<uint8_t> out = Bytes(static_cast<uint8_t>(tag), size), in(size, 0);
  auto recv = pair.b->Recv(pair.a_at_b, tag, MutableBuffer::Host(in.data(), in.size()));
  auto send = pair.a->Send(pair.b_at_a, tag, ConstBuffer::Host(out.data(), out.size()));
  ASSERT_TRUE(recv.ok() && send.ok());
  ASSERT_TRUE((*recv)->Wait(absl::Now() + kWait).ok());
  ASSERT_TRUE((*send)->Wait(absl::Now() + kWait).ok());
  EXPECT_EQ((*recv)->bytes(), size);
  EXPECT_EQ(in, out);
}

TEST(UcxTransportTest, LargeMessagesOnOneHostAreCopiedStraightFromTheSender) {
  Pair pair = Connected(Named("a"), Named("b"));
  ASSERT_NE(pair.a, nullptr);
  const size_t threshold = UcxTransport::Options().zero_copy_threshold;
  Transfer(pair, threshold - 1, 1);  // below the threshold: UCX's own path
  EXPECT_EQ(pair.a->stats().zero_copy_sends, 0u);
  Transfer(pair, threshold, 2);
  Transfer(pair, (3 << 20) + 5, 3);
  EXPECT_EQ(pair.a->stats().zero_copy_sends, 2u);
  EXPECT_EQ(pair.b->stats().zero_copy_receives, 2u);
  EXPECT_EQ(pair.a->stats().sends, 4u);     // the ping, and three transfers
  EXPECT_EQ(pair.b->stats().receives, 4u);  // the ping, and three transfers
}

TEST(UcxTransportTest, ZeroCopyIsOnlyUsedWhenTheReceiverOffersIt) {
  UcxTransport::Options no_zero_copy = Named("b");
  no_zero_copy.same_host_zero_copy = false;
  Pair pair = Connected(Named("a"), no_zero_copy);
  ASSERT_NE(pair.a, nullptr);
  Transfer(pair, (3 << 20) + 5, 1);
  EXPECT_EQ(pair.a->stats().zero_copy_sends, 0u);
  EXPECT_EQ(pair.b->stats().zero_copy_receives, 0u);
  EXPECT_EQ(pair.b->stats().receives, 2u);
}

TEST(UcxTransportTest, ZeroCopyIntoATooSmallBufferIsTruncation) {
  Pair pair = Connected(Named("a"), Named("b"));
  ASSERT_NE(pair.a, nullptr);
  // Smaller than a descriptor, and larger than one but smaller than the message.
  for (size_t buffer_size : {size_t{8}, size_t{100000}}) {
    std::vector<uint8_t> out = Bytes(7, 1 << 20), in(buffer_size, 0);
    auto recv = pair.b->Recv(pair.a_at_b, 5, MutableBuffer::Host(in.data(), in.size()));
    auto send = pair.a->Send(pair.b_at_a, 5, ConstBuffer::Host(out.data(), out.size()));
    ASSERT_TRUE(recv.ok() && send.ok());
    absl::Status status = (*recv)->Wait(absl::Now() + kWait);
    EXPECT_EQ(status.code(), absl::StatusCode::kOutOfRange) << status;
    EXPECT_THAT(std::string(status.message()),
                HasSubstr(absl::StrCat("larger than the ", buffer_size, "-byte receive buffer")));
    EXPECT_TRUE((*send)->Wait(absl::Now() + kWait).ok());
  }
  Transfer(pair, 1 << 20, 6);  // the connection still works
}

// The service tag space (for layered backends) and the user one share tags' values but never
// match each other: each receive, posted before any message and before the other space's message
// is sent, gets the message of its own space. Small (eager) and large (zero-copy) messages.
TEST(UcxTransportTest, ServiceAndUserMessagesWithEqualTagsNeverMatchEachOther) {
  Pair pair = Connected(Named("a"), Named("b"));
  ASSERT_NE(pair.a, nullptr);
  for (Tag tag : {Tag{0}, Tag{7}, kMaxTag}) {
    for (size_t size : {size_t{16}, size_t{1} << 20}) {
      for (bool service_first : {true, false}) {
        const std::string what = absl::StrCat("tag ", tag, ", ", size, " bytes, ",
                                              service_first ? "service" : "user", " message first");
        std::vector<uint8_t> user_out = Bytes(1, size), service_out = Bytes(2, size);
        std::vector<uint8_t> user_in(size, 0), service_in(size, 0);
        // The receive of the space whose message comes second is posted first.
        std::unique_ptr<Operation> user_recv, service_recv, user_send, service_send;
        auto post_user_recv = [&] {
          auto op = pair.b->Recv(pair.a_at_b, tag, MutableBuffer::Host(user_in.data(), size));
          ASSERT_TRUE(op.ok()) << op.status();
          user_recv = std::move(op).value();
        };
        auto post_service_recv = [&] {
          auto op =
              pair.b->RecvService(pair.a_at_b, tag, MutableBuffer::Host(service_in.data(), size));
          ASSERT_TRUE(op.ok()) << op.status();
          service_recv = std::move(op).value();
        };
        auto send_user = [&] {
          auto op = pair.a->Send(pair.b_at_a, tag, ConstBuffer::Host(user_out.data(), size));
          ASSERT_TRUE(op.ok()) << op.status();
          user_send = std::move(op).value();
        };
        auto send_service = [&] {
          auto op =
              pair.a->SendService(pair.b_at_a, tag, ConstBuffer::Host(service_out.data(), size));
          ASSERT_TRUE(op.ok()) << op.status();
          service_send = std::move(op).value();
        };
        if (service_first) {
          post_user_recv();
          send_service();
          send_user();
          post_service_recv();
        } else {
          post_service_recv();
          send_user();
          send_service();
          post_user_recv();
        }
        for (auto* op : {&user_recv, &service_recv, &user_send, &service_send}) {
          absl::Status status = (*op)->Wait(absl::Now() + kWait);
          ASSERT_TRUE(status.ok()) << what << ": " << status;
        }
        EXPECT_EQ(user_in, user_out) << what;
        EXPECT_EQ(service_in, service_out) << what;
      }
    }
  }
  // Service operations validate their arguments like user ones and name themselves.
  std::vector<uint8_t> buffer(8);
  auto big_tag = pair.a->SendService(pair.b_at_a, kMaxTag + 1, ConstBuffer::Host(buffer.data(), 8));
  EXPECT_EQ(big_tag.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(big_tag.status().message()), HasSubstr("service send to peer 'b'"));
}

TEST(UcxTransportTest, LoopbackToItself) {
  auto a = UcxTransport::Create(Named("self"));
  ASSERT_TRUE(a.ok());
  auto self = (*a)->Connect((*a)->LocalAddress(), absl::Now() + kWait);
  ASSERT_TRUE(self.ok());
  std::vector<uint8_t> out = Bytes(4, 100000), in(out.size(), 0);
  auto recv = (*a)->Recv(*self, 5, MutableBuffer::Host(in.data(), in.size()));
  auto send = (*a)->Send(*self, 5, ConstBuffer::Host(out.data(), out.size()));
  ASSERT_TRUE(recv.ok() && send.ok());
  ASSERT_TRUE((*recv)->Wait(absl::Now() + kWait).ok());
  ASSERT_TRUE((*send)->Wait(absl::Now() + kWait).ok());
  EXPECT_EQ(in, out);
}

}  // namespace
}  // namespace hetpar::transport::ucx
