// Helpers for tests against the Megatron-LM reference fixtures (tests/data/fixtures/megatron_ref/,
// written by tools/megatron_ref/gen_fixtures.py with Megatron-LM's own code and NumPy).
#pragma once
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "data/indexed_dataset.h"
#include "data_test_util.h"

namespace mt::data::testing {

inline bool is_regular_file_path(const std::string& p) { return std::filesystem::is_regular_file(p); }

inline std::string source_dir() {
  if (const char* s = std::getenv("MT_SOURCE_DIR"); s != nullptr && *s != '\0') return s;
  return ".";
}

/// The parsed fixture `name` (e.g. "gpt.json"), or null JSON when absent.
inline nlohmann::json load_megatron_fixture(const std::string& name) {
  const std::string path = source_dir() + "/tests/data/fixtures/megatron_ref/" + name;
  std::ifstream f(path);
  if (!f) return nlohmann::json();
  return nlohmann::json::parse(f);
}

#define MT_REQUIRE_FIXTURE(j, name)                                                                   \
  if ((j).is_null()) {                                                                                \
    GTEST_SKIP() << "fixture tests/data/fixtures/megatron_ref/" << (name)                             \
                 << " not found (set MT_SOURCE_DIR; regenerate with tools/megatron_ref/gen_fixtures.py)"; \
  }

/// The fixtures' token rule: token(corpus_id, seq, pos) = (corpus_id * 7919 + seq * 131 + pos * 7) % 50257.
inline int32_t fixture_token(int64_t corpus, int64_t seq, int64_t pos) {
  return static_cast<int32_t>((corpus * 7919 + seq * 131 + pos * 7) % 50257);
}

/// Writes a fixture corpus ({"id", "lengths"}) as <dir>/<name>.bin/.idx (one sequence per document).
inline std::string write_fixture_corpus(const std::string& dir, const nlohmann::json& corpus) {
  const std::string prefix = dir + "/" + corpus.at("name").get<std::string>();
  IndexedDatasetBuilder b(prefix, IndexDType::kUInt16);
  const int64_t id = corpus.at("id").get<int64_t>();
  const auto lengths = corpus.at("lengths").get<std::vector<int64_t>>();
  for (size_t s = 0; s < lengths.size(); ++s) {
    std::vector<int32_t> t(lengths[s]);
    for (int64_t p = 0; p < lengths[s]; ++p) t[p] = fixture_token(id, static_cast<int64_t>(s), p);
    b.add_document(t);
  }
  b.finalize();
  return prefix;
}

}  // namespace mt::data::testing
