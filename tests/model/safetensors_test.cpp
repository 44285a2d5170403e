// Hugging Face safetensors reader/writer (src/model/hf/safetensors.h) against the format spec
// (github.com/huggingface/safetensors README "Format"), bytes produced by the reference
// implementation (safetensors 0.8.0 / huggingface_hub 1.33.0, embedded below), hand-built files,
// and every documented error.
#include "model/hf/safetensors.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/dtype.h"
#include "testing/testing.h"

namespace mt::hf {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using mt::testing::randn;
using mt::testing::rounded;
using mt::testing::test_rng;

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           fmt::format("mt_safetensors_{}_{:016x}", ::getpid(), static_cast<uint64_t>(test_rng()()));
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  fs::path dir_;
};

std::string read_all(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

void write_all(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(f.good()) << path;
}

// Little-endian byte strings, assembled explicitly (independent of host byte order).
std::string le(uint64_t v, int nbytes) {
  std::string s;
  for (int i = 0; i < nbytes; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  return s;
}
uint64_t get_le(const std::string& s, size_t at, int nbytes) {
  uint64_t v = 0;
  for (int i = nbytes - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(s[at + i]);
  return v;
}
uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
uint64_t f64_bits(double d) {
  uint64_t u;
  std::memcpy(&u, &d, 8);
  return u;
}
std::string f32_le(const std::vector<float>& v) {
  std::string s;
  for (float f : v) s += le(f32_bits(f), 4);
  return s;
}

// A safetensors file: 8-byte N, `header` padded with `pad` spaces, then `data`.
std::string st_bytes(const std::string& header, const std::string& data, size_t pad = 0) {
  std::string h = header + std::string(pad, ' ');
  return le(h.size(), 8) + h + data;
}

std::string from_hex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) out.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  return out;
}

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * 4) == 0);
}

