#include "common/logging.h"

#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <mutex>

namespace hetpar {
namespace {

std::mutex& TagMutex() {
  static std::mutex mu;
  return mu;
}
std::string& Tag() {
  static std::string tag;
  return tag;
}

LogLevel InitialLevel() {
  LogLevel level = LogLevel::kInfo;
  if (const char* env = std::getenv("HETPAR_LOG_LEVEL")) ParseLogLevel(env, &level);
  return level;
}

std::atomic<int>& Level() {
  static std::atomic<int> level{static_cast<int>(InitialLevel())};
  return level;
}

}  // namespace

void SetLogTag(std::string_view tag) {
  std::lock_guard<std::mutex> lock(TagMutex());
  Tag() = std::string(tag);
}

void SetLogLevel(LogLevel level) { Level().store(static_cast<int>(level)); }

LogLevel GetLogLevel() { return static_cast<LogLevel>(Level().load(std::memory_order_relaxed)); }

bool ParseLogLevel(std::string_view text, LogLevel* level) {
  if (text == "debug") {
    *level = LogLevel::kDebug;
  } else if (text == "info") {
    *level = LogLevel::kInfo;
  } else if (text == "warning") {
    *level = LogLevel::kWarning;
  } else if (text == "error") {
    *level = LogLevel::kError;
  } else {
    return false;
  }
  return true;
}

namespace internal {

LogMessage::LogMessage(LogLevel level, const char* file, int line) : level_(level) {
  static constexpr char kLetters[] = {'D', 'I', 'W', 'E'};
  timeval tv;
  gettimeofday(&tv, nullptr);
  tm local;
  localtime_r(&tv.tv_sec, &local);
  char stamp[32];
  std::snprintf(stamp, sizeof(stamp), "%c%02d%02d %02d:%02d:%02d.%03d",
                kLetters[static_cast<int>(level)], local.tm_mon + 1, local.tm_mday, local.tm_hour,
                local.tm_min, local.tm_sec, static_cast<int>(tv.tv_usec / 1000));
  stream_ << stamp;
  {
    std::lock_guard<std::mutex> lock(TagMutex());
    if (!Tag().empty()) stream_ << " [" << Tag() << "]";
  }
  if (level_ >= LogLevel::kWarning) {
    std::string_view path(file);
    auto slash = path.rfind('/');
    stream_ << " " << (slash == std::string_view::npos ? path : path.substr(slash + 1)) << ":"
            << line;
  }
  stream_ << " ";
}

LogMessage::~LogMessage() {
  stream_ << '\n';
  const std::string text = stream_.str();
  // One write(2) per line keeps concurrent lines whole.
  ssize_t unused = ::write(STDERR_FILENO, text.data(), text.size());
  (void)unused;
}

}  // namespace internal
}  // namespace hetpar
