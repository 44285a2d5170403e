#include "comm/tcp_store.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <map>
#include <thread>

#include <fmt/ranges.h>

#include "core/check.h"

namespace mt {

namespace {

enum Op : uint8_t { kSet = 1, kGet = 2, kAdd = 3 };
constexpr uint32_t kMaxValueBytes = 64u << 20;

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::string errno_str(int e) { return std::strerror(e); }

void append_u32(std::string& s, uint32_t v) { s.append(reinterpret_cast<const char*>(&v), 4); }

uint32_t read_u32(const char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

/// Sends all of `data`; false on a broken connection.
bool send_all(int fd, const std::string& data) {
  size_t off = 0;
  while (off < data.size()) {
    ssize_t n = ::send(fd, data.data() + off, data.size() - off, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    off += static_cast<size_t>(n);
  }
  return true;
}

void set_nodelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Server: one thread, poll() over the listening socket, the clients and a wake-up pipe.
// ---------------------------------------------------------------------------------------------

class TcpStoreServer {
 public:
  TcpStoreServer(int port, int expected_clients, double timeout_s)
      : expected_clients_(expected_clients), timeout_s_(timeout_s) {
    listen_fd_ = ::socket(AF_INET6, SOCK_STREAM, 0);
    bool v6 = listen_fd_ >= 0;
    if (!v6) listen_fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    MT_REQUIRE(listen_fd_ >= 0, "TCP store: socket() failed: {}", errno_str(errno));
    int one = 1, zero = 0;
    setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    int rc;
    if (v6) {
      setsockopt(listen_fd_, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));  // IPv4 too
      sockaddr_in6 a{};
      a.sin6_family = AF_INET6;
      a.sin6_addr = in6addr_any;
      a.sin6_port = htons(static_cast<uint16_t>(port));
      rc = ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a));
    } else {
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_ANY);
      a.sin_port = htons(static_cast<uint16_t>(port));
      rc = ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a));
    }
    if (rc != 0) {
      int e = errno;
      ::close(listen_fd_);
      MT_FAIL("TCP store: cannot listen on port {} (MASTER_PORT): {}{}", port, errno_str(e),
              e == EADDRINUSE ? "; choose another MASTER_PORT" : "");
    }
    MT_REQUIRE(::listen(listen_fd_, 1024) == 0, "TCP store: listen() on port {} failed: {}", port, errno_str(errno));
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&ss), &len);
    port_ = ss.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port)
                                     : ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
    MT_REQUIRE(::pipe(wake_) == 0, "TCP store: pipe() failed: {}", errno_str(errno));
    thread_ = std::thread([this] { loop(); });
  }

  /// Waits (up to the timeout) until every expected client has connected and disconnected, so
  /// that no rank loses the store while it still needs it, then stops the thread.
  ~TcpStoreServer() {
    const auto t0 = Clock::now();
    while ((ever_connected_.load() < expected_clients_ || open_.load() > 0) && seconds_since(t0) < timeout_s_) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    stop_ = true;
    char c = 1;
    [[maybe_unused]] ssize_t w = ::write(wake_[1], &c, 1);
    thread_.join();
    ::close(listen_fd_);
    ::close(wake_[0]);
    ::close(wake_[1]);
  }

  int port() const { return port_; }

 private:
  struct Conn {
    int fd;
    std::string in;
  };

  void loop() {
    std::vector<Conn> conns;
    std::vector<pollfd> fds;
    while (!stop_) {
      fds.clear();
      fds.push_back({wake_[0], POLLIN, 0});
      fds.push_back({listen_fd_, POLLIN, 0});
      for (auto& c : conns) fds.push_back({c.fd, POLLIN, 0});
      int n = ::poll(fds.data(), fds.size(), -1);
      if (n < 0) {
        if (errno == EINTR) continue;
        break;
      }
      if (stop_) break;
      if (fds[1].revents & POLLIN) {
        int fd = ::accept(listen_fd_, nullptr, nullptr);
        if (fd >= 0) {
          set_nodelay(fd);
          conns.push_back({fd, {}});
          ++ever_connected_;
          ++open_;
        }
      }
      // Serve existing connections (indices shifted by 2 in fds; new ones are polled next round).
      std::vector<bool> closed(conns.size(), false);
      for (size_t i = 0; i + 2 < fds.size(); ++i) {
        if (!(fds[i + 2].revents & (POLLIN | POLLHUP | POLLERR))) continue;
        if (!serve(conns[i])) closed[i] = true;
      }
      for (size_t i = conns.size(); i-- > 0;) {
        if (i < closed.size() && closed[i]) {
          ::close(conns[i].fd);
          conns.erase(conns.begin() + static_cast<long>(i));
          --open_;
        }
      }
    }
    for (auto& c : conns) ::close(c.fd);
  }

  /// Reads what is available and answers every complete request; false: close the connection.
  bool serve(Conn& c) {
    char buf[65536];
    ssize_t n = ::recv(c.fd, buf, sizeof(buf), 0);
    if (n < 0 && errno == EINTR) return true;
    if (n <= 0) return false;
    c.in.append(buf, static_cast<size_t>(n));
    for (;;) {
      // request: u8 op | u32 key_len | key | u32 value_len | value
      if (c.in.size() < 5) return true;
      const uint32_t klen = read_u32(c.in.data() + 1);
      if (klen > kMaxValueBytes) return false;
      if (c.in.size() < 9 + static_cast<size_t>(klen)) return true;
      const uint32_t vlen = read_u32(c.in.data() + 5 + klen);
      if (vlen > kMaxValueBytes) return false;
      const size_t total = 9 + static_cast<size_t>(klen) + vlen;
      if (c.in.size() < total) return true;
      const uint8_t op = static_cast<uint8_t>(c.in[0]);
      std::string key = c.in.substr(5, klen), value = c.in.substr(9 + klen, vlen);
      c.in.erase(0, total);
      // reply: u8 found | u32 len | bytes
      std::string reply;
      if (op == kSet) {
        kv_[key] = std::move(value);
        reply.push_back(1);
        append_u32(reply, 0);
      } else if (op == kGet) {
        auto it = kv_.find(key);
        reply.push_back(it != kv_.end() ? 1 : 0);
        append_u32(reply, it != kv_.end() ? static_cast<uint32_t>(it->second.size()) : 0);
        if (it != kv_.end()) reply += it->second;
      } else if (op == kAdd) {
        int64_t cur = 0;
        auto it = kv_.find(key);
        if (it != kv_.end()) cur = std::stoll(it->second);
        cur += std::stoll(value);
        std::string s = std::to_string(cur);
        kv_[key] = s;
        reply.push_back(1);
        append_u32(reply, static_cast<uint32_t>(s.size()));
        reply += s;
      } else {
        return false;
      }
      if (!send_all(c.fd, reply)) return false;
    }
  }

  int listen_fd_ = -1;
  int port_ = 0;
  int wake_[2] = {-1, -1};
  int expected_clients_;
  double timeout_s_;
  std::atomic<bool> stop_{false};
  std::atomic<int> ever_connected_{0};
  std::atomic<int> open_{0};
  std::map<std::string, std::string> kv_;  // touched only by the server thread
  std::thread thread_;
};

