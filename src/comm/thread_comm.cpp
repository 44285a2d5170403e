#include "comm/thread_comm.h"

#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "comm/comm_util.h"

namespace mt {

namespace {

// Shared state of one group of threads.
struct ThreadGroup {
  explicit ThreadGroup(int n) : size(n), ptrs(n, nullptr), ints(2 * n, 0) {}
  const int size;
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  uint64_t generation = 0;
  bool aborted = false;
  std::vector<const void*> ptrs;  // published buffers of the current collective
  std::vector<int> ints;          // published (color, key) pairs for split
  std::map<std::pair<int, int>, std::deque<std::vector<char>>> mailbox;  // (src, dst) -> messages
  std::map<std::pair<uint64_t, int>, std::shared_ptr<ThreadGroup>> children;
  uint64_t splits = 0;

  void barrier(const std::string& name, int rank) {
    std::unique_lock<std::mutex> lock(mu);
    if (aborted) MT_FAIL("{}: rank {}: a peer failed", name, rank);
    const uint64_t gen = generation;
    if (++arrived == size) {
      arrived = 0;
      ++generation;
      cv.notify_all();
      return;
    }
    cv.wait(lock, [&] { return generation != gen || aborted; });
    if (aborted && generation == gen) MT_FAIL("{}: rank {}: a peer failed during a collective", name, rank);
  }
  void abort() {
    std::lock_guard<std::mutex> lock(mu);
    aborted = true;
    cv.notify_all();
    for (auto& [k, c] : children) c->abort();
  }
};

float load_f(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::kF32: return static_cast<const float*>(p)[i];
    case DType::kBF16: return bf16_bits_to_f32(static_cast<const uint16_t*>(p)[i]);
    case DType::kF16: return f16_bits_to_f32(static_cast<const uint16_t*>(p)[i]);
    case DType::kI32: return static_cast<float>(static_cast<const int32_t*>(p)[i]);
    default: MT_FAIL("thread communicator: unsupported dtype {}", dtype_name(t));
  }
}

void store_f(void* p, DType t, int64_t i, double v) {
  switch (t) {
    case DType::kF32: static_cast<float*>(p)[i] = static_cast<float>(v); break;
    case DType::kBF16: static_cast<uint16_t*>(p)[i] = f32_to_bf16_bits(static_cast<float>(v)); break;
    case DType::kF16: static_cast<uint16_t*>(p)[i] = f32_to_f16_bits(static_cast<float>(v)); break;
    case DType::kI32: static_cast<int32_t*>(p)[i] = static_cast<int32_t>(v); break;
    default: MT_FAIL("thread communicator: unsupported dtype {}", dtype_name(t));
  }
}

class ThreadCommunicator final : public Communicator {
 public:
  ThreadCommunicator(std::shared_ptr<ThreadGroup> g, int rank, std::string name)
      : g_(std::move(g)), rank_(rank), name_(std::move(name)) {}
  int rank() const override { return rank_; }
  int size() const override { return g_->size; }
  const std::string& name() const override { return name_; }

