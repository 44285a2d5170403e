// Megatron's memory-mapped indexed dataset (megatron/core/datasets/indexed_dataset.py,
// IndexedDataset / IndexedDatasetBuilder), the on-disk format of preprocess_data.py's output.
//
// <prefix>.bin: the tokens of all sequences back to back, no header.
// <prefix>.idx: little-endian, packed (no padding):
//   magic "MMIDIDX\0\0" (9 bytes) | uint64 version = 1 | uint8 dtype code | uint64 N (sequences) |
//   uint64 D (documents + 1) | int32[N] sequence lengths (tokens) | int64[N] sequence byte offsets
//   into .bin | int64[D] document indices.
// Document k is sequences [di[k], di[k+1]); di[0] = 0, di[D-1] = N; equal neighbours are empty
// documents. The int64 arrays are generally misaligned in the file (they are read with memcpy).
// preprocess_data writes one sequence per document (no sentence splitting).
#pragma once
#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace mt::data {

/// Token dtype codes of the .idx header (Megatron's DType enum in indexed_dataset.py).
enum class IndexDType : uint8_t {
  kUInt8 = 1,
  kInt8 = 2,
  kInt16 = 3,
  kInt32 = 4,
  kInt64 = 5,
  kFloat64 = 6,
  kFloat32 = 7,
  kUInt16 = 8,
};

/// Bytes per element; 0 for an unknown code.
size_t index_dtype_size(IndexDType t);
/// "uint8", "int8", ..., "uint16"; "unknown" otherwise.
std::string_view index_dtype_name(IndexDType t);
/// True for codes 1..8.
bool index_dtype_valid(uint8_t code);
/// Megatron's DType.optimal_dtype: uint16 if vocab_size < 65500, else int32.
IndexDType index_dtype_for_vocab(int64_t vocab_size);

inline constexpr char kIndexMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
inline constexpr uint64_t kIndexVersion = 1;
inline constexpr size_t kIndexHeaderBytes = 9 + 8 + 1 + 8 + 8;  // 34

/// Read-only, memory-mapped view of <prefix>.idx / <prefix>.bin, validated on open.
/// Thread-safe for concurrent reads. Not copyable (owns the mappings); share it via shared_ptr.
class IndexedDataset {
 public:
  /// Opens and validates. Errors (mt::Error naming the file): missing .idx or .bin; .idx shorter than
  /// its header or than the arrays its header announces (truncated), or longer than that (trailing
  /// bytes; a trailing int8[N] of sequence modes, as Megatron's multimodal datasets write, is
  /// accepted and ignored); wrong magic; version != 1; unknown dtype code; a negative sequence length;
  /// document indices not starting at 0, not ending at N, or decreasing; a sequence whose byte offset
  /// + length exceeds the .bin size; .bin size != (sum of lengths) * element size.
  explicit IndexedDataset(const std::string& prefix);
  ~IndexedDataset();
  IndexedDataset(const IndexedDataset&) = delete;
  IndexedDataset& operator=(const IndexedDataset&) = delete;

  const std::string& prefix() const { return prefix_; }
  IndexDType dtype() const { return dtype_; }
  size_t element_size() const { return index_dtype_size(dtype_); }

  int64_t num_sequences() const { return num_sequences_; }
  /// Number of documents (D - 1).
  int64_t num_documents() const { return static_cast<int64_t>(document_indices_.size()) - 1; }
  /// Sum of all sequence lengths.
  int64_t num_tokens() const { return num_tokens_; }

  /// Length in tokens of sequence i. Error: i out of range.
  int32_t sequence_length(int64_t i) const;
  /// Byte offset of sequence i in .bin. Error: i out of range.
  int64_t sequence_offset(int64_t i) const;
  /// All N sequence lengths / the D = documents + 1 document indices.
  const std::vector<int32_t>& sequence_lengths() const { return lengths_; }
  const std::vector<int64_t>& document_indices() const { return document_indices_; }

  /// Copies tokens [offset, offset + count) of sequence i into out[0..count), converted to int32.
  /// Errors: i or the range out of bounds; a stored value not representable as int32 (int64 /
  /// float types) - naming the sequence and position.
  void read(int64_t i, int64_t offset, int64_t count, int32_t* out) const;
  /// All tokens of sequence i as int32.
  std::vector<int32_t> get(int64_t i) const;
  /// Raw bytes of the .bin file (nullptr when it is empty).
  const uint8_t* bin_data() const { return bin_; }
  int64_t bin_size() const { return bin_size_; }

 private:
  std::string prefix_;
  IndexDType dtype_ = IndexDType::kUInt16;
  int64_t num_sequences_ = 0;
  int64_t num_tokens_ = 0;
  std::vector<int32_t> lengths_;
  std::vector<int64_t> offsets_;
  std::vector<int64_t> document_indices_;
  const uint8_t* bin_ = nullptr;
  int64_t bin_size_ = 0;
  void* bin_map_ = nullptr;
  size_t bin_map_size_ = 0;

  void load_index(const std::string& idx_path);
};

/// Writes <prefix>.bin and <prefix>.idx (Megatron's IndexedDatasetBuilder). Tokens are streamed to a
/// temporary .bin as they are added; finalize() writes the .idx to a temporary file and renames both
/// into place, so an error (or destruction without finalize) leaves no partial output (and no
/// temporary files). Not thread-safe.
class IndexedDatasetBuilder {
 public:
  /// Error: the temporary .bin cannot be created.
  IndexedDatasetBuilder(const std::string& prefix, IndexDType dtype);
  ~IndexedDatasetBuilder();
  IndexedDatasetBuilder(const IndexedDatasetBuilder&) = delete;
  IndexedDatasetBuilder& operator=(const IndexedDatasetBuilder&) = delete;

  /// Appends one sequence (not yet ending a document). Error: a token not representable in the dtype
  /// (e.g. >= 65536 or < 0 for uint16), naming the value and its position.
  void add_item(std::span<const int32_t> tokens);
  /// Ends the current document (after the items added since the last end).
  void end_document();
  /// One document = one sequence (as preprocess_data writes). An empty `tokens` adds no sequence and
  /// an empty document (a repeated document index), as Megatron does for empty texts.
  void add_document(std::span<const int32_t> tokens);
  /// Megatron's add_document(tokens, lengths): the sequences of the given lengths (summing to
  /// tokens.size()), then end_document(). Error: lengths that do not sum to tokens.size() or are < 0.
  void add_document(std::span<const int32_t> tokens, std::span<const int32_t> lengths);

  /// Writes the .idx and moves both files into place. Errors: I/O failures, naming the file;
  /// items added after the last end_document() (an unterminated document).
  void finalize();

  int64_t num_sequences() const { return static_cast<int64_t>(lengths_.size()); }
  int64_t num_documents() const { return static_cast<int64_t>(document_indices_.size()) - 1; }

 private:
  std::string prefix_;
  IndexDType dtype_;
  std::string bin_tmp_, idx_tmp_;
  std::FILE* bin_file_ = nullptr;
  std::vector<int32_t> lengths_;
  std::vector<int64_t> document_indices_{0};
  std::vector<uint8_t> scratch_;
  bool finalized_ = false;

  void cleanup() noexcept;
};

}  // namespace mt::data