// ---------------------------------------------------------------------------------------------
// Client
// ---------------------------------------------------------------------------------------------

namespace {

int connect_with_retries(const std::string& host, int port, double timeout_s) {
  const auto t0 = Clock::now();
  std::string last_error = "no attempt";
  const std::string port_str = std::to_string(port);
  for (;;) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    int gai = ::getaddrinfo(host.c_str(), port_str.c_str(), &hints, &res);
    if (gai != 0) {
      last_error = fmt::format("cannot resolve '{}': {}", host, gai_strerror(gai));
    } else {
      for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
        int fd = ::socket(a->ai_family, a->ai_socktype, a->ai_protocol);
        if (fd < 0) continue;
        timeval tv{5, 0};  // bounds one connect() attempt to a silent host
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
        if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
          ::freeaddrinfo(res);
          timeval none{0, 0};
          setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &none, sizeof(none));
          set_nodelay(fd);
          return fd;
        }
        last_error = errno_str(errno);
        ::close(fd);
      }
      ::freeaddrinfo(res);
    }
    if (seconds_since(t0) > timeout_s) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  MT_FAIL(
      "TCP store: could not connect to {}:{} (MASTER_ADDR:MASTER_PORT) within {:.1f} s (last error: {}); is rank 0 "
      "running, and are MASTER_ADDR and MASTER_PORT the same on every rank?",
      host, port, timeout_s, last_error);
}

}  // namespace

TcpStore::TcpStore(std::string host, int port, int world_size, bool is_server, double timeout_s)
    : host_(std::move(host)), port_(port), world_size_(world_size), timeout_s_(timeout_s) {
  MT_REQUIRE(world_size >= 1, "TCP store: world_size {} must be >= 1", world_size);
  MT_REQUIRE(port >= 0 && port <= 65535, "TCP store: port {} out of range", port);
  MT_REQUIRE(timeout_s > 0, "TCP store: timeout {} s must be positive", timeout_s);
  if (is_server) {
    server_ = std::make_unique<TcpStoreServer>(port, world_size, timeout_s);
    port_ = server_->port();
  } else {
    MT_REQUIRE(port > 0, "TCP store: a client needs the server's port (MASTER_PORT), got {}", port);
  }
  fd_ = connect_with_retries(host_, port_, timeout_s_);
}

TcpStore::~TcpStore() {
  if (fd_ >= 0) ::close(fd_);
  server_.reset();  // waits for the other ranks to finish with the store
}

