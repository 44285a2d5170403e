#include "data/index_cache.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <thread>

#include "core/check.h"

namespace mt::data {
namespace {

constexpr char kMagic[8] = {'M', 'T', 'I', 'D', 'X', 'C', '0', '1'};

struct Hasher {
  uint64_t h = 0xcbf29ce484222325ull;
  void add(const void* p, size_t n) { h = fnv1a64(p, n, h); }
};

template <typename T>
bool take(const std::string& buf, size_t* pos, T* v) {
  if (buf.size() - *pos < sizeof(T)) return false;
  std::memcpy(v, buf.data() + *pos, sizeof(T));
  *pos += sizeof(T);
  return true;
}

template <typename T>
bool take_array(const std::string& buf, size_t* pos, uint64_t n, std::vector<T>* out) {
  if (n > (buf.size() - *pos) / sizeof(T)) return false;
  out->resize(n);
  if (n) std::memcpy(out->data(), buf.data() + *pos, n * sizeof(T));
  *pos += n * sizeof(T);
  return true;
}

std::string read_all(const std::string& path, bool* ok) {
  std::string buf;
  std::FILE* f = std::fopen(path.c_str(), "rb");
  *ok = f != nullptr;
  if (!f) return buf;
  char chunk[1 << 16];
  size_t n;
  while ((n = std::fread(chunk, 1, sizeof chunk, f)) > 0) buf.append(chunk, n);
  *ok = !std::ferror(f);
  std::fclose(f);
  return buf;
}

std::string unique_tmp_name(const std::string& path) {
  static std::atomic<uint64_t> counter{0};
  std::random_device rd;
  return fmt::format("{}.tmp.{}.{}.{:08x}", path, ::getpid(), counter.fetch_add(1), rd());
}

void write_bytes_atomically(const std::string& path, const std::vector<std::pair<const void*, size_t>>& parts,
                            const std::string& what) {
  const std::string tmp = unique_tmp_name(path);
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  MT_REQUIRE(f != nullptr,
             "cannot write {} '{}': {} (the index cache directory must be writable; set --data-cache-path to a "
             "writable directory)",
             what, tmp, std::strerror(errno));
  bool ok = true;
  for (const auto& [p, n] : parts) ok = ok && (n == 0 || std::fwrite(p, 1, n, f) == n);
  ok = (std::fflush(f) == 0) && ok;
  const int err = errno;
  ok = (std::fclose(f) == 0) && ok;
  if (!ok) {
    std::remove(tmp.c_str());
    MT_FAIL("cannot write {} '{}': {}", what, tmp, std::strerror(err));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int e = errno;
    std::remove(tmp.c_str());
    MT_FAIL("cannot rename '{}' to '{}': {}", tmp, path, std::strerror(e));
  }
}

}  // namespace

uint64_t fnv1a64(const void* bytes, size_t n, uint64_t seed) {
  const auto* p = static_cast<const unsigned char*>(bytes);
  uint64_t h = seed;
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 0x100000001b3ull;
  }
  return h;
}

std::string description_hash(const std::string& description) {
  return fmt::format("{:016x}", fnv1a64(description.data(), description.size()));
}

std::string index_cache_path(const std::string& dir, const std::string& description, const std::string& kind) {
  return fmt::format("{}/{}-{}.mtidx", dir, description_hash(description), kind);
}

