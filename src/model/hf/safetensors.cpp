#include "model/hf/safetensors.h"

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fmt/ranges.h>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>

#include "core/check.h"
#include "data/file_util.h"

namespace mt::hf {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; this code copies it to and from host memory as is");

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr uint64_t kMaxHeaderSize = 100'000'000;  // the reference's MAX_HEADER_SIZE
constexpr size_t kChunkBytes = size_t{16} << 20;   // conversion chunk when reading / writing
constexpr const char* kIndexName = "model.safetensors.index.json";
constexpr const char* kSingleName = "model.safetensors";

uint64_t load_u64_le(const unsigned char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

void store_u64_le(uint64_t v, char* p) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<char>((v >> (8 * i)) & 0xffu);
}

// Product of dims, or false on overflow of uint64.
bool checked_numel(const std::vector<int64_t>& shape, uint64_t* out) {
  uint64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(n, static_cast<uint64_t>(d), &n)) return false;
  }
  *out = n;
  return true;
}

// A JSON value that is a non-negative integer (not a float, not a bool).
bool as_u64(const json& v, uint64_t* out) {
  if (v.is_number_unsigned()) {
    *out = v.get<uint64_t>();
    return true;
  }
  if (v.is_number_integer() && v.get<int64_t>() >= 0) {
    *out = static_cast<uint64_t>(v.get<int64_t>());
    return true;
  }
  return false;
}

bool valid_utf8(const std::string& s) {
  try {
    (void)json(s).dump();
    return true;
  } catch (const json::type_error&) {
    return false;
  }
}

// Parses one header entry (tensor `name`) of file `path`; `buffer_len` = bytes after the header.
SafetensorsTensorInfo parse_tensor_entry(const std::string& path, const std::string& name, const json& e,
                                         uint64_t buffer_len) {
  SafetensorsTensorInfo t;
  t.name = name;
  MT_REQUIRE(e.is_object(), "safetensors file '{}': header entry of tensor '{}' is not an object: {}", path, name,
             e.dump());
  MT_REQUIRE(e.contains("dtype") && e["dtype"].is_string(),
             "safetensors file '{}': tensor '{}' has no string \"dtype\": {}", path, name, e.dump());
  t.dtype = e["dtype"].get<std::string>();
  const int bits = safetensors_dtype_bits(t.dtype);
  MT_REQUIRE(bits > 0,
             "safetensors file '{}': tensor '{}' has unknown dtype '{}' (expected one of BOOL, F4, F6_E2M3, "
             "F6_E3M2, U8, I8, F8_E5M2, F8_E4M3, F8_E8M0, F8_E4M3FNUZ, F8_E5M2FNUZ, I16, U16, F16, BF16, I32, "
             "U32, F32, C64, F64, I64, U64)",
             path, name, t.dtype);
  MT_REQUIRE(e.contains("shape") && e["shape"].is_array(),
             "safetensors file '{}': tensor '{}' has no \"shape\" array: {}", path, name, e.dump());
  for (const json& d : e["shape"]) {
    uint64_t v = 0;
    MT_REQUIRE(as_u64(d, &v) && v <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()),
               "safetensors file '{}': tensor '{}' has an invalid dimension {} in shape {}", path, name, d.dump(),
               e["shape"].dump());
    t.shape.push_back(static_cast<int64_t>(v));
  }
  const json* off = e.contains("data_offsets") ? &e["data_offsets"] : nullptr;
  MT_REQUIRE(off != nullptr && off->is_array() && off->size() == 2 && as_u64((*off)[0], &t.begin) &&
                 as_u64((*off)[1], &t.end),
             "safetensors file '{}': tensor '{}' needs \"data_offsets\": [begin, end] of non-negative integers, "
             "got {}",
             path, name, off ? off->dump() : std::string("nothing"));
  MT_REQUIRE(t.end >= t.begin, "safetensors file '{}': tensor '{}' has data_offsets [{}, {}] with end < begin",
             path, name, t.begin, t.end);
  MT_REQUIRE(t.end <= buffer_len,
             "safetensors file '{}': tensor '{}' has data_offsets [{}, {}] beyond the end of the byte buffer "
             "({} bytes; file truncated?)",
             path, name, t.begin, t.end, buffer_len);
  uint64_t numel = 0, nbits = 0;
  MT_REQUIRE(checked_numel(t.shape, &numel) && !__builtin_mul_overflow(numel, static_cast<uint64_t>(bits), &nbits),
             "safetensors file '{}': tensor '{}': shape {} x {} bits overflows", path, name, e["shape"].dump(),
             bits);
  MT_REQUIRE(nbits % 8 == 0,
             "safetensors file '{}': tensor '{}' of dtype {} and shape {} does not fill whole bytes ({} bits)", path,
             name, t.dtype, e["shape"].dump(), nbits);
  MT_REQUIRE(t.end - t.begin == nbits / 8,
             "safetensors file '{}': tensor '{}' has data_offsets [{}, {}] ({} bytes) but dtype {} and shape {} "
             "need {} bytes",
             path, name, t.begin, t.end, t.end - t.begin, t.dtype, e["shape"].dump(), nbits / 8);
  return t;
}

