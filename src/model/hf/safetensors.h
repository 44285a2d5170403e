// Hugging Face safetensors: reading and writing single files and (sharded) model directories.
//
// Source: the safetensors format (github.com/huggingface/safetensors, README "Format", and the
// reference implementation safetensors/src/tensor.rs, v0.8). A file is
//   [8 bytes: uint64 little-endian N] [N bytes: UTF-8 JSON header] [byte buffer]
// The header maps tensor name -> {"dtype": "F32"|..., "shape": [d0, ...], "data_offsets":
// [begin, end]} (offsets in bytes, relative to the start of the byte buffer), plus an optional
// "__metadata__": {string: string}. The header may end with spaces (0x20). Tensor data is
// little-endian, row-major (C order), with no padding: the tensors, sorted by offset, cover the
// buffer exactly, and the file ends with the last tensor.
//
// Model directories (transformers' save_pretrained / huggingface_hub.save_torch_state_dict):
// either a single `model.safetensors`, or shards `model-00001-of-00003.safetensors`, ... with
// `model.safetensors.index.json` = {"metadata": {"total_size": bytes}, "weight_map": {tensor
// name: shard file name}}.
//
// Files are read with std::ifstream on demand (the header at open, a tensor's bytes when asked).
// All errors are mt::Error naming the file (or directory) and, where there is one, the tensor.
#pragma once
#include <cstdint>
#include <fstream>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"

namespace mt::hf {

/// Bits per element of a safetensors dtype string ("F32" -> 32, "BF16" -> 16, "F4" -> 4, ...),
/// or 0 when the string is not a dtype of the reference implementation (BOOL, F4, F6_E2M3,
/// F6_E3M2, U8, I8, F8_E5M2, F8_E4M3, F8_E8M0, F8_E4M3FNUZ, F8_E5M2FNUZ, I16, U16, F16, BF16, I32,
/// U32, F32, C64, F64, I64, U64).
int safetensors_dtype_bits(std::string_view dtype);

/// The safetensors dtype string of a float DType: kF32 -> "F32", kBF16 -> "BF16", kF16 -> "F16".
/// Error: any other DType.
std::string_view safetensors_dtype_name(DType dtype);

/// One tensor of a file's header. [begin, end) are byte offsets into the file's byte buffer
/// (which starts at file offset 8 + N).
struct SafetensorsTensorInfo {
  std::string name;
  std::string dtype;           ///< safetensors dtype string, e.g. "BF16"
  std::vector<int64_t> shape;  ///< [] for a scalar (numel 1)
  uint64_t begin = 0, end = 0;

  int64_t numel() const;                         ///< product of shape (1 for a scalar)
  uint64_t nbytes() const { return end - begin; }
};

/// One safetensors file: the header is read and validated at open(), tensor data is read on
/// demand. Copyable; holds no open file handle.
class SafetensorsFile {
 public:
  /// Opens and validates `path` as the reference reader does. Errors (mt::Error naming the file,
  /// and the tensor where there is one): missing/unreadable file; file shorter than 8 bytes;
  /// N > 100,000,000 (the reference's limit) or 8 + N larger than the file; header not valid
  /// UTF-8 JSON, or not an object; an entry without a string "dtype", an integer "shape" array
  /// (dims >= 0) or a 2-integer "data_offsets" array; unknown dtype string; "__metadata__" not an
  /// object of strings; end < begin; (end - begin) != numel * dtype size (or a sub-byte dtype
  /// whose numel does not fill whole bytes, or numel overflowing); overlapping tensors; a hole
  /// (bytes covered by no tensor, including before the first); data_offsets beyond the end of the
  /// file (truncated data); extra bytes after the last tensor.
  static SafetensorsFile open(const std::string& path);

  /// All tensors, in increasing data offset order.
  const std::vector<SafetensorsTensorInfo>& tensors() const { return tensors_; }
  /// The tensor called `name`, or nullptr.
  const SafetensorsTensorInfo* find(const std::string& name) const;
  /// Tensor `name` converted to float32, row-major, numel() values. F32 bitwise; BF16 and F16
  /// exactly (every value is representable); F64 rounded to nearest. Errors: no such tensor
  /// (names the file and the tensor); another dtype (names the file, tensor and dtype); the file
  /// shorter than the header says (changed since open).
  std::vector<float> read_f32(const std::string& name) const;
  /// The raw little-endian bytes of tensor `name` (nbytes() of them), any dtype. Errors as
  /// read_f32 except the dtype.
  std::vector<uint8_t> read_bytes(const std::string& name) const;
  /// "__metadata__" of the header (empty when absent).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::string& path() const { return path_; }
  /// N, the header length in bytes (padding included); the byte buffer starts at 8 + N.
  uint64_t header_size() const { return header_size_; }

 private:
  // A stream positioned at the first byte of tensor t's data.
  std::ifstream open_data(const SafetensorsTensorInfo& t) const;
  // Reads the next n bytes of tensor t's data from f into dst.
  void read_exact(std::ifstream& f, const SafetensorsTensorInfo& t, uint64_t n, char* dst) const;

