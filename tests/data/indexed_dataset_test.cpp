// Megatron indexed dataset: files written byte by byte from the format spec (docs/data.md)
// are read back; the builder's output is compared byte for byte with the spec; every documented
// corruption raises mt::Error naming the file.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>

#include "data/indexed_dataset.h"
#include "data_test_util.h"
#include "testing/testing.h"

namespace mt::data {
namespace {

using testing::expect_error;
using testing::read_file;
using testing::TempDir;
using testing::write_file;

// Little-endian serialisation helpers for hand-made files.
template <typename T>
void put(std::string* s, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  s->append(b, sizeof(T));
}

struct Spec {
  uint8_t code = 4;
  std::vector<int32_t> lengths;
  std::vector<int64_t> offsets;
  std::vector<int64_t> doc_idx;
  uint64_t version = 1;
  std::string magic = std::string("MMIDIDX\0\0", 9);
};

std::string idx_bytes(const Spec& s) {
  std::string b = s.magic;
  put<uint64_t>(&b, s.version);
  put<uint8_t>(&b, s.code);
  put<uint64_t>(&b, s.lengths.size());
  put<uint64_t>(&b, s.doc_idx.size());
  for (int32_t l : s.lengths) put<int32_t>(&b, l);
  for (int64_t o : s.offsets) put<int64_t>(&b, o);
  for (int64_t d : s.doc_idx) put<int64_t>(&b, d);
  return b;
}

// Four documents: doc 0 = sequences 0 and 1, doc 1 empty (repeated index), doc 2 = sequence 2 (an
// empty sequence), doc 3 = sequence 3. N = 4, so the int64 arrays start at byte 34 + 16 = 50
// (misaligned).
struct Fixture {
  std::vector<std::vector<int32_t>> seqs = {{5, 7, 65535}, {0, 1}, {}, {300}};
  std::vector<int64_t> doc_idx = {0, 2, 2, 3, 4};
};

Spec spec_for(const Fixture& f, uint8_t code, size_t esize) {
  Spec s;
  s.code = code;
  int64_t off = 0;
  for (const auto& q : f.seqs) {
    s.lengths.push_back(static_cast<int32_t>(q.size()));
    s.offsets.push_back(off);
    off += static_cast<int64_t>(q.size() * esize);
  }
  s.doc_idx = f.doc_idx;
  return s;
}

std::string bin_u16(const Fixture& f) {
  std::string b;
  for (const auto& q : f.seqs)
    for (int32_t t : q) put<uint16_t>(&b, static_cast<uint16_t>(t));
  return b;
}

TEST(IndexedDataset, ReadsHandWrittenFiles) {
  TempDir dir;
  Fixture f;
  const std::string prefix = dir.file("ds");
  write_file(prefix + ".idx", idx_bytes(spec_for(f, 8, 2)));
  write_file(prefix + ".bin", bin_u16(f));
  IndexedDataset ds(prefix);
  EXPECT_EQ(ds.dtype(), IndexDType::kUInt16);
  EXPECT_EQ(ds.num_sequences(), 4);
  EXPECT_EQ(ds.num_documents(), 4);
  EXPECT_EQ(ds.num_tokens(), 6);
  EXPECT_EQ(ds.document_indices(), f.doc_idx);
  for (int64_t i = 0; i < 4; ++i) {
    EXPECT_EQ(ds.sequence_length(i), static_cast<int32_t>(f.seqs[i].size()));
    EXPECT_EQ(ds.get(i), f.seqs[i]);
  }
  EXPECT_EQ(ds.sequence_offset(3), 10);
  int32_t two[2] = {-1, -1};
  ds.read(0, 1, 2, two);
  EXPECT_EQ(two[0], 7);
  EXPECT_EQ(two[1], 65535);
  expect_error([&] { ds.read(0, 2, 2, two); }, {"out of range", "sequence 0"});
  expect_error([&] { ds.sequence_length(4); }, {"sequence 4"});
}

TEST(IndexedDataset, ReadsEveryDtypeCode) {
  TempDir dir;
  struct C {
    IndexDType t;
    std::vector<int32_t> vals;
  };
  const std::vector<C> cases = {
      {IndexDType::kUInt8, {0, 255, 7}},        {IndexDType::kInt8, {-128, 127, 0}},
      {IndexDType::kInt16, {-32768, 32767, 1}}, {IndexDType::kInt32, {-5, 2147483647, 50256}},
      {IndexDType::kInt64, {-1, 123456789, 3}}, {IndexDType::kFloat64, {0, 50256, -7}},
      {IndexDType::kFloat32, {0, 16777216, 9}}, {IndexDType::kUInt16, {0, 65535, 50256}},
  };
  for (const auto& c : cases) {
    const std::string prefix = dir.file(std::string(index_dtype_name(c.t)));
    {
      IndexedDatasetBuilder b(prefix, c.t);
      b.add_document(c.vals);
      b.add_document({});
      b.finalize();
    }
    EXPECT_EQ(std::filesystem::file_size(prefix + ".bin"), c.vals.size() * index_dtype_size(c.t));
    IndexedDataset ds(prefix);
    EXPECT_EQ(ds.dtype(), c.t);
    EXPECT_EQ(ds.num_documents(), 2);
    EXPECT_EQ(ds.get(0), c.vals) << index_dtype_name(c.t);
  }
}

TEST(IndexedDatasetBuilder, WritesTheSpecBytes) {
  TempDir dir;
  Fixture f;
  const std::string prefix = dir.file("built");
  IndexedDatasetBuilder b(prefix, IndexDType::kUInt16);
  b.add_item(f.seqs[0]);
  b.add_item(f.seqs[1]);
  b.end_document();
  b.end_document();            // empty document
  b.add_item(f.seqs[2]);       // an empty sequence
  b.end_document();
  b.add_document(f.seqs[3]);
  EXPECT_EQ(b.num_sequences(), 4);
  EXPECT_EQ(b.num_documents(), 4);
  b.finalize();
  EXPECT_EQ(read_file(prefix + ".idx"), idx_bytes(spec_for(f, 8, 2)));
  EXPECT_EQ(read_file(prefix + ".bin"), bin_u16(f));
  // Only the two outputs exist: no temporary files are left.
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir.path()), std::filesystem::directory_iterator()), 2);
}

