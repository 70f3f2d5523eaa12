// A `hetpar coordinator` process facing a client that holds the token but sends absurd sizes: a
// 1 MB host, a 50 MB data address and a 64 MB rendezvous value (and sizes just past each field's
// limit) are refused with INVALID_ARGUMENT or RESOURCE_EXHAUSTED naming the limit, the
// coordinator keeps serving, and its log stays small.
#include <filesystem>
#include <string>

#include "common/control/client.h"
#include "gmock/gmock.h"
#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "tests/coordinator/coordinator_test_util.h"

namespace hetpar::testing {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kToken[] = "input-limits-test-token-0123456789abcdef";

class InputLimitsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    setenv("XDG_RUNTIME_DIR", dir_.path().c_str(), 1);
    setenv("HETPAR_TOKEN", kToken, 1);
    auto coordinator = StartCoordinator({"--config", kSourceDir + "/configs/tiny.yaml"},
                                        dir_.File("coordinator.log"));
    unsetenv("HETPAR_TOKEN");
    ASSERT_TRUE(coordinator.ok()) << coordinator.status();
    coordinator_.emplace(*std::move(coordinator));
    coordinator::ClientOptions options;
    options.address = coordinator_->address;
    options.token = kToken;
    options.rpc_timeout = absl::Seconds(60);
    auto connection = coordinator::CoordinatorConnection::Create(options);
    ASSERT_TRUE(connection.ok()) << connection.status();
    connection_ = *connection;
  }

  grpc::Status Register(const std::string& host, const std::string& data_address) {
    v1::RegisterRequest request;
    request.set_role(v1::WORKER_ROLE_ENCODER);
    request.set_host(host);
    request.set_data_address(data_address);
    v1::RegisterResponse response;
    grpc::ClientContext context;
    connection_->PrepareContext(&context, absl::Seconds(60));
    return connection_->coordinator().Register(&context, request, &response);
  }

  grpc::Status SetValue(const std::string& key, const std::string& value) {
    v1::KvSetRequest request;
    request.set_generation(1);
    request.set_key(key);
    request.set_value(value);
    v1::KvSetResponse response;
    grpc::ClientContext context;
    connection_->PrepareContext(&context, absl::Seconds(60));
    return connection_->key_value().Set(&context, request, &response);
  }

  TempDir dir_;
  std::optional<CoordinatorProcess> coordinator_;
  std::shared_ptr<coordinator::CoordinatorConnection> connection_;
};

TEST_F(InputLimitsTest, OversizedInputsAreRefusedNamingTheLimitAndTheCoordinatorKeepsServing) {
  const grpc::Status host = Register(std::string(1 << 20, 'h'), "addr");
  EXPECT_EQ(host.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(host.error_message(), HasSubstr("host is 1048576 bytes; the limit is 253 bytes"));

  const grpc::Status address = Register("10.0.0.7", std::string(50 << 20, 'a'));
  EXPECT_EQ(address.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << address.error_message();
  EXPECT_THAT(address.error_message(), HasSubstr("8388608"));  // the request limit

  const grpc::Status address_past_limit = Register("10.0.0.7", std::string(100 << 10, 'a'));
  EXPECT_EQ(address_past_limit.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(address_past_limit.error_message(),
              HasSubstr("data_address is 102400 bytes; the limit is 65536 bytes"));

  const grpc::Status value = SetValue("k", std::string(64 << 20, 'v'));
  EXPECT_EQ(value.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << value.error_message();
  EXPECT_THAT(value.error_message(), HasSubstr("8388608"));

  const grpc::Status value_past_limit = SetValue("k", std::string(2 << 20, 'v'));
  EXPECT_EQ(value_past_limit.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(value_past_limit.error_message(),
              HasSubstr("rendezvous value is 2097152 bytes; the limit is 1048576 bytes"));

  // Still serving: a sane worker registers and the status answers.
  EXPECT_TRUE(Register("10.0.0.7", "a-ucx-address").ok());
  EXPECT_TRUE(SetValue("k", "v").ok());
  coordinator::AdminClient admin(connection_);
  auto status = admin.Status();
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->workers_size(), 1);

  // The log names the refusals without the payloads.
  const std::string log = ReadFile(coordinator_->log);
  EXPECT_LT(log.size(), 64u << 10) << "the coordinator's log grew to " << log.size() << " bytes";
  EXPECT_THAT(log, HasSubstr("host is 1048576 bytes"));
  EXPECT_THAT(log, Not(HasSubstr(std::string(300, 'h'))));
}

}  // namespace
}  // namespace hetpar::testing
