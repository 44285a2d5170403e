// Error handling: every failing call or violated invariant throws mt::Error with file:line,
// the failing expression and the values involved. Never abort, never return garbage.
#pragma once
#include <fmt/format.h>
#include <stdexcept>
#include <string>

namespace mt {

/// The single exception type of megatron.cpp. what() = "<file>:<line>: <message>".
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg) : std::runtime_error(msg) {}
};

[[noreturn]] void throw_error(const char* file, int line, const std::string& msg);

}  // namespace mt

/// MT_CHECK(cond, "fmt {}", args...): invariant check, always on; throws mt::Error.
#define MT_CHECK(cond, ...)                                                                     \
  do {                                                                                          \
    if (!(cond)) [[unlikely]] {                                                                 \
      ::mt::throw_error(__FILE__, __LINE__, fmt::format("check failed: {}: {}", #cond,          \
                                                        fmt::format(__VA_ARGS__)));             \
    }                                                                                           \
  } while (0)

/// MT_FAIL("fmt {}", args...): unconditional error.
#define MT_FAIL(...) ::mt::throw_error(__FILE__, __LINE__, fmt::format(__VA_ARGS__))

/// Input validation with a user-facing message (no "check failed" prefix).
#define MT_REQUIRE(cond, ...)                                                                   \
  do {                                                                                          \
    if (!(cond)) [[unlikely]] ::mt::throw_error(__FILE__, __LINE__, fmt::format(__VA_ARGS__));  \
  } while (0)