// ---------------------------------------------------------------------------------------------
// Writing
// ---------------------------------------------------------------------------------------------

int layout_rank(DType t) {  // the reference sorts by dtype descending: F32 > BF16 > F16
  switch (t) {
    case DType::kF32: return 0;
    case DType::kBF16: return 1;
    case DType::kF16: return 2;
    default: return 3;
  }
}

uint64_t data_bytes(const TensorToWrite& t) {
  uint64_t n = 0;
  checked_numel(t.shape, &n);  // validated before use
  return n * dtype_size(t.dtype);
}

// Checks every tensor (messages name `where` and the tensor).
void validate_tensors(const std::string& where, const std::vector<TensorToWrite>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  std::set<std::string_view> seen;
  for (const TensorToWrite& t : tensors) {
    MT_REQUIRE(!t.name.empty(), "writing safetensors '{}': a tensor has an empty name", where);
    MT_REQUIRE(t.name != "__metadata__", "writing safetensors '{}': '__metadata__' is reserved, not a tensor name",
               where);
    MT_REQUIRE(valid_utf8(t.name), "writing safetensors '{}': tensor name '{}' is not valid UTF-8", where, t.name);
    MT_REQUIRE(seen.insert(t.name).second, "writing safetensors '{}': duplicate tensor name '{}'", where, t.name);
    MT_REQUIRE(t.dtype == DType::kF32 || t.dtype == DType::kBF16 || t.dtype == DType::kF16,
               "writing safetensors '{}': tensor '{}' has dtype {}, expected fp32, bf16 or fp16", where, t.name,
               dtype_name(t.dtype));
    uint64_t numel = 0, nbytes = 0;
    MT_REQUIRE(checked_numel(t.shape, &numel) && !__builtin_mul_overflow(numel, dtype_size(t.dtype), &nbytes),
               "writing safetensors '{}': tensor '{}' has an invalid shape [{}]", where, t.name,
               fmt::join(t.shape, ", "));
    MT_REQUIRE(t.data.size() == numel, "writing safetensors '{}': tensor '{}' of shape [{}] needs {} values, got {}",
               where, t.name, fmt::join(t.shape, ", "), numel, t.data.size());
  }
  for (const auto& [k, v] : metadata) {
    MT_REQUIRE(valid_utf8(k) && valid_utf8(v), "writing safetensors '{}': metadata entry '{}' is not valid UTF-8",
               where, k);
  }
}

// Appends t.data stored as t.dtype to `out` (little-endian), chunk by chunk.
void write_tensor_data(std::ofstream& out, const TensorToWrite& t) {
  if (t.dtype == DType::kF32) {
    out.write(reinterpret_cast<const char*>(t.data.data()), static_cast<std::streamsize>(t.data.size() * 4));
    return;
  }
  std::vector<uint16_t> buf(std::min(t.data.size(), kChunkBytes / 2));
  for (size_t i = 0; i < t.data.size(); i += buf.size()) {
    const size_t n = std::min(buf.size(), t.data.size() - i);
    if (t.dtype == DType::kBF16) {
      for (size_t k = 0; k < n; ++k) buf[k] = f32_to_bf16_bits(t.data[i + k]);
    } else {
      for (size_t k = 0; k < n; ++k) buf[k] = f32_to_f16_bits(t.data[i + k]);
    }
    out.write(reinterpret_cast<const char*>(buf.data()), static_cast<std::streamsize>(n * 2));
  }
}

