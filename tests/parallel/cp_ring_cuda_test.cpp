// The overlapped p2p ring of context-parallel attention (model/layers/cp_attention.h) on one GPU:
// CP 2 and 4 thread ranks share the GPU through a stream-ordered point-to-point communicator
// (below; NCCL does not put two ranks on one device), each rank with its own compute stream.
// A receive is ordered after the sender's stream reached the send (an event) and the sender's
// stream continues only after the copy (another event), as NCCL's p2p orders them, but nothing
// waits on the host: the ring stream of ContextParallelRegion really runs beside the compute
// stream. Every receive is delayed by a host function on the receiving (ring) stream and every
// rank's compute stream starts late, so that a missing event wait in the layer reads or
// overwrites a block in flight (checked: dropping either wait of the ring makes the cases fail).
// Forward output and dqkv of each rank's shard must equal one rank's (CP 1) attention over the
// whole sequence: CP 2 and 4, fp32 (simple kernels, rel. 1e-5) and bf16 (tensor-core kernels,
// rel. 2e-2), causal, GQA, with and without document starts, with and without attention dropout
// (the mask keyed by global positions: every layout draws the one-rank mask), and with the blocks
// on cuDNN's fused attention (its execution count proves it ran: 2 per ring step of each rank).
#include <gtest/gtest.h>
#include <cuda_runtime.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <thread>

#include "model/gpt_model.h"
#include "model/layers/cp_attention.h"
#include "model/module.h"
#include "ops/cuda/cudnn_attention.h"
#include "ops/flash_attention.h"
#include "parallel/mappings.h"
#include "testing/testing.h"

namespace mt {
namespace {

using testing::OwnedTensor;

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) MT_FAIL("{}: {}", what, cudaGetErrorString(e));
}

void CUDART_CB sleep_ms(void* ms) {
  std::this_thread::sleep_for(std::chrono::milliseconds(reinterpret_cast<intptr_t>(ms)));
}
void delay(const Stream& st, intptr_t ms) {
  check_cuda(cudaLaunchHostFunc(static_cast<cudaStream_t>(st.cuda_stream()), sleep_ms, reinterpret_cast<void*>(ms)),
             "cudaLaunchHostFunc");
}

// The mailboxes of one group of thread ranks: messages per (source, destination) in send order.
struct Mailboxes {
  struct Msg {
    const void* src;
    size_t bytes;
    cudaEvent_t sent;            // recorded on the sender's stream at the send
    cudaEvent_t copied = nullptr;  // recorded on the receiver's stream after the copy
  };
  std::mutex mu;
  std::condition_variable cv;
  std::map<std::pair<int, int>, std::deque<std::shared_ptr<Msg>>> box;
};

