// Small file helpers shared by the data layer. All errors are mt::Error naming the path.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>

namespace mt::data {

/// Whole file as bytes. Error: missing/unreadable file ("<what> '<path>': <strerror>").
std::string read_file_to_string(const std::string& path, std::string_view what);

/// True when `path` exists and is a regular file (or a symlink to one).
bool is_regular_file(const std::string& path);

/// Size in bytes of an existing file. Error: missing file.
int64_t file_size_bytes(const std::string& path, std::string_view what);

}  // namespace mt::data
