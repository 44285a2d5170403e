// Shared scaffolding of the kernel benches (bench/*_bench.cpp): comma-separated size lists, the
// median of timed repetitions on a stream, and main()'s error reporting.
#pragma once
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <vector>

#include "core/stream.h"

namespace mt::bench {

/// "1024,2048" -> {1024, 2048}.
inline std::vector<int64_t> parse_list(const char* s) {
  std::vector<int64_t> v;
  for (const char* p = s; *p;) {
    v.push_back(std::atoll(p));
    while (*p && *p != ',') ++p;
    if (*p == ',') ++p;
  }
  return v;
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

/// Median milliseconds of `iters` runs of f() on `st` (events around each run), after 3 warm-up runs.
template <typename F>
double time_ms(const Stream& st, int iters, F&& f) {
  for (int i = 0; i < 3; ++i) f();
  Event a(st.device()), b(st.device());
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
    a.record(st);
    f();
    b.record(st);
    b.synchronize();
    ms.push_back(b.elapsed_ms_since(a));
  }
  return median(ms);
}

/// main() of a bench: runs body(argc, argv); an exception prints "<name>: <what>" and exits 1.
template <typename F>
int run_main(const char* name, int argc, char** argv, F&& body) {
  try {
    return body(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", name, e.what());
    return 1;
  }
}

}  // namespace mt::bench
