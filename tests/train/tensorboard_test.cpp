// TensorBoard event files (train/tensorboard.h): CRC-32C against published check values and a
// bitwise reference, the exact bytes of one record, a round trip of Megatron's scalar tags, and
// the reader's detection of flipped bytes, truncation and malformed protobuf.
//
// With MT_TENSORBOARD_TEST_OUT=<dir> set, the round-trip test also leaves an event file and
// <dir>/expected.json there for `tools/check_tensorboard.py <dir> --expect-json <dir>/expected.json`
// (the real tensorboard package's reader).
#include <gtest/gtest.h>
#include <unistd.h>

#include <bit>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <regex>

#include "core/check.h"
#include "train/tensorboard.h"

namespace mt {
namespace {

namespace fs = std::filesystem;

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "mt_tensorboard_test_XXXXXX").string();
    MT_REQUIRE(::mkdtemp(tmpl.data()) != nullptr, "mkdtemp '{}' failed", tmpl);
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

// Bit-at-a-time CRC-32C, independent of the table in tensorboard.cpp.
uint32_t reference_crc32c(const std::string& s) {
  uint32_t c = 0xFFFFFFFFu;
  for (unsigned char b : s) {
    c ^= b;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
  }
  return ~c;
}
uint32_t reference_mask(uint32_t c) { return ((c >> 15) | (c << 17)) + 0xa282ead8u; }

std::string le_bytes(uint64_t v, int n) {
  std::string s;
  for (int i = 0; i < n; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  return s;
}

// A TFRecord framed by the test itself.
std::string frame(const std::string& data) {
  const std::string len = le_bytes(data.size(), 8);
  return len + le_bytes(reference_mask(reference_crc32c(len)), 4) + data +
         le_bytes(reference_mask(reference_crc32c(data)), 4);
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}
void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

double now_seconds() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

// The mt::Error message of `f()`, or "" when it does not throw.
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Crc32c, KnownAnswers) {
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(crc32c("", 0), 0u);
  std::string buf(32, '\0');
  EXPECT_EQ(crc32c(buf.data(), buf.size()), 0x8A9136AAu);
  // RFC 3720 B.4 (iSCSI), also leveldb's crc32c_test.
  buf.assign(32, '\xff');
  EXPECT_EQ(crc32c(buf.data(), buf.size()), 0x62A8AB43u);
  for (int i = 0; i < 32; ++i) buf[i] = static_cast<char>(i);
  EXPECT_EQ(crc32c(buf.data(), buf.size()), 0x46DD794Eu);
  for (int i = 0; i < 32; ++i) buf[i] = static_cast<char>(31 - i);
  EXPECT_EQ(crc32c(buf.data(), buf.size()), 0x113FDB5Cu);
}

TEST(Crc32c, MatchesBitwiseReferenceAndMask) {
  std::mt19937 rng(std::random_device{}());
  for (int trial = 0; trial < 200; ++trial) {
    std::string s(rng() % 300, '\0');
    for (char& c : s) c = static_cast<char>(rng());
    ASSERT_EQ(crc32c(s.data(), s.size()), reference_crc32c(s)) << "length " << s.size();
    ASSERT_EQ(masked_crc32c(s.data(), s.size()), reference_mask(reference_crc32c(s)));
  }
}

TEST(TensorBoard, RecordBytes) {
  TempDir dir;
  std::string path;
  const double t0 = now_seconds();
  {
    TensorBoardWriter w(dir.path().string());
    path = w.path();
    w.add_scalar("lm loss", 2.5, 7, 1700000000.25);
  }
  const double t1 = now_seconds();
  const std::string file = read_bytes(path);

  // Record 0: Event{wall_time = now, step = 0, file_version = "brain.Event:2"}.
  ASSERT_GE(file.size(), 12u);
  const std::string v0_tail = std::string("\x10\x00\x1a\x0d", 4) + "brain.Event:2";
  const size_t len0 = 9 + v0_tail.size();  // 0x09 + double, then the rest
  EXPECT_EQ(file.substr(0, 8), le_bytes(len0, 8));
  const std::string data0 = file.substr(12, len0);
  ASSERT_EQ(data0[0], '\x09');  // field 1, wire type 1
  uint64_t bits = 0;
  for (int i = 7; i >= 0; --i) bits = (bits << 8) | static_cast<unsigned char>(data0[1 + i]);
  const double wall0 = std::bit_cast<double>(bits);
  EXPECT_GE(wall0, t0 - 1);
  EXPECT_LE(wall0, t1 + 1);
  EXPECT_EQ(data0.substr(9), v0_tail);
  const std::string record0 = frame(data0);
  ASSERT_EQ(file.substr(0, record0.size()), record0);

  // Record 1, encoded here by hand: Event{1: wall_time, 2: step, 5: Summary{1: Value{1: tag,
  // 2: simple_value}}}.
  const std::string value = std::string("\x0a\x07", 2) + "lm loss" + "\x15" + le_bytes(0x40200000u, 4);  // 2.5f
  const std::string summary = std::string("\x0a") + static_cast<char>(value.size()) + value;
  const std::string event = std::string("\x09") + le_bytes(std::bit_cast<uint64_t>(1700000000.25), 8) +
                            std::string("\x10\x07\x2a", 3) + static_cast<char>(summary.size()) + summary;
  ASSERT_EQ(event.size(), 29u);
  const std::string record1 = frame(event);
  ASSERT_EQ(record1.size(), 8 + 4 + 29 + 4u);
  EXPECT_EQ(file.size(), record0.size() + record1.size());
  EXPECT_EQ(file.substr(record0.size()), record1);
}

TEST(TensorBoard, MegatronScalarsRoundTrip) {
  TempDir dir;
  const char* keep = std::getenv("MT_TENSORBOARD_TEST_OUT");
  const fs::path log_dir = keep != nullptr ? fs::path(keep) : dir.path() / "runs" / "nested";
  struct Point {
    std::string tag;
    double value;
    int64_t step;
    double wall_time;
  };
  std::vector<Point> written;
  std::mt19937 rng(std::random_device{}());
  std::uniform_real_distribution<double> uni(-3.0, 3.0);
  const std::vector<std::string> tags = {"lm loss", "learning-rate", "grad-norm", "loss-scale", "lm loss validation"};
  std::string path;
  const double t0 = now_seconds();
  {
    TensorBoardWriter w(log_dir.string());
    path = w.path();
    for (int64_t step = 10; step <= 50; step += 10) {
      for (size_t k = 0; k < tags.size(); ++k) {
        // Values of every magnitude Megatron logs: losses ~10, lr ~1e-4, loss scale 2^32.
        const double v = k == 3 ? std::ldexp(1.0, 32 - static_cast<int>(step / 10)) : std::exp(uni(rng)) * std::pow(10.0, -4.0 * (k == 1));
        const double wall = k % 2 == 0 ? 1.7e9 + static_cast<double>(step) + 0.125 : -1;
        w.add_scalar(tags[k], v, step, wall);
        written.push_back({tags[k], v, step, wall});
      }
    }
    w.flush();  // and the destructor flushes again
  }
  const double t1 = now_seconds();

  const auto got = read_tensorboard_scalars(path);
  ASSERT_EQ(got.size(), written.size());
  for (size_t i = 0; i < got.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "scalar " << i << " tag " << written[i].tag);
    EXPECT_EQ(got[i].tag, written[i].tag);
    EXPECT_EQ(got[i].value, static_cast<float>(written[i].value));  // exact after float32 rounding
    EXPECT_EQ(got[i].step, written[i].step);
    if (written[i].wall_time >= 0) {
      EXPECT_EQ(got[i].wall_time, written[i].wall_time);
    } else {
      EXPECT_GE(got[i].wall_time, t0 - 1);
      EXPECT_LE(got[i].wall_time, t1 + 1);
    }
  }

