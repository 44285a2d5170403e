#include "data/indexed_dataset.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/check.h"

namespace mt::data {

size_t index_dtype_size(IndexDType t) {
  switch (t) {
    case IndexDType::kUInt8: return 1;
    case IndexDType::kInt8: return 1;
    case IndexDType::kInt16: return 2;
    case IndexDType::kInt32: return 4;
    case IndexDType::kInt64: return 8;
    case IndexDType::kFloat64: return 8;
    case IndexDType::kFloat32: return 4;
    case IndexDType::kUInt16: return 2;
  }
  return 0;
}

std::string_view index_dtype_name(IndexDType t) {
  switch (t) {
    case IndexDType::kUInt8: return "uint8";
    case IndexDType::kInt8: return "int8";
    case IndexDType::kInt16: return "int16";
    case IndexDType::kInt32: return "int32";
    case IndexDType::kInt64: return "int64";
    case IndexDType::kFloat64: return "float64";
    case IndexDType::kFloat32: return "float32";
    case IndexDType::kUInt16: return "uint16";
  }
  return "unknown";
}

bool index_dtype_valid(uint8_t code) { return code >= 1 && code <= 8; }

IndexDType index_dtype_for_vocab(int64_t vocab_size) {
  return vocab_size < 65500 ? IndexDType::kUInt16 : IndexDType::kInt32;
}

namespace {

template <typename T>
T load_le(const uint8_t* p) {  // the formats are little-endian, as is every supported host
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// Converts `count` stored elements at `src` to int32. Returns the index of the first element that
// is not an integer representable as int32, or -1.
template <typename T>
int64_t convert_to_int32(const uint8_t* src, int64_t count, int32_t* out) {
  for (int64_t k = 0; k < count; ++k) {
    const T v = load_le<T>(src + k * sizeof(T));
    if constexpr (std::is_floating_point_v<T>) {
      if (!(v >= -2147483648.0 && v <= 2147483647.0) || std::trunc(v) != v) return k;
    } else if constexpr (sizeof(T) > 4) {
      if (v < std::numeric_limits<int32_t>::min() || v > std::numeric_limits<int32_t>::max()) return k;
    }
    out[k] = static_cast<int32_t>(v);
  }
  return -1;
}

struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

// -------------------------------------------------------------------------------------------------
// Reader
// -------------------------------------------------------------------------------------------------

IndexedDataset::IndexedDataset(const std::string& prefix) : prefix_(prefix) {
  const std::string idx_path = prefix + ".idx", bin_path = prefix + ".bin";
  struct stat st{};
  MT_REQUIRE(::stat(idx_path.c_str(), &st) == 0, "indexed dataset: index file '{}' not found: {}", idx_path,
             std::strerror(errno));
  MT_REQUIRE(::stat(bin_path.c_str(), &st) == 0, "indexed dataset: data file '{}' not found: {}", bin_path,
             std::strerror(errno));
  load_index(idx_path);

  Fd f;
  f.fd = ::open(bin_path.c_str(), O_RDONLY | O_CLOEXEC);
  MT_REQUIRE(f.fd >= 0, "indexed dataset: cannot open data file '{}': {}", bin_path, std::strerror(errno));
  MT_REQUIRE(::fstat(f.fd, &st) == 0, "indexed dataset: cannot stat '{}': {}", bin_path, std::strerror(errno));
  bin_size_ = static_cast<int64_t>(st.st_size);

  const int64_t esize = static_cast<int64_t>(element_size());
  for (int64_t i = 0; i < num_sequences_; ++i) {
    const int64_t begin = offsets_[i];
    const int64_t bytes = static_cast<int64_t>(lengths_[i]) * esize;
    MT_REQUIRE(begin >= 0 && begin <= bin_size_ && bytes <= bin_size_ - begin,
               "indexed dataset '{}': sequence {} occupies bytes [{}, {}) but the data file '{}' has {} bytes",
               idx_path, i, begin, begin + bytes, bin_path, bin_size_);
  }
  MT_REQUIRE(num_tokens_ * esize == bin_size_,
             "indexed dataset: data file '{}' has {} bytes, but '{}' lists {} tokens of {} ({} bytes)", bin_path,
             bin_size_, idx_path, num_tokens_, index_dtype_name(dtype_), num_tokens_ * esize);
  if (bin_size_ > 0) {
    void* p = ::mmap(nullptr, static_cast<size_t>(bin_size_), PROT_READ, MAP_SHARED, f.fd, 0);
    MT_REQUIRE(p != MAP_FAILED, "indexed dataset: cannot mmap '{}' ({} bytes): {}", bin_path, bin_size_,
               std::strerror(errno));
    bin_map_ = p;
    bin_map_size_ = static_cast<size_t>(bin_size_);
    bin_ = static_cast<const uint8_t*>(p);
  }
}

IndexedDataset::~IndexedDataset() {
  if (bin_map_ != nullptr) ::munmap(bin_map_, bin_map_size_);
}

void IndexedDataset::load_index(const std::string& idx_path) {
  Fd f;
  f.fd = ::open(idx_path.c_str(), O_RDONLY | O_CLOEXEC);
  MT_REQUIRE(f.fd >= 0, "indexed dataset: cannot open index file '{}': {}", idx_path, std::strerror(errno));
  struct stat st{};
  MT_REQUIRE(::fstat(f.fd, &st) == 0, "indexed dataset: cannot stat '{}': {}", idx_path, std::strerror(errno));
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  MT_REQUIRE(size >= kIndexHeaderBytes, "indexed dataset: index file '{}' is truncated: {} bytes, header needs {}",
             idx_path, size, kIndexHeaderBytes);
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, f.fd, 0);
  MT_REQUIRE(map != MAP_FAILED, "indexed dataset: cannot mmap '{}': {}", idx_path, std::strerror(errno));
  struct Unmap {
    void* p;
    size_t n;
    ~Unmap() { ::munmap(p, n); }
  } unmap{map, size};
  const auto* p = static_cast<const uint8_t*>(map);

  MT_REQUIRE(std::memcmp(p, kIndexMagic, sizeof(kIndexMagic)) == 0,
             "indexed dataset: '{}' is not a Megatron index file (bad magic; expected \"MMIDIDX\\x00\\x00\")",
             idx_path);
  const uint64_t version = load_le<uint64_t>(p + 9);
  MT_REQUIRE(version == kIndexVersion, "indexed dataset: '{}' has unsupported version {} (expected {})", idx_path,
             version, kIndexVersion);
  const uint8_t code = p[17];
  MT_REQUIRE(index_dtype_valid(code),
             "indexed dataset: '{}' has unknown dtype code {} (expected 1..8: uint8, int8, int16, int32, int64, "
             "float64, float32, uint16)",
             idx_path, code);
  dtype_ = static_cast<IndexDType>(code);
  const uint64_t n = load_le<uint64_t>(p + 18);
  const uint64_t d = load_le<uint64_t>(p + 26);
  // Overflow-safe size check: each count alone must fit the file.
  const bool fits = n <= size / 12 && d <= size / 8 && kIndexHeaderBytes + 12 * n + 8 * d <= size;
  MT_REQUIRE(fits,
             "indexed dataset: index file '{}' is truncated: the header announces {} sequences and {} document "
             "indices ({} bytes) but the file has {} bytes",
             idx_path, n, d, static_cast<double>(kIndexHeaderBytes) + 12.0 * n + 8.0 * d, size);
  const uint64_t expected = kIndexHeaderBytes + 12 * n + 8 * d;
  MT_REQUIRE(size == expected || size == expected + n,
             "indexed dataset: index file '{}' has {} bytes, expected {} for {} sequences and {} document indices",
             idx_path, size, expected, n, d);
  MT_REQUIRE(d >= 1, "indexed dataset: '{}' has no document indices (expected at least [0])", idx_path);

  num_sequences_ = static_cast<int64_t>(n);
  lengths_.resize(n);
  offsets_.resize(n);
  document_indices_.resize(d);
  const uint8_t* q = p + kIndexHeaderBytes;
  if (n > 0) std::memcpy(lengths_.data(), q, 4 * n);
  q += 4 * n;
  if (n > 0) std::memcpy(offsets_.data(), q, 8 * n);  // misaligned in general
  q += 8 * n;
  std::memcpy(document_indices_.data(), q, 8 * d);

  num_tokens_ = 0;
  for (uint64_t i = 0; i < n; ++i) {
    MT_REQUIRE(lengths_[i] >= 0, "indexed dataset: '{}': sequence {} has negative length {}", idx_path, i,
               lengths_[i]);
    num_tokens_ += lengths_[i];
  }
  MT_REQUIRE(document_indices_[0] == 0, "indexed dataset: '{}': document indices must start at 0, got {}", idx_path,
             document_indices_[0]);
  MT_REQUIRE(document_indices_[d - 1] == num_sequences_,
             "indexed dataset: '{}': document indices must end at the number of sequences {}, got {}", idx_path,
             num_sequences_, document_indices_[d - 1]);
  for (uint64_t k = 1; k < d; ++k) {
    MT_REQUIRE(document_indices_[k] >= document_indices_[k - 1],
               "indexed dataset: '{}': document indices decrease at {}: {} after {}", idx_path, k,
               document_indices_[k], document_indices_[k - 1]);
  }
}

int32_t IndexedDataset::sequence_length(int64_t i) const {
  MT_REQUIRE(i >= 0 && i < num_sequences_, "indexed dataset '{}': sequence {} out of range [0, {})", prefix_, i,
             num_sequences_);
  return lengths_[i];
}

int64_t IndexedDataset::sequence_offset(int64_t i) const {
  MT_REQUIRE(i >= 0 && i < num_sequences_, "indexed dataset '{}': sequence {} out of range [0, {})", prefix_, i,
             num_sequences_);
  return offsets_[i];
}

void IndexedDataset::read(int64_t i, int64_t offset, int64_t count, int32_t* out) const {
  const int64_t len = sequence_length(i);
  MT_REQUIRE(offset >= 0 && count >= 0 && offset <= len && count <= len - offset,
             "indexed dataset '{}': tokens [{}, {}) out of range for sequence {} of length {}", prefix_, offset,
             offset + count, i, len);
  if (count == 0) return;
  const uint8_t* src = bin_ + offsets_[i] + offset * static_cast<int64_t>(element_size());
  int64_t bad = -1;
  switch (dtype_) {
    case IndexDType::kUInt8: bad = convert_to_int32<uint8_t>(src, count, out); break;
    case IndexDType::kInt8: bad = convert_to_int32<int8_t>(src, count, out); break;
    case IndexDType::kInt16: bad = convert_to_int32<int16_t>(src, count, out); break;
    case IndexDType::kInt32: bad = convert_to_int32<int32_t>(src, count, out); break;
    case IndexDType::kInt64: bad = convert_to_int32<int64_t>(src, count, out); break;
    case IndexDType::kFloat64: bad = convert_to_int32<double>(src, count, out); break;
    case IndexDType::kFloat32: bad = convert_to_int32<float>(src, count, out); break;
    case IndexDType::kUInt16: bad = convert_to_int32<uint16_t>(src, count, out); break;
  }
  MT_REQUIRE(bad < 0, "indexed dataset '{}': sequence {} token {} ({}) is not an int32 token id", prefix_, i,
             offset + bad, index_dtype_name(dtype_));
}

std::vector<int32_t> IndexedDataset::get(int64_t i) const {
  std::vector<int32_t> out(static_cast<size_t>(sequence_length(i)));
  read(i, 0, static_cast<int64_t>(out.size()), out.data());
  return out;
}

// -------------------------------------------------------------------------------------------------
// Writer
// -------------------------------------------------------------------------------------------------

namespace {

std::string temp_suffix() {
  static std::atomic<uint64_t> counter{0};
  return fmt::format(".tmp-{}-{}", static_cast<long>(::getpid()), counter.fetch_add(1));
}

void write_or_throw(std::FILE* f, const void* data, size_t bytes, const std::string& path) {
  if (bytes == 0) return;
  MT_REQUIRE(std::fwrite(data, 1, bytes, f) == bytes, "indexed dataset builder: writing '{}' failed: {}", path,
             std::strerror(errno));
}

template <typename T>
void pack(std::span<const int32_t> tokens, std::vector<uint8_t>* buf, IndexDType t) {
  buf->resize(tokens.size() * sizeof(T));
  for (size_t k = 0; k < tokens.size(); ++k) {
    const int32_t v = tokens[k];
    if constexpr (std::is_integral_v<T> && sizeof(T) < 4) {
      MT_REQUIRE(v >= std::numeric_limits<T>::min() && v <= std::numeric_limits<T>::max(),
                 "indexed dataset builder: token {} at position {} does not fit dtype {}", v, k,
                 index_dtype_name(t));
    }
    const T x = static_cast<T>(v);
    std::memcpy(buf->data() + k * sizeof(T), &x, sizeof(T));
  }
}

}  // namespace

IndexedDatasetBuilder::IndexedDatasetBuilder(const std::string& prefix, IndexDType dtype)
    : prefix_(prefix), dtype_(dtype) {
  MT_REQUIRE(index_dtype_valid(static_cast<uint8_t>(dtype)), "indexed dataset builder: unknown dtype code {}",
             static_cast<int>(dtype));
  const std::string suffix = temp_suffix();
  bin_tmp_ = prefix + ".bin" + suffix;
  idx_tmp_ = prefix + ".idx" + suffix;
  bin_file_ = std::fopen(bin_tmp_.c_str(), "wb");
  MT_REQUIRE(bin_file_ != nullptr, "indexed dataset builder: cannot create '{}': {}", bin_tmp_,
             std::strerror(errno));
}

IndexedDatasetBuilder::~IndexedDatasetBuilder() { cleanup(); }

void IndexedDatasetBuilder::cleanup() noexcept {
  if (bin_file_ != nullptr) {
    std::fclose(bin_file_);
    bin_file_ = nullptr;
  }
  if (!finalized_) {
    std::remove(bin_tmp_.c_str());
    std::remove(idx_tmp_.c_str());
  }
}

void IndexedDatasetBuilder::add_item(std::span<const int32_t> tokens) {
  MT_REQUIRE(!finalized_ && bin_file_ != nullptr, "indexed dataset builder '{}': add after finalize", prefix_);
  MT_REQUIRE(tokens.size() <= static_cast<size_t>(std::numeric_limits<int32_t>::max()),
             "indexed dataset builder '{}': a sequence of {} tokens exceeds the int32 length field", prefix_,
             tokens.size());
  switch (dtype_) {
    case IndexDType::kUInt8: pack<uint8_t>(tokens, &scratch_, dtype_); break;
    case IndexDType::kInt8: pack<int8_t>(tokens, &scratch_, dtype_); break;
    case IndexDType::kInt16: pack<int16_t>(tokens, &scratch_, dtype_); break;
    case IndexDType::kInt32: pack<int32_t>(tokens, &scratch_, dtype_); break;
    case IndexDType::kInt64: pack<int64_t>(tokens, &scratch_, dtype_); break;
    case IndexDType::kFloat64: pack<double>(tokens, &scratch_, dtype_); break;
    case IndexDType::kFloat32: pack<float>(tokens, &scratch_, dtype_); break;
    case IndexDType::kUInt16: pack<uint16_t>(tokens, &scratch_, dtype_); break;
  }
  write_or_throw(bin_file_, scratch_.data(), scratch_.size(), bin_tmp_);
  lengths_.push_back(static_cast<int32_t>(tokens.size()));
}

void IndexedDatasetBuilder::end_document() {
  MT_REQUIRE(!finalized_, "indexed dataset builder '{}': end_document after finalize", prefix_);
  document_indices_.push_back(static_cast<int64_t>(lengths_.size()));
}

void IndexedDatasetBuilder::add_document(std::span<const int32_t> tokens) {
  if (!tokens.empty()) add_item(tokens);
  end_document();
}

void IndexedDatasetBuilder::add_document(std::span<const int32_t> tokens, std::span<const int32_t> lengths) {
  int64_t total = 0;
  for (int32_t l : lengths) {
    MT_REQUIRE(l >= 0, "indexed dataset builder '{}': negative sequence length {}", prefix_, l);
    total += l;
  }
  MT_REQUIRE(total == static_cast<int64_t>(tokens.size()),
             "indexed dataset builder '{}': sequence lengths sum to {} but the document has {} tokens", prefix_, total,
             tokens.size());
  size_t pos = 0;
  for (int32_t l : lengths) {
    add_item(tokens.subspan(pos, static_cast<size_t>(l)));
    pos += static_cast<size_t>(l);
  }
  end_document();
}

void IndexedDatasetBuilder::finalize() {
  MT_REQUIRE(!finalized_ && bin_file_ != nullptr, "indexed dataset builder '{}': finalize called twice", prefix_);
  MT_REQUIRE(document_indices_.back() == static_cast<int64_t>(lengths_.size()),
             "indexed dataset builder '{}': {} sequences were added after the last end_document()", prefix_,
             static_cast<int64_t>(lengths_.size()) - document_indices_.back());
  const bool flushed = std::fflush(bin_file_) == 0;
  const bool closed = std::fclose(bin_file_) == 0;
  bin_file_ = nullptr;
  MT_REQUIRE(flushed && closed, "indexed dataset builder: writing '{}' failed: {}", bin_tmp_, std::strerror(errno));

  std::FILE* idx = std::fopen(idx_tmp_.c_str(), "wb");
  MT_REQUIRE(idx != nullptr, "indexed dataset builder: cannot create '{}': {}", idx_tmp_, std::strerror(errno));
  try {
    const uint64_t version = kIndexVersion;
    const uint8_t code = static_cast<uint8_t>(dtype_);
    const uint64_t n = lengths_.size(), d = document_indices_.size();
    write_or_throw(idx, kIndexMagic, sizeof(kIndexMagic), idx_tmp_);
    write_or_throw(idx, &version, 8, idx_tmp_);
    write_or_throw(idx, &code, 1, idx_tmp_);
    write_or_throw(idx, &n, 8, idx_tmp_);
    write_or_throw(idx, &d, 8, idx_tmp_);
    write_or_throw(idx, lengths_.data(), 4 * n, idx_tmp_);
    std::vector<int64_t> offsets(n);
    int64_t off = 0;
    const int64_t esize = static_cast<int64_t>(index_dtype_size(dtype_));
    for (uint64_t i = 0; i < n; ++i) {
      offsets[i] = off;
      off += static_cast<int64_t>(lengths_[i]) * esize;
    }
    write_or_throw(idx, offsets.data(), 8 * n, idx_tmp_);
    write_or_throw(idx, document_indices_.data(), 8 * d, idx_tmp_);
  } catch (...) {
    std::fclose(idx);
    throw;
  }
  MT_REQUIRE(std::fclose(idx) == 0, "indexed dataset builder: writing '{}' failed: {}", idx_tmp_,
             std::strerror(errno));
  const std::string bin_path = prefix_ + ".bin", idx_path = prefix_ + ".idx";
  MT_REQUIRE(std::rename(bin_tmp_.c_str(), bin_path.c_str()) == 0, "indexed dataset builder: rename '{}' -> '{}': {}",
             bin_tmp_, bin_path, std::strerror(errno));
  if (std::rename(idx_tmp_.c_str(), idx_path.c_str()) != 0) {
    const int err = errno;
    std::remove(bin_path.c_str());
    MT_FAIL("indexed dataset builder: rename '{}' -> '{}': {}", idx_tmp_, idx_path, std::strerror(err));
  }
  finalized_ = true;
}

}  // namespace mt::data
