// TLS and mutual TLS on the coordinator's endpoint, with certificates made by the openssl
// command line for this test.
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "common/control/client.h"
#include "coordinator/server.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hetpar::coordinator {
namespace {

constexpr char kToken[] = "tls-test-token-77";

class TlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    char pattern[] = "/tmp/hetpar-tls-test-XXXXXX";
    ASSERT_NE(mkdtemp(pattern), nullptr);
    dir_ = new std::string(pattern);
    // Two CAs (the second signs nothing the server trusts), a server certificate for
    // 127.0.0.1 and a client certificate, all EC P-256 (fast to make).
    const std::string script = absl::StrCat(
        "set -e; cd ", *dir_, "; ",
        "key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out $1 "
        "2>/dev/null; }; ",
        "key ca.key; openssl req -x509 -new -key ca.key -out ca.pem -days 2 "
        "-subj '/CN=hetpar test CA'; ",
        "key other-ca.key; openssl req -x509 -new -key other-ca.key -out other-ca.pem -days 2 "
        "-subj '/CN=other CA'; ",
        "key server.key; openssl req -new -key server.key -out server.csr -subj '/CN=localhost'; ",
        "printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\n' > server.ext; ",
        "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial "
        "-out server.pem -days 2 -extfile server.ext 2>/dev/null; ",
        "key client.key; openssl req -new -key client.key -out client.csr -subj '/CN=worker'; ",
        "openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial "
        "-out client.pem -days 2 2>/dev/null; ",
        "key rogue.key; openssl req -new -key rogue.key -out rogue.csr -subj '/CN=rogue'; ",
        "openssl x509 -req -in rogue.csr -CA other-ca.pem -CAkey other-ca.key "
        "-CAcreateserial -out rogue.pem -days 2 2>/dev/null");
    const std::string script_path = *dir_ + "/make-certs.sh";
    std::ofstream(script_path) << script << "\n";
    ASSERT_EQ(std::system(("sh " + script_path).c_str()), 0) << script;
  }
  static void TearDownTestSuite() {
    std::filesystem::remove_all(*dir_);
    delete dir_;
  }
  static std::string File(const std::string& name) { return *dir_ + "/" + name; }

  void StartServer(bool mutual) {
    v1::RunSpec spec;
    spec.mutable_run()->set_name("tls");
    spec.mutable_run()->set_steps(1);
    spec.mutable_encoder()->mutable_layout()->set_dp(1);
    spec.mutable_llm()->mutable_layout()->set_dp(1);
    spec.mutable_coordinator()->set_heartbeat_timeout_s(10);
    spec.mutable_coordinator()->set_register_timeout_s(60);
    ServerOptions options;
    options.listen_address = "127.0.0.1:0";
    options.token = kToken;
    options.tls.cert_file = File("server.pem");
    options.tls.key_file = File("server.key");
    if (mutual) options.tls.client_ca_file = File("ca.pem");
    auto server = CoordinatorServer::Create(spec, options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }

  absl::StatusOr<v1::StatusResponse> StatusWith(ClientTlsOptions tls,
                                                const std::string& token = kToken) {
    ClientOptions options;
    options.address = server_->address();
    options.token = token;
    options.tls = std::move(tls);
    options.rpc_timeout = absl::Seconds(5);
    auto connection = CoordinatorConnection::Create(options);
    if (!connection.ok()) return connection.status();
    return AdminClient(*connection).Status();
  }

  static std::string* dir_;
  std::unique_ptr<CoordinatorServer> server_;
};

std::string* TlsTest::dir_ = nullptr;

