// TensorBoard event-file writer and reader; the format is described in train/tensorboard.h.
#include "train/tensorboard.h"

#include <unistd.h>

#include <array>
#include <atomic>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "core/check.h"
#include "core/crc32c.h"
#include "core/logging.h"

namespace mt {
namespace {

namespace fs = std::filesystem;

constexpr uint32_t kCrcMaskDelta = 0xa282ead8u;
constexpr const char* kFileVersion = "brain.Event:2";
constexpr size_t kRecordHeaderBytes = 12;  // uint64 length + uint32 masked crc of it
constexpr size_t kRecordFooterBytes = 4;   // uint32 masked crc of the data

// Protobuf wire types (protobuf encoding guide) and the field numbers we use.
constexpr uint32_t kWireVarint = 0, kWireFixed64 = 1, kWireLengthDelimited = 2, kWireFixed32 = 5;
constexpr uint32_t kEventWallTime = 1, kEventStep = 2, kEventFileVersion = 3, kEventSummary = 5;
constexpr uint32_t kSummaryValue = 1;
constexpr uint32_t kValueTag = 1, kValueSimpleValue = 2;


// ---- encoding ----------------------------------------------------------------------------

void put_fixed32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xffu));
}
void put_fixed64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xffu));
}
void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7fu) | 0x80u));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}
void put_key(std::string& out, uint32_t field, uint32_t wire_type) { put_varint(out, (field << 3) | wire_type); }
void put_bytes_field(std::string& out, uint32_t field, const std::string& bytes) {
  put_key(out, field, kWireLengthDelimited);
  put_varint(out, bytes.size());
  out += bytes;
}

double now_seconds() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

// Event{wall_time, step} with the fields in number order, as protobuf serialises them; the
// caller appends the oneof member.
void begin_event(std::string& out, double wall_time, int64_t step) {
  out.clear();
  put_key(out, kEventWallTime, kWireFixed64);
  put_fixed64(out, std::bit_cast<uint64_t>(wall_time));
  put_key(out, kEventStep, kWireVarint);
  put_varint(out, static_cast<uint64_t>(step));  // int64: negatives take 10 bytes
}

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0 || buf[0] == '\0') return "localhost";
  std::string h(buf);
  for (char& c : h)
    if (c == '/') c = '_';
  return h;
}

// ---- decoding ----------------------------------------------------------------------------

// A cursor over one protobuf message; every failure throws naming the file and record.
class WireReader {
 public:
  WireReader(const uint8_t* p, const uint8_t* end, const std::string& file, size_t record)
      : p_(p), end_(end), file_(file), record_(record) {}

  bool done() const { return p_ >= end_; }

  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      MT_REQUIRE(p_ < end_, "TensorBoard event file '{}' record {}: malformed protobuf (truncated varint)",
                 file_, record_);
      const uint8_t b = *p_++;
      v |= static_cast<uint64_t>(b & 0x7fu) << shift;
      if ((b & 0x80u) == 0) return v;
    }
    MT_FAIL("TensorBoard event file '{}' record {}: malformed protobuf (varint longer than 10 bytes)", file_,
            record_);
  }
  uint32_t fixed32() {
    const uint8_t* b = take(4);
    return uint32_t(b[0]) | uint32_t(b[1]) << 8 | uint32_t(b[2]) << 16 | uint32_t(b[3]) << 24;
  }
  uint64_t fixed64() {
    const uint8_t* b = take(8);
    uint64_t v = 0;
    for (int i = 7; i >= 0; --i) v = (v << 8) | b[i];
    return v;
  }
  // A length-delimited payload: [begin, begin + size).
  std::pair<const uint8_t*, const uint8_t*> bytes() {
    const uint64_t n = varint();
    MT_REQUIRE(n <= static_cast<uint64_t>(end_ - p_),
               "TensorBoard event file '{}' record {}: malformed protobuf (length {} past the end, {} bytes "
               "left)",
               file_, record_, n, end_ - p_);
    const uint8_t* b = take(static_cast<size_t>(n));
    return {b, b + n};
  }
  void skip(uint32_t wire_type) {
    switch (wire_type) {
      case kWireVarint: varint(); return;
      case kWireFixed64: take(8); return;
      case kWireLengthDelimited: bytes(); return;
      case kWireFixed32: take(4); return;
      default:
        MT_FAIL("TensorBoard event file '{}' record {}: malformed protobuf (unsupported wire type {})", file_,
                record_, wire_type);
    }
  }
  // Throws when field `field` (`name`) arrived with another wire type than `expected`.
  void expect(uint32_t field, uint32_t wire_type, uint32_t expected, const char* name) const {
    MT_REQUIRE(wire_type == expected,
               "TensorBoard event file '{}' record {}: malformed protobuf ({} (field {}) has wire type {}, "
               "expected {})",
               file_, record_, name, field, wire_type, expected);
  }
  WireReader sub(std::pair<const uint8_t*, const uint8_t*> r) const { return {r.first, r.second, file_, record_}; }

 private:
  const uint8_t* take(size_t n) {
    MT_REQUIRE(n <= static_cast<size_t>(end_ - p_),
               "TensorBoard event file '{}' record {}: malformed protobuf (needs {} bytes, {} left)", file_,
               record_, n, end_ - p_);
    const uint8_t* b = p_;
    p_ += n;
    return b;
  }

  const uint8_t* p_;
  const uint8_t* end_;
  const std::string& file_;
  size_t record_;
};

