// TCP store on loopback: ranks are threads of this process, each with its own connection.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "comm/tcp_store.h"
#include "core/check.h"

namespace mt {
namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

/// Runs fn(rank, store) on `world` threads; rank 0 hosts the store on a free port.
template <typename Fn>
void run_ranks(int world, double timeout_s, Fn fn) {
  TcpStore server("127.0.0.1", 0, world, true, timeout_s);
  const int port = server.port();
  std::vector<std::thread> threads;
  std::vector<std::string> errors(world);
  for (int r = 1; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        TcpStore store("127.0.0.1", port, world, false, timeout_s);
        fn(r, store);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  try {
    fn(0, server);
  } catch (const std::exception& e) {
    errors[0] = e.what();
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < world; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

TEST(TcpStore, SetGetAcrossRanks) {
  run_ranks(4, 10.0, [](int r, TcpStore& s) {
    s.set("key/" + std::to_string(r), "value of " + std::to_string(r));
    for (int q = 0; q < 4; ++q) EXPECT_EQ(s.get("key/" + std::to_string(q)), "value of " + std::to_string(q));
    EXPECT_FALSE(s.try_get("never").has_value());
    s.wait({"key/0", "key/1", "key/2", "key/3"});
  });
}

TEST(TcpStore, BinaryAndLargeValues) {
  std::string blob(1 << 20, '\0');
  for (size_t i = 0; i < blob.size(); ++i) blob[i] = static_cast<char>((i * 131) & 0xff);
  run_ranks(2, 10.0, [&](int r, TcpStore& s) {
    if (r == 0) s.set("blob", blob);
    EXPECT_EQ(s.get("blob"), blob);
    s.set("empty", "");
    EXPECT_EQ(s.get("empty"), "");
  });
}

TEST(TcpStore, AddIsAtomic) {
  std::atomic<int64_t> max_seen{0};
  run_ranks(4, 10.0, [&](int r, TcpStore& s) {
    for (int i = 0; i < 50; ++i) {
      int64_t v = s.add("counter", 1);
      int64_t prev = max_seen.load();
      while (v > prev && !max_seen.compare_exchange_weak(prev, v)) {
      }
    }
    s.barrier(r);
    EXPECT_EQ(s.add("counter", 0), 200);
  });
  EXPECT_EQ(max_seen.load(), 200);
}

TEST(TcpStore, Barrier) {
  std::atomic<int> arrived{0};
  run_ranks(4, 10.0, [&](int r, TcpStore& s) {
    for (int gen = 1; gen <= 3; ++gen) {
      if (r == 3) std::this_thread::sleep_for(std::chrono::milliseconds(50));  // a late rank
      ++arrived;
      s.barrier(r);
      EXPECT_GE(arrived.load(), 4 * gen) << "rank " << r << " left barrier " << gen << " early";
      s.barrier(r);  // nobody starts the next round before everyone checked
    }
  });
}

TEST(TcpStore, GetTimesOutNamingTheKey) {
  TcpStore s("127.0.0.1", 0, 1, true, 0.3);
  const auto t0 = Clock::now();
  try {
    s.get("nccl/never-set");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'nccl/never-set' was not set within 0.3 s"), std::string::npos) << e.what();
  }
  EXPECT_GE(since(t0), 0.3);
  EXPECT_LT(since(t0), 3.0);
  EXPECT_THROW(s.wait({"a", "b"}), Error);
}

TEST(TcpStore, BarrierTimeoutNamesMissingRanks) {
  // World of 3, rank 2 never comes.
  TcpStore server("127.0.0.1", 0, 3, true, 0.5);
  std::string err1;
  std::thread t([&] {
    try {
      TcpStore c("127.0.0.1", server.port(), 3, false, 0.5);
      c.barrier(1);
    } catch (const Error& e) {
      err1 = e.what();
    }
  });
  try {
    server.barrier(0);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("ranks [2] of 3 never arrived"), std::string::npos) << e.what();
  }
  t.join();
  EXPECT_NE(err1.find("ranks [2] of 3 never arrived"), std::string::npos) << err1;
}

TEST(TcpStore, ConnectTimesOutNamingTheAddress) {
  const int port = find_free_port();
  const auto t0 = Clock::now();
  try {
    TcpStore c("127.0.0.1", port, 2, false, 0.3);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(fmt::format("127.0.0.1:{}", port)), std::string::npos) << e.what();
  }
  EXPECT_LT(since(t0), 5.0);
}

TEST(TcpStore, PortInUse) {
  TcpStore a("127.0.0.1", 0, 1, true, 1.0);
  try {
    TcpStore b("127.0.0.1", a.port(), 1, true, 1.0);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(std::to_string(a.port())), std::string::npos) << e.what();
  }
}

TEST(TcpStore, ServerGoneIsAnError) {
  auto server = std::make_unique<TcpStore>("127.0.0.1", 0, 2, true, 0.5);
  TcpStore c("127.0.0.1", server->port(), 2, false, 0.5);
  c.set("x", "1");
  server.reset();  // waits up to 0.5 s for `c` to leave, then closes
  EXPECT_THROW(c.get("x"), Error);
}

}  // namespace
}  // namespace mt