class StreamOrderedP2P final : public Communicator {
 public:
  StreamOrderedP2P(std::shared_ptr<Mailboxes> m, int rank, int size) : m_(std::move(m)), rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }
  void all_reduce(const Tensor&, ReduceOp, const Stream&) override { unsupported("all_reduce"); }
  void all_gather(const Tensor&, const Tensor&, const Stream&) override { unsupported("all_gather"); }
  void reduce_scatter(const Tensor&, const Tensor&, ReduceOp, const Stream&) override { unsupported("reduce_scatter"); }
  void broadcast(const Tensor&, int, const Stream&) override { unsupported("broadcast"); }
  void all_to_all(const Tensor&, const Tensor&, const Stream&) override { unsupported("all_to_all"); }
  void all_to_allv(const Tensor&, const AllToAllvSplits&, const Tensor&, const AllToAllvSplits&,
                   const Stream&) override {
    unsupported("all_to_allv");
  }
  void send(const Tensor& t, int peer, const Stream& st) override { ops_.push_back({true, t, peer, &st}); }
  void recv(const Tensor& t, int peer, const Stream& st) override { ops_.push_back({false, t, peer, &st}); }
  void group_start() override {}
  void group_end() override {
    std::vector<std::pair<std::shared_ptr<Mailboxes::Msg>, const Stream*>> sent;
    for (const Op& o : ops_) {  // post every send first: the group cannot deadlock
      if (!o.send) continue;
      auto msg = std::make_shared<Mailboxes::Msg>(Mailboxes::Msg{o.t.data(), o.t.nbytes(), nullptr});
      check_cuda(cudaEventCreateWithFlags(&msg->sent, cudaEventDisableTiming), "event");
      check_cuda(cudaEventRecord(msg->sent, static_cast<cudaStream_t>(o.st->cuda_stream())), "record");
      std::lock_guard<std::mutex> lock(m_->mu);
      m_->box[{rank_, o.peer}].push_back(msg);
      sent.emplace_back(msg, o.st);
    }
    m_->cv.notify_all();
    for (const Op& o : ops_) {
      if (o.send) continue;
      std::shared_ptr<Mailboxes::Msg> msg;
      {
        std::unique_lock<std::mutex> lock(m_->mu);
        auto& q = m_->box[{o.peer, rank_}];
        m_->cv.wait(lock, [&] { return !q.empty(); });
        msg = q.front();
        q.pop_front();
      }
      MT_CHECK(msg->bytes == o.t.nbytes(), "rank {} receives {} bytes from rank {} into {} bytes", rank_, msg->bytes,
               o.peer, o.t.nbytes());
      const auto s = static_cast<cudaStream_t>(o.st->cuda_stream());
      check_cuda(cudaStreamWaitEvent(s, msg->sent, 0), "wait");
      delay(*o.st, 2);  // a slow link: the layer must wait for the receive before it reads
      check_cuda(cudaMemcpyAsync(o.t.data(), msg->src, msg->bytes, cudaMemcpyDeviceToDevice, s), "copy");
      cudaEvent_t copied;
      check_cuda(cudaEventCreateWithFlags(&copied, cudaEventDisableTiming), "event");
      check_cuda(cudaEventRecord(copied, s), "record");
      check_cuda(cudaEventDestroy(msg->sent), "destroy");
      std::lock_guard<std::mutex> lock(m_->mu);
      msg->copied = copied;
      m_->cv.notify_all();
    }
    for (auto& [msg, st] : sent) {  // the sender's stream may reuse the buffer after the copy
      std::unique_lock<std::mutex> lock(m_->mu);
      m_->cv.wait(lock, [&] { return msg->copied != nullptr; });
      check_cuda(cudaStreamWaitEvent(static_cast<cudaStream_t>(st->cuda_stream()), msg->copied, 0), "wait");
      check_cuda(cudaEventDestroy(msg->copied), "destroy");
    }
    ops_.clear();
  }
  void barrier() override { unsupported("barrier"); }
  std::shared_ptr<Communicator> split(int, int, const std::string&) override { unsupported("split"); }

 private:
  struct Op {
    bool send;
    Tensor t;
    int peer;
    const Stream* st;
  };
  [[noreturn]] void unsupported(const char* what) const { MT_FAIL("StreamOrderedP2P has no {}", what); }
  std::shared_ptr<Mailboxes> m_;
  int rank_, size_;
  std::string name_ = "cp";
  std::vector<Op> ops_;
};

struct Case {
  int cp;
  DType dtype;
  bool docs;
  float dropout = 0.f;  // --attention-dropout
  bool cudnn = false;   // the blocks on cuDNN (--attention-backend fused) where it applies
};

constexpr int64_t kSeq = 512, kB = 2, kHeads = 4, kGroups = 2, kD = 64;

TransformerConfig config(const Case& z) {
  TransformerConfig c;
  c.hidden_size = kHeads * kD;
  c.num_attention_heads = kHeads;
  c.num_query_groups = kGroups;
  c.seq_length = kSeq;
  c.cp_comm_type = "p2p";
  c.attention_dropout = z.dropout;
  return c;
}