// Appends the simple_value scalars of one serialized Event to `out`.
void decode_event(WireReader ev, std::vector<TensorBoardScalar>& out) {
  double wall_time = 0;
  int64_t step = 0;
  std::vector<std::pair<const uint8_t*, const uint8_t*>> summaries;
  while (!ev.done()) {
    const uint64_t key = ev.varint();
    const auto field = static_cast<uint32_t>(key >> 3), wt = static_cast<uint32_t>(key & 7u);
    if (field == kEventWallTime) {
      ev.expect(field, wt, kWireFixed64, "Event.wall_time");
      wall_time = std::bit_cast<double>(ev.fixed64());
    } else if (field == kEventStep) {
      ev.expect(field, wt, kWireVarint, "Event.step");
      step = static_cast<int64_t>(ev.varint());
    } else if (field == kEventSummary) {
      ev.expect(field, wt, kWireLengthDelimited, "Event.summary");
      summaries.push_back(ev.bytes());
    } else {
      ev.skip(wt);
    }
  }
  for (const auto& s : summaries) {
    WireReader summary = ev.sub(s);
    while (!summary.done()) {
      const uint64_t key = summary.varint();
      const auto field = static_cast<uint32_t>(key >> 3), wt = static_cast<uint32_t>(key & 7u);
      if (field != kSummaryValue) {
        summary.skip(wt);
        continue;
      }
      summary.expect(field, wt, kWireLengthDelimited, "Summary.value");
      WireReader value = summary.sub(summary.bytes());
      std::string tag;
      bool has_simple_value = false;
      float simple_value = 0;
      while (!value.done()) {
        const uint64_t vkey = value.varint();
        const auto vfield = static_cast<uint32_t>(vkey >> 3), vwt = static_cast<uint32_t>(vkey & 7u);
        if (vfield == kValueTag) {
          value.expect(vfield, vwt, kWireLengthDelimited, "Summary.Value.tag");
          const auto t = value.bytes();
          tag.assign(reinterpret_cast<const char*>(t.first), static_cast<size_t>(t.second - t.first));
        } else if (vfield == kValueSimpleValue) {
          value.expect(vfield, vwt, kWireFixed32, "Summary.Value.simple_value");
          simple_value = std::bit_cast<float>(value.fixed32());
          has_simple_value = true;
        } else {
          value.skip(vwt);
        }
      }
      if (has_simple_value) out.push_back({std::move(tag), simple_value, step, wall_time});
    }
  }
}

uint32_t load_le32(const uint8_t* b) {
  return uint32_t(b[0]) | uint32_t(b[1]) << 8 | uint32_t(b[2]) << 16 | uint32_t(b[3]) << 24;
}
uint64_t load_le64(const uint8_t* b) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | b[i];
  return v;
}

}  // namespace

uint32_t masked_crc32c(const void* data, size_t n) {
  const uint32_t c = crc32c(data, n);
  return ((c >> 15) | (c << 17)) + kCrcMaskDelta;
}

// ---- TensorBoardWriter -------------------------------------------------------------------

void TensorBoardWriter::FileCloser::operator()(std::FILE* f) const {
  if (f != nullptr) std::fclose(f);
}

TensorBoardWriter::TensorBoardWriter(const std::string& log_dir) {
  MT_REQUIRE(!log_dir.empty(), "--tensorboard-dir: empty directory name");
  std::error_code ec;
  fs::create_directories(log_dir, ec);
  MT_REQUIRE(!ec, "--tensorboard-dir '{}': cannot create the directory: {}", log_dir, ec.message());
  MT_REQUIRE(fs::is_directory(log_dir, ec), "--tensorboard-dir '{}': exists and is not a directory", log_dir);

  static std::atomic<int64_t> writers_opened{0};
  const auto seconds = static_cast<int64_t>(std::floor(now_seconds()));
  const std::string name = fmt::format("events.out.tfevents.{:010d}.{}.{}.{}", seconds, host_name(),
                                       static_cast<int64_t>(::getpid()), writers_opened.fetch_add(1));
  path_ = (fs::path(log_dir) / name).string();
  // "x": fail rather than overwrite an existing file (C11 exclusive mode).
  std::FILE* f = std::fopen(path_.c_str(), "wbx");
  MT_REQUIRE(f != nullptr, "--tensorboard-dir '{}': cannot create the event file '{}': {}", log_dir, name,
             std::strerror(errno));
  file_.reset(f);

  begin_event(event_, now_seconds(), 0);
  put_bytes_field(event_, kEventFileVersion, kFileVersion);
  write_record(event_);
  flush();
}