// Runs fn, expects mt::Error whose message contains every string of `parts`.
void expect_error(const std::function<void()>& fn, std::initializer_list<std::string> parts) {
  try {
    fn();
    ADD_FAILURE() << "no mt::Error thrown; expected one mentioning " << *parts.begin();
  } catch (const mt::Error& e) {
    const std::string msg = e.what();
    for (const std::string& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
  }
}

int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

TensorToWrite make(std::string name, DType dtype, std::vector<int64_t> shape) {
  TensorToWrite t{std::move(name), dtype, std::move(shape), {}};
  t.data = randn(numel(t.shape));
  return t;
}

// ---------------------------------------------------------------------------------------------
// The written bytes, checked against the spec byte by byte
// ---------------------------------------------------------------------------------------------

TEST_F(SafetensorsTest, WrittenBytesFollowTheSpec) {
  // Round-to-nearest-even ties and overflow, appended to random values.
  const float bf16_tie_down = 1.f + std::ldexp(1.f, -8);       // -> 1.0          (0x3f80)
  const float bf16_tie_up = 1.f + 3.f * std::ldexp(1.f, -8);   // -> 1 + 2^-6     (0x3f82)
  const float f16_tie_down = 1.f + std::ldexp(1.f, -11);       // -> 1.0          (0x3c00)
  const float f16_tie_up = 1.f + 3.f * std::ldexp(1.f, -11);   // -> 1 + 2^-9     (0x3c02)
  std::vector<TensorToWrite> in = {
      make("z.f16", DType::kF16, {2, 5}),
      make("m.bf16", DType::kBF16, {7}),  // 14 bytes: odd element count
      make("w.f32", DType::kF32, {3, 4}),
      make("a.f32", DType::kF32, {}),     // scalar
      make("b.bf16", DType::kBF16, {2, 2}),
  };
  in[0].data[7] = f16_tie_down;
  in[0].data[8] = f16_tie_up;
  in[0].data[9] = 70000.f;  // > fp16 max -> +inf
  in[1].data[5] = bf16_tie_down;
  in[1].data[6] = -bf16_tie_up;
  const std::string p = path("spec.safetensors");
  write_safetensors(p, in, {{"format", "pt"}, {"note", "x"}});
  EXPECT_FALSE(fs::exists(p + ".tmp"));

  const std::string bytes = read_all(p);
  ASSERT_GE(bytes.size(), 8u);
  const uint64_t n = get_le(bytes, 0, 8);
  ASSERT_LE(8 + n, bytes.size());
  EXPECT_EQ((8 + n) % 8, 0u);
  const std::string header = bytes.substr(8, n);
  const size_t close = header.rfind('}');
  ASSERT_NE(close, std::string::npos);
  EXPECT_EQ(header.substr(close + 1), std::string(n - close - 1, ' '));  // padding: spaces only
  EXPECT_LT(n - close - 1, 8u);
  EXPECT_EQ(header.find('\n'), std::string::npos);  // compact, as the reference

  const json h = json::parse(header);
  ASSERT_TRUE(h.is_object());
  EXPECT_EQ(h.size(), in.size() + 1);
  EXPECT_EQ(h["__metadata__"], (json{{"format", "pt"}, {"note", "x"}}));
  EXPECT_EQ(header.rfind("{\"__metadata__\":", 0), 0u);  // metadata first
  const uint64_t buffer_len = bytes.size() - 8 - n;
  const std::string buffer = bytes.substr(8 + n);

  // Layout: F32 by name, BF16 by name, F16 by name; contiguous from 0, covering the buffer.
  const std::vector<std::string> order = {"a.f32", "w.f32", "b.bf16", "m.bf16", "z.f16"};
  uint64_t expected_begin = 0;
  size_t last_key_pos = 0;
  for (const std::string& name : order) {
    const TensorToWrite& t = *std::find_if(in.begin(), in.end(), [&](const auto& x) { return x.name == name; });
    SCOPED_TRACE(name);
    ASSERT_TRUE(h.contains(name));
    const json& e = h[name];
    EXPECT_EQ(e.size(), 3u);
    EXPECT_EQ(e["dtype"], t.dtype == DType::kF32 ? "F32" : t.dtype == DType::kBF16 ? "BF16" : "F16");
    EXPECT_EQ(e["shape"].get<std::vector<int64_t>>(), t.shape);
    const uint64_t begin = e["data_offsets"][0], end = e["data_offsets"][1];
    EXPECT_EQ(begin, expected_begin);
    EXPECT_EQ(end - begin, t.data.size() * dtype_size(t.dtype));
    expected_begin = end;
    const size_t key_pos = header.find("\"" + name + "\":{\"dtype\"");  // keys in layout order
    EXPECT_GT(key_pos, last_key_pos);
    last_key_pos = key_pos;
    for (size_t i = 0; i < t.data.size(); ++i) {
      const float v = t.data[i];
      if (t.dtype == DType::kF32) {
        EXPECT_EQ(get_le(buffer, begin + 4 * i, 4), f32_bits(v)) << i;
      } else if (t.dtype == DType::kBF16) {
        EXPECT_EQ(get_le(buffer, begin + 2 * i, 2), f32_to_bf16_bits(v)) << i;
      } else {
        EXPECT_EQ(get_le(buffer, begin + 2 * i, 2), f32_to_f16_bits(v)) << i;
      }
    }
  }
  EXPECT_EQ(expected_begin, buffer_len);
  // The rounding itself, against hand-computed bit patterns.
  const uint64_t m0 = h["m.bf16"]["data_offsets"][0], z0 = h["z.f16"]["data_offsets"][0];
  EXPECT_EQ(get_le(buffer, m0 + 10, 2), 0x3f80u);
  EXPECT_EQ(get_le(buffer, m0 + 12, 2), 0xbf82u);
  EXPECT_EQ(get_le(buffer, z0 + 14, 2), 0x3c00u);
  EXPECT_EQ(get_le(buffer, z0 + 16, 2), 0x3c02u);
  EXPECT_EQ(get_le(buffer, z0 + 18, 2), 0x7c00u);
}

TEST_F(SafetensorsTest, NoMetadataKeyWhenEmptyAndEmptyFile) {
  const std::string p = path("plain.safetensors");
  write_safetensors(p, {make("x", DType::kF32, {3})});
  const std::string bytes = read_all(p);
  const uint64_t n = get_le(bytes, 0, 8);
  EXPECT_EQ(json::parse(bytes.substr(8, n)).count("__metadata__"), 0u);
  EXPECT_TRUE(SafetensorsFile::open(p).metadata().empty());

  const std::string e = path("empty.safetensors");
  write_safetensors(e, {});
  EXPECT_EQ(read_all(e), le(8, 8) + "{}      ");
  EXPECT_TRUE(SafetensorsFile::open(e).tensors().empty());
}

// ---------------------------------------------------------------------------------------------
// Round trip
// ---------------------------------------------------------------------------------------------

TEST_F(SafetensorsTest, RoundTrip) {
  std::vector<TensorToWrite> in;
  const DType dtypes[] = {DType::kF32, DType::kBF16, DType::kF16};
  std::uniform_int_distribution<int> dim(1, 9);
  for (int i = 0; i < 12; ++i) {
    std::vector<int64_t> shape;
    for (int r = i % 4; r > 0; --r) shape.push_back(dim(test_rng()));
    in.push_back(make(fmt::format("layers.{}.w{}", i, i % 3), dtypes[i % 3], shape));
  }
  in.push_back(make("empty", DType::kBF16, {0, 4}));
  in[0].data[0] = std::nanf("");
  in[1].data[0] = -std::numeric_limits<float>::infinity();
  const std::string p = path("rt.safetensors");
  write_safetensors(p, in, {{"format", "pt"}});

  const SafetensorsFile f = SafetensorsFile::open(p);
  EXPECT_EQ(f.path(), p);
  EXPECT_EQ(f.metadata(), (std::map<std::string, std::string>{{"format", "pt"}}));
  EXPECT_EQ(f.tensors().size(), in.size());
  for (size_t i = 1; i < f.tensors().size(); ++i) EXPECT_EQ(f.tensors()[i].begin, f.tensors()[i - 1].end);
  for (const TensorToWrite& t : in) {
    SCOPED_TRACE(t.name);
    const SafetensorsTensorInfo* info = f.find(t.name);
    ASSERT_NE(info, nullptr);
    EXPECT_EQ(info->shape, t.shape);
    EXPECT_EQ(info->dtype, safetensors_dtype_name(t.dtype));
    EXPECT_EQ(info->numel(), static_cast<int64_t>(t.data.size()));
    EXPECT_EQ(info->nbytes(), t.data.size() * dtype_size(t.dtype));
    const std::vector<float> back = f.read_f32(t.name);
    // fp32 bitwise (NaN included); bf16/fp16 equal (bitwise) to the round-to-nearest-even values.
    EXPECT_TRUE(bitwise_equal(back, rounded(t.data, t.dtype)));
    if (t.dtype == DType::kF32) {
      EXPECT_TRUE(bitwise_equal(back, t.data));
    }
  }
  EXPECT_EQ(f.find("absent"), nullptr);
  // Overwriting an existing file goes through the rename as well.
  write_safetensors(p, {in[0]});
  EXPECT_EQ(SafetensorsFile::open(p).tensors().size(), 1u);
  EXPECT_FALSE(fs::exists(p + ".tmp"));
}

// Tensors larger than the 16 MiB conversion chunk of the writer and the reader.
TEST_F(SafetensorsTest, LargeTensorsCrossChunks) {
  const int64_t n = (int64_t{8} << 20) + 12345;  // bf16: 2 chunks of 8 Mi elements
  std::vector<TensorToWrite> in = {make("big.bf16", DType::kBF16, {n}), make("big.f16", DType::kF16, {n / 5, 5}),
                                   make("small", DType::kF32, {3})};
  const std::string p = path("big.safetensors");
  write_safetensors(p, in);
  const SafetensorsFile f = SafetensorsFile::open(p);
  for (const TensorToWrite& t : in) EXPECT_TRUE(bitwise_equal(f.read_f32(t.name), rounded(t.data, t.dtype))) << t.name;
}

// ---------------------------------------------------------------------------------------------
// Files not written by us
// ---------------------------------------------------------------------------------------------

// safetensors.torch.save_file({"b.weight": arange(6).reshape(2,3)*0.25-0.5 (float32),
// "c": [1.5,-2,0.125] (bfloat16), "a.bias": [[0.5,-3,1024]] (float16), "ab": [7] (bfloat16)},
// metadata={"format": "pt"}) with safetensors 0.8.0.
const char* const kReferenceHex =
    "10010000000000007b225f5f6d657461646174615f5f223a7b22666f726d6174223a227074227d2c22622e7765696768"
    "74223a7b226474797065223a22463332222c227368617065223a5b322c335d2c22646174615f6f666673657473223a5b"
    "302c32345d7d2c226162223a7b226474797065223a2242463136222c227368617065223a5b315d2c22646174615f6f66"
    "6673657473223a5b32342c32365d7d2c2263223a7b226474797065223a2242463136222c227368617065223a5b335d2c"
    "22646174615f6f666673657473223a5b32362c33325d7d2c22612e62696173223a7b226474797065223a22463136222c"
    "227368617065223a5b312c335d2c22646174615f6f666673657473223a5b33322c33385d7d7d2020000000bf000080be"
    "000000000000803e0000003f0000403fe040c03f00c0003e003800c20064";

TEST_F(SafetensorsTest, ReferenceFileReadAndReproducedByteForByte) {
  const std::string ref = from_hex(kReferenceHex);
  const std::string p = path("ref.safetensors");
  write_all(p, ref);
  const SafetensorsFile f = SafetensorsFile::open(p);
  EXPECT_EQ(f.metadata().at("format"), "pt");
  ASSERT_EQ(f.tensors().size(), 4u);
  EXPECT_EQ(f.tensors()[0].name, "b.weight");
  EXPECT_EQ(f.read_f32("b.weight"), (std::vector<float>{-0.5f, -0.25f, 0.f, 0.25f, 0.5f, 0.75f}));
  EXPECT_EQ(f.read_f32("c"), (std::vector<float>{1.5f, -2.f, 0.125f}));
  EXPECT_EQ(f.read_f32("a.bias"), (std::vector<float>{0.5f, -3.f, 1024.f}));
  EXPECT_EQ(f.read_f32("ab"), (std::vector<float>{7.f}));
  EXPECT_EQ(f.find("a.bias")->shape, (std::vector<int64_t>{1, 3}));

  // Our writer, given the same tensors in another order, writes the same bytes.
  const std::string q = path("ours.safetensors");
  write_safetensors(q,
                    {{"a.bias", DType::kF16, {1, 3}, {0.5f, -3.f, 1024.f}},
                     {"c", DType::kBF16, {3}, {1.5f, -2.f, 0.125f}},
                     {"b.weight", DType::kF32, {2, 3}, {-0.5f, -0.25f, 0.f, 0.25f, 0.5f, 0.75f}},
                     {"ab", DType::kBF16, {1}, {7.f}}},
                    {{"format", "pt"}});
  EXPECT_EQ(read_all(q), ref);
}

TEST_F(SafetensorsTest, HandBuiltFile) {
  const std::vector<double> d64 = {0.1, -1e30, 3.0};
  const std::vector<float> f32 = randn(4);
  // Keys deliberately not in offset order; whitespace inside the JSON; padding not to 8.
  const std::string header =
      "{ \"i\" : {\"shape\":[2],\"dtype\":\"I64\",\"data_offsets\":[52,68]},\n"
      "  \"__metadata__\": {\"format\": \"pt\", \"who\": \"hand\"},\n"
      "  \"d\": {\"dtype\": \"F64\", \"shape\": [3], \"data_offsets\": [0, 24]},\n"
      "  \"h\": {\"dtype\": \"F16\", \"shape\": [1, 2], \"data_offsets\": [46, 50]},\n"
      "  \"e\": {\"dtype\": \"F32\", \"shape\": [0, 3], \"data_offsets\": [50, 50]},\n"
      "  \"f\": {\"dtype\": \"F32\", \"shape\": [2, 2], \"data_offsets\": [24, 40], \"extra\": 1},\n"
      "  \"u\": {\"dtype\": \"U8\", \"shape\": [2], \"data_offsets\": [50, 52]},\n"
      "  \"b\": {\"dtype\": \"BF16\", \"shape\": [3], \"data_offsets\": [40, 46]} }";
  std::string data;
  for (double v : d64) data += le(f64_bits(v), 8);
  data += f32_le(f32);
  data += le(0x3fc0, 2) + le(0xc000, 2) + le(0x3e00, 2);  // bf16 1.5, -2, 0.125
  data += le(0x0001, 2) + le(0xfbff, 2);                   // fp16 2^-24 (subnormal), -65504
  data += std::string("\x07\xff", 2);                      // U8
  data += le(static_cast<uint64_t>(-5), 8) + le(1, 8);     // I64
  ASSERT_EQ(data.size(), 68u);
  const std::string p = path("hand.safetensors");
  write_all(p, st_bytes(header, data, 5));

  const SafetensorsFile f = SafetensorsFile::open(p);
  EXPECT_EQ(f.header_size(), header.size() + 5);
  EXPECT_EQ(f.metadata(), (std::map<std::string, std::string>{{"format", "pt"}, {"who", "hand"}}));
  std::vector<std::string> names;
  for (const auto& t : f.tensors()) names.push_back(t.name);
  EXPECT_EQ(names, (std::vector<std::string>{"d", "f", "b", "h", "e", "u", "i"}));  // offset order
  EXPECT_EQ(f.read_f32("d"), (std::vector<float>{static_cast<float>(d64[0]), static_cast<float>(d64[1]), 3.f}));
  EXPECT_TRUE(bitwise_equal(f.read_f32("f"), f32));
  EXPECT_EQ(f.read_f32("b"), (std::vector<float>{1.5f, -2.f, 0.125f}));
  EXPECT_EQ(f.read_f32("h"), (std::vector<float>{std::ldexp(1.f, -24), -65504.f}));
  EXPECT_TRUE(f.read_f32("e").empty());
  EXPECT_EQ(f.find("e")->shape, (std::vector<int64_t>{0, 3}));
  EXPECT_EQ(f.read_bytes("u"), (std::vector<uint8_t>{7, 255}));
  const std::vector<uint8_t> i64 = f.read_bytes("i");
  ASSERT_EQ(i64.size(), 16u);
  int64_t first;
  std::memcpy(&first, i64.data(), 8);
  EXPECT_EQ(first, -5);
  expect_error([&] { f.read_f32("i"); }, {p, "'i'", "I64"});
  expect_error([&] { f.read_f32("nope"); }, {p, "'nope'"});
  expect_error([&] { f.read_bytes("nope"); }, {p, "'nope'"});
}

// ---------------------------------------------------------------------------------------------
// Every documented error of the reader
// ---------------------------------------------------------------------------------------------

TEST_F(SafetensorsTest, ReaderErrors) {
  int k = 0;
  // Writes `bytes` to a fresh file, expects open() to fail with a message naming the file
  // and every string of `parts`.
  auto expect_open_error = [&](const std::string& bytes, std::initializer_list<std::string> parts) {
    const std::string p = path(fmt::format("bad{}.safetensors", k++));
    write_all(p, bytes);
    SCOPED_TRACE(p);
    try {
      SafetensorsFile::open(p);
      ADD_FAILURE() << "no mt::Error";
    } catch (const mt::Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(p), std::string::npos) << msg;
      for (const std::string& s : parts) EXPECT_NE(msg.find(s), std::string::npos) << "'" << s << "' not in: " << msg;
    }
  };
  const std::string good_entry = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  const std::string eight(8, '\x11');

  // Sanity: the building blocks make a valid file.
  write_all(path("ok.safetensors"), st_bytes("{" + good_entry + "}", eight));
  EXPECT_EQ(SafetensorsFile::open(path("ok.safetensors")).tensors().size(), 1u);

  // Missing file.
  expect_error([&] { SafetensorsFile::open(path("missing.safetensors")); }, {path("missing.safetensors")});
  // File shorter than 8 bytes.
  expect_open_error("", {"0 bytes"});
  expect_open_error(std::string(7, '\0'), {"7 bytes"});
  // N larger than the file; N beyond the reference's limit.
  expect_open_error(le(1000, 8) + "{}", {"1000"});
  expect_open_error(le(200'000'000, 8) + "{}", {"200000000"});
  // Invalid JSON; not UTF-8; not an object.
  expect_open_error(st_bytes(R"({"a": {"dtype": )", ""), {"JSON"});
  expect_open_error(st_bytes("{\"a\xff\": 1}", ""), {"JSON"});
  expect_open_error(st_bytes("[1, 2]", ""), {"not an object"});
  // Malformed entries.
  expect_open_error(st_bytes(R"({"a": 3})", ""), {"'a'"});
  expect_open_error(st_bytes(R"({"a":{"shape":[2],"data_offsets":[0,8]}})", eight), {"'a'", "dtype"});
  expect_open_error(st_bytes(R"({"a":{"dtype":"F32","data_offsets":[0,8]}})", eight), {"'a'", "shape"});
  expect_open_error(st_bytes(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", eight), {"'a'", "-2"});
  expect_open_error(st_bytes(R"({"a":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})", eight), {"'a'", "2.5"});
  expect_open_error(st_bytes(R"({"a":{"dtype":"F32","shape":[2]}})", eight), {"'a'", "data_offsets"});
  expect_open_error(st_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8,9]}})", eight),
                    {"'a'", "data_offsets"});
  expect_open_error(st_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[-1,8]}})", eight),
                    {"'a'", "data_offsets"});
  // Unknown dtype.
  expect_open_error(st_bytes(R"({"a":{"dtype":"F33","shape":[2],"data_offsets":[0,8]}})", eight), {"'a'", "F33"});
  expect_open_error(st_bytes(R"({"a":{"dtype":"f32","shape":[2],"data_offsets":[0,8]}})", eight), {"'a'", "f32"});
  // Bad __metadata__.
  expect_open_error(st_bytes(R"({"__metadata__":{"k":1},)" + good_entry + "}", eight), {"__metadata__", "'k'"});
  expect_open_error(st_bytes(R"({"__metadata__":"x",)" + good_entry + "}", eight), {"__metadata__"});
  // data_offsets out of the buffer; end < begin.
  expect_open_error(st_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", eight),
                    {"'a'", "[4, 12]", "8 bytes"});
  expect_open_error(st_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,4]}})", eight),
                    {"'a'", "end < begin"});
  // Size mismatch (numel * dtype size != end - begin), and a numel that overflows.
  expect_open_error(st_bytes(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", eight),
                    {"'a'", "12 bytes"});
  expect_open_error(st_bytes(R"({"a":{"dtype":"BF16","shape":[2],"data_offsets":[0,8]}})", eight), {"'a'", "4 bytes"});
  expect_open_error(
      st_bytes(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", eight),
      {"'a'", "overflow"});
  // Sub-byte dtype not filling whole bytes.
  expect_open_error(st_bytes(R"({"a":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}})", "\x11\x11"),
                    {"'a'", "whole bytes"});
  // Overlap.
  expect_open_error(st_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                             R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                             std::string(12, '\1')),
                    {"'b'", "'a'", "overlaps"});
  expect_open_error(st_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                             R"("b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
                             eight),
                    {"'b'", "'a'", "overlaps"});
  // Holes: between tensors, before the first, after the last.
  expect_open_error(st_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                             R"("b":{"dtype":"F32","shape":[2],"data_offsets":[12,20]}})",
                             std::string(20, '\1')),
                    {"'b'", "[8, 12)", "hole"});
  expect_open_error(st_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", std::string(12, '\1')),
                    {"'a'", "[0, 4)", "hole"});
  expect_open_error(st_bytes("{" + good_entry + "}", std::string(12, '\1')), {"[8, 12)"});
  expect_open_error(st_bytes("{}", "x"), {"[0, 1)"});

  // Truncated data: a valid file cut short.
  const std::string t = path("trunc.safetensors");
  write_safetensors(t, {make("w", DType::kF32, {4, 4}), make("v", DType::kBF16, {3})});
  const std::string full = read_all(t);
  expect_open_error(full.substr(0, full.size() - 2), {"'v'", "truncated"});  // v: the last in layout
  // A file that shrinks after open: the read fails, naming file and tensor.
  const SafetensorsFile opened = SafetensorsFile::open(t);
  fs::resize_file(t, full.size() - 40);
  expect_error([&] { opened.read_f32("w"); }, {t, "'w'"});
}