struct Shard {
  std::vector<float> out, dqkv;
};

// One rank's attention (CP rank `rank` of `cp`; cp = 1: the whole sequence) on rows of the full
// [s, b, width] inputs; the outputs in the rank's local row order.
Shard run_rank(const Case& z, int cp, int rank, std::shared_ptr<Communicator> comm, const std::vector<float>& qkv,
               const std::vector<float>& dctx, const std::vector<int32_t>& doc) {
  const TransformerConfig c = config(z);
  const Device dev = Device::cuda(0);
  Stream st(dev);
  const int64_t sl = kSeq / cp, width = kGroups * (kHeads / kGroups + 2) * kD, ow = kHeads * kD;
  auto shard = [&](const std::vector<float>& full, int64_t w) {
    std::vector<float> local(static_cast<size_t>(sl * kB * w));
    cp_shard_rows(local.data(), full.data(), kSeq, kB * w, cp, rank);
    return local;
  };
  const ContextParallelOptions o = GPTModel::validate_context_parallel(c, cp, 1);
  ContextParallelRegion region(comm, o, kSeq, dev);
  TensorParallelRegion tp(std::make_shared<SingleRankCommunicator>("tp"), false);
  ContextParallelAttention attn(c, 0, tp, region, z.cudnn);
  BufferPlanner planner(dev, z.dtype);
  for (int pass = 0; pass < 2; ++pass) {
    planner.begin_pass();
    planner.open_area(BufferPlanner::Family::kActivations, 0);
    attn.plan(planner, sl, kB);
    planner.close_area();
    if (pass == 0) planner.materialize();
  }
  const std::vector<int64_t> qkv_shape{sl, kB, kGroups, kHeads / kGroups + 2, kD};
  OwnedTensor x = testing::make_tensor(shard(qkv, width), z.dtype, dev, qkv_shape, st);
  OwnedTensor dout = testing::make_tensor(shard(dctx, ow), z.dtype, dev, {sl, kB, ow}, st);
  OwnedTensor out(z.dtype, dev, {sl, kB, ow}), dx(z.dtype, dev, qkv_shape);
  std::vector<int32_t> ldoc(static_cast<size_t>(kB * sl));
  cp_shard_columns(ldoc.data(), doc.data(), kB, kSeq, cp, rank);
  OwnedTensor d = testing::make_int_tensor(ldoc, dev, {kB, sl}, st);
  MicroBatch mb;
  if (z.docs) mb.doc_start = d.t;
  DropoutContext dc;
  dc.seed = 20261128;
  dc.iteration = 3;
  const StepContext ctx{mb, dc, 0, st};
  st.synchronize();
  delay(st, 20);  // the compute stream starts late: the ring must wait for the packed block
  attn.forward(out, x, ctx);
  delay(st, 5);
  attn.backward(dx, dout, out, x, ctx);
  return Shard{testing::to_host(out, st), testing::to_host(dx, st)};
}

class CpRingOnOneGpu : public ::testing::TestWithParam<Case> {};

