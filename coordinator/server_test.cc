// Every RPC of the coordinator against an in-process server on a free port.
#include "coordinator/server.h"

#include <stdlib.h>
#include <zlib.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/control/client.h"
#include "gmock/gmock.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"

namespace hetpar::coordinator {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kToken[] = "test-run-token-5f1e";

v1::RunSpec TinySpec(double heartbeat_timeout_s = 10, int64_t steps = 1) {
  v1::RunSpec spec;
  spec.mutable_run()->set_name("tiny");
  spec.mutable_run()->set_steps(steps);
  spec.mutable_run()->set_grad_clip(1.0);
  spec.set_placement(v1::PLACEMENT_NON_COLOCATED);
  spec.mutable_encoder()->mutable_layout()->set_dp(2);
  spec.mutable_encoder()->mutable_layout()->set_tp(1);
  spec.mutable_llm()->mutable_layout()->set_dp(1);
  spec.mutable_llm()->mutable_layout()->set_tp(2);
  spec.mutable_coordinator()->set_heartbeat_timeout_s(heartbeat_timeout_s);
  spec.mutable_coordinator()->set_register_timeout_s(60);
  return spec;
}

// Plans each step with 8 loss tokens and a per-worker plan text.
class FixedPlanner : public StepPlanner {
 public:
  absl::StatusOr<PlannedStep> Plan(int64_t step, int64_t generation,
                                   const Membership& membership) override {
    PlannedStep plan;
    plan.global_loss_tokens = 8;
    for (const WorkerRecord* w : membership.LiveWorkers()) {
      v1::RankStepPlan& rank_plan = plan.worker_plans[w->worker_id];
      rank_plan.set_rank(w->world_rank);
      rank_plan.set_step(step);
      rank_plan.set_generation(generation);
    }
    return plan;
  }
};

// A planner whose Prepare waits (at most 120 s) until CancelPreparation, as one waiting for
// another process's data set generation does.
class PreparingPlanner : public FixedPlanner {
 public:
  explicit PreparingPlanner(std::shared_ptr<absl::Notification> cancelled)
      : cancelled_(std::move(cancelled)) {}
  absl::Status Prepare() override {
    if (!cancelled_->WaitForNotificationWithTimeout(absl::Seconds(120))) {
      return absl::DeadlineExceededError("never cancelled");
    }
    return absl::CancelledError("cancelled");
  }
  void CancelPreparation() override {
    if (!asked_.exchange(true)) cancelled_->Notify();
  }
  bool NeedsPreparation() const override { return true; }

 private:
  std::shared_ptr<absl::Notification> cancelled_;
  std::atomic<bool> asked_{false};
};

class ServerTest : public ::testing::Test {
 protected:
  void StartServer(v1::RunSpec spec, std::unique_ptr<StepPlanner> planner = nullptr) {
    ServerOptions options;
    options.listen_address = "127.0.0.1:0";
    options.token = kToken;
    options.controller.stop_timeout = absl::Seconds(5);
    auto server = CoordinatorServer::Create(spec, options, std::move(planner));
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    ASSERT_GT(server_->port(), 0);
    EXPECT_EQ(server_->address(), absl::StrCat("127.0.0.1:", server_->port()));
  }

  std::shared_ptr<CoordinatorConnection> Connect(const std::string& token = kToken,
                                                 bool dedicated = false) {
    ClientOptions options;
    options.address = server_->address();
    options.token = token;
    options.rpc_timeout = absl::Seconds(10);
    options.dedicated_connection = dedicated;
    auto connection = CoordinatorConnection::Create(options);
    EXPECT_TRUE(connection.ok()) << connection.status();
    return *connection;
  }

  std::unique_ptr<WorkerSession> StartWorker(v1::WorkerRole role, const std::string& host) {
    WorkerSession::Options options;
    options.registration.set_role(role);
    options.registration.set_host(host);
    options.registration.set_data_address(host + ":7000");
    options.registration.add_capabilities("cpu");
    auto session = WorkerSession::Start(Connect(), std::move(options));
    EXPECT_TRUE(session.ok()) << session.status();
    return session.ok() ? *std::move(session) : nullptr;
  }

  // Two encoders and two LLM ranks, in that order, all past WaitForRunStart.
  std::vector<std::unique_ptr<WorkerSession>> StartFourWorkers() {
    std::vector<std::unique_ptr<WorkerSession>> workers;
    workers.push_back(StartWorker(v1::WORKER_ROLE_ENCODER, "enc-a"));
    workers.push_back(StartWorker(v1::WORKER_ROLE_ENCODER, "enc-b"));
    workers.push_back(StartWorker(v1::WORKER_ROLE_LLM, "llm-a"));
    workers.push_back(StartWorker(v1::WORKER_ROLE_LLM, "llm-b"));
    for (auto& w : workers) {
      auto assignment = w->WaitForRunStart(absl::Seconds(20));
      EXPECT_TRUE(assignment.ok()) << assignment.status();
    }
    return workers;
  }