  std::string path_;
  uint64_t header_size_ = 0;
  std::vector<SafetensorsTensorInfo> tensors_;
  std::map<std::string, size_t> index_;  // name -> position in tensors_
  std::map<std::string, std::string> metadata_;
};

/// A Hugging Face model directory: model.safetensors.index.json + shards, or model.safetensors.
class SafetensorsCheckpoint {
 public:
  /// Opens `dir`. When <dir>/model.safetensors.index.json exists it is used (and a
  /// model.safetensors beside it ignored): every shard it names is opened and must hold every
  /// tensor the weight_map assigns to it (tensors of a shard that the weight_map does not list
  /// are not part of the checkpoint; "metadata"/"total_size" is not checked, as transformers
  /// does not). Otherwise <dir>/model.safetensors is opened.
  /// Errors (naming the directory or index and the file/tensor): `dir` not a directory; neither
  /// file present; index not JSON, without a "weight_map" object of strings, or naming a file
  /// by a path (containing '/' or '\\', or "." / ".."); a named shard missing; a tensor absent
  /// from the shard the weight_map names; any error of SafetensorsFile::open.
  static SafetensorsCheckpoint open(const std::string& dir);

  bool has(const std::string& name) const { return where_.count(name) != 0; }
  /// Every tensor name, sorted.
  std::vector<std::string> names() const;
  /// Header entry of tensor `name`. Error naming the directory and the tensor when absent.
  SafetensorsTensorInfo info(const std::string& name) const;
  /// As SafetensorsFile::read_f32, from the file holding `name`. Error naming the directory and
  /// the tensor when absent.
  std::vector<float> read_f32(const std::string& name) const;
  /// The file holding `name`. Error naming the directory and the tensor when absent.
  const SafetensorsFile& file_of(const std::string& name) const;
  /// The opened files: the shards sorted by file name, or the single model.safetensors.
  const std::vector<SafetensorsFile>& files() const { return files_; }
  const std::string& dir() const { return dir_; }
  /// True when opened through model.safetensors.index.json.
  bool sharded() const { return sharded_; }

 private:
  std::string dir_;
  bool sharded_ = false;
  std::vector<SafetensorsFile> files_;
  std::map<std::string, size_t> where_;  // tensor name -> position in files_
};

/// A tensor to write: `data` holds numel(shape) float32 values (row-major) stored as `dtype`
/// (kF32 bitwise; kBF16 / kF16 rounded to nearest even, overflow to inf, NaN kept).
struct TensorToWrite {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::vector<float> data;
};

/// Writes a safetensors file at `path` (through `path`.tmp and a rename, so readers never see a
/// partial file). Layout as the reference writer (safetensors.torch.save_file): tensors sorted by
/// dtype, widest first (F32, then BF16, then F16), then by name (byte-wise), stored contiguously
/// from offset 0 in that order; the header is compact JSON with "__metadata__" first (only when
/// `metadata` is non-empty, keys sorted) and the tensors in layout order, each as
/// {"dtype", "shape", "data_offsets"}, padded with spaces so that N is a multiple of 8. For the
/// same tensors and metadata the file is byte-identical to the reference's.
/// Errors (naming the path and the tensor): empty or duplicate name, the name "__metadata__",
/// a dtype other than kF32/kBF16/kF16, a negative dimension, data.size() != numel, a name or
/// metadata string that is not valid UTF-8, the file cannot be written.
void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

/// File name of shard i (1-based) of n: "model-00001-of-00003.safetensors" (5 digits, as
/// transformers / huggingface_hub).
std::string safetensors_shard_name(int i, int n);

/// Writes a Hugging Face model directory `dir` (created if needed). When max_shard_bytes is 0 or
/// the sum of the tensors' data bytes is <= max_shard_bytes: a single <dir>/model.safetensors.
/// Otherwise shards, filled in the given order and keeping tensors whole: a tensor starts a new
/// shard when the current one is non-empty and would exceed max_shard_bytes (data bytes, headers
/// not counted) — a tensor larger than the limit gets a shard of its own — as
/// huggingface_hub.split_torch_state_dict_into_shards; then model.safetensors.index.json
/// ({"metadata": {"total_size": sum of tensor data bytes}, "weight_map": {name: file}}, keys
/// sorted, indent 2) written last. If the split yields one shard, a single model.safetensors is
/// written instead. `metadata` goes into every file's "__metadata__". Files of an earlier save
/// that the new one does not use (model.safetensors.index.json, model.safetensors and
/// model-NNNNN-of-NNNNN.safetensors) are removed after the new files are in place.
/// Errors: as write_safetensors; the directory cannot be created.
void write_safetensors_checkpoint(const std::string& dir, const std::vector<TensorToWrite>& tensors,
                                  uint64_t max_shard_bytes = 0,
                                  const std::map<std::string, std::string>& metadata = {});

}  // namespace mt::hf