TEST_P(CpRingOnOneGpu, ShardsEqualOneRank) {
  const Case z = GetParam();
  const int64_t width = kGroups * (kHeads / kGroups + 2) * kD, ow = kHeads * kD;
  const std::vector<float> qkv = testing::rounded(testing::randn(kSeq * kB * width), z.dtype);
  const std::vector<float> dctx = testing::rounded(testing::randn(kSeq * kB * ow), z.dtype);
  std::vector<int32_t> doc(static_cast<size_t>(kB * kSeq));
  for (int64_t b = 0; b < kB; ++b)
    for (int64_t i = 0; i < kSeq; ++i) doc[b * kSeq + i] = static_cast<int32_t>(i / (97 + 60 * b) * (97 + 60 * b));
  Case one = z;
  one.cudnn = false;  // the reference: one rank on the FlashAttention-2 kernels
  const Shard ref = run_rank(one, 1, 0, std::make_shared<SingleRankCommunicator>("cp"), qkv, dctx, doc);
  const int64_t cudnn_before = cuda::cudnn_attention_executions();
  std::vector<Shard> got(static_cast<size_t>(z.cp));
  auto boxes = std::make_shared<Mailboxes>();
  std::vector<std::thread> threads;
  std::vector<std::string> errors(static_cast<size_t>(z.cp));
  for (int r = 0; r < z.cp; ++r)
    threads.emplace_back([&, r] {
      try {
        got[static_cast<size_t>(r)] = run_rank(z, z.cp, r, std::make_shared<StreamOrderedP2P>(boxes, r, z.cp), qkv, dctx, doc);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (const auto& e : errors) ASSERT_TRUE(e.empty()) << e;
  // cuDNN ran every block (forward and backward, each step of each rank) where it applies.
  const bool cudnn_runs = z.cudnn && flash_attention_cudnn_available() && !z.docs && z.dropout == 0.f &&
                          z.dtype != DType::kF32;
  EXPECT_EQ(cuda::cudnn_attention_executions() - cudnn_before, cudnn_runs ? 2 * z.cp * z.cp : 0);
  const double tol = z.dtype == DType::kF32 ? 1e-5 : 2e-2;
  for (int r = 0; r < z.cp; ++r) {
    auto local = [&](const std::vector<float>& full, int64_t w) {
      std::vector<float> l(static_cast<size_t>(kSeq / z.cp * kB * w));
      cp_shard_rows(l.data(), full.data(), kSeq, kB * w, z.cp, r);
      return l;
    };
    EXPECT_LT(testing::rel_err(got[static_cast<size_t>(r)].out, local(ref.out, ow)), tol) << "output of rank " << r;
    const std::vector<float> want = local(ref.dqkv, width);
    const std::vector<float>& have = got[static_cast<size_t>(r)].dqkv;
    // The parts of dqkv ([.., g, qpg + 2, d]): dQ, dK, dV.
    std::vector<float> part[2][3];
    const int64_t w = kHeads / kGroups + 2;
    for (size_t e = 0; e < have.size(); ++e) {
      const int64_t j = static_cast<int64_t>(e) / kD % w, k = j < w - 2 ? 0 : j - (w - 2) + 1;
      part[0][k].push_back(have[e]);
      part[1][k].push_back(want[e]);
    }
    for (int k = 0; k < 3; ++k)
      EXPECT_LT(testing::rel_err(part[0][k], part[1][k]), tol) << "d" << "qkv"[k] << " of rank " << r;
  }
}

std::string case_name(const ::testing::TestParamInfo<Case>& i) {
  const Case& z = i.param;
  return fmt::format("cp{}_p2p_{}{}{}{}", z.cp, z.dtype == DType::kF32 ? "fp32" : "bf16", z.docs ? "_docs" : "",
                     z.dropout > 0.f ? "_dropout" : "", z.cudnn ? "_cudnn" : "");
}

INSTANTIATE_TEST_SUITE_P(Layouts, CpRingOnOneGpu,
                         ::testing::Values(Case{2, DType::kF32, false}, Case{4, DType::kF32, true},
                                           Case{2, DType::kBF16, true}, Case{4, DType::kBF16, false},
                                           Case{2, DType::kF32, true, 0.2f}, Case{4, DType::kBF16, true, 0.1f},
                                           Case{2, DType::kBF16, false, 0.1f},
                                           // cuDNN blocks (and, with documents, the fallback)
                                           Case{2, DType::kBF16, false, 0.f, true},
                                           Case{4, DType::kBF16, false, 0.f, true},
                                           Case{2, DType::kBF16, true, 0.f, true}),
                         case_name);

}  // namespace
}  // namespace mt