  void all_reduce(const Tensor& t, ReduceOp op, const Stream&) override {
    check_cpu(t);
    const int64_t n = t.numel();
    publish(t.data());
    std::vector<double> acc(static_cast<size_t>(n));
    reduce_into(acc, t.dtype(), 0, n, op);
    g_->barrier(name_, rank_);  // everyone has read every buffer
    for (int64_t i = 0; i < n; ++i) store_f(t.data(), t.dtype(), i, acc[i]);
    g_->barrier(name_, rank_);
  }
  void all_gather(const Tensor& out, const Tensor& in, const Stream&) override {
    check_cpu(out);
    MT_CHECK(out.numel() == in.numel() * size() && out.dtype() == in.dtype(), "{}: all_gather out {} vs in {} x {}",
             name_, out.str(), in.str(), size());
    const size_t bytes = in.nbytes();
    std::vector<char> mine(static_cast<const char*>(in.data()), static_cast<const char*>(in.data()) + bytes);
    publish(mine.data());
    for (int r = 0; r < size(); ++r) std::memcpy(static_cast<char*>(out.data()) + r * bytes, g_->ptrs[r], bytes);
    g_->barrier(name_, rank_);
  }
  void reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op, const Stream&) override {
    check_cpu(in);
    MT_CHECK(in.numel() == out.numel() * size() && out.dtype() == in.dtype(), "{}: reduce_scatter out {} vs in {}",
             name_, out.str(), in.str());
    const int64_t n = out.numel();
    publish(in.data());
    std::vector<double> acc(static_cast<size_t>(n));
    reduce_into(acc, in.dtype(), rank_ * n, n, op);
    g_->barrier(name_, rank_);
    for (int64_t i = 0; i < n; ++i) store_f(out.data(), out.dtype(), i, acc[i]);
    g_->barrier(name_, rank_);
  }
  void broadcast(const Tensor& t, int root, const Stream&) override {
    check_cpu(t);
    publish(t.data());
    if (rank_ != root) std::memcpy(t.data(), g_->ptrs[root], t.nbytes());
    g_->barrier(name_, rank_);
  }
  void all_to_all(const Tensor& out, const Tensor& in, const Stream&) override {
    check_cpu(in);
    MT_CHECK(out.numel() == in.numel() && in.numel() % size() == 0, "{}: all_to_all out {} vs in {}", name_,
             out.str(), in.str());
    const size_t chunk = in.nbytes() / size();
    std::vector<char> mine(static_cast<const char*>(in.data()), static_cast<const char*>(in.data()) + in.nbytes());
    publish(mine.data());
    for (int r = 0; r < size(); ++r)
      std::memcpy(static_cast<char*>(out.data()) + r * chunk, static_cast<const char*>(g_->ptrs[r]) + rank_ * chunk,
                  chunk);
    g_->barrier(name_, rank_);
  }
  void all_to_allv(const Tensor& out, const AllToAllvSplits& recv, const Tensor& in, const AllToAllvSplits& send,
                   const Stream&) override {
    check_cpu(in);
    check_cpu(out);
    const auto [roff, soff] = comm_detail::check_all_to_allv(*this, out, recv, in, send);
    // Each rank publishes its send side; receivers copy their pieces out of the senders' tensors
    // (which stay untouched until the barrier after the copies).
    struct Side {
      const char* data;
      const std::vector<int64_t>* counts;
      const std::vector<int64_t>* offsets;
    };
    const Side mine{static_cast<const char*>(in.data()), &send.counts, &soff};
    publish(&mine);
    const size_t es = dtype_size(in.dtype());
    std::string mismatch;
    for (int r = 0; r < size(); ++r) {
      const Side& from = *static_cast<const Side*>(g_->ptrs[r]);
      const int64_t n = (*from.counts)[rank_];
      if (n != recv.counts[r]) {
        mismatch = fmt::format("all_to_allv on {}: rank {} sends {} elements but this rank expects {}",
                               comm_detail::describe(*this), r, n, recv.counts[r]);
        break;
      }
      if (n > 0)
        std::memcpy(static_cast<char*>(out.data()) + roff[r] * es, from.data + (*from.offsets)[rank_] * es,
                    static_cast<size_t>(n) * es);
    }
    g_->barrier(name_, rank_);  // every rank has read every sender's tensor
    MT_REQUIRE(mismatch.empty(), "{}", mismatch);
  }
  void send(const Tensor& t, int peer, const Stream&) override {
    check_cpu(t);
    MT_CHECK(peer >= 0 && peer < size() && peer != rank_, "{}: rank {} cannot send to {}", name_, rank_, peer);
    std::lock_guard<std::mutex> lock(g_->mu);
    g_->mailbox[{rank_, peer}].emplace_back(static_cast<const char*>(t.data()),
                                             static_cast<const char*>(t.data()) + t.nbytes());
    g_->cv.notify_all();
  }
  void recv(const Tensor& t, int peer, const Stream&) override {
    check_cpu(t);
    MT_CHECK(peer >= 0 && peer < size() && peer != rank_, "{}: rank {} cannot receive from {}", name_, rank_, peer);
    if (in_group_) {  // complete at group_end, after this rank's sends of the group are posted
      pending_.push_back({t, peer});
      return;
    }
    do_recv(t, peer);
  }
  void group_start() override { in_group_ = true; }
  void group_end() override {
    in_group_ = false;
    auto pending = std::move(pending_);
    pending_.clear();
    for (auto& [t, peer] : pending) do_recv(t, peer);
  }
  void barrier() override { g_->barrier(name_, rank_); }

