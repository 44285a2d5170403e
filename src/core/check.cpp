#include "core/check.h"

namespace mt {

void throw_error(const char* file, int line, const std::string& msg) {
  std::string f(file);
  auto pos = f.rfind("/src/");
  if (pos == std::string::npos) pos = f.rfind("/tests/");
  if (pos != std::string::npos) f = f.substr(pos + 1);
  throw Error(fmt::format("{}:{}: {}", f, line, msg));
}

}  // namespace mt
