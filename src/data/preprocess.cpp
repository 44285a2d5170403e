#include "data/preprocess.h"

#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <thread>

#include "core/check.h"
#include "data/file_util.h"
#include "data/gpt2_tokenizer.h"
#include "data/indexed_dataset.h"
#include "data/tokenizer.h"

namespace mt::data {
namespace {

constexpr size_t kBatchDocs = 2048;
constexpr size_t kBatchBytes = size_t{32} << 20;

struct Input {
  std::string path;
  bool is_text;  // true: one .txt document; false: JSON lines
};

bool ends_with_txt(const std::string& p) { return p.size() >= 4 && p.compare(p.size() - 4, 4, ".txt") == 0; }

std::vector<Input> expand_inputs(const std::vector<std::string>& inputs) {
  namespace fs = std::filesystem;
  std::vector<Input> out;
  for (const std::string& in : inputs) {
    std::error_code ec;
    const fs::file_status st = fs::status(in, ec);
    MT_REQUIRE(!ec && fs::exists(st), "preprocess-data: input '{}' not found", in);
    if (fs::is_directory(st)) {
      std::vector<std::string> files;
      for (const auto& e : fs::directory_iterator(in)) {
        if (e.is_regular_file() && e.path().extension() == ".txt") files.push_back(e.path().string());
      }
      MT_REQUIRE(!files.empty(), "preprocess-data: input directory '{}' has no *.txt files", in);
      std::sort(files.begin(), files.end());
      for (auto& f : files) out.push_back({std::move(f), true});
    } else {
      MT_REQUIRE(fs::is_regular_file(st), "preprocess-data: input '{}' is not a regular file or directory", in);
      out.push_back({in, ends_with_txt(in)});
    }
  }
  return out;
}

// One unit of work: a .txt document or a JSON line, with where it came from.
struct Doc {
  std::string raw;
  const std::string* file = nullptr;
  int64_t line = 0;  // 0 for .txt documents
  bool is_text = false;
  std::vector<std::vector<int32_t>> tokens;   // per key: the document's tokens
  std::vector<std::vector<int32_t>> lengths;  // per key: its sequence lengths (one per non-empty text)
  std::exception_ptr error;
};

void tokenize_doc(Doc& doc, const Tokenizer& tok, const std::vector<std::string>& keys, bool append_eod,
                  bool split_sentences) {
  doc.tokens.assign(keys.size(), {});
  doc.lengths.assign(keys.size(), {});
  // As Megatron's Encoder.encode: each non-empty text (a string, or each string of a list) is one
  // sequence; EOD is appended to the last sequence of a non-empty document.
  auto add_one = [&](size_t k, std::string_view text) {
    const size_t before = doc.tokens[k].size();
    tok.encode_append(text, &doc.tokens[k]);
    const size_t n = doc.tokens[k].size() - before;
    if (n > 0) doc.lengths[k].push_back(static_cast<int32_t>(n));
  };
  auto add_text = [&](size_t k, std::string_view text) {
    if (!split_sentences) {
      add_one(k, text);
      return;
    }
    for (std::string_view sentence : split_into_sentences(text)) add_one(k, sentence);
  };
  auto finish = [&](size_t k) {
    if (append_eod && !doc.tokens[k].empty()) {
      doc.tokens[k].push_back(tok.eod());
      doc.lengths[k].back() += 1;
    }
  };
  if (doc.is_text) {
    add_text(0, doc.raw);  // keys == {"text"} (checked up front)
    finish(0);
    return;
  }
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(doc.raw);
  } catch (const nlohmann::json::exception& e) {
    MT_FAIL("preprocess-data: {}:{}: invalid JSON: {}", *doc.file, doc.line, e.what());
  }
  MT_REQUIRE(j.is_object(), "preprocess-data: {}:{}: expected a JSON object, got {}", *doc.file, doc.line,
             j.type_name());
  for (size_t k = 0; k < keys.size(); ++k) {
    auto it = j.find(keys[k]);
    MT_REQUIRE(it != j.end(), "preprocess-data: {}:{}: key '{}' not found", *doc.file, doc.line, keys[k]);
    if (it->is_array()) {
      for (const auto& s : *it) {
        MT_REQUIRE(s.is_string(), "preprocess-data: {}:{}: key '{}' is a list with a {} element, expected strings",
                   *doc.file, doc.line, keys[k], s.type_name());
        add_text(k, s.get_ref<const std::string&>());
      }
    } else {
      MT_REQUIRE(it->is_string(), "preprocess-data: {}:{}: key '{}' is a {}, expected a string or a list of strings",
                 *doc.file, doc.line, keys[k], it->type_name());
      add_text(k, it->get_ref<const std::string&>());
    }
    finish(k);
  }
}

void tokenize_batch(std::vector<Doc>& batch, const Tokenizer& tok, const std::vector<std::string>& keys,
                    bool append_eod, bool split_sentences, int workers) {
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i; (i = next.fetch_add(1)) < batch.size();) {
      try {
        tokenize_doc(batch[i], tok, keys, append_eod, split_sentences);
      } catch (...) {
        batch[i].error = std::current_exception();
      }
    }
  };
  const int nthreads = static_cast<int>(std::min<size_t>(static_cast<size_t>(workers), batch.size()));
  if (nthreads <= 1) {
    work();
  } else {
    std::vector<std::thread> threads;
    for (int t = 0; t < nthreads; ++t) threads.emplace_back(work);
    for (auto& t : threads) t.join();
  }
  for (const Doc& d : batch) {
    if (d.error) std::rethrow_exception(d.error);  // the first error in input order
  }
}