  if (keep != nullptr) {
    nlohmann::json expected = nlohmann::json::object();
    for (const auto& p : written) expected[p.tag][std::to_string(p.step)] = static_cast<float>(p.value);
    std::ofstream(log_dir / "expected.json") << expected.dump(2) << "\n";
    std::printf("kept %s and %s\n", path.c_str(), (log_dir / "expected.json").string().c_str());
  }
}

TEST(TensorBoard, EdgeValuesAndSteps) {
  TempDir dir;
  std::string path;
  {
    TensorBoardWriter w(dir.path().string());
    path = w.path();
    w.add_scalar("nan", std::nan(""), 1, 1.0);
    w.add_scalar("inf", -std::numeric_limits<double>::infinity(), -5, 2.0);
    w.add_scalar("big step", 0.0, int64_t{1} << 40, 3.0);
    w.add_scalar("min step", 1e-30, std::numeric_limits<int64_t>::min(), 0.0);
    w.add_scalar("tag with spaces / and \xc3\xa9", 1e39, 0, 4.5);  // > FLT_MAX: inf
  }
  const auto got = read_tensorboard_scalars(path);
  ASSERT_EQ(got.size(), 5u);
  EXPECT_TRUE(std::isnan(got[0].value));
  EXPECT_EQ(got[1].value, -std::numeric_limits<float>::infinity());
  EXPECT_EQ(got[1].step, -5);
  EXPECT_EQ(got[2].value, 0.f);
  EXPECT_EQ(got[2].step, int64_t{1} << 40);
  EXPECT_EQ(got[3].value, 1e-30f);
  EXPECT_EQ(got[3].step, std::numeric_limits<int64_t>::min());
  EXPECT_EQ(got[3].wall_time, 0.0);
  EXPECT_EQ(got[4].tag, "tag with spaces / and \xc3\xa9");
  EXPECT_EQ(got[4].value, std::numeric_limits<float>::infinity());
  EXPECT_EQ(got[4].wall_time, 4.5);
}

