// A minimal TCP key-value store for bootstrap (PyTorch c10d's TCPStore role): rank 0 hosts the
// server on MASTER_PORT of all its interfaces, every rank (rank 0 included) is a client of
// MASTER_ADDR:MASTER_PORT. Used to hand NCCL's unique id to the ranks when they were not started
// by mpirun. POSIX sockets, one server thread; requests are answered at once (get() polls), so a
// client never leaves half-finished requests behind after a timeout.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace mt {

class TcpStoreServer;

class TcpStore {
 public:
  /// is_server: this process hosts the store on `port` (0: any free port, see port()). Every
  /// instance then connects as a client to host:port, retrying until `timeout_s`. Errors:
  /// mt::Error naming host:port (port in use, nobody listening within the timeout).
  /// `world_size` = the number of clients expected (barrier, and the server's shutdown waits up
  /// to the timeout for that many clients to have come and gone).
  TcpStore(std::string host, int port, int world_size, bool is_server, double timeout_s);
  ~TcpStore();
  TcpStore(const TcpStore&) = delete;
  TcpStore& operator=(const TcpStore&) = delete;

  int port() const { return port_; }
  const std::string& host() const { return host_; }

  void set(const std::string& key, const std::string& value);
  /// The value of `key`, waiting up to the timeout for some rank to set it. Throws mt::Error
  /// naming the key and the timeout.
  std::string get(const std::string& key);
  /// The value of `key` if it is set (no waiting).
  std::optional<std::string> try_get(const std::string& key);
  /// Atomically adds `delta` to the integer at `key` (missing = 0); returns the new value.
  int64_t add(const std::string& key, int64_t delta);
  /// Waits until every key is set; the error lists the missing keys.
  void wait(const std::vector<std::string>& keys);
  /// All `world_size` ranks call it (same number of times, same order). `rank` identifies this
  /// caller: on timeout the error lists the ranks that never arrived.
  void barrier(int rank);

 private:
  std::string request(uint8_t op, const std::string& key, const std::string& value, bool* found);

  std::string host_;
  int port_ = 0;
  int world_size_ = 1;
  double timeout_s_ = 0;
  int fd_ = -1;
  int64_t barrier_generation_ = 0;
  std::unique_ptr<TcpStoreServer> server_;
};

/// A TCP port that was free on this machine a moment ago (bind to port 0, read, close).
int find_free_port();

}  // namespace mt