class Progress {
 public:
  explicit Progress(int64_t interval) : interval_(std::max<int64_t>(interval, 1)) {}
  void update(const PreprocessStats& s, bool final) {
    if (!final && s.documents < next_report_) return;
    while (next_report_ <= s.documents) next_report_ += interval_;
    const double secs = elapsed();
    std::fprintf(stderr, "preprocess-data: %s%lld documents, %lld tokens, %.2f MB in %.1f s (%.1f docs/s, %.2f MB/s)\n",
                 final ? "done: " : "", static_cast<long long>(s.documents), static_cast<long long>(s.tokens),
                 s.bytes / 1e6, secs, s.documents / std::max(secs, 1e-9), s.bytes / 1e6 / std::max(secs, 1e-9));
  }
  double elapsed() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }

 private:
  int64_t interval_;
  int64_t next_report_ = interval_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

}  // namespace

std::vector<std::string_view> split_into_sentences(std::string_view text) {
  std::vector<std::string_view> out;
  auto is_space = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; };
  auto is_closer = [](char c) { return c == '"' || c == '\'' || c == ')' || c == ']' || c == '}'; };
  size_t i = 0;
  const size_t n = text.size();
  while (i < n && is_space(text[i])) ++i;
  size_t start = i;
  while (i < n) {
    const char c = text[i];
    if (c == '.' || c == '!' || c == '?') {
      size_t e = i + 1;
      while (e < n && (text[e] == '.' || text[e] == '!' || text[e] == '?')) ++e;
      while (e < n && is_closer(text[e])) ++e;
      size_t w = e;
      while (w < n && is_space(text[w])) ++w;
      // A boundary: terminal punctuation, whitespace, then an upper-case ASCII letter, a digit, an
      // opening quote/bracket or a non-ASCII byte; not after a single-letter abbreviation ("J. Smith").
      const bool single_letter = i >= 1 && std::isalpha(static_cast<unsigned char>(text[i - 1])) &&
                                 (i < 2 || is_space(text[i - 2])) && c == '.';
      if (w > e && w < n && !single_letter &&
          (std::isupper(static_cast<unsigned char>(text[w])) || std::isdigit(static_cast<unsigned char>(text[w])) ||
           text[w] == '"' || text[w] == '\'' || text[w] == '(' || text[w] == '[' ||
           static_cast<unsigned char>(text[w]) >= 0x80)) {
        out.push_back(text.substr(start, e - start));
        start = i = w;
        continue;
      }
      i = e;
      continue;
    }
    ++i;
  }
  size_t end = n;
  while (end > start && is_space(text[end - 1])) --end;
  if (end > start) out.push_back(text.substr(start, end - start));
  return out;
}

void merge_datasets(const std::vector<std::string>& input_prefixes, const std::string& output_prefix) {
  MT_REQUIRE(!input_prefixes.empty(), "merge-datasets: no input prefixes");
  std::vector<std::unique_ptr<IndexedDataset>> inputs;
  for (const std::string& p : input_prefixes) {
    inputs.push_back(std::make_unique<IndexedDataset>(p));
    MT_REQUIRE(inputs.back()->dtype() == inputs.front()->dtype(),
               "merge-datasets: '{}' has dtype {}, '{}' has {} (all inputs must have the same dtype)", p,
               index_dtype_name(inputs.back()->dtype()), input_prefixes.front(), index_dtype_name(inputs.front()->dtype()));
  }
  IndexedDatasetBuilder out(output_prefix, inputs.front()->dtype());
  std::vector<int32_t> buf;
  for (const auto& in : inputs) {
    const auto& di = in->document_indices();
    for (size_t d = 0; d + 1 < di.size(); ++d) {
      for (int64_t s = di[d]; s < di[d + 1]; ++s) {
        buf.resize(static_cast<size_t>(in->sequence_length(s)));
        in->read(s, 0, static_cast<int64_t>(buf.size()), buf.data());
        out.add_item(buf);
      }
      out.end_document();
    }
  }
  out.finalize();
}