std::string TcpStore::request(uint8_t op, const std::string& key, const std::string& value, bool* found) {
  MT_REQUIRE(fd_ >= 0, "TCP store {}:{}: the connection was lost earlier", host_, port_);
  MT_REQUIRE(key.size() <= kMaxValueBytes && value.size() <= kMaxValueBytes, "TCP store: key/value too large");
  std::string msg;
  msg.push_back(static_cast<char>(op));
  append_u32(msg, static_cast<uint32_t>(key.size()));
  msg += key;
  append_u32(msg, static_cast<uint32_t>(value.size()));
  msg += value;
  auto lost = [&](const std::string& why) {
    ::close(fd_);
    fd_ = -1;
    MT_FAIL("TCP store {}:{}: {} (request for key '{}'); the store's host (rank 0) may have exited", host_, port_,
            why, key);
  };
  if (!send_all(fd_, msg)) lost("connection lost while sending");
  const auto t0 = Clock::now();
  auto read_exact = [&](char* dst, size_t n) {
    size_t off = 0;
    while (off < n) {
      const double left = timeout_s_ - seconds_since(t0);
      if (left <= 0) lost(fmt::format("no reply within {:.1f} s", timeout_s_));
      pollfd p{fd_, POLLIN, 0};
      int rc = ::poll(&p, 1, static_cast<int>(left * 1000) + 1);
      if (rc < 0 && errno == EINTR) continue;
      if (rc <= 0) continue;
      ssize_t k = ::recv(fd_, dst + off, n - off, 0);
      if (k < 0 && errno == EINTR) continue;
      if (k <= 0) lost("the server closed the connection");
      off += static_cast<size_t>(k);
    }
  };
  char head[5];
  read_exact(head, 5);
  const uint32_t len = read_u32(head + 1);
  if (len > kMaxValueBytes) lost("malformed reply");
  std::string out(len, '\0');
  if (len > 0) read_exact(out.data(), len);
  if (found) *found = head[0] != 0;
  return out;
}

void TcpStore::set(const std::string& key, const std::string& value) { request(kSet, key, value, nullptr); }

std::optional<std::string> TcpStore::try_get(const std::string& key) {
  bool found = false;
  std::string v = request(kGet, key, "", &found);
  if (!found) return std::nullopt;
  return v;
}

std::string TcpStore::get(const std::string& key) {
  const auto t0 = Clock::now();
  int sleep_ms = 1;
  for (;;) {
    if (auto v = try_get(key)) return *v;
    if (seconds_since(t0) > timeout_s_) {
      MT_FAIL("TCP store {}:{}: key '{}' was not set within {:.1f} s", host_, port_, key, timeout_s_);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(sleep_ms));
    sleep_ms = std::min(sleep_ms * 2, 50);
  }
}

int64_t TcpStore::add(const std::string& key, int64_t delta) {
  return std::stoll(request(kAdd, key, std::to_string(delta), nullptr));
}

void TcpStore::wait(const std::vector<std::string>& keys) {
  const auto t0 = Clock::now();
  int sleep_ms = 1;
  for (;;) {
    std::vector<std::string> missing;
    for (const auto& k : keys) {
      if (!try_get(k)) missing.push_back(k);
    }
    if (missing.empty()) return;
    if (seconds_since(t0) > timeout_s_) {
      MT_FAIL("TCP store {}:{}: keys [{}] were not set within {:.1f} s", host_, port_, fmt::join(missing, ", "),
              timeout_s_);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(sleep_ms));
    sleep_ms = std::min(sleep_ms * 2, 50);
  }
}

void TcpStore::barrier(int rank) {
  MT_REQUIRE(rank >= 0 && rank < world_size_, "TCP store barrier: rank {} out of range [0, {})", rank, world_size_);
  const std::string prefix = fmt::format("__barrier/{}/", barrier_generation_++);
  set(prefix + std::to_string(rank), "");
  add(prefix + "count", 1);
  const auto t0 = Clock::now();
  int sleep_ms = 1;
  while (add(prefix + "count", 0) < world_size_) {
    if (seconds_since(t0) > timeout_s_) {
      std::vector<int> missing;
      for (int r = 0; r < world_size_; ++r) {
        if (!try_get(prefix + std::to_string(r))) missing.push_back(r);
      }
      MT_FAIL("TCP store {}:{}: barrier timed out after {:.1f} s at rank {}; ranks [{}] of {} never arrived", host_,
              port_, timeout_s_, rank, fmt::join(missing, ", "), world_size_);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(sleep_ms));
    sleep_ms = std::min(sleep_ms * 2, 20);
  }
}

int find_free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  MT_REQUIRE(fd >= 0, "find_free_port: socket() failed: {}", errno_str(errno));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  a.sin_port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    int e = errno;
    ::close(fd);
    MT_FAIL("find_free_port: bind() failed: {}", errno_str(e));
  }
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

}  // namespace mt
