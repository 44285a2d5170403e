// On-disk cache of dataset index arrays (--data-cache-path), shared by GPTDataset and BlendedDataset.
//
// Each cached object is one file "<dir>/<hash>-<kind>.mtidx" (plus a human-readable
// "<dir>/<hash>-<kind>-description.txt"), where <hash> is a 64-bit FNV-1a hash (16 hex digits) of
// the object's description string (Megatron uses the MD5 of its JSON description; the names differ
// from Megatron's, the role is the same). File layout (little-endian):
//   "MTIDXC01" | uint64 description bytes | description | uint32 n_i32 | uint32 n_i64 |
//   per array: uint64 length, then the int32 arrays' data, then the int64 arrays' data |
//   uint64 FNV-1a-64 of every preceding byte.
// A file whose size, magic, description or checksum does not match is treated as missing.
// Files are written to a unique temporary name in the same directory and renamed into place, so
// readers never see a partial file.
//
// Multi-rank use ("built once by one rank while the others wait", as Megatron's
// build_generic_dataset does with a barrier): the building rank calls with build_if_missing = true;
// the others call with build_if_missing = false, which polls until a valid file appears (or
// wait_timeout_s passes, an error). With a barrier after the builder's call, the waiting ranks find
// the file at once; without one, polling is enough.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace mt::data {

struct IndexCacheOptions {
  std::string dir;               ///< --data-cache-path; empty: no cache, always build in memory
  bool build_if_missing = true;  ///< false: wait for another process to write the file
  double wait_timeout_s = 3600;  ///< how long a waiting process polls before failing
  double poll_interval_s = 0.2;
};

struct IndexArrays {
  std::vector<std::vector<int32_t>> i32;
  std::vector<std::vector<int64_t>> i64;
};

/// 64-bit FNV-1a of `bytes` (seed = the FNV offset basis unless given).
uint64_t fnv1a64(const void* bytes, size_t n, uint64_t seed = 0xcbf29ce484222325ull);
/// 16 lower-case hex digits of fnv1a64(description).
std::string description_hash(const std::string& description);

/// Path of the cache file for (options.dir, description, kind).
std::string index_cache_path(const std::string& dir, const std::string& description, const std::string& kind);

/// Loads the arrays cached for `description`, or builds them with `build` and (with a cache dir)
/// writes them. `kind` names the object in the file name, e.g. "GPTDataset-train". *built (if
/// given) tells whether `build` ran. Errors (mt::Error): the cache directory cannot be created or
/// written (the message names it and suggests --data-cache-path), a waiting process timed out.
/// A corrupt or mismatching file is rebuilt (by a building process) or waited on.
IndexArrays load_or_build_index_arrays(const IndexCacheOptions& options, const std::string& description,
                                       const std::string& kind, const std::function<IndexArrays()>& build,
                                       bool* built = nullptr);

/// Reads and validates a cache file; false (and no error) when it is missing, truncated, corrupt or
/// made for another description.
bool read_index_cache_file(const std::string& path, const std::string& description, IndexArrays* out);
/// Writes a cache file atomically (temporary file + rename). Errors name the path.
void write_index_cache_file(const std::string& path, const std::string& description, const IndexArrays& arrays);

}  // namespace mt::data