  // The next message of `kind`, skipping others (assignments).
  static absl::StatusOr<v1::CoordinatorMessage> NextOf(WorkerSession& w,
                                                       v1::CoordinatorMessage::KindCase kind,
                                                       absl::Duration timeout = absl::Seconds(20)) {
    const absl::Time deadline = absl::Now() + timeout;
    while (true) {
      auto m = w.Next(deadline - absl::Now());
      if (!m.ok() || m->kind_case() == kind) return m;
    }
  }

  std::unique_ptr<CoordinatorServer> server_;
};

TEST_F(ServerTest, RegisterSessionsStatusAndStop) {
  StartServer(TinySpec());
  auto admin = AdminClient(Connect());
  auto status = admin.Status();
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->state(), v1::RUN_STATE_WAITING);
  EXPECT_EQ(status->expected_workers(), 4);
  EXPECT_EQ(status->missing_size(), 4);
  EXPECT_EQ(status->listen_address(), server_->address());

  auto workers = StartFourWorkers();
  const v1::Assignment e0 = workers[0]->assignment();
  EXPECT_EQ(e0.role(), v1::WORKER_ROLE_ENCODER);
  ASSERT_EQ(e0.ranks_size(), 1);
  EXPECT_EQ(e0.ranks(0).rank(), 0);
  EXPECT_EQ(e0.generation(), 1);
  ASSERT_EQ(e0.peers_size(), 2);
  EXPECT_EQ(e0.peers(0).host(), "llm-a");
  EXPECT_EQ(e0.peers(0).data_address(), "llm-a:7000");
  EXPECT_EQ(e0.peers(1).ranks(0).tp(), 1);
  const v1::Assignment l1 = workers[3]->assignment();
  EXPECT_EQ(l1.ranks(0).module(), v1::MODULE_LLM);
  EXPECT_EQ(l1.ranks(0).tp(), 1);
  ASSERT_EQ(l1.peers_size(), 2);
  EXPECT_EQ(l1.peers(1).host(), "enc-b");
  EXPECT_EQ(workers[2]->registration().spec().run().name(), "tiny");

  // The last worker learns its peers from Register, possibly before its session is open.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  do {
    status = admin.Status();
    ASSERT_TRUE(status.ok());
  } while (absl::Now() < deadline &&
           std::any_of(status->workers().begin(), status->workers().end(),
                       [](const v1::WorkerStatus& w) { return !w.session_open(); }));
  EXPECT_EQ(status->state(), v1::RUN_STATE_RUNNING);
  ASSERT_EQ(status->workers_size(), 4);
  const std::vector<std::string> hosts = {"enc-a", "enc-b", "llm-a", "llm-b"};
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(status->workers(i).host(), hosts[i]);
    EXPECT_TRUE(status->workers(i).alive());
    EXPECT_TRUE(status->workers(i).session_open());
    EXPECT_EQ(status->workers(i).capabilities(0), "cpu");
    EXPECT_LT(status->workers(i).last_heartbeat_age_s(), 5.0);
  }
  EXPECT_EQ(status->missing_size(), 0);
  EXPECT_GT(status->cpu_seconds(), 0.0);

  // A fifth worker finds every rank taken.
  WorkerSession::Options extra;
  extra.registration.set_role(v1::WORKER_ROLE_LLM);
  auto fifth = WorkerSession::Start(Connect(), extra);
  EXPECT_EQ(fifth.status().code(), absl::StatusCode::kResourceExhausted);

  auto stop = admin.Stop("test over");
  ASSERT_TRUE(stop.ok()) << stop.status();
  EXPECT_EQ(stop->state(), v1::RUN_STATE_STOPPING);
  for (auto& w : workers) {
    auto m = NextOf(*w, v1::CoordinatorMessage::kStop);
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_EQ(m->stop().reason(), "stop requested: test over");
    EXPECT_TRUE(w->Close(absl::Seconds(10)).ok());
  }
  EXPECT_EQ(server_->WaitForEnd(absl::Seconds(10)), v1::RUN_STATE_DONE);
  status = admin.Status();
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(status->state(), v1::RUN_STATE_DONE);
}

