// --timing-log-level / --timing-log-option: the timers (core/timers.h) on CPU streams, where an
// event is the host clock at record time, and the cross-rank report (train/timing_log.h) on
// three thread ranks that each time a sleep of a different length.
#include <gtest/gtest.h>

#include <chrono>
#include <regex>
#include <thread>

#include "comm/thread_comm.h"
#include "core/check.h"
#include "train/timing_log.h"

namespace mt {
namespace {

void sleep_ms(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

// The numbers after "<name> ....: " on the report line of timer `name`.
std::vector<double> values(const std::string& report, const std::string& name) {
  std::smatch m;
  const std::regex line(name + " \\.+: \\(?([0-9.]+)(, ([0-9.]+)\\))?");
  if (!std::regex_search(report, m, line)) return {};
  std::vector<double> v{std::stod(m[1].str())};
  if (m[3].matched) v.push_back(std::stod(m[3].str()));
  return v;
}

TEST(Timers, MeasureStreamTimePerIteration) {
  Stream st;
  Timers t(1, Device::cpu());
  for (int it = 0; it < 2; ++it) {
    ScopedTimer whole(&t, Timers::kOptimizer, st);
    t.start(Timers::kForwardBackward, st);
    sleep_ms(15);
    t.stop(Timers::kForwardBackward, st);
  }
  const auto v = t.take(st, 2);
  EXPECT_GE(v[2 * Timers::kForwardBackward], 15.f);      // ms per iteration
  EXPECT_EQ(v[2 * Timers::kForwardBackward + 1], 2.f);  // intervals recorded
  EXPECT_GE(v[2 * Timers::kOptimizer], v[2 * Timers::kForwardBackward]);
  EXPECT_EQ(v[2 * Timers::kAllGradsSync + 1], 0.f);  // never started
  // take() forgets what it returned.
  const auto again = t.take(st, 1);
  EXPECT_EQ(again[2 * Timers::kForwardBackward], 0.f);
  EXPECT_EQ(again[2 * Timers::kForwardBackward + 1], 0.f);
  EXPECT_STREQ(Timers::name(Timers::kAllGradsSync), "all-grads-sync");
}

TEST(Timers, OffRecordsNothing) {
  Stream st;
  Timers t(0, Device::cpu());
  EXPECT_FALSE(t.active());
  t.start(Timers::kForwardBackward, st);
  t.stop(Timers::kForwardBackward, st);
  EXPECT_EQ(t.take(st, 1)[2 * Timers::kForwardBackward + 1], 0.f);
  run_thread_ranks(1, [&](int, std::shared_ptr<Communicator> w) {
    EXPECT_EQ(timing_report(t, TimingLogOption::kMinMax, *w, st, 1), "");
  });
}

TEST(Timers, Errors) {
  Stream st;
  Timers t(1, Device::cpu());
  EXPECT_THROW(t.stop(Timers::kOptimizer, st), Error);  // not running
  t.start(Timers::kOptimizer, st);
  EXPECT_THROW(t.start(Timers::kOptimizer, st), Error);  // already running
  EXPECT_THROW(t.take(st, 0), Error);
  try {
    Timers::check_level(2);
    ADD_FAILURE() << "level 2 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--timing-log-level 2"), std::string::npos) << e.what();
  }
  try {
    parse_timing_log_option("median");
    ADD_FAILURE() << "'median' accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("median"), std::string::npos) << e.what();
  }
  EXPECT_EQ(parse_timing_log_option("max"), TimingLogOption::kMax);
  EXPECT_EQ(parse_timing_log_option("all"), TimingLogOption::kAll);
}

// Rank r sleeps 20·(r+1) ms inside forward-backward in each of 2 iterations; the report is the
// same text on every rank and gives min / max / every rank's time per iteration.
TEST(TimingLog, ReportAcrossRanks) {
  for (TimingLogOption opt : {TimingLogOption::kMinMax, TimingLogOption::kMax, TimingLogOption::kAll}) {
    std::vector<std::string> reports(3);
    run_thread_ranks(3, [&](int rank, std::shared_ptr<Communicator> w) {
      Stream st;
      Timers t(1, Device::cpu());
      for (int it = 0; it < 2; ++it) {
        ScopedTimer fb(&t, Timers::kForwardBackward, st);
        sleep_ms(20 * (rank + 1));
      }
      if (rank == 1) {  // a timer that ran on one rank only is still reported
        t.start(Timers::kEmbeddingGradsAllReduce, st);
        t.stop(Timers::kEmbeddingGradsAllReduce, st);
      }
      reports[static_cast<size_t>(rank)] = timing_report(t, opt, *w, st, 2);
    });
    const std::string& r = reports[0];
    SCOPED_TRACE(r);
    EXPECT_EQ(reports[1], r);
    EXPECT_EQ(reports[2], r);
    EXPECT_EQ(r.find("all-grads-sync"), std::string::npos);  // ran nowhere: left out
    EXPECT_NE(r.find("embedding-grads-all-reduce"), std::string::npos);
    if (opt == TimingLogOption::kMinMax) {
      EXPECT_EQ(r.rfind("(min, max) time across ranks (ms):", 0), 0u);
      const auto v = values(r, "forward-backward");
      ASSERT_EQ(v.size(), 2u);
      EXPECT_GE(v[0], 20.0);
      EXPECT_GE(v[1], 60.0);
      EXPECT_LT(v[0], v[1]);
    } else if (opt == TimingLogOption::kMax) {
      EXPECT_EQ(r.rfind("(max) time across ranks (ms):", 0), 0u);
      const auto v = values(r, "forward-backward");
      ASSERT_EQ(v.size(), 1u);
      EXPECT_GE(v[0], 60.0);
    } else {
      EXPECT_EQ(r.rfind("times across ranks (ms):", 0), 0u);
      for (int k = 0; k < 3; ++k) {
        std::smatch m;
        const std::regex line("forward-backward:(\\n +rank +[0-9]+: [0-9.]+){" + std::to_string(k) +
                              "}\\n +rank +" + std::to_string(k) + ": ([0-9.]+)");
        ASSERT_TRUE(std::regex_search(r, m, line)) << "no line for rank " << k;
        EXPECT_GE(std::stod(m[2].str()), 20.0 * (k + 1));
      }
    }
  }
}

}  // namespace
}  // namespace mt