TEST(IndexedDatasetBuilder, DocumentWithSequenceLengths) {
  TempDir dir;
  Fixture f;
  const std::string prefix = dir.file("lens");
  {
    IndexedDatasetBuilder b(prefix, IndexDType::kUInt16);
    std::vector<int32_t> doc0 = f.seqs[0];
    doc0.insert(doc0.end(), f.seqs[1].begin(), f.seqs[1].end());
    b.add_document(doc0, std::vector<int32_t>{3, 2});
    b.add_document({}, {});
    b.add_document({}, std::vector<int32_t>{0});
    b.add_document(f.seqs[3], std::vector<int32_t>{1});
    expect_error([&] { b.add_document(f.seqs[0], std::vector<int32_t>{1, 1}); }, {"sum to 2", "3 tokens"});
    b.finalize();
  }
  EXPECT_EQ(read_file(prefix + ".idx"), idx_bytes(spec_for(f, 8, 2)));
  EXPECT_EQ(read_file(prefix + ".bin"), bin_u16(f));
}

TEST(IndexedDatasetBuilder, Int32BytesAndEmptyDataset) {
  TempDir dir;
  {
    IndexedDatasetBuilder b(dir.file("i32"), IndexDType::kInt32);
    b.add_document(std::vector<int32_t>{70000, -1});
    b.finalize();
    Spec s;
    s.code = 4;
    s.lengths = {2};
    s.offsets = {0};
    s.doc_idx = {0, 1};
    EXPECT_EQ(read_file(dir.file("i32.idx")), idx_bytes(s));
    std::string bin;
    put<int32_t>(&bin, 70000);
    put<int32_t>(&bin, -1);
    EXPECT_EQ(read_file(dir.file("i32.bin")), bin);
  }
  {
    IndexedDatasetBuilder b(dir.file("empty"), IndexDType::kUInt16);
    b.finalize();
    IndexedDataset ds(dir.file("empty"));
    EXPECT_EQ(ds.num_sequences(), 0);
    EXPECT_EQ(ds.num_documents(), 0);
    EXPECT_EQ(ds.bin_size(), 0);
  }
}

TEST(IndexedDatasetBuilder, ErrorsLeaveNoFiles) {
  TempDir dir;
  auto count_files = [&] {
    return std::distance(std::filesystem::directory_iterator(dir.path()), std::filesystem::directory_iterator());
  };
  {
    IndexedDatasetBuilder b(dir.file("x"), IndexDType::kUInt16);
    b.add_document(std::vector<int32_t>{1, 2});
    expect_error([&] { b.add_document(std::vector<int32_t>{1, 65536}); }, {"65536", "uint16"});
    expect_error([&] { b.add_document(std::vector<int32_t>{-1}); }, {"-1", "uint16"});
    EXPECT_EQ(count_files(), 1);  // the temporary .bin
  }  // destroyed without finalize
  EXPECT_EQ(count_files(), 0);
  {
    IndexedDatasetBuilder b(dir.file("y"), IndexDType::kInt32);
    b.add_item(std::vector<int32_t>{1});
    expect_error([&] { b.finalize(); }, {"after the last end_document"});
  }
  EXPECT_EQ(count_files(), 0);
  expect_error([&] { IndexedDatasetBuilder b(dir.file("no/such/dir/z"), IndexDType::kInt32); }, {"no/such/dir/z"});
  EXPECT_EQ(index_dtype_for_vocab(50257), IndexDType::kUInt16);
  EXPECT_EQ(index_dtype_for_vocab(65499), IndexDType::kUInt16);
  EXPECT_EQ(index_dtype_for_vocab(65500), IndexDType::kInt32);
  EXPECT_EQ(index_dtype_for_vocab(128256), IndexDType::kInt32);
}