// `hetpar stop` while the run waits for its ranks: a worker that waits for the run to start hears
// the stop, closes its session as asked, and the run ends done, nobody cut off at the stop's
// deadline (which would have made the coordinator report its outputs incomplete).
TEST_F(ServerTest, AStopWhileTheRunWaitsForItsRanksEndsTheWaitOfThoseRegistered) {
  StartServer(TinySpec());
  auto worker = StartWorker(v1::WORKER_ROLE_ENCODER, "enc-a");
  ASSERT_NE(worker, nullptr);
  auto admin = AdminClient(Connect());
  // The stop reaches the sessions that are open.
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (true) {
    auto status = admin.Status();
    ASSERT_TRUE(status.ok()) << status.status();
    if (status->workers_size() == 1 && status->workers(0).session_open()) break;
    ASSERT_LT(absl::Now(), deadline) << "the worker's session did not open";
    absl::SleepFor(absl::Milliseconds(20));
  }
  absl::StatusOr<v1::Assignment> waited;
  std::thread waiter([&] { waited = worker->WaitForRunStart(absl::Seconds(60)); });
  auto stop = admin.Stop("not today");
  ASSERT_TRUE(stop.ok()) << stop.status();
  waiter.join();
  EXPECT_TRUE(IsStoppedBeforeStart(waited.status())) << waited.status();
  EXPECT_THAT(waited.status().message(),
              HasSubstr("the run stopped before it started: stop requested: not today"));
  EXPECT_TRUE(worker->Close(absl::Seconds(10)).ok());
  EXPECT_EQ(server_->WaitForEnd(absl::Seconds(10)), v1::RUN_STATE_DONE);
  EXPECT_THAT(server_->CutAtStop(), ::testing::IsEmpty());
}