// ---------------------------------------------------------------------------------------------
// Writer errors
// ---------------------------------------------------------------------------------------------

TEST_F(SafetensorsTest, WriterErrors) {
  const std::string p = path("w.safetensors");
  const TensorToWrite a = make("a", DType::kF32, {2, 3});
  expect_error([&] { write_safetensors(p, {a, make("b", DType::kBF16, {1}), a}); }, {p, "duplicate", "'a'"});
  TensorToWrite shortd = make("s", DType::kF16, {2, 3});
  shortd.data.pop_back();
  expect_error([&] { write_safetensors(p, {shortd}); }, {p, "'s'", "6 values, got 5"});
  expect_error([&] { write_safetensors(p, {{"i", DType::kI32, {1}, {1.f}}}); }, {p, "'i'", "int32"});
  expect_error([&] { write_safetensors(p, {{"n", DType::kF32, {-1}, {}}}); }, {p, "'n'"});
  expect_error([&] { write_safetensors(p, {{"__metadata__", DType::kF32, {1}, {1.f}}}); }, {p, "__metadata__"});
  expect_error([&] { write_safetensors(p, {{"", DType::kF32, {1}, {1.f}}}); }, {p, "empty name"});
  expect_error([&] { write_safetensors(p, {{"bad\xff", DType::kF32, {1}, {1.f}}}); }, {p, "UTF-8"});
  expect_error([&] { write_safetensors(p, {a}, {{"k", "\xfe"}}); }, {p, "'k'", "UTF-8"});
  EXPECT_FALSE(fs::exists(p));
  const std::string nodir = path("no/such/dir/x.safetensors");
  expect_error([&] { write_safetensors(nodir, {a}); }, {nodir});
  expect_error([&] { write_safetensors_checkpoint(path("ck"), {a, a}); }, {path("ck"), "duplicate", "'a'"});
}

