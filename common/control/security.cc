#include "common/control/security.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/atomic_file.h"
#include "common/status.h"
#include "grpcpp/security/server_credentials.h"

namespace hetpar::coordinator {

absl::Status ValidateToken(std::string_view token, std::string_view origin) {
  if (token.size() < 8 || token.size() > 4096) {
    return absl::InvalidArgumentError(absl::StrCat("run token from ", std::string(origin), " has ",
                                                   token.size(),
                                                   " characters; expected 8 to 4096"));
  }
  for (size_t i = 0; i < token.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(token[i]);
    if (c <= 0x20 || c >= 0x7f) {
      return absl::InvalidArgumentError(
          absl::StrCat("run token from ", std::string(origin), " has a space or non-printable ",
                       "character at position ", i, "; expected printable ASCII without spaces"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadSmallFile(const std::string& path, std::string_view what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    const int err = errno;
    const std::string reason = std::strerror(err);
    if (err == EACCES) {
      return absl::PermissionDeniedError(
          absl::StrCat("cannot read ", std::string(what), " ", path, ": ", reason));
    }
    return absl::NotFoundError(
        absl::StrCat("cannot read ", std::string(what), " ", path, ": ", reason));
  }
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

absl::StatusOr<RunToken> ReadTokenFile(const std::string& path) {
  absl::StatusOr<std::string> text = ReadSmallFile(path, "run token file");
  if (!text.ok()) return text.status();
  RunToken token{std::string(absl::StripAsciiWhitespace(*text)), "file " + path};
  if (absl::Status s = ValidateToken(token.value, token.origin); !s.ok()) return s;
  return token;
}

absl::StatusOr<RunToken> ResolveToken(const std::string& flag_file,
                                      const std::string& config_file) {
  if (!flag_file.empty()) return ReadTokenFile(flag_file);
  if (const char* env = std::getenv(kTokenFileEnvVar); env != nullptr && env[0] != '\0') {
    return ReadTokenFile(env);
  }
  if (const char* env = std::getenv(kTokenEnvVar); env != nullptr && env[0] != '\0') {
    RunToken token{std::string(absl::StripAsciiWhitespace(env)), kTokenEnvVar};
    if (absl::Status s = ValidateToken(token.value, token.origin); !s.ok()) return s;
    return token;
  }
  if (!config_file.empty()) return ReadTokenFile(config_file);
  return absl::NotFoundError(absl::StrCat("no run token: pass --token-file, set ", kTokenFileEnvVar,
                                          " or ", kTokenEnvVar,
                                          ", or set coordinator.token_file in the RunSpec"));
}

absl::StatusOr<std::string> GenerateToken() {
  unsigned char bytes[32];
  const int fd = ::open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot open /dev/urandom to generate a run token: ", std::strerror(errno)));
  }
  size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t n = ::read(fd, bytes + got, sizeof(bytes) - got);
    if (n <= 0) {
      if (n < 0 && errno == EINTR) continue;
      ::close(fd);
      return absl::UnavailableError("short read from /dev/urandom while generating a run token");
    }
    got += static_cast<size_t>(n);
  }
  ::close(fd);
  static constexpr char kHex[] = "0123456789abcdef";
  std::string token;
  token.reserve(2 * sizeof(bytes));
  for (unsigned char b : bytes) {
    token.push_back(kHex[b >> 4]);
    token.push_back(kHex[b & 15]);
  }
  return token;
}

std::string LocalTokenPath(int port) {
  std::string dir;
  if (const char* runtime = std::getenv("XDG_RUNTIME_DIR"); runtime != nullptr && runtime[0]) {
    dir = absl::StrCat(runtime, "/hetpar");
  } else {
    dir = absl::StrCat("/tmp/hetpar-", ::getuid());
  }
  return absl::StrCat(dir, "/coordinator-", port, ".token");
}

absl::Status WriteLocalTokenFile(const std::string& path, const std::string& token) {
  const std::string dir = path.substr(0, path.rfind('/'));
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return absl::PermissionDeniedError(absl::StrCat("cannot create directory ", dir,
                                                    " for the run token: ", std::strerror(errno)));
  }
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != ::getuid() ||
      (st.st_mode & 077) != 0) {
    return absl::PermissionDeniedError(
        absl::StrCat("directory ", dir,
                     " for the run token must be a directory owned by this user with mode 0700"));
  }
  // Never more open than 0600, not even while it is written; two coordinators writing it at once
  // each write a temporary file of their own.
  return Annotate(WriteFileAtomically(path, token + "\n", AtomicFileOptions{0600}),
                  absl::StrCat("cannot write run token file ", path));
}

bool TokenMatches(std::string_view expected, std::string_view presented) {
  // Compare every byte of the longer string so the time does not depend on where they differ.
  const size_t n = std::max(expected.size(), presented.size());
  unsigned char diff = expected.size() == presented.size() ? 0 : 1;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char a = i < expected.size() ? expected[i] : 0;
    const unsigned char b = i < presented.size() ? presented[i] : 0;
    diff |= a ^ b;
  }
  return diff == 0;
}

int PortOf(std::string_view address) {
  std::string_view rest = address;
  if (const size_t scheme = rest.find(":///"); scheme != std::string_view::npos) {
    rest.remove_prefix(scheme + 4);
  }
  const size_t colon = rest.rfind(':');
  if (colon == std::string_view::npos) return -1;
  if (rest.find(']') != std::string_view::npos && rest.rfind(']') > colon) return -1;
  int port = -1;
  if (!absl::SimpleAtoi(std::string(rest.substr(colon + 1)), &port) || port < 0 || port > 65535)
    return -1;
  return port;
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const ServerTlsOptions& tls) {
  if (!tls.enabled()) {
    if (!tls.key_file.empty() || !tls.client_ca_file.empty()) {
      return absl::InvalidArgumentError(
          "--tls-key and --tls-client-ca need --tls-cert (the server certificate)");
    }
    return grpc::InsecureServerCredentials();
  }
  if (tls.key_file.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls-cert ", tls.cert_file, " needs --tls-key (its private key)"));
  }
  grpc::SslServerCredentialsOptions options;
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  absl::StatusOr<std::string> cert = ReadSmallFile(tls.cert_file, "TLS certificate");
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadSmallFile(tls.key_file, "TLS private key");
  if (!key.ok()) return key.status();
  pair.cert_chain = *cert;
  pair.private_key = *key;
  options.pem_key_cert_pairs.push_back(std::move(pair));
  if (!tls.client_ca_file.empty()) {
    absl::StatusOr<std::string> ca = ReadSmallFile(tls.client_ca_file, "TLS client CA");
    if (!ca.ok()) return ca.status();
    options.pem_root_certs = *ca;
    options.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(options);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const ClientTlsOptions& tls) {
  if (!tls.enabled()) {
    if (!tls.cert_file.empty() || !tls.key_file.empty()) {
      return absl::InvalidArgumentError(
          "a client certificate needs --tls-ca (the CA that signed the coordinator's certificate)");
    }
    return grpc::InsecureChannelCredentials();
  }
  grpc::SslCredentialsOptions options;
  absl::StatusOr<std::string> ca = ReadSmallFile(tls.ca_file, "TLS CA");
  if (!ca.ok()) return ca.status();
  options.pem_root_certs = *ca;
  if (tls.cert_file.empty() != tls.key_file.empty()) {
    return absl::InvalidArgumentError("a client certificate needs both --tls-cert and --tls-key");
  }
  if (!tls.cert_file.empty()) {
    absl::StatusOr<std::string> cert = ReadSmallFile(tls.cert_file, "TLS client certificate");
    if (!cert.ok()) return cert.status();
    absl::StatusOr<std::string> key = ReadSmallFile(tls.key_file, "TLS client private key");
    if (!key.ok()) return key.status();
    options.pem_cert_chain = *cert;
    options.pem_private_key = *key;
  }
  return grpc::SslCredentials(options);
}

}  // namespace hetpar::coordinator
