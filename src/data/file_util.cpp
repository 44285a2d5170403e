#include "data/file_util.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>

#include "core/check.h"

namespace mt::data {

std::string read_file_to_string(const std::string& path, std::string_view what) {
  struct FileCloser {
    void operator()(std::FILE* f) const { std::fclose(f); }
  };
  std::unique_ptr<std::FILE, FileCloser> f(std::fopen(path.c_str(), "rb"));
  MT_REQUIRE(f != nullptr, "{} '{}': cannot open: {}", what, path, std::strerror(errno));
  struct stat st{};
  MT_REQUIRE(fstat(fileno(f.get()), &st) == 0 && S_ISREG(st.st_mode), "{} '{}': not a regular file", what, path);
  std::string data;
  data.resize(static_cast<size_t>(st.st_size));
  size_t got = data.empty() ? 0 : std::fread(data.data(), 1, data.size(), f.get());
  MT_REQUIRE(got == data.size(), "{} '{}': read {} of {} bytes: {}", what, path, got, data.size(),
             std::strerror(errno));
  // A file that grew meanwhile: read the rest too.
  char buf[65536];
  while (size_t k = std::fread(buf, 1, sizeof(buf), f.get())) data.append(buf, k);
  MT_REQUIRE(!std::ferror(f.get()), "{} '{}': read error: {}", what, path, std::strerror(errno));
  return data;
}

bool is_regular_file(const std::string& path) {
  struct stat st{};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

int64_t file_size_bytes(const std::string& path, std::string_view what) {
  struct stat st{};
  MT_REQUIRE(::stat(path.c_str(), &st) == 0, "{} '{}': {}", what, path, std::strerror(errno));
  return static_cast<int64_t>(st.st_size);
}

}  // namespace mt::data
