#include "common/control/security.h"

#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hetpar::coordinator {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

class SecurityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/hetpar-security-test-XXXXXX";
    ASSERT_NE(mkdtemp(pattern), nullptr);
    dir_ = pattern;
    unsetenv(kTokenEnvVar);
  }
  void TearDown() override {
    unsetenv(kTokenEnvVar);
    std::filesystem::remove_all(dir_);
  }
  std::string Write(const std::string& name, const std::string& text) {
    const std::string path = dir_ + "/" + name;
    std::ofstream(path) << text;
    return path;
  }
  std::string dir_;
};

TEST_F(SecurityTest, ValidateTokenNamesTheProblemButNotTheToken) {
  EXPECT_TRUE(ValidateToken("abcdefgh", "x").ok());
  auto short_token = ValidateToken("abc", "file t");
  EXPECT_EQ(short_token.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(short_token.message()), HasSubstr("has 3 characters; expected 8 to"));
  EXPECT_THAT(std::string(short_token.message()), HasSubstr("file t"));
  EXPECT_THAT(std::string(short_token.message()), Not(HasSubstr("abc")));
  auto spaced = ValidateToken("secret token", "HETPAR_TOKEN");
  EXPECT_EQ(spaced.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(spaced.message()), HasSubstr("position 6"));
  EXPECT_THAT(std::string(spaced.message()), Not(HasSubstr("secret")));
}

TEST_F(SecurityTest, ReadTokenFileTrimsWhitespace) {
  auto token = ReadTokenFile(Write("token", "  s3cr3t-t0ken\n"));
  ASSERT_TRUE(token.ok()) << token.status();
  EXPECT_EQ(token->value, "s3cr3t-t0ken");
  EXPECT_EQ(token->origin, "file " + dir_ + "/token");
  auto missing = ReadTokenFile(dir_ + "/absent");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr(dir_ + "/absent"));
}

TEST_F(SecurityTest, ResolveTokenOrder) {
  const std::string flag = Write("flag", "from-the-flag");
  const std::string config = Write("config", "from-the-config");
  EXPECT_EQ(ResolveToken("", "").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ResolveToken("", config)->value, "from-the-config");
  setenv(kTokenEnvVar, "from-the-environment", 1);
  EXPECT_EQ(ResolveToken("", config)->value, "from-the-environment");
  EXPECT_EQ(ResolveToken("", config)->origin, "HETPAR_TOKEN");
  EXPECT_EQ(ResolveToken(flag, config)->value, "from-the-flag");
}

TEST_F(SecurityTest, GeneratedTokensAreRandomHex) {
  auto a = GenerateToken();
  auto b = GenerateToken();
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->size(), 64u);
  EXPECT_NE(*a, *b);
  EXPECT_EQ(a->find_first_not_of("0123456789abcdef"), std::string::npos);
  EXPECT_TRUE(ValidateToken(*a, "generated").ok());
}

TEST_F(SecurityTest, LocalTokenFileIsPrivate) {
  setenv("XDG_RUNTIME_DIR", dir_.c_str(), 1);
  const std::string path = LocalTokenPath(4321);
  EXPECT_EQ(path, dir_ + "/hetpar/coordinator-4321.token");
  ASSERT_TRUE(WriteLocalTokenFile(path, "0123456789abcdef").ok());
  struct stat st;
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  ASSERT_EQ(stat((dir_ + "/hetpar").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  EXPECT_EQ(ReadTokenFile(path)->value, "0123456789abcdef");
  // A directory others can read is refused.
  ASSERT_EQ(chmod((dir_ + "/hetpar").c_str(), 0755), 0);
  EXPECT_EQ(WriteLocalTokenFile(path, "0123456789abcdef").code(),
            absl::StatusCode::kPermissionDenied);
  unsetenv("XDG_RUNTIME_DIR");
}

TEST_F(SecurityTest, TokenMatchesIsExact) {
  EXPECT_TRUE(TokenMatches("Bearer abcdefgh", "Bearer abcdefgh"));
  EXPECT_FALSE(TokenMatches("Bearer abcdefgh", "Bearer abcdefgi"));
  EXPECT_FALSE(TokenMatches("Bearer abcdefgh", "Bearer abcdefg"));
  EXPECT_FALSE(TokenMatches("Bearer abcdefgh", std::string_view("Bearer abcdefgh\0", 16)));
  EXPECT_FALSE(TokenMatches("Bearer abcdefgh", ""));
}

TEST_F(SecurityTest, PortOf) {
  EXPECT_EQ(PortOf("127.0.0.1:50051"), 50051);
  EXPECT_EQ(PortOf("dns:///coordinator.local:7000"), 7000);
  EXPECT_EQ(PortOf("[::1]:9"), 9);
  EXPECT_EQ(PortOf("[::1]"), -1);
  EXPECT_EQ(PortOf("host"), -1);
  EXPECT_EQ(PortOf("host:99999"), -1);
}

TEST_F(SecurityTest, CredentialsNeedTheirFiles) {
  EXPECT_TRUE(MakeServerCredentials({}).ok());
  EXPECT_TRUE(MakeChannelCredentials({}).ok());
  ServerTlsOptions server;
  server.cert_file = dir_ + "/absent.pem";
  EXPECT_EQ(MakeServerCredentials(server).status().code(), absl::StatusCode::kInvalidArgument);
  server.key_file = dir_ + "/absent.key";
  auto missing = MakeServerCredentials(server);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("absent.pem"));
  ClientTlsOptions client;
  client.cert_file = dir_ + "/c.pem";
  EXPECT_EQ(MakeChannelCredentials(client).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace hetpar::coordinator
