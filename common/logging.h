// Minimal thread-safe logging for hetpar processes.
//
//   HETPAR_LOG(INFO) << "registered as encoder rank " << rank;
//
// Lines go to stderr as `I1129 16:20:00.123 [tag] message`, one write per line so lines of
// concurrent threads never interleave. The tag names the process (SetLogTag), for example
// "coordinator" or "enc r1". Levels below the threshold (HETPAR_LOG_LEVEL=debug|info|warning|
// error, default info) cost one comparison.
#ifndef HETPAR_COMMON_LOGGING_H_
#define HETPAR_COMMON_LOGGING_H_

#include <sstream>
#include <string>
#include <string_view>

namespace hetpar {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

void SetLogTag(std::string_view tag);
void SetLogLevel(LogLevel level);
LogLevel GetLogLevel();
// Parses "debug", "info", "warning" or "error"; returns false for anything else.
bool ParseLogLevel(std::string_view text, LogLevel* level);

namespace internal {

class LogMessage {
 public:
  LogMessage(LogLevel level, const char* file, int line);
  ~LogMessage();
  LogMessage(const LogMessage&) = delete;
  LogMessage& operator=(const LogMessage&) = delete;
  std::ostream& stream() { return stream_; }

 private:
  LogLevel level_;
  std::ostringstream stream_;
};

// Turns the streamed expression into void, so HETPAR_LOG is one expression (safe in an unbraced
// if/else).
struct LogVoidify {
  void operator&(std::ostream&) {}
};

}  // namespace internal
}  // namespace hetpar

#define HETPAR_LOG_LEVEL_DEBUG ::hetpar::LogLevel::kDebug
#define HETPAR_LOG_LEVEL_INFO ::hetpar::LogLevel::kInfo
#define HETPAR_LOG_LEVEL_WARNING ::hetpar::LogLevel::kWarning
#define HETPAR_LOG_LEVEL_ERROR ::hetpar::LogLevel::kError

#define HETPAR_LOG(level)                              \
  (HETPAR_LOG_LEVEL_##level < ::hetpar::GetLogLevel()) \
      ? (void)0                                        \
      : ::hetpar::internal::LogVoidify() &             \
            ::hetpar::internal::LogMessage(HETPAR_LOG_LEVEL_##level, __FILE__, __LINE__).stream()

#endif  // HETPAR_COMMON_LOGGING_H_