PreprocessStats preprocess_data(const PreprocessConfig& cfg) {
  MT_REQUIRE(!cfg.inputs.empty(), "preprocess-data: no --input given");
  MT_REQUIRE(!cfg.output_prefix.empty(), "preprocess-data: no --output-prefix given");
  MT_REQUIRE(!cfg.json_keys.empty(), "preprocess-data: --json-keys is empty");
  MT_REQUIRE(cfg.workers >= 1, "preprocess-data: --workers must be >= 1, got {}", cfg.workers);
  for (size_t a = 0; a < cfg.json_keys.size(); ++a) {
    for (size_t b = a + 1; b < cfg.json_keys.size(); ++b) {
      MT_REQUIRE(cfg.json_keys[a] != cfg.json_keys[b], "preprocess-data: --json-keys lists '{}' twice",
                 cfg.json_keys[a]);
    }
  }

  const std::vector<Input> inputs = expand_inputs(cfg.inputs);
  const bool any_text = std::any_of(inputs.begin(), inputs.end(), [](const Input& i) { return i.is_text; });
  const bool any_json = std::any_of(inputs.begin(), inputs.end(), [](const Input& i) { return !i.is_text; });
  const std::vector<std::string> keys = any_json ? cfg.json_keys : std::vector<std::string>{"text"};
  MT_REQUIRE(!(any_text && any_json && !(keys.size() == 1 && keys[0] == "text")),
             "preprocess-data: .txt inputs (documents of key 'text') cannot be mixed with JSON-lines inputs when "
             "--json-keys is not just 'text' (got {} keys, first '{}')",
             keys.size(), keys[0]);

  const std::unique_ptr<Tokenizer> tok_ptr =
      make_tokenizer(cfg.tokenizer_type, cfg.vocab_file, cfg.merge_file, cfg.tokenizer_model, cfg.vocab_size,
                     cfg.tiktoken);
  const Tokenizer& tok = *tok_ptr;
  if (cfg.append_eod) (void)tok.eod();  // fails early if the tokenizer has no end-of-document token
  const IndexDType dtype = index_dtype_for_vocab(tok.vocab_size());

  PreprocessStats stats;
  std::vector<std::unique_ptr<IndexedDatasetBuilder>> builders;
  for (const std::string& key : keys) {
    stats.output_prefixes.push_back(
        fmt::format("{}_{}_{}", cfg.output_prefix, key, cfg.split_sentences ? "sentence" : "document"));
    builders.push_back(std::make_unique<IndexedDatasetBuilder>(stats.output_prefixes.back(), dtype));
  }

  Progress progress(cfg.log_interval);
  std::vector<Doc> batch;
  size_t batch_bytes = 0;
  auto flush = [&] {
    if (batch.empty()) return;
    tokenize_batch(batch, tok, keys, cfg.append_eod, cfg.split_sentences, cfg.workers);
    for (Doc& d : batch) {
      for (size_t k = 0; k < keys.size(); ++k) {
        builders[k]->add_document(d.tokens[k], d.lengths[k]);
        stats.tokens += static_cast<int64_t>(d.tokens[k].size());
      }
      ++stats.documents;
      stats.bytes += static_cast<int64_t>(d.raw.size());
      progress.update(stats, false);
    }
    batch.clear();
    batch_bytes = 0;
  };
  auto add = [&](Doc&& d) {
    batch_bytes += d.raw.size();
    batch.push_back(std::move(d));
    if (batch.size() >= kBatchDocs || batch_bytes >= kBatchBytes) flush();
  };

  for (const Input& in : inputs) {
    if (in.is_text) {
      Doc d;
      d.raw = read_file_to_string(in.path, "preprocess-data input");
      d.file = &in.path;
      d.is_text = true;
      add(std::move(d));
      continue;
    }
    std::ifstream f(in.path, std::ios::binary);
    MT_REQUIRE(f.is_open(), "preprocess-data: cannot open input '{}'", in.path);
    std::string line;
    int64_t line_no = 0;
    while (std::getline(f, line)) {
      ++line_no;
      if (line.find_first_not_of(" \t\r\n") == std::string::npos) continue;  // blank line
      Doc d;
      d.raw = std::move(line);
      d.file = &in.path;
      d.line = line_no;
      add(std::move(d));
      line.clear();
    }
    MT_REQUIRE(!f.bad(), "preprocess-data: read error in '{}' after line {}", in.path, line_no);
  }
  flush();
  for (auto& b : builders) b->finalize();
  stats.seconds = progress.elapsed();
  progress.update(stats, true);
  return stats;
}

}  // namespace mt::data