// Each corruption: write the files, expect an error whose message names `names` (the file) and `what`.
class Corruption : public ::testing::Test {
 protected:
  TempDir dir;
  Fixture f;
  std::string prefix = dir.file("c");
  void write(const Spec& s, const std::string& bin) {
    write_file(prefix + ".idx", idx_bytes(s));
    write_file(prefix + ".bin", bin);
  }
  void write_raw(const std::string& idx, const std::string& bin) {
    write_file(prefix + ".idx", idx);
    write_file(prefix + ".bin", bin);
  }
  void expect(const std::string& file_suffix, const std::string& what) {
    expect_error([&] { IndexedDataset ds(prefix); }, {prefix + file_suffix, what});
  }
  Spec good() { return spec_for(f, 8, 2); }
};

TEST_F(Corruption, MissingFiles) {
  expect(".idx", "not found");
  write_file(prefix + ".idx", idx_bytes(good()));
  expect(".bin", "not found");
}

TEST_F(Corruption, WrongMagic) {
  Spec s = good();
  s.magic = std::string("MMIDIDY\0\0", 9);
  write(s, bin_u16(f));
  expect(".idx", "magic");
}

TEST_F(Corruption, UnsupportedVersion) {
  Spec s = good();
  s.version = 2;
  write(s, bin_u16(f));
  expect(".idx", "version 2");
}

TEST_F(Corruption, UnknownDtype) {
  for (uint8_t code : {0, 9, 255}) {
    Spec s = good();
    s.code = code;
    write(s, bin_u16(f));
    expect(".idx", "dtype code " + std::to_string(code));
  }
}

TEST_F(Corruption, TruncatedIndex) {
  const std::string full = idx_bytes(good());
  for (size_t cut : {full.size() - 1, full.size() - 8, size_t{40}, size_t{33}, size_t{0}}) {
    write_raw(full.substr(0, cut), bin_u16(f));
    expect(".idx", "truncated");
  }
  // A header announcing an absurd count must not overflow the size check.
  std::string huge = full.substr(0, 18);
  put<uint64_t>(&huge, ~uint64_t{0} / 4);
  put<uint64_t>(&huge, 1);
  write_raw(huge, bin_u16(f));
  expect(".idx", "truncated");
}

TEST_F(Corruption, TrailingBytes) {
  write_raw(idx_bytes(good()) + "xx", bin_u16(f));
  expect(".idx", "expected");
  // A trailing int8[N] of sequence modes (Megatron multimodal) is accepted.
  write_raw(idx_bytes(good()) + std::string(4, '\0'), bin_u16(f));
  EXPECT_NO_THROW(IndexedDataset ds(prefix));
}

TEST_F(Corruption, DocumentIndices) {
  Spec s = good();
  s.doc_idx = {1, 2, 2, 3, 4};
  write(s, bin_u16(f));
  expect(".idx", "start at 0");
  s.doc_idx = {0, 2, 2, 3, 3};
  write(s, bin_u16(f));
  expect(".idx", "end at the number of sequences 4");
  s.doc_idx = {0, 3, 2, 3, 4};
  write(s, bin_u16(f));
  expect(".idx", "decrease");
  s.doc_idx = {};
  write(s, bin_u16(f));
  expect(".idx", "no document indices");
}

TEST_F(Corruption, NegativeLength) {
  Spec s = good();
  s.lengths[1] = -2;
  write(s, bin_u16(f));
  expect(".idx", "negative length");
}

TEST_F(Corruption, OffsetsBeyondBin) {
  Spec s = good();
  s.offsets[3] = 12;  // 1 token at byte 12: needs 14 bytes, .bin has 12
  write(s, bin_u16(f));
  expect(".bin", "sequence 3");
  // A truncated .bin fails the same check.
  write(good(), bin_u16(f).substr(0, 11));
  expect(".bin", "has 11 bytes");
}

TEST_F(Corruption, BinSizeMismatch) {
  write(good(), bin_u16(f) + "zz");
  expect(".bin", "14 bytes");
}

TEST(IndexedDataset, Int64ValueOutOfInt32RangeIsAnError) {
  TempDir dir;
  const std::string prefix = dir.file("w");
  Spec s;
  s.code = 5;
  s.lengths = {2};
  s.offsets = {0};
  s.doc_idx = {0, 1};
  std::string bin;
  put<int64_t>(&bin, 1);
  put<int64_t>(&bin, int64_t{1} << 40);
  write_file(prefix + ".idx", idx_bytes(s));
  write_file(prefix + ".bin", bin);
  IndexedDataset ds(prefix);
  expect_error([&] { ds.get(0); }, {"sequence 0 token 1", "int64"});
}

}  // namespace
}  // namespace mt::data