// The standard health service answers probes without the run token: a HealthCheckRequest for the
// whole server (service "", an empty message) gets HealthCheckResponse{status: SERVING}, whose
// wire form is field 1 (varint) = 1.
TEST_F(ServerTest, TheHealthServiceAnswersServingWithoutAToken) {
  StartServer(TinySpec());
  auto channel = grpc::CreateChannel(server_->address(), grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  grpc::Slice empty("");
  grpc::ByteBuffer request(&empty, 1);
  grpc::ByteBuffer response;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  absl::Notification done;
  grpc::Status status;
  stub.UnaryCall(&context, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &response,
                 [&](grpc::Status s) {
                   status = std::move(s);
                   done.Notify();
                 });
  done.WaitForNotification();
  ASSERT_TRUE(status.ok()) << status.error_message();
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(response.Dump(&slices).ok());
  std::string bytes;
  for (const grpc::Slice& slice : slices) {
    bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  EXPECT_EQ(bytes, std::string("\x08\x01", 2));
}

TEST_F(ServerTest, MissingOrWrongTokenIsUnauthenticatedAndLoggedWithoutTheToken) {
  StartServer(TinySpec());
  const std::string wrong = "wrong-token-0000";
  ::testing::internal::CaptureStderr();
  {
    WorkerSession::Options options;
    options.registration.set_role(v1::WORKER_ROLE_ENCODER);
    auto session = WorkerSession::Start(Connect(wrong), options);
    EXPECT_EQ(session.status().code(), absl::StatusCode::kUnauthenticated);
    EXPECT_THAT(std::string(session.status().message()), HasSubstr("Register RPC to coordinator"));
  }
  auto admin = AdminClient(Connect(wrong));
  EXPECT_EQ(admin.Status().status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(admin.Stop("x").status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(admin.Scale(3).status().code(), absl::StatusCode::kUnauthenticated);
  KeyValueClient kv(Connect(wrong), 1);
  EXPECT_EQ(kv.Set("k", "v").code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(kv.Get("k", absl::Seconds(1)).status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(kv.Wait({"k"}, absl::Seconds(1)).code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(kv.Add("k", 1).status().code(), absl::StatusCode::kUnauthenticated);
  // No token at all, on the raw stubs.
  auto connection = Connect();
  {
    grpc::ClientContext context;
    v1::RegisterRequest request;
    request.set_role(v1::WORKER_ROLE_ENCODER);
    v1::RegisterResponse response;
    EXPECT_EQ(connection->coordinator().Register(&context, request, &response).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  {
    grpc::ClientContext context;
    auto stream = connection->coordinator().Session(&context);
    v1::WorkerMessage open;
    open.mutable_open()->set_worker_id("enc0-1");
    stream->Write(open);
    v1::CoordinatorMessage reply;
    EXPECT_FALSE(stream->Read(&reply));
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_THAT(log, HasSubstr("rejected Coordinator.Register from ipv4:127.0.0.1:"));
  EXPECT_THAT(log, HasSubstr("rejected Admin.Status from ipv4:127.0.0.1:"));
  EXPECT_THAT(log, HasSubstr("rejected KeyValue.Wait from ipv4:127.0.0.1:"));
  EXPECT_THAT(log, HasSubstr("rejected Coordinator.Session from ipv4:127.0.0.1:"));
  EXPECT_THAT(log, HasSubstr("wrong run token"));
  EXPECT_THAT(log, HasSubstr("missing run token"));
  EXPECT_THAT(log, Not(HasSubstr(wrong)));
  EXPECT_THAT(log, Not(HasSubstr(kToken)));
  // Nothing was admitted; Status never shows the token.
  auto status = AdminClient(Connect()).Status();
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(status->workers_size(), 0);
  EXPECT_THAT(status->DebugString(), Not(HasSubstr(kToken)));
}

TEST_F(ServerTest, SilentWorkerIsDeclaredDeadAfterTheTimeout) {
  // Long enough that no heartbeating worker, slowed by a loaded machine, is taken for silent.
  constexpr absl::Duration kTimeout = absl::Seconds(5);
  // How late the loss may be seen on a loaded machine; only a missed timeout exceeds it.
  constexpr absl::Duration kSlack = absl::Seconds(30);
  StartServer(TinySpec(absl::ToDoubleSeconds(kTimeout)));
  auto workers = StartFourWorkers();
  EXPECT_DOUBLE_EQ(workers[1]->assignment().heartbeat_interval_s(), 1.0);  // timeout / 5
  // The server last heard from the worker no earlier than `asked - age`: its clock read `asked`
  // or later when it answered. Later messages only move that time on, so the worker cannot be
  // declared dead before `asked - age + kTimeout`.
  const absl::Time asked = absl::Now();
  const v1::StatusResponse before = server_->Status();
  auto silent = std::find_if(before.workers().begin(), before.workers().end(), [&](const auto& w) {
    return w.worker_id() == workers[1]->worker_id();
  });
  ASSERT_NE(silent, before.workers().end());
  ASSERT_TRUE(silent->alive());
  const absl::Time earliest_loss = asked - absl::Seconds(silent->last_heartbeat_age_s()) + kTimeout;
  const absl::Time paused = absl::Now();
  workers[1]->PauseHeartbeats(true);
  auto change = NextOf(*workers[0], v1::CoordinatorMessage::kMembershipChange, kTimeout + kSlack);
  const absl::Time seen = absl::Now();
  ASSERT_TRUE(change.ok()) << change.status();
  EXPECT_GE(seen, earliest_loss) << "declared dead " << (earliest_loss - seen)
                                 << " before the heartbeat timeout ran out";
  EXPECT_LE(seen - paused, kTimeout + kSlack);
  EXPECT_EQ(change->membership_change().generation(), 2);
  ASSERT_EQ(change->membership_change().lost_size(), 1);
  EXPECT_EQ(change->membership_change().lost(0).worker_id(), workers[1]->worker_id());
  EXPECT_THAT(change->membership_change().reason(), HasSubstr("no heartbeat for"));
  // The others got it too, and the silent one's session was ended.
  auto other = NextOf(*workers[3], v1::CoordinatorMessage::kMembershipChange);
  ASSERT_TRUE(other.ok());
  auto ended = NextOf(*workers[1], v1::CoordinatorMessage::kMembershipChange, absl::Seconds(10));
  EXPECT_EQ(ended.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(std::string(ended.status().message()), HasSubstr("declared dead"));
  auto status = AdminClient(Connect()).Status();
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(status->generation(), 2);
  // Its encoder replica left the run: nothing is missing, the pool is one replica smaller.
  EXPECT_EQ(status->missing_size(), 0);
  EXPECT_EQ(status->encoder_replicas(), 1);
  ASSERT_EQ(status->pool_changes_size(), 1);
  EXPECT_EQ(status->pool_changes(0).replica(), 1);
  // The heartbeating workers, registered before the silent one went quiet, have by now been up
  // longer than the timeout (the loss came no earlier than a timeout after its last message), and
  // they are alive and recently heard from.
  int alive = 0;
  for (const auto& w : status->workers()) {
    if (!w.alive()) continue;
    ++alive;
    EXPECT_LT(w.last_heartbeat_age_s(), absl::ToDoubleSeconds(kTimeout)) << w.worker_id();
  }
  EXPECT_EQ(alive, 3);
  for (auto& w : workers) (void)w->Close(absl::Seconds(5));
}

TEST_F(ServerTest, SessionWithoutOpenIsEndedAtTheHeartbeatTimeout) {
  StartServer(TinySpec(/*heartbeat_timeout_s=*/1));
  auto connection = Connect();
  grpc::ClientContext context;
  connection->PrepareContext(&context, absl::Seconds(60));
  const absl::Time start = absl::Now();
  auto stream = connection->coordinator().Session(&context);
  v1::CoordinatorMessage reply;
  EXPECT_FALSE(stream->Read(&reply));
  const grpc::Status status = stream->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_THAT(status.error_message(), HasSubstr("no SessionOpen within 1s"));
  // Not before the timeout; the upper bound only has to tell a missed timeout from a slow machine.
  EXPECT_GE(absl::Now() - start, absl::Seconds(1));
  EXPECT_LT(absl::Now() - start, absl::Seconds(1) + absl::Seconds(30));
}

TEST_F(ServerTest, CrashedWorkerIsLostAtOnce) {
  StartServer(TinySpec(/*heartbeat_timeout_s=*/30));
  auto workers = StartFourWorkers();
  const absl::Time crashed = absl::Now();
  workers[1]->Cancel();  // encoder rank 1
  auto change = NextOf(*workers[0], v1::CoordinatorMessage::kMembershipChange);
  ASSERT_TRUE(change.ok()) << change.status();
  EXPECT_LT(absl::Now() - crashed, absl::Seconds(10));
  EXPECT_EQ(change->membership_change().lost(0).worker_id(), workers[1]->worker_id());
  EXPECT_THAT(change->membership_change().reason(), HasSubstr("session ended"));
  for (auto& w : workers) (void)w->Close(absl::Seconds(5));
}

TEST_F(ServerTest, ACrashedLlmWorkerFailsTheRunAndEndsTheOthersSessions) {
  StartServer(TinySpec(/*heartbeat_timeout_s=*/30));
  auto workers = StartFourWorkers();
  workers[2]->Cancel();  // llm rank 0
  auto stop = NextOf(*workers[0], v1::CoordinatorMessage::kStop);
  ASSERT_TRUE(stop.ok()) << stop.status();
  EXPECT_THAT(stop->stop().reason(), HasSubstr(workers[2]->worker_id()));
  EXPECT_THAT(stop->stop().reason(), HasSubstr("held by no other worker"));
  EXPECT_EQ(server_->Status().state(), v1::RUN_STATE_FAILED);
  for (auto& w : workers) (void)w->Close(absl::Seconds(5));
}

TEST_F(ServerTest, StepRunsThroughGradNormToCommit) {
  StartServer(TinySpec(10, /*steps=*/1), std::make_unique<FixedPlanner>());
  auto workers = StartFourWorkers();
  std::vector<v1::StepPlan> plans;
  for (auto& w : workers) {
    auto m = NextOf(*w, v1::CoordinatorMessage::kStepPlan);
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_EQ(m->step_plan().rank_plan().rank(), w->assignment().world_rank());
    EXPECT_EQ(m->step_plan().rank_plan().step(), 0);
    EXPECT_EQ(m->step_plan().rank_plan().generation(), 1);
    EXPECT_EQ(m->step_plan().grad_norm_contributors(), 3);
    plans.push_back(m->step_plan());
  }
  // dp-0 ranks: encoder 0 (worker 0), llm 0 and 1 (workers 2, 3).
  const double partials[] = {9.0, 0.0, 16.0, 0.0};
  for (int i : {0, 2, 3}) {
    v1::GradNormPartial p;
    p.set_step(0);
    p.set_generation(1);
    p.set_module(i == 0 ? v1::MODULE_ENCODER : v1::MODULE_LLM);
    p.set_sum_squares(partials[i]);
    ASSERT_TRUE(workers[i]->SendGradNormPartial(p).ok());
  }
  for (auto& w : workers) {
    auto m = NextOf(*w, v1::CoordinatorMessage::kGradNorm);
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_DOUBLE_EQ(m->grad_norm().norm(), 5.0);
    EXPECT_DOUBLE_EQ(m->grad_norm().clip_coefficient(), 1.0 / (5.0 + 1e-6));
  }
  for (size_t i = 0; i < workers.size(); ++i) {
    v1::StepReport r;
    r.set_step(0);
    r.set_generation(1);
    r.set_ok(true);
    if (i == 2) {
      r.set_loss_sum(20.0);
      r.set_loss_tokens(8);
    }
    ASSERT_TRUE(workers[i]->SendReport(r).ok());
  }
  for (auto& w : workers) {
    auto m = NextOf(*w, v1::CoordinatorMessage::kCommit);
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_DOUBLE_EQ(m->commit().loss(), 2.5);
    auto stop = NextOf(*w, v1::CoordinatorMessage::kStop);
    ASSERT_TRUE(stop.ok()) << stop.status();
    EXPECT_EQ(stop->stop().reason(), "completed 1 steps");
    EXPECT_TRUE(w->Close(absl::Seconds(10)).ok());
  }
  EXPECT_EQ(server_->WaitForEnd(absl::Seconds(10)), v1::RUN_STATE_DONE);
  const v1::StatusResponse status = server_->Status();
  EXPECT_EQ(status.committed_steps(), 1);
  ASSERT_EQ(status.recent_steps_size(), 1);
  EXPECT_TRUE(status.recent_steps(0).committed());
  EXPECT_DOUBLE_EQ(status.recent_steps(0).loss(), 2.5);
}

TEST_F(ServerTest, KeyValueStoreSemantics) {
  StartServer(TinySpec());
  KeyValueClient kv(Connect(), 1);
  ASSERT_TRUE(kv.Set("a", std::string("\0\xff", 2)).ok());
  EXPECT_EQ(*kv.Get("a", absl::Seconds(1)), std::string("\0\xff", 2));
  EXPECT_TRUE(*kv.Check({"a"}));
  EXPECT_FALSE(*kv.Check({"a", "b"}));
  EXPECT_EQ(*kv.NumKeys(), 1);
  EXPECT_EQ(*kv.CompareSet("a", std::string("\0\xff", 2), "swapped"), "swapped");
  EXPECT_EQ(*kv.CompareSet("a", "nope", "x"), "swapped");
  EXPECT_TRUE(*kv.Delete("a"));
  EXPECT_FALSE(*kv.Delete("a"));
  EXPECT_EQ(*kv.NumKeys(), 0);

  // Get waits for a key written later by someone else: the writer sets it once the server holds
  // the Get as a pending wait.
  ASSERT_EQ(server_->pending_key_value_waits(), 0);
  std::thread writer([&] {
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    while (server_->pending_key_value_waits() == 0 && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    EXPECT_EQ(server_->pending_key_value_waits(), 1) << "the Get never waited";
    KeyValueClient other(Connect(), 1);
    ASSERT_TRUE(other.Set("late", "here").ok());
  });
  auto late = kv.Get("late", absl::Seconds(20));
  writer.join();
  ASSERT_TRUE(late.ok()) << late.status();
  EXPECT_EQ(*late, "here");
  EXPECT_EQ(server_->pending_key_value_waits(), 0);
  ASSERT_TRUE(kv.Wait({"late"}, absl::Seconds(1)).ok());

  // Wait times out at its deadline, not before.
  const absl::Time start = absl::Now();
  absl::Status timed_out = kv.Wait({"late", "never"}, absl::Milliseconds(400));
  const absl::Duration waited = absl::Now() - start;
  EXPECT_EQ(timed_out.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(timed_out.message()), HasSubstr("'never'"));
  EXPECT_GE(waited, absl::Milliseconds(400));
  EXPECT_LT(waited, absl::Milliseconds(400) + absl::Seconds(30));
  EXPECT_EQ(kv.Get("never", absl::Milliseconds(100)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(kv.Get("never", absl::ZeroDuration()).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(kv.Wait({"x"}, absl::ZeroDuration()).code(), absl::StatusCode::kInvalidArgument);

  // Another generation's keyspace is refused.
  KeyValueClient stale(Connect(), 7);
  auto refused = stale.Set("a", "b");
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(refused.message()), HasSubstr("generation 7"));
}

TEST_F(ServerTest, AddIsAtomicUnder32ConcurrentClients) {
  StartServer(TinySpec());
  constexpr int kClients = 32;
  constexpr int kAdds = 25;
  std::vector<std::vector<int64_t>> seen(kClients);
  std::vector<std::thread> threads;
  for (int c = 0; c < kClients; ++c) {
    threads.emplace_back([&, c, connection = Connect(kToken, /*dedicated=*/true)] {
      KeyValueClient kv(connection, 1);
      for (int i = 0; i < kAdds; ++i) {
        auto value = kv.Add("counter", 1);
        ASSERT_TRUE(value.ok()) << value.status();
        seen[c].push_back(*value);
      }
    });
  }
  for (auto& t : threads) t.join();
  std::vector<int64_t> all;
  for (const auto& s : seen) all.insert(all.end(), s.begin(), s.end());
  std::sort(all.begin(), all.end());
  ASSERT_EQ(all.size(), static_cast<size_t>(kClients * kAdds));
  for (size_t i = 0; i < all.size(); ++i) ASSERT_EQ(all[i], static_cast<int64_t>(i) + 1);
  EXPECT_EQ(*KeyValueClient(Connect(), 1).Get("counter", absl::Seconds(1)),
            std::to_string(kClients * kAdds));
}

TEST_F(ServerTest, ScaleSetsThePoolsTargetWithinItsBoundsAndRefusesOtherSizes) {
  StartServer(TinySpec());
  AdminClient admin(Connect());
  // Status as the CLI sees it, less the clocks that move on their own.
  auto status_now = [&]() -> std::string {
    auto status = admin.Status();
    EXPECT_TRUE(status.ok()) << status.status();
    if (!status.ok()) return "";
    status->clear_uptime_s();
    status->clear_cpu_seconds();
    status->clear_missing_deadline_s();
    return status->DebugString();
  };
  const std::string before = status_now();
  // 5 requested; TinySpec's encoder.layout.dp is 2 and failure.min_encoder_replicas 1.
  auto refused = admin.Scale(5);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr("encoder_replicas=5 is out of range: the pool holds 1 "
                        "(failure.min_encoder_replicas) to 2 (encoder.layout.dp) replicas"));
  EXPECT_EQ(status_now(), before);
  auto invalid = admin.Scale(-1);
  EXPECT_EQ(invalid.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(invalid.status().message()), HasSubstr("encoder_replicas=-1"));
  EXPECT_EQ(status_now(), before);
  // On the wire it is gRPC's INVALID_ARGUMENT.
  auto connection = Connect();
  grpc::ClientContext context;
  connection->PrepareContext(&context, absl::Seconds(10));
  v1::ScaleRequest request;
  request.set_encoder_replicas(3);
  v1::ScaleResponse response;
  const grpc::Status raw = connection->admin().Scale(&context, request, &response);
  EXPECT_EQ(raw.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  // A size in range is the pool's new target.
  auto scaled = admin.Scale(1);
  ASSERT_TRUE(scaled.ok()) << scaled.status();
  EXPECT_EQ(scaled->requested_encoder_replicas(), 1);
  auto status = admin.Status();
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(status->encoder_replicas_target(), 1);
}

// A parameter file as common/nn/export.h lays it out: the 32-byte header counting `entries`,
// then `body` standing for the entries (the coordinator copies them as bytes).
std::string ParameterFileBytes(uint64_t entries, const std::string& body) {
  std::string bytes("HETPARAM", 8);
  auto put = [&](uint64_t value, int size) {
    for (int i = 0; i < size; ++i) bytes.push_back(static_cast<char>(value >> (8 * i)));
  };
  put(1, 4);  // version
  put(0, 4);  // flags
  put(entries, 8);
  put(crc32_z(crc32_z(0, Z_NULL, 0), reinterpret_cast<const Bytef*>(bytes.data()), 24), 4);
  put(0, 4);
  return bytes + body;
}

std::string ReadWhole(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

TEST_F(ServerTest, PutOutputWritesWholeFilesIntoTheRunDirectoryAndJoinsStageParts) {
  std::string pattern = (std::filesystem::temp_directory_path() / "server_test.XXXXXX").string();
  ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
  const std::string run_dir = pattern + "/run";
  v1::RunSpec spec = TinySpec();
  spec.mutable_run()->set_out_dir(run_dir);
  spec.mutable_llm()->mutable_layout()->set_pp(2);
  StartServer(spec);
  std::unique_ptr<WorkerSession> worker = StartWorker(v1::WORKER_ROLE_LLM, "llm-a");
  ASSERT_NE(worker, nullptr);
  auto connection = Connect();
  // Local files, as a worker leaves them in its scratch directory. 2.5 MiB: three chunks.
  std::string big(size_t{5} << 19, '\0');
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>((i * 131) >> 3);
  const std::string stage0 = ParameterFileBytes(2, "first stage's two entries");
  const std::string stage1 = ParameterFileBytes(3, big);
  const std::map<std::string, std::string> local = {
      {"sums", "{\"sum\": 1.5}\n"}, {"stage0", stage0}, {"stage1", stage1}};
  for (const auto& [name, bytes] : local) {
    std::ofstream(pattern + "/" + name, std::ios::binary) << bytes;
  }
  const absl::Duration timeout = absl::Seconds(20);
  const std::string id = worker->worker_id();
  ASSERT_TRUE(
      PutOutputFile(*connection, id, "workers/rank-2-llm.json", pattern + "/sums", timeout).ok());
  EXPECT_EQ(ReadWhole(run_dir + "/workers/rank-2-llm.json"), local.at("sums"));
  // The second stage's part first: nothing is joined until both are in.
  ASSERT_TRUE(
      PutOutputFile(*connection, id, "model/llm.hpar.stage-1", pattern + "/stage1", timeout).ok());
  EXPECT_FALSE(std::filesystem::exists(run_dir + "/model/llm.hpar"));
  EXPECT_EQ(ReadWhole(run_dir + "/model/llm.hpar.stage-1"), stage1);
  ASSERT_TRUE(
      PutOutputFile(*connection, id, "model/llm.hpar.stage-0", pattern + "/stage0", timeout).ok());
  // One header counting all five entries, then stage 0's entries and stage 1's.
  EXPECT_EQ(ReadWhole(run_dir + "/model/llm.hpar"),
            ParameterFileBytes(5, "first stage's two entries" + big));
  EXPECT_FALSE(std::filesystem::exists(run_dir + "/model/llm.hpar.stage-0"));
  EXPECT_FALSE(std::filesystem::exists(run_dir + "/model/llm.hpar.stage-1"));

  // Refused: a name outside the outputs, a stage the layout lacks, an unknown worker, a wrong
  // token. None leaves a file behind.
  for (const std::string name : {"../escape.json", "/etc/passwd", "model/llm.hpar.stage-2",
                                 "workers/rank-x-llm.json", "model/vision.hpar", "config.yaml"}) {
    const absl::Status refused = PutOutputFile(*connection, id, name, pattern + "/sums", timeout);
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << name << ": " << refused;
    EXPECT_THAT(std::string(refused.message()), HasSubstr(name)) << refused;
  }
  const absl::Status stranger =
      PutOutputFile(*connection, "w-999", "model/encoder.hpar", pattern + "/sums", timeout);
  EXPECT_EQ(stranger.code(), absl::StatusCode::kPermissionDenied) << stranger;
  const absl::Status no_token = PutOutputFile(*Connect("wrong-token-0000000000"), id,
                                              "model/encoder.hpar", pattern + "/sums", timeout);
  EXPECT_EQ(no_token.code(), absl::StatusCode::kUnauthenticated) << no_token;
  // A file whose bytes do not match the checksum its sender gives is not written.
  {
    grpc::ClientContext context;
    connection->PrepareContext(&context, timeout);
    v1::PutOutputResponse response;
    auto writer = connection->coordinator().PutOutput(&context, &response);
    v1::OutputChunk chunk;
    chunk.set_worker_id(id);
    chunk.set_name("model/encoder.hpar");
    chunk.set_total_bytes(4);
    chunk.set_data("abcd");
    chunk.set_last(true);
    chunk.set_crc32(12345);
    writer->Write(chunk);
    writer->WritesDone();
    const grpc::Status damaged = writer->Finish();
    EXPECT_EQ(damaged.error_code(), grpc::StatusCode::DATA_LOSS);
    EXPECT_THAT(damaged.error_message(), HasSubstr("CRC-32 12345"));
  }
  EXPECT_FALSE(std::filesystem::exists(run_dir + "/model/encoder.hpar"));
  std::vector<std::string> left;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(run_dir)) {
    if (entry.is_regular_file()) left.push_back(entry.path().lexically_relative(run_dir));
  }
  std::sort(left.begin(), left.end());
  EXPECT_THAT(left, testing::ElementsAre("model/llm.hpar", "workers/rank-2-llm.json"));
  std::filesystem::remove_all(pattern);
}

// A shutdown does not wait for a preparation that may last hours (another process generating the
// data set): it cancels it, and the run does not fail for it.
TEST_F(ServerTest, ShutdownCancelsThePlannersPreparationInsteadOfWaitingForIt) {
  auto cancelled = std::make_shared<absl::Notification>();
  StartServer(TinySpec(), std::make_unique<PreparingPlanner>(cancelled));
  EXPECT_FALSE(cancelled->HasBeenNotified());
  const absl::Time start = absl::Now();
  server_->Shutdown(absl::Seconds(2));
  EXPECT_TRUE(cancelled->HasBeenNotified());
  EXPECT_LT(absl::Now() - start, absl::Seconds(60));
  EXPECT_EQ(server_->state(), v1::RUN_STATE_WAITING);
}

TEST_F(ServerTest, ListenFailureIsReported) {
  StartServer(TinySpec());
  ServerOptions options;
  options.listen_address = server_->address();  // taken
  options.token = kToken;
  auto second = CoordinatorServer::Create(TinySpec(), options);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(second.status().message()), HasSubstr(server_->address()));
}

}  // namespace
}  // namespace hetpar::coordinator