// ---------------------------------------------------------------------------------------------
// Model directories
// ---------------------------------------------------------------------------------------------

std::vector<std::string> dir_listing(const fs::path& d) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(d)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

// huggingface_hub.save_torch_state_dict({f"layer.{i}.w": torch.ones(4, 4) * i for i in range(5)},
// d, max_shard_size=150) (hub 1.33.0): three shards, and this index (transformers'
// save_pretrained writes the same with a final newline).
TEST_F(SafetensorsTest, ShardedMatchesHuggingFaceHub) {
  std::vector<TensorToWrite> in;
  for (int i = 0; i < 5; ++i) in.push_back({fmt::format("layer.{}.w", i), DType::kF32, {4, 4}, std::vector<float>(16, static_cast<float>(i))});
  const std::string d = path("hub");
  write_safetensors_checkpoint(d, in, 150, {{"format", "pt"}});
  EXPECT_EQ(dir_listing(d), (std::vector<std::string>{"model-00001-of-00003.safetensors",
                                                      "model-00002-of-00003.safetensors",
                                                      "model-00003-of-00003.safetensors",
                                                      "model.safetensors.index.json"}));
  EXPECT_EQ(read_all(d + "/model.safetensors.index.json"),
            "{\n  \"metadata\": {\n    \"total_size\": 320\n  },\n  \"weight_map\": {\n"
            "    \"layer.0.w\": \"model-00001-of-00003.safetensors\",\n"
            "    \"layer.1.w\": \"model-00001-of-00003.safetensors\",\n"
            "    \"layer.2.w\": \"model-00002-of-00003.safetensors\",\n"
            "    \"layer.3.w\": \"model-00002-of-00003.safetensors\",\n"
            "    \"layer.4.w\": \"model-00003-of-00003.safetensors\"\n  }\n}\n");
  const std::string shard1_header =
      R"({"__metadata__":{"format":"pt"},"layer.0.w":{"dtype":"F32","shape":[4,4],"data_offsets":[0,64]},)"
      R"("layer.1.w":{"dtype":"F32","shape":[4,4],"data_offsets":[64,128]}}      )";
  EXPECT_EQ(read_all(d + "/model-00001-of-00003.safetensors"),
            st_bytes(shard1_header, f32_le(std::vector<float>(16, 0.f)) + f32_le(std::vector<float>(16, 1.f))));
  const std::string shard3_header =
      R"({"__metadata__":{"format":"pt"},"layer.4.w":{"dtype":"F32","shape":[4,4],"data_offsets":[0,64]}})";
  EXPECT_EQ(read_all(d + "/model-00003-of-00003.safetensors"),
            st_bytes(shard3_header, f32_le(std::vector<float>(16, 4.f))));
}