// Writes `bytes` to `path` via `path`.tmp + rename; `fill` writes the content.
template <class Fill>
void write_atomic(const fs::path& path, std::string_view what, Fill&& fill) {
  fs::path tmp = path;
  tmp += ".tmp";
  try {
    {
      std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
      MT_REQUIRE(f.good(), "cannot create {} '{}': {}", what, tmp.string(), std::strerror(errno));
      fill(f);
      f.flush();
      MT_REQUIRE(f.good(), "error writing {} '{}': {}", what, tmp.string(), std::strerror(errno));
    }
    std::error_code ec;
    fs::rename(tmp, path, ec);
    MT_REQUIRE(!ec, "cannot rename '{}' to '{}': {}", tmp.string(), path.string(), ec.message());
  } catch (...) {
    std::error_code ec;
    fs::remove(tmp, ec);
    throw;
  }
}

// One file from already validated tensors.
void write_file(const std::string& path, std::vector<const TensorToWrite*> tensors,
                const std::map<std::string, std::string>& metadata) {
  std::stable_sort(tensors.begin(), tensors.end(), [](const TensorToWrite* a, const TensorToWrite* b) {
    const int ra = layout_rank(a->dtype), rb = layout_rank(b->dtype);
    return ra != rb ? ra < rb : a->name < b->name;
  });
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    header["__metadata__"] = std::move(m);
  }
  uint64_t offset = 0;
  for (const TensorToWrite* t : tensors) {
    const uint64_t n = data_bytes(*t);
    nlohmann::ordered_json e = nlohmann::ordered_json::object();
    e["dtype"] = safetensors_dtype_name(t->dtype);
    e["shape"] = t->shape;
    e["data_offsets"] = {offset, offset + n};
    header[t->name] = std::move(e);
    offset += n;
  }
  std::string text = header.dump();
  text.resize((text.size() + 7) / 8 * 8, ' ');
  MT_REQUIRE(text.size() <= kMaxHeaderSize, "writing safetensors '{}': header of {} bytes exceeds the limit of {}",
             path, text.size(), kMaxHeaderSize);
  write_atomic(path, "safetensors file", [&](std::ofstream& f) {
    char len[8];
    store_u64_le(text.size(), len);
    f.write(len, 8);
    f.write(text.data(), static_cast<std::streamsize>(text.size()));
    for (const TensorToWrite* t : tensors) write_tensor_data(f, *t);
  });
}

bool is_shard_name(const std::string& s) {
  static const std::regex re("model-[0-9]{5}-of-[0-9]{5}\\.safetensors");
  return std::regex_match(s, re);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Dtypes
// ---------------------------------------------------------------------------------------------

int safetensors_dtype_bits(std::string_view d) {
  static const std::map<std::string_view, int> kBits = {
      {"BOOL", 8},        {"F4", 4},          {"F6_E2M3", 6}, {"F6_E3M2", 6}, {"U8", 8},   {"I8", 8},
      {"F8_E5M2", 8},     {"F8_E4M3", 8},     {"F8_E8M0", 8}, {"F8_E4M3FNUZ", 8},          {"F8_E5M2FNUZ", 8},
      {"I16", 16},        {"U16", 16},        {"F16", 16},    {"BF16", 16},   {"I32", 32}, {"U32", 32},
      {"F32", 32},        {"C64", 64},        {"F64", 64},    {"I64", 64},    {"U64", 64},
  };
  auto it = kBits.find(d);
  return it == kBits.end() ? 0 : it->second;
}

std::string_view safetensors_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "F32";
    case DType::kBF16: return "BF16";
    case DType::kF16: return "F16";
    default: break;
  }
  MT_FAIL("no safetensors float dtype for {} (expected fp32, bf16 or fp16)", dtype_name(dtype));
}