// A file with the version record and three scalars; returns its bytes and where record 1 starts.
std::pair<std::string, size_t> three_scalar_file(const TempDir& dir, std::string* path) {
  {
    TensorBoardWriter w(dir.path().string());
    *path = w.path();
    w.add_scalar("lm loss", 3.25, 1, 1.7e9);
    w.add_scalar("lm loss", 3.0, 2, 1.7e9 + 1);
    w.add_scalar("lm loss", 2.75, 3, 1.7e9 + 2);
  }
  const std::string bytes = read_bytes(*path);
  uint64_t len0 = 0;
  for (int i = 7; i >= 0; --i) len0 = (len0 << 8) | static_cast<unsigned char>(bytes[i]);
  return {bytes, 12 + len0 + 4};
}

TEST(TensorBoard, FlippedByteIsDetected) {
  TempDir dir;
  std::string path;
  const auto [good, r1] = three_scalar_file(dir, &path);
  ASSERT_EQ(read_tensorboard_scalars(path).size(), 3u);
  const std::string corrupt = (dir.path() / "corrupt.tfevents").string();
  // Every byte of record 1: length, its CRC, the data, the data CRC.
  const size_t r1_size = (good.size() - r1) / 3;  // records 1..3 have the same size
  for (size_t off = r1; off < r1 + r1_size; ++off) {
    std::string bad = good;
    bad[off] = static_cast<char>(bad[off] ^ (1 << (off % 8)));
    write_bytes(corrupt, bad);
    const std::string msg = error_of([&] { read_tensorboard_scalars(corrupt); });
    SCOPED_TRACE(::testing::Message() << "flipped offset " << off << ": " << msg);
    EXPECT_NE(msg.find(corrupt), std::string::npos);
    EXPECT_NE(msg.find("record 1"), std::string::npos);
    EXPECT_TRUE(msg.find("CRC mismatch") != std::string::npos || msg.find("truncated") != std::string::npos);
  }
  // A flip in the data of record 2 names record 2.
  std::string bad = good;
  bad[r1 + r1_size + 20] ^= 0x40;
  write_bytes(corrupt, bad);
  const std::string msg = error_of([&] { read_tensorboard_scalars(corrupt); });
  EXPECT_NE(msg.find("record 2"), std::string::npos) << msg;
  EXPECT_NE(msg.find("data CRC mismatch"), std::string::npos) << msg;
}

TEST(TensorBoard, TruncatedFileIsDetected) {
  TempDir dir;
  std::string path;
  const auto [good, r1] = three_scalar_file(dir, &path);
  const size_t record_size = (good.size() - r1) / 3;
  const size_t r3 = r1 + 2 * record_size;
  const std::string cut = (dir.path() / "cut.tfevents").string();
  for (size_t n = r3 + 1; n < good.size(); ++n) {
    write_bytes(cut, good.substr(0, n));
    const std::string msg = error_of([&] { read_tensorboard_scalars(cut); });
    SCOPED_TRACE(::testing::Message() << "cut at " << n << " of " << good.size() << ": " << msg);
    EXPECT_NE(msg.find(cut), std::string::npos);
    EXPECT_NE(msg.find("record 3"), std::string::npos);
    EXPECT_NE(msg.find("truncated"), std::string::npos);
  }
  // Cut at a record boundary: a shorter, valid file.
  write_bytes(cut, good.substr(0, r3));
  const auto two = read_tensorboard_scalars(cut);
  ASSERT_EQ(two.size(), 2u);
  EXPECT_EQ(two[1].value, 3.0f);
  EXPECT_EQ(two[1].step, 2);
}