TEST_F(SafetensorsTest, ShardedCheckpointRoundTrip) {
  std::vector<TensorToWrite> in = {
      make("embed", DType::kBF16, {10, 8}),        // 160 B
      make("layers.0.qkv", DType::kBF16, {24, 8}), // 384 B: larger than the limit, a shard of its own
      make("layers.0.norm", DType::kF32, {8}),     // 32 B
      make("layers.0.proj", DType::kF16, {9, 8}),  // 144 B
      make("layers.1.norm", DType::kF32, {8}),     // 32 B
      make("final", DType::kF32, {5}),             // 20 B
  };
  const std::string d = path("ck");
  write_safetensors_checkpoint(d, in, 200, {{"format", "pt"}});
  // Greedy in the given order: {embed} {qkv} {norm0, proj} {norm1, final}.
  const std::vector<std::string> shards = {safetensors_shard_name(1, 4), safetensors_shard_name(2, 4),
                                           safetensors_shard_name(3, 4), safetensors_shard_name(4, 4)};
  EXPECT_EQ(shards[2], "model-00003-of-00004.safetensors");
  std::vector<std::string> expected_files = shards;
  expected_files.push_back("model.safetensors.index.json");
  EXPECT_EQ(dir_listing(d), expected_files);

  const json index = json::parse(read_all(d + "/model.safetensors.index.json"));
  EXPECT_EQ(index["metadata"]["total_size"], 160 + 384 + 32 + 144 + 32 + 20);
  EXPECT_EQ(index["weight_map"], (json{{"embed", shards[0]},
                                        {"layers.0.qkv", shards[1]},
                                        {"layers.0.norm", shards[2]},
                                        {"layers.0.proj", shards[2]},
                                        {"layers.1.norm", shards[3]},
                                        {"final", shards[3]}}));
  EXPECT_EQ(SafetensorsFile::open(d + "/" + shards[2]).metadata().at("format"), "pt");

  const SafetensorsCheckpoint ck = SafetensorsCheckpoint::open(d);
  EXPECT_TRUE(ck.sharded());
  EXPECT_EQ(ck.files().size(), 4u);
  EXPECT_EQ(ck.names(), (std::vector<std::string>{"embed", "final", "layers.0.norm", "layers.0.proj",
                                                  "layers.0.qkv", "layers.1.norm"}));
  for (const TensorToWrite& t : in) {
    SCOPED_TRACE(t.name);
    EXPECT_TRUE(ck.has(t.name));
    EXPECT_EQ(ck.info(t.name).shape, t.shape);
    EXPECT_EQ(ck.info(t.name).dtype, safetensors_dtype_name(t.dtype));
    EXPECT_TRUE(bitwise_equal(ck.read_f32(t.name), rounded(t.data, t.dtype)));
  }
  EXPECT_FALSE(ck.has("nope"));
  expect_error([&] { ck.info("nope"); }, {d, "'nope'"});
  expect_error([&] { ck.read_f32("nope"); }, {d, "'nope'"});

  // Re-saving unsharded replaces the index and the shards by model.safetensors.
  write_safetensors_checkpoint(d, in);
  EXPECT_EQ(dir_listing(d), (std::vector<std::string>{"model.safetensors"}));
  const SafetensorsCheckpoint single = SafetensorsCheckpoint::open(d);
  EXPECT_FALSE(single.sharded());
  EXPECT_EQ(single.names().size(), in.size());
  for (const TensorToWrite& t : in) EXPECT_TRUE(bitwise_equal(single.read_f32(t.name), rounded(t.data, t.dtype)));
  // Everything fits: one file as well; a single tensor over the limit: one file.
  write_safetensors_checkpoint(d, in, 10'000);
  EXPECT_EQ(dir_listing(d), (std::vector<std::string>{"model.safetensors"}));
  write_safetensors_checkpoint(d, {in[1]}, 100);
  EXPECT_EQ(dir_listing(d), (std::vector<std::string>{"model.safetensors"}));
  // And sharded again: model.safetensors goes.
  write_safetensors_checkpoint(d, in, 400);
  EXPECT_EQ(dir_listing(d).size(), 4u);  // 3 shards + index
  EXPECT_EQ(SafetensorsCheckpoint::open(d).names().size(), in.size());
}

TEST_F(SafetensorsTest, CheckpointErrors) {
  std::vector<TensorToWrite> in = {make("a", DType::kF32, {16}), make("b", DType::kF32, {16}),
                                   make("c", DType::kF32, {16})};
  const std::string d = path("ck");
  write_safetensors_checkpoint(d, in, 64);
  const std::string index_path = d + "/model.safetensors.index.json";
  const std::string index_text = read_all(index_path);
  ASSERT_EQ(SafetensorsCheckpoint::open(d).files().size(), 3u);

  // Neither file, or no directory at all.
  const std::string empty = path("empty");
  fs::create_directories(empty);
  expect_error([&] { SafetensorsCheckpoint::open(empty); }, {empty, "model.safetensors"});
  expect_error([&] { SafetensorsCheckpoint::open(path("absent")); }, {path("absent")});
  // A shard named by the index is missing.
  const std::string shard2 = d + "/" + safetensors_shard_name(2, 3);
  const std::string shard2_bytes = read_all(shard2);
  fs::remove(shard2);
  expect_error([&] { SafetensorsCheckpoint::open(d); }, {safetensors_shard_name(2, 3), index_path});
  write_all(shard2, shard2_bytes);
  // The weight_map assigns a tensor to a shard that does not hold it.
  json index = json::parse(index_text);
  index["weight_map"]["a"] = safetensors_shard_name(3, 3);
  write_all(index_path, index.dump(2));
  expect_error([&] { SafetensorsCheckpoint::open(d); }, {index_path, "'a'", safetensors_shard_name(3, 3)});
  // The weight_map names a tensor no file has.
  index = json::parse(index_text);
  index["weight_map"]["ghost"] = safetensors_shard_name(1, 3);
  write_all(index_path, index.dump(2));
  expect_error([&] { SafetensorsCheckpoint::open(d); }, {index_path, "'ghost'"});
  // A path instead of a file name.
  index = json::parse(index_text);
  index["weight_map"]["a"] = "../x.safetensors";
  write_all(index_path, index.dump(2));
  expect_error([&] { SafetensorsCheckpoint::open(d); }, {index_path, "../x.safetensors"});
  // Not JSON; no weight_map; a non-string entry.
  write_all(index_path, "{\"weight_map\": ");
  expect_error([&] { SafetensorsCheckpoint::open(d); }, {index_path, "JSON"});
  write_all(index_path, "{\"metadata\": {}}");
  expect_error([&] { SafetensorsCheckpoint::open(d); }, {index_path, "weight_map"});
  write_all(index_path, "{\"weight_map\": {\"a\": 3}}");
  expect_error([&] { SafetensorsCheckpoint::open(d); }, {index_path, "'a'"});
  // A corrupt shard: the file's own error, naming it.
  write_all(index_path, index_text);
  write_all(shard2, shard2_bytes.substr(0, shard2_bytes.size() - 1));
  expect_error([&] { SafetensorsCheckpoint::open(d); }, {shard2});
}

}  // namespace
}  // namespace mt::hf