TEST_F(TlsTest, ClientTrustingTheCaConnects) {
  StartServer(/*mutual=*/false);
  ClientTlsOptions tls;
  tls.ca_file = File("ca.pem");
  auto status = StatusWith(tls);
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->run_name(), "tls");
  // Registration works over TLS too.
  ClientOptions options;
  options.address = server_->address();
  options.token = kToken;
  options.tls = tls;
  WorkerSession::Options worker;
  worker.registration.set_role(v1::WORKER_ROLE_ENCODER);
  auto session = WorkerSession::Start(*CoordinatorConnection::Create(options), worker);
  ASSERT_TRUE(session.ok()) << session.status();
  EXPECT_EQ((*session)->assignment().ranks(0).module(), v1::MODULE_ENCODER);
  EXPECT_TRUE((*session)->Close(absl::Seconds(5)).ok());
}

TEST_F(TlsTest, PlaintextOrUntrustedClientsFailTheHandshake) {
  StartServer(false);
  EXPECT_EQ(StatusWith({}).status().code(), absl::StatusCode::kUnavailable);
  ClientTlsOptions other;
  other.ca_file = File("other-ca.pem");
  EXPECT_EQ(StatusWith(other).status().code(), absl::StatusCode::kUnavailable);
}

// A client whose CA did not sign the coordinator's certificate learns why at once, instead of
// waiting out its connect timeout to read "is it running?". (A client without TLS sees only the
// socket closed, which says nothing certain: it waits, and the error names the last failure.)
TEST_F(TlsTest, AnUntrustedCertificateEndsTheWaitForTheCoordinatorSayingWhy) {
  StartServer(false);
  ClientOptions options;
  options.address = server_->address();
  options.token = kToken;
  options.tls.ca_file = File("other-ca.pem");
  auto connection = CoordinatorConnection::Create(options);
  ASSERT_TRUE(connection.ok()) << connection.status();
  const absl::Status waited = (*connection)->WaitForConnected(absl::Seconds(120));
  EXPECT_EQ(waited.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(waited.message()),
              ::testing::HasSubstr("cannot connect securely to the coordinator at " +
                                   server_->address()));
  EXPECT_THAT(std::string(waited.message()), ::testing::HasSubstr("check --tls-ca"));
}

// A client without TLS sees the socket closed: the wait goes on (a coordinator going down looks
// the same), and its error says that a coordinator serving TLS may be why.
TEST_F(TlsTest, APlaintextClientsWaitEndsSayingTheCoordinatorMayServeTls) {
  StartServer(false);
  ClientOptions options;
  options.address = server_->address();
  options.token = kToken;
  auto connection = CoordinatorConnection::Create(options);
  ASSERT_TRUE(connection.ok()) << connection.status();
  const absl::Status waited = (*connection)->WaitForConnected(absl::Seconds(4));
  EXPECT_EQ(waited.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(waited.message()),
              ::testing::HasSubstr("cannot reach the coordinator at " + server_->address()));
  EXPECT_THAT(std::string(waited.message()),
              ::testing::HasSubstr("this side uses no TLS, and a coordinator that serves TLS "
                                   "closes such connections"))
      << waited;
}

TEST_F(TlsTest, TokenIsStillRequiredOverTls) {
  StartServer(false);
  ClientTlsOptions tls;
  tls.ca_file = File("ca.pem");
  EXPECT_EQ(StatusWith(tls, "not-the-token").status().code(), absl::StatusCode::kUnauthenticated);
}

TEST_F(TlsTest, MutualTlsNeedsAClientCertificateFromTheCa) {
  StartServer(/*mutual=*/true);
  ClientTlsOptions tls;
  tls.ca_file = File("ca.pem");
  EXPECT_EQ(StatusWith(tls).status().code(), absl::StatusCode::kUnavailable);
  ClientTlsOptions rogue = tls;
  rogue.cert_file = File("rogue.pem");
  rogue.key_file = File("rogue.key");
  EXPECT_EQ(StatusWith(rogue).status().code(), absl::StatusCode::kUnavailable);
  ClientTlsOptions good = tls;
  good.cert_file = File("client.pem");
  good.key_file = File("client.key");
  auto status = StatusWith(good);
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->state(), v1::RUN_STATE_WAITING);
}

}  // namespace
}  // namespace hetpar::coordinator