TEST(TensorBoard, MalformedProtobufNamesRecord) {
  TempDir dir;
  std::string path;
  const auto [good, r1] = three_scalar_file(dir, &path);
  const std::string bad_file = (dir.path() / "bad.tfevents").string();
  // Valid CRCs around bad payloads: step with wire type 2; a summary longer than the event.
  for (const std::string& payload : {std::string("\x12\x01\x00", 3), std::string("\x2a\x7f\x0a", 3)}) {
    write_bytes(bad_file, good.substr(0, r1) + frame(payload));
    const std::string msg = error_of([&] { read_tensorboard_scalars(bad_file); });
    EXPECT_NE(msg.find(bad_file), std::string::npos) << msg;
    EXPECT_NE(msg.find("record 1"), std::string::npos) << msg;
    EXPECT_NE(msg.find("malformed protobuf"), std::string::npos) << msg;
  }
  // Unknown fields (a source_metadata, field 10) and a value without simple_value are skipped.
  const std::string value_no_scalar = std::string("\x0a\x01") + "x";
  const std::string summary = std::string("\x0a") + static_cast<char>(value_no_scalar.size()) + value_no_scalar;
  const std::string event = std::string("\x10\x05\x2a") + static_cast<char>(summary.size()) + summary +
                            std::string("\x52\x02\x0a\x00", 4);
  write_bytes(bad_file, good.substr(0, r1) + frame(event));
  EXPECT_TRUE(read_tensorboard_scalars(bad_file).empty());
  EXPECT_NE(error_of([&] { read_tensorboard_scalars((dir.path() / "missing").string()); }).find("missing"),
            std::string::npos);
}

TEST(TensorBoard, FileNamePattern) {
  TempDir dir;
  const fs::path log_dir = dir.path() / "a" / "b";  // parents are created
  const auto t0 = static_cast<int64_t>(std::floor(now_seconds()));
  TensorBoardWriter w1(log_dir.string());
  TensorBoardWriter w2(log_dir.string());
  const auto t1 = static_cast<int64_t>(std::floor(now_seconds()));
  EXPECT_NE(w1.path(), w2.path());
  char host[256] = {};
  ASSERT_EQ(::gethostname(host, sizeof(host) - 1), 0);
  for (const auto* w : {&w1, &w2}) {
    const fs::path p(w->path());
    EXPECT_EQ(p.parent_path(), log_dir);
    EXPECT_TRUE(fs::is_regular_file(p));
    std::smatch m;
    const std::string name = p.filename().string();
    ASSERT_TRUE(std::regex_match(name, m, std::regex(R"(events\.out\.tfevents\.(\d{10})\.(.+)\.(\d+)\.(\d+))")))
        << name;
    const int64_t seconds = std::stoll(m[1].str());
    EXPECT_GE(seconds, t0);
    EXPECT_LE(seconds, t1);
    EXPECT_EQ(m[2].str(), std::string(host));
    EXPECT_EQ(std::stoll(m[3].str()), static_cast<int64_t>(::getpid()));
    // Only the version record so far, already flushed by the constructor.
    EXPECT_TRUE(read_tensorboard_scalars(w->path()).empty());
    EXPECT_EQ(fs::file_size(p), 12u + 26u + 4u);
  }
}

TEST(TensorBoard, UnwritableDirectoryIsAnError) {
  TempDir dir;
  const fs::path file = dir.path() / "regular_file";
  write_bytes(file.string(), "x");
  // Works as root too: a directory cannot be created below a regular file.
  for (const fs::path& bad : {file / "tb", file}) {
    const std::string msg = error_of([&] { TensorBoardWriter w(bad.string()); });
    EXPECT_NE(msg.find(bad.string()), std::string::npos) << msg;
    EXPECT_NE(msg.find("--tensorboard-dir"), std::string::npos) << msg;
  }
  EXPECT_NE(error_of([] { TensorBoardWriter w(""); }).find("empty"), std::string::npos);
  TensorBoardWriter w(dir.path().string());
  EXPECT_NE(error_of([&] { w.add_scalar("", 1.0, 1); }).find("empty scalar tag"), std::string::npos);
}

}  // namespace
}  // namespace mt