TensorBoardWriter::~TensorBoardWriter() {
  if (!file_) return;  // moved from
  try {
    flush();
  } catch (const std::exception& e) {
    log_warn("{}", e.what());
  }
}

void TensorBoardWriter::add_scalar(const std::string& tag, double value, int64_t step, double wall_time) {
  MT_REQUIRE(!tag.empty(), "TensorBoard event file '{}': empty scalar tag (value {} at step {})", path_, value,
             step);
  MT_REQUIRE(file_ != nullptr, "TensorBoardWriter: add_scalar('{}') on a moved-from writer", tag);
  // Summary.Value{tag, simple_value}, wrapped in Summary{value}, wrapped in Event.summary.
  std::string v;
  put_bytes_field(v, kValueTag, tag);
  put_key(v, kValueSimpleValue, kWireFixed32);
  put_fixed32(v, std::bit_cast<uint32_t>(static_cast<float>(value)));
  std::string summary;
  put_bytes_field(summary, kSummaryValue, v);
  begin_event(event_, wall_time < 0 ? now_seconds() : wall_time, step);
  put_bytes_field(event_, kEventSummary, summary);
  write_record(event_);
}

void TensorBoardWriter::write_record(const std::string& data) {
  record_.clear();
  put_fixed64(record_, data.size());
  put_fixed32(record_, masked_crc32c(record_.data(), 8));
  record_ += data;
  put_fixed32(record_, masked_crc32c(data.data(), data.size()));
  const size_t written = std::fwrite(record_.data(), 1, record_.size(), file_.get());
  MT_REQUIRE(written == record_.size(), "TensorBoard event file '{}': write failed after {} of {} bytes: {}",
             path_, written, record_.size(), std::strerror(errno));
}

void TensorBoardWriter::flush() {
  if (!file_) return;
  MT_REQUIRE(std::fflush(file_.get()) == 0, "TensorBoard event file '{}': flush failed: {}", path_,
             std::strerror(errno));
}

// ---- reader ------------------------------------------------------------------------------

std::vector<TensorBoardScalar> read_tensorboard_scalars(const std::string& event_file) {
  std::ifstream in(event_file, std::ios::binary);
  MT_REQUIRE(in.good(), "TensorBoard event file '{}': cannot open: {}", event_file, std::strerror(errno));
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  MT_REQUIRE(!in.bad(), "TensorBoard event file '{}': read failed", event_file);

  std::vector<TensorBoardScalar> out;
  const auto* base = reinterpret_cast<const uint8_t*>(bytes.data());
  size_t pos = 0;
  for (size_t record = 0; pos < bytes.size(); ++record) {
    const size_t left = bytes.size() - pos;
    MT_REQUIRE(left >= kRecordHeaderBytes,
               "TensorBoard event file '{}' record {} (offset {}): truncated header ({} of {} bytes)", event_file,
               record, pos, left, kRecordHeaderBytes);
    const uint8_t* h = base + pos;
    const uint64_t length = load_le64(h);
    const uint32_t length_crc = load_le32(h + 8);
    MT_REQUIRE(length_crc == masked_crc32c(h, 8),
               "TensorBoard event file '{}' record {} (offset {}): length CRC mismatch (stored {:#010x}, "
               "computed {:#010x}; length field {})",
               event_file, record, pos, length_crc, masked_crc32c(h, 8), length);
    MT_REQUIRE(length <= left - kRecordHeaderBytes && left - kRecordHeaderBytes - length >= kRecordFooterBytes,
               "TensorBoard event file '{}' record {} (offset {}): truncated (needs {} data + {} CRC bytes, {} "
               "left)",
               event_file, record, pos, length, kRecordFooterBytes, left - kRecordHeaderBytes);
    const uint8_t* data = h + kRecordHeaderBytes;
    const auto n = static_cast<size_t>(length);
    const uint32_t data_crc = load_le32(data + n);
    MT_REQUIRE(data_crc == masked_crc32c(data, n),
               "TensorBoard event file '{}' record {} (offset {}): data CRC mismatch (stored {:#010x}, computed "
               "{:#010x}; {} data bytes)",
               event_file, record, pos, data_crc, masked_crc32c(data, n), n);
    decode_event(WireReader(data, data + n, event_file, record), out);
    pos += kRecordHeaderBytes + n + kRecordFooterBytes;
  }
  return out;
}

}  // namespace mt