  std::shared_ptr<Communicator> split(int color, int key, const std::string& name) override {
    uint64_t seq;
    {
      std::lock_guard<std::mutex> lock(g_->mu);
      g_->ints[2 * rank_] = color;
      g_->ints[2 * rank_ + 1] = key;
      seq = g_->splits;
    }
    g_->barrier(name_, rank_);
    std::vector<std::pair<std::pair<int, int>, int>> members;  // ((key, rank), rank) of my color
    for (int r = 0; r < size(); ++r)
      if (g_->ints[2 * r] == color) members.push_back({{g_->ints[2 * r + 1], r}, r});
    std::sort(members.begin(), members.end());
    int new_rank = 0;
    for (size_t i = 0; i < members.size(); ++i)
      if (members[i].second == rank_) new_rank = static_cast<int>(i);
    std::shared_ptr<ThreadGroup> child;
    if (color >= 0) {
      std::lock_guard<std::mutex> lock(g_->mu);
      auto& slot = g_->children[{seq, color}];
      if (!slot) slot = std::make_shared<ThreadGroup>(static_cast<int>(members.size()));
      child = slot;
    }
    g_->barrier(name_, rank_);
    if (rank_ == 0) {
      std::lock_guard<std::mutex> lock(g_->mu);
      ++g_->splits;
    }
    g_->barrier(name_, rank_);
    if (color < 0) return nullptr;
    return std::make_shared<ThreadCommunicator>(child, new_rank, name);
  }

 private:
  void check_cpu(const Tensor& t) const {
    MT_CHECK(t.device().is_cpu() && t.is_contiguous(), "{}: thread communicator needs contiguous CPU tensors, got {}",
             name_, t.str());
  }
  void publish(const void* p) {
    {
      std::lock_guard<std::mutex> lock(g_->mu);
      g_->ptrs[rank_] = p;
    }
    g_->barrier(name_, rank_);
  }
  void reduce_into(std::vector<double>& acc, DType t, int64_t offset, int64_t n, ReduceOp op) {
    for (int64_t i = 0; i < n; ++i) {
      // fp32 accumulation in rank order, as a ring/tree of fp32 adds would do.
      float a = load_f(g_->ptrs[0], t, offset + i);
      for (int r = 1; r < size(); ++r) {
        const float b = load_f(g_->ptrs[r], t, offset + i);
        a = op == ReduceOp::kSum ? a + b : (op == ReduceOp::kMax ? std::max(a, b) : std::min(a, b));
      }
      acc[i] = a;
    }
  }
  void do_recv(const Tensor& t, int peer) {
    std::unique_lock<std::mutex> lock(g_->mu);
    auto& q = g_->mailbox[{peer, rank_}];
    g_->cv.wait(lock, [&] { return !q.empty() || g_->aborted; });
    if (q.empty()) MT_FAIL("{}: rank {}: peer {} failed before sending", name_, rank_, peer);
    MT_CHECK(q.front().size() == t.nbytes(), "{}: rank {} expected {} bytes from {}, got {}", name_, rank_, t.nbytes(),
             peer, q.front().size());
    std::memcpy(t.data(), q.front().data(), t.nbytes());
    q.pop_front();
  }

  std::shared_ptr<ThreadGroup> g_;
  int rank_;
  std::string name_;
  bool in_group_ = false;
  std::vector<std::pair<Tensor, int>> pending_;
};

}  // namespace

void run_thread_ranks(int n, const std::function<void(int, std::shared_ptr<Communicator>)>& fn) {
  MT_CHECK(n >= 1, "run_thread_ranks: n = {}", n);
  auto group = std::make_shared<ThreadGroup>(n);
  std::vector<std::exception_ptr> errors(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r, std::make_shared<ThreadCommunicator>(group, r, "world"));
      } catch (...) {
        errors[r] = std::current_exception();
        group->abort();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace mt
