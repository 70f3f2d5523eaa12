// An environment variable set (or unset) for one scope, restored when the scope ends:
//
//   ScopedEnv level("UCX_LOG_LEVEL", "debug");
//   ScopedEnv none("LOCAL_RANK", nullptr);  // unset until the scope ends
#ifndef HETPAR_TESTS_UTIL_SCOPED_ENV_H_
#define HETPAR_TESTS_UTIL_SCOPED_ENV_H_

#include <cstdlib>
#include <string>

namespace hetpar::testing {

class ScopedEnv {
 public:
  // `value` nullptr unsets the variable.
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* old = std::getenv(name);
    had_ = old != nullptr;
    if (had_) old_ = old;
    if (value != nullptr) {
      setenv(name, value, 1);
    } else {
      unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (had_) {
      setenv(name_, old_.c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::string old_;
  bool had_ = false;
};

}  // namespace hetpar::testing

#endif  // HETPAR_TESTS_UTIL_SCOPED_ENV_H_