bool read_index_cache_file(const std::string& path, const std::string& description, IndexArrays* out) {
  bool ok = false;
  const std::string buf = read_all(path, &ok);
  if (!ok || buf.size() < sizeof(kMagic) + 8 + 8 + 8) return false;
  uint64_t stored_sum;
  std::memcpy(&stored_sum, buf.data() + buf.size() - 8, 8);
  if (fnv1a64(buf.data(), buf.size() - 8) != stored_sum) return false;
  const std::string body = buf.substr(0, buf.size() - 8);
  if (std::memcmp(body.data(), kMagic, sizeof kMagic) != 0) return false;
  size_t pos = sizeof kMagic;
  uint64_t dlen;
  if (!take(body, &pos, &dlen) || dlen > body.size() - pos) return false;
  if (body.compare(pos, dlen, description) != 0 || dlen != description.size()) return false;
  pos += dlen;
  uint32_t n32, n64;
  if (!take(body, &pos, &n32) || !take(body, &pos, &n64) || n32 > 64 || n64 > 64) return false;
  std::vector<uint64_t> lens(n32 + n64);
  for (auto& l : lens) {
    if (!take(body, &pos, &l)) return false;
  }
  IndexArrays a;
  a.i32.resize(n32);
  a.i64.resize(n64);
  for (uint32_t i = 0; i < n32; ++i) {
    if (!take_array(body, &pos, lens[i], &a.i32[i])) return false;
  }
  for (uint32_t i = 0; i < n64; ++i) {
    if (!take_array(body, &pos, lens[n32 + i], &a.i64[i])) return false;
  }
  if (pos != body.size()) return false;
  *out = std::move(a);
  return true;
}

void write_index_cache_file(const std::string& path, const std::string& description, const IndexArrays& arrays) {
  const uint64_t dlen = description.size();
  const uint32_t n32 = static_cast<uint32_t>(arrays.i32.size()), n64 = static_cast<uint32_t>(arrays.i64.size());
  std::vector<uint64_t> lens;
  for (const auto& v : arrays.i32) lens.push_back(v.size());
  for (const auto& v : arrays.i64) lens.push_back(v.size());
  std::vector<std::pair<const void*, size_t>> parts = {
      {kMagic, sizeof kMagic}, {&dlen, 8}, {description.data(), description.size()}, {&n32, 4}, {&n64, 4},
      {lens.data(), lens.size() * 8}};
  for (const auto& v : arrays.i32) parts.emplace_back(v.data(), v.size() * 4);
  for (const auto& v : arrays.i64) parts.emplace_back(v.data(), v.size() * 8);
  Hasher h;
  for (const auto& [p, n] : parts) h.add(p, n);
  const uint64_t sum = h.h;
  parts.emplace_back(&sum, 8);
  write_bytes_atomically(path, parts, "index cache file");
}

IndexArrays load_or_build_index_arrays(const IndexCacheOptions& opt, const std::string& description,
                                       const std::string& kind, const std::function<IndexArrays()>& build,
                                       bool* built) {
  if (built) *built = false;
  if (opt.dir.empty()) {
    if (built) *built = true;
    return build();
  }
  const std::string path = index_cache_path(opt.dir, description, kind);
  IndexArrays arrays;
  if (read_index_cache_file(path, description, &arrays)) return arrays;
  if (!opt.build_if_missing) {
    const auto start = std::chrono::steady_clock::now();
    for (;;) {
      std::this_thread::sleep_for(std::chrono::duration<double>(opt.poll_interval_s));
      if (read_index_cache_file(path, description, &arrays)) return arrays;
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      MT_REQUIRE(waited < opt.wait_timeout_s,
                 "timed out after {:.0f} s waiting for the index cache file '{}' (built by another rank; did it "
                 "fail?)",
                 waited, path);
    }
  }
  std::error_code ec;
  std::filesystem::create_directories(opt.dir, ec);
  MT_REQUIRE(!ec && std::filesystem::is_directory(opt.dir),
             "cannot create the index cache directory '{}': {} (set --data-cache-path to a writable directory)",
             opt.dir, ec ? ec.message() : "not a directory");
  MT_REQUIRE(::access(opt.dir.c_str(), W_OK) == 0,
             "the index cache directory '{}' is not writable: {} (set --data-cache-path to a writable directory)",
             opt.dir, std::strerror(errno));
  arrays = build();
  if (built) *built = true;
  const std::string desc_path = fmt::format("{}/{}-{}-description.txt", opt.dir, description_hash(description), kind);
  write_bytes_atomically(desc_path, {{description.data(), description.size()}}, "index cache description");
  write_index_cache_file(path, description, arrays);
  return arrays;
}

}  // namespace mt::data