int64_t SafetensorsTensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// ---------------------------------------------------------------------------------------------
// SafetensorsFile
// ---------------------------------------------------------------------------------------------

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  SafetensorsFile sf;
  sf.path_ = path;
  std::error_code ec;
  MT_REQUIRE(fs::is_regular_file(path, ec), "safetensors file '{}' does not exist or is not a regular file", path);
  const uint64_t file_size = fs::file_size(path, ec);
  MT_REQUIRE(!ec, "safetensors file '{}': cannot get its size: {}", path, ec.message());
  std::ifstream f(path, std::ios::binary);
  MT_REQUIRE(f.good(), "cannot open safetensors file '{}': {}", path, std::strerror(errno));
  MT_REQUIRE(file_size >= 8, "safetensors file '{}' has {} bytes, fewer than the 8 of its header length", path,
             file_size);
  unsigned char len[8];
  f.read(reinterpret_cast<char*>(len), 8);
  MT_REQUIRE(f.gcount() == 8, "safetensors file '{}': cannot read the header length", path);
  const uint64_t n = load_u64_le(len);
  MT_REQUIRE(n <= kMaxHeaderSize, "safetensors file '{}': header length {} exceeds the limit of {} bytes", path, n,
             kMaxHeaderSize);
  MT_REQUIRE(n <= file_size - 8, "safetensors file '{}': header length {} exceeds the {} bytes after the length field",
             path, n, file_size - 8);
  sf.header_size_ = n;
  std::string text(n, '\0');
  f.read(text.data(), static_cast<std::streamsize>(n));
  MT_REQUIRE(static_cast<uint64_t>(f.gcount()) == n, "safetensors file '{}': cannot read the {}-byte header", path,
             n);
  json header;
  try {
    header = json::parse(text);
  } catch (const json::exception& e) {
    MT_FAIL("safetensors file '{}': header is not valid UTF-8 JSON: {}", path, e.what());
  }
  MT_REQUIRE(header.is_object(), "safetensors file '{}': header is a JSON {}, not an object", path,
             header.type_name());

  const uint64_t buffer_len = file_size - 8 - n;
  for (const auto& [key, value] : header.items()) {
    if (key == "__metadata__") {
      MT_REQUIRE(value.is_object(), "safetensors file '{}': \"__metadata__\" is not an object: {}", path,
                 value.dump());
      for (const auto& [mk, mv] : value.items()) {
        MT_REQUIRE(mv.is_string(), "safetensors file '{}': \"__metadata__\" entry '{}' is not a string: {}", path, mk,
                   mv.dump());
        sf.metadata_[mk] = mv.get<std::string>();
      }
      continue;
    }
    sf.tensors_.push_back(parse_tensor_entry(path, key, value, buffer_len));
  }
  std::stable_sort(sf.tensors_.begin(), sf.tensors_.end(), [](const auto& a, const auto& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  // The tensors, in offset order, must tile [0, buffer_len) exactly.
  uint64_t expected = 0;
  const SafetensorsTensorInfo* prev = nullptr;
  for (const SafetensorsTensorInfo& t : sf.tensors_) {
    MT_REQUIRE(t.begin >= expected,
               "safetensors file '{}': tensor '{}' (data_offsets [{}, {}]) overlaps tensor '{}' (data_offsets [{}, "
               "{}])",
               path, t.name, t.begin, t.end, prev ? prev->name : "", prev ? prev->begin : 0, prev ? prev->end : 0);
    MT_REQUIRE(t.begin == expected,
               "safetensors file '{}': bytes [{}, {}) of the data buffer, before tensor '{}', belong to no tensor "
               "(a hole)",
               path, expected, t.begin, t.name);
    expected = t.end;
    prev = &t;
  }
  MT_REQUIRE(expected == buffer_len,
             "safetensors file '{}': the tensors cover {} bytes but the data buffer holds {} (bytes [{}, {}) belong "
             "to no tensor)",
             path, expected, buffer_len, expected, buffer_len);
  for (size_t i = 0; i < sf.tensors_.size(); ++i) sf.index_[sf.tensors_[i].name] = i;
  return sf;
}

const SafetensorsTensorInfo* SafetensorsFile::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

std::ifstream SafetensorsFile::open_data(const SafetensorsTensorInfo& t) const {
  std::ifstream f(path_, std::ios::binary);
  MT_REQUIRE(f.good(), "cannot open safetensors file '{}' to read tensor '{}': {}", path_, t.name,
             std::strerror(errno));
  f.seekg(static_cast<std::streamoff>(8 + header_size_ + t.begin));
  return f;
}

void SafetensorsFile::read_exact(std::ifstream& f, const SafetensorsTensorInfo& t, uint64_t n, char* dst) const {
  f.read(dst, static_cast<std::streamsize>(n));
  MT_REQUIRE(static_cast<uint64_t>(f.gcount()) == n,
             "safetensors file '{}': read {} of {} bytes of tensor '{}' (file changed since it was opened?)", path_,
             f.gcount(), n, t.name);
}

std::vector<uint8_t> SafetensorsFile::read_bytes(const std::string& name) const {
  const SafetensorsTensorInfo* t = find(name);
  MT_REQUIRE(t != nullptr, "safetensors file '{}' has no tensor '{}'", path_, name);
  std::vector<uint8_t> out(t->nbytes());
  if (!out.empty()) {
    std::ifstream f = open_data(*t);
    read_exact(f, *t, out.size(), reinterpret_cast<char*>(out.data()));
  }
  return out;
}

std::vector<float> SafetensorsFile::read_f32(const std::string& name) const {
  const SafetensorsTensorInfo* t = find(name);
  MT_REQUIRE(t != nullptr, "safetensors file '{}' has no tensor '{}'", path_, name);
  const std::string& d = t->dtype;
  MT_REQUIRE(d == "F32" || d == "BF16" || d == "F16" || d == "F64",
             "safetensors file '{}': tensor '{}' has dtype {}, which read_f32 does not convert (F32, BF16, F16, F64)",
             path_, name, d);
  const size_t numel = static_cast<size_t>(t->numel());
  std::vector<float> out(numel);
  if (numel == 0) return out;
  std::ifstream f = open_data(*t);
  if (d == "F32") {
    read_exact(f, *t, numel * 4, reinterpret_cast<char*>(out.data()));
    return out;
  }
  const size_t esize = safetensors_dtype_bits(d) / 8;
  const size_t chunk = std::min(numel, kChunkBytes / esize);
  std::vector<char> buf(chunk * esize);
  for (size_t i = 0; i < numel; i += chunk) {
    const size_t k = std::min(chunk, numel - i);
    read_exact(f, *t, k * esize, buf.data());
    float* o = out.data() + i;
    if (d == "F64") {
      for (size_t j = 0; j < k; ++j) {
        double v;
        std::memcpy(&v, buf.data() + 8 * j, 8);
        o[j] = static_cast<float>(v);
      }
    } else {
      const bool bf16 = d == "BF16";
      for (size_t j = 0; j < k; ++j) {
        uint16_t h;
        std::memcpy(&h, buf.data() + 2 * j, 2);
        o[j] = bf16 ? bf16_bits_to_f32(h) : f16_bits_to_f32(h);
      }
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// SafetensorsCheckpoint
// ---------------------------------------------------------------------------------------------

SafetensorsCheckpoint SafetensorsCheckpoint::open(const std::string& dir) {
  SafetensorsCheckpoint ck;
  ck.dir_ = dir;
  std::error_code ec;
  MT_REQUIRE(fs::is_directory(dir, ec), "Hugging Face checkpoint directory '{}' does not exist or is not a directory",
             dir);
  const fs::path index_path = fs::path(dir) / kIndexName;
  const fs::path single_path = fs::path(dir) / kSingleName;
  if (fs::is_regular_file(index_path, ec)) {
    ck.sharded_ = true;
    const std::string ipath = index_path.string();
    json index;
    try {
      index = json::parse(data::read_file_to_string(ipath, "safetensors index"));
    } catch (const json::exception& e) {
      MT_FAIL("safetensors index '{}' is not valid JSON: {}", ipath, e.what());
    }
    MT_REQUIRE(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(),
               "safetensors index '{}' has no \"weight_map\" object", ipath);
    std::map<std::string, size_t> file_pos;  // shard file name -> position in files_
    std::map<std::string, std::string> assigned;
    for (const auto& [tensor, file] : index["weight_map"].items()) {
      MT_REQUIRE(file.is_string(), "safetensors index '{}': weight_map entry of tensor '{}' is not a string: {}",
                 ipath, tensor, file.dump());
      const std::string name = file.get<std::string>();
      MT_REQUIRE(!name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
                     name.find('\\') == std::string::npos,
                 "safetensors index '{}': tensor '{}' is mapped to '{}', which is not a file name in '{}'", ipath,
                 tensor, name, dir);
      assigned[tensor] = name;
      file_pos.emplace(name, 0);
    }
    for (auto& [name, pos] : file_pos) {
      const fs::path p = fs::path(dir) / name;
      MT_REQUIRE(fs::is_regular_file(p, ec), "safetensors index '{}' names shard '{}', but '{}' does not exist", ipath,
                 name, p.string());
      pos = ck.files_.size();
      ck.files_.push_back(SafetensorsFile::open(p.string()));
    }
    for (const auto& [tensor, name] : assigned) {
      const size_t pos = file_pos.at(name);
      MT_REQUIRE(ck.files_[pos].find(tensor) != nullptr,
                 "safetensors index '{}' maps tensor '{}' to '{}', but that file has no tensor '{}'", ipath, tensor,
                 ck.files_[pos].path(), tensor);
      ck.where_[tensor] = pos;
    }
    return ck;
  }
  MT_REQUIRE(fs::is_regular_file(single_path, ec), "Hugging Face checkpoint directory '{}' holds neither {} nor {}",
             dir, kIndexName, kSingleName);
  ck.files_.push_back(SafetensorsFile::open(single_path.string()));
  for (const SafetensorsTensorInfo& t : ck.files_[0].tensors()) ck.where_[t.name] = 0;
  return ck;
}

std::vector<std::string> SafetensorsCheckpoint::names() const {
  std::vector<std::string> out;
  out.reserve(where_.size());
  for (const auto& [name, pos] : where_) out.push_back(name);
  return out;
}

const SafetensorsFile& SafetensorsCheckpoint::file_of(const std::string& name) const {
  auto it = where_.find(name);
  MT_REQUIRE(it != where_.end(), "Hugging Face checkpoint '{}' has no tensor '{}'", dir_, name);
  return files_[it->second];
}

SafetensorsTensorInfo SafetensorsCheckpoint::info(const std::string& name) const {
  return *file_of(name).find(name);
}

std::vector<float> SafetensorsCheckpoint::read_f32(const std::string& name) const {
  return file_of(name).read_f32(name);
}

// ---------------------------------------------------------------------------------------------
// Writers
// ---------------------------------------------------------------------------------------------

void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  validate_tensors(path, tensors, metadata);
  std::vector<const TensorToWrite*> ptrs;
  for (const TensorToWrite& t : tensors) ptrs.push_back(&t);
  write_file(path, std::move(ptrs), metadata);
}

std::string safetensors_shard_name(int i, int n) { return fmt::format("model-{:05d}-of-{:05d}.safetensors", i, n); }

void write_safetensors_checkpoint(const std::string& dir, const std::vector<TensorToWrite>& tensors,
                                  uint64_t max_shard_bytes, const std::map<std::string, std::string>& metadata) {
  validate_tensors(dir, tensors, metadata);
  std::error_code ec;
  fs::create_directories(dir, ec);
  MT_REQUIRE(!ec, "cannot create Hugging Face checkpoint directory '{}': {}", dir, ec.message());

  uint64_t total = 0;
  std::vector<std::vector<const TensorToWrite*>> shards(1);
  uint64_t current = 0;
  for (const TensorToWrite& t : tensors) {
    const uint64_t n = data_bytes(t);
    total += n;
    if (max_shard_bytes > 0 && !shards.back().empty() && current + n > max_shard_bytes) {
      shards.emplace_back();
      current = 0;
    }
    shards.back().push_back(&t);
    current += n;
  }

  const fs::path root(dir);
  std::set<std::string> keep;
  if (shards.size() == 1) {
    write_file((root / kSingleName).string(), shards[0], metadata);
    keep.insert(kSingleName);
  } else {
    const int n = static_cast<int>(shards.size());
    json weight_map = json::object();
    for (int i = 0; i < n; ++i) {
      const std::string name = safetensors_shard_name(i + 1, n);
      write_file((root / name).string(), shards[i], metadata);
      for (const TensorToWrite* t : shards[i]) weight_map[t->name] = name;
      keep.insert(name);
    }
    json index = {{"metadata", {{"total_size", total}}}, {"weight_map", std::move(weight_map)}};
    const std::string text = index.dump(2) + "\n";
    write_atomic(root / kIndexName, "safetensors index", [&](std::ofstream& f) { f << text; });
    keep.insert(kIndexName);
  }
  // Remove what an earlier save left and this one does not use (index first: it decides).
  for (const char* name : {kIndexName, kSingleName}) {
    if (!keep.count(name)) fs::remove(root / name, ec);
  }
  for (const fs::directory_entry& e : fs::directory_iterator(root, ec)) {
    const std::string name = e.path().filename().string();
    if (is_shard_name(name) && !keep.count(name)) fs::remove(e.path(), ec);
  }
}

}  // namespace mt::hf
