// Context-parallel attention of one layer over NCCL, one rank per GPU (CP = the number of ranks),
// bf16, micro-batch 1, the attention of the Llama-style 1.18B model (32 heads of 64 in 8 query
// groups; --heads/--groups/--dim to change):
//   mpiexec --allow-run-as-root -np 2 build/cp_ring_bench [--seqs 32768,65536,131072]
//       [--types p2p,a2a] [--ring nccl,ce] [--backend fused|flash] [--iters 5] [--min-hidden 0.5]
// --ring: how the p2p ring exchanges its blocks, a row for each value given (a2a rows have no ring):
//   nccl  NCCL's send/recv kernels on the ring stream;
//   ce    copy-engine transfers (ContextParallelOptions::ring_copy_engine, comm/nccl/peer_ring.h);
//         where the region cannot use them (no peer access, ...) the row says so and is skipped.
// (The environment variable MT_CP_RING overrides the option in every region: leave it unset.)
// Per (sequence, comm type, ring), as ContextParallelAttention runs in training (model/layers/cp_attention.h):
//   fwd / bwd ms   the layer's forward and backward (median of --iters after 3 warm-ups, CUDA
//                  events on the compute stream, max over ranks);
//   compute ms     the block attention alone (CpRingTrace: events around every ring step's blocks;
//                  median of --iters traced iterations);
//   exposed ms     ring exchange time outside every block computation (cp_overlap), fwd + bwd
//                  (median of the same traced iterations); an exchange span runs from the ring
//                  stream's start to the transfers' end, so it also counts waiting for the peer;
//   other ms       fwd + bwd − compute − exposed: packing, merges and, for a2a, the all-to-alls;
//   alone ms       the same communication timed without compute: the ring's schedule of
//                  sends/receives (p2p: P−1 K/V exchanges forward; backward P−1 K/V, P−1 dK/dV and
//                  the final dK/dV home) by the row's mechanism (NCCL send/recv, or a
//                  PeerRingExchange of its own on buffers of the same sizes), or the a2a's four
//                  all-to-alls;
//   hidden         p2p: 1 − exposed / alone, the fraction of the ring's communication the traced
//                  iterations show hidden (information; skew between the ranks counts as exposed);
//   serial ms      p2p: fwd + bwd with the ring serialised (ContextParallelRegion::
//                  set_ring_serialised: the compute waits for each exchange before its blocks —
//                  the same exchanges and blocks, the negative control), medians as fwd / bwd;
//   vs serial      p2p: (serial − fwd − bwd) / hideable, where hideable = alone · (3P − 3)/(3P − 2)
//                  (everything but the final dK/dV exchange home, 3/4 at CP 2): the share of the
//                  hideable communication the overlap saves against the serialised ring. ~0 when
//                  the ring is serialised; the overlap check gates on it;
//   1 GPU ms       rank 0: the whole sequence's attention on one GPU (flash_attention_forward +
//                  _backward, cuDNN with --backend fused), and the speed-up of the CP layer over it.
// TF/s per GPU: FlashAttention's count (causal forward 2·b·n·s²·d, backward 2.5×) / CP / time.
// Exits 1 (FAIL line) when a p2p row's "vs serial" is below --min-hidden: the overlapped layer is
// not faster than the serialised one by that share of the hideable communication. The share is
// measurable only where the exchanges are not lost in the timing noise of the blocks (at CP 2 on
// NVLink they are 2–4% of the layer at 32K–64K): --heads 8 --groups 8 at 8K–16K makes them ~1/3. Timings never gate CI; this bench is run by bench/cp_bench.sh on a 2-GPU machine.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "bench_dist.h"
#include "bench_util.h"
#include "comm/bootstrap.h"
#include "comm/nccl/nccl_communicator.h"
#include "comm/nccl/peer_ring.h"
#include "core/buffer.h"
#include "model/gpt_model.h"
#include "model/layers/cp_attention.h"
#include "model/module.h"
#include "ops/elementwise.h"
#include "ops/flash_attention.h"
#include "ops/init.h"
#include "parallel/mappings.h"

namespace {

using namespace mt;
using bench::max_over;
using bench::parse_list;
using bench::randomize;
using bench::timed;

struct Options {
  std::vector<int64_t> seqs{32768, 65536, 131072};
  std::vector<std::string> types{"p2p", "a2a"};
  std::vector<std::string> rings{"nccl", "ce"};
  bool fused = true;
  int iters = 5;
  double min_hidden = 0.5;
  int64_t heads = 32, groups = 8, dim = 64;
};

struct Row {
  double fwd = 0, bwd = 0, compute = 0, exposed = 0, alone = 0, one_gpu = 0, serial = 0;
  std::string skipped;  // why the row was not run (copy engines refused)
};

std::vector<std::string> split_list(const std::string& list) {
  std::vector<std::string> out;
  for (std::string t = list; !t.empty();) {
    const size_t k = t.find(',');
    out.push_back(t.substr(0, k));
    t = k == std::string::npos ? "" : t.substr(k + 1);
  }
  return out;
}

Row bench_one(const Options& opt, const std::shared_ptr<Communicator>& world, Device dev, int64_t s,
              const std::string& type, const std::string& ring_kind) {
  const int cp = world->size();
  const int64_t sl = s / cp, d = opt.dim, n = opt.heads, g = opt.groups, qpg = n / g;
  TransformerConfig c;
  c.num_attention_heads = n;
  c.num_query_groups = g;
  c.hidden_size = n * d;
  c.seq_length = s;
  c.cp_comm_type = type;
  c.attention_dropout = 0.f;
  const bool cudnn = opt.fused && flash_attention_cudnn_available();
  Stream st(dev);
  ContextParallelOptions o = GPTModel::validate_context_parallel(c, cp, 1);
  const bool ce = ring_kind == "ce";
  o.ring_copy_engine = ce;
  ContextParallelRegion region(world, o, s, dev);
  TensorParallelRegion tp(std::make_shared<SingleRankCommunicator>("tp"), false);
  ContextParallelAttention attn(c, 0, tp, region, cudnn);
  BufferPlanner planner(dev, DType::kBF16);
  for (int pass = 0; pass < 2; ++pass) {
    planner.begin_pass();
    planner.open_area(BufferPlanner::Family::kActivations, 0);
    attn.plan(planner, sl, 1);
    planner.close_area();
    if (pass == 0) planner.materialize();
  }
  Row r;
  if (ce && region.p2p_size() > 1 && !region.ring_uses_copy_engine(st)) {  // refused (agreed over the ring)
    r.skipped = region.ring_copy_engine_why_not();
    return r;
  }
  const int64_t ce_before = cp_ring_copy_engine_exchanges();
  const int64_t width = g * (qpg + 2) * d;
  Buffer bx(dev, sl * width * 2), bdx(dev, sl * width * 2), bo(dev, sl * n * d * 2), bdo(dev, sl * n * d * 2);
  const Tensor x = bx.as(DType::kBF16, {sl, 1, g, qpg + 2, d}), dx = bdx.as(DType::kBF16, {sl, 1, g, qpg + 2, d});
  const Tensor out = bo.as(DType::kBF16, {sl, 1, n * d}), dout = bdo.as(DType::kBF16, {sl, 1, n * d});
  randomize(x, 1 + 2 * world->rank(), st);
  randomize(dout, 2 + 2 * world->rank(), st);
  MicroBatch mb;
  DropoutContext dc;
  dc.training = false;
  const StepContext ctx{mb, dc, 0, st};
  r.fwd = timed(*world, st, opt.iters, [&] { attn.forward(out, x, ctx); });
  r.bwd = timed(*world, st, opt.iters, [&] { attn.backward(dx, dout, out, x, ctx); });
  if (region.p2p_size() > 1) {  // the negative control: the same layer with the ring serialised
    const auto host = [&](const Tensor& t) {
      std::vector<uint8_t> h(static_cast<size_t>(t.nbytes()));
      copy_bytes(h.data(), Device::cpu(), t.data(), dev, h.size(), st);
      st.synchronize();
      return h;
    };
    attn.forward(out, x, ctx);
    const std::vector<uint8_t> out_ovl = host(out);
    region.set_ring_serialised(true);
    r.serial = timed(*world, st, opt.iters, [&] { attn.forward(out, x, ctx); }) +
               timed(*world, st, opt.iters, [&] { attn.backward(dx, dout, out, x, ctx); });
    // the control adds waits only: the forward's output is the same bytes (the backward's dQ may
    // differ in its last bits: cuDNN accumulates it with atomics)
    attn.forward(out, x, ctx);
    MT_REQUIRE(host(out) == out_ovl, "cp_ring_bench: the serialised ring's output differs from the overlapped one's");
    region.set_ring_serialised(false);
  }
  // Traced iterations: block compute and exposed exchange time, the median of --iters (max over ranks).
  CpRingTrace trace(dev);
  region.set_trace(&trace);
  std::vector<double> computes, exposeds;
  for (int it = 0; it < std::max(1, opt.iters); ++it) {
    double compute = 0, exposed = 0;
    for (int phase = 0; phase < 2; ++phase) {
      trace.clear();
      if (phase == 0) attn.forward(out, x, ctx);
      else attn.backward(dx, dout, out, x, ctx);
      st.synchronize();
      if (region.p2p_size() > 1) region.ring().stream.synchronize();
      const CpOverlap ov = cp_overlap(trace.spans_ms());
      compute += ov.compute_ms;
      exposed += ov.exposed_ms;
    }
    computes.push_back(compute);
    exposeds.push_back(exposed);
  }
  region.set_trace(nullptr);
  const double compute = bench::median(computes), exposed = bench::median(exposeds);
  if (ce && region.p2p_size() > 1)
    MT_REQUIRE(cp_ring_copy_engine_exchanges() > ce_before, "cp_ring_bench: --ring ce ran no copy-engine exchange");
  r.compute = max_over(*world, static_cast<float>(compute), st);
  r.exposed = max_over(*world, static_cast<float>(exposed), st);
  // The communication alone, same sizes and schedule.
  const int a2a = region.a2a_size(), p = region.p2p_size();
  const int64_t kv_elems = a2a * sl * (g / a2a) * 2 * d;
  if (p > 1) {
    Communicator& ring = region.p2p_group();
    Buffer b0(dev, kv_elems * 2), b1(dev, kv_elems * 2), b2(dev, kv_elems * 2), b3(dev, kv_elems * 2);
    const Tensor k0 = b0.as(DType::kBF16, {kv_elems}), k1 = b1.as(DType::kBF16, {kv_elems}),
                 k2 = b2.as(DType::kBF16, {kv_elems}), k3 = b3.as(DType::kBF16, {kv_elems});
    const int next = (ring.rank() + 1) % p, prev = (ring.rank() + p - 1) % p;
    // --ring ce: the same protocol on the same sizes, by an exchange of its own (p2p: the ring is
    // the whole CP group, `world`).
    std::unique_ptr<PeerRingExchange> x;
    if (ce) {
      auto nccl = std::dynamic_pointer_cast<NcclCommunicator>(world);
      MT_REQUIRE(nccl && p == cp, "cp_ring_bench: --ring ce times the ring of --types p2p over NCCL");
      std::string why;
      x = PeerRingExchange::create(nccl, {b1.data(), b3.data()}, &why);
      MT_REQUIRE(x != nullptr, "cp_ring_bench: the copy-engine exchange alone was refused: {}", why);
    }
    auto step = [&](bool kv, bool dkv) {
      if (x) {
        const size_t bytes = static_cast<size_t>(kv_elems) * 2;
        PeerRingExchange::Transfer t[2];
        size_t n = 0;
        if (kv) t[n++] = {b0.data(), b1.data(), bytes};
        if (dkv) t[n++] = {b2.data(), b3.data(), bytes};
        x->exchange(std::span<const PeerRingExchange::Transfer>(t, n), static_cast<cudaStream_t>(st.cuda_stream()));
        return;
      }
      ring.group_start();
      if (kv) {
        ring.send(k0, next, st);
        ring.recv(k1, prev, st);
      }
      if (dkv) {
        ring.send(k2, next, st);
        ring.recv(k3, prev, st);
      }
      ring.group_end();
    };
    r.alone = timed(*world, st, opt.iters, [&] {
      for (int i = 0; i + 1 < p; ++i) step(true, false);  // forward
      for (int i = 0; i < p; ++i) step(i + 1 < p, i > 0);  // backward
      step(false, true);                                   // the final dK/dV home
    });
  } else {
    Communicator& group = region.a2a_group();
    const int64_t qkv_elems = sl * width, out_elems = sl * n * d;
    Buffer b0(dev, qkv_elems * 2), b1(dev, qkv_elems * 2);
    const Tensor s0 = b0.as(DType::kBF16, {qkv_elems}), s1 = b1.as(DType::kBF16, {qkv_elems});
    r.alone = timed(*world, st, opt.iters, [&] {
      group.all_to_all(s1, s0, st);  // qkv in, output back, dout in, dqkv back
      group.all_to_all(s1.flat_range(0, out_elems), s0.flat_range(0, out_elems), st);
      group.all_to_all(s1.flat_range(0, out_elems), s0.flat_range(0, out_elems), st);
      group.all_to_all(s1, s0, st);
    });
  }
  // One GPU: the whole sequence's attention (rank 0; the others wait).
  if (world->rank() == 0) {
    FlashAttentionConfig f;
    f.seq = s;
    f.batch = 1;
    f.groups = g;
    f.queries_per_group = qpg;
    f.head_dim = d;
    f.softmax_scale = 1.f / std::sqrt(static_cast<float>(d));
    f.cudnn = opt.fused;
    Buffer fx(dev, s * width * 2), fdx(dev, s * width * 2), fo(dev, s * n * d * 2), fdo(dev, s * n * d * 2),
        fl(dev, s * n * 4), fw(dev, flash_attention_workspace_bytes(f));
    const Tensor qkv = fx.as(DType::kBF16, {s, 1, g, qpg + 2, d}), dqkv = fdx.as(DType::kBF16, {s, 1, g, qpg + 2, d});
    const Tensor o1 = fo.as(DType::kBF16, {s, 1, n, d}), do1 = fdo.as(DType::kBF16, {s, 1, n, d});
    const Tensor lse = fl.as(DType::kF32, {1, n, s}), ws = fw.as(DType::kU8, {static_cast<int64_t>(fw.bytes())});
    randomize(qkv, 11, st);
    randomize(do1, 12, st);
    auto one = std::make_shared<SingleRankCommunicator>("one");
    r.one_gpu = timed(*one, st, opt.iters, [&] {
      flash_attention_forward(o1, lse, qkv, f, st);
      flash_attention_backward(dqkv, do1, o1, lse, qkv, ws, f, st);
    });
  }
  world->barrier();
  return r;
}

int bench_main(int argc, char** argv) {
  Options opt;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    const char* v = argv[i + 1];
    if (a == "--seqs") opt.seqs = parse_list(v);
    else if (a == "--types") opt.types = split_list(v);
    else if (a == "--ring") {
      opt.rings = split_list(v);
      for (const std::string& k : opt.rings)
        MT_REQUIRE(k == "nccl" || k == "ce", "--ring {}: expected nccl or ce (comma-separated)", k);
    } else if (a == "--backend") {
      MT_REQUIRE(std::string(v) == "fused" || std::string(v) == "flash", "--backend {}: expected fused or flash", v);
      opt.fused = std::string(v) == "fused";
    } else if (a == "--iters") opt.iters = std::atoi(v);
    else if (a == "--min-hidden") opt.min_hidden = std::atof(v);
    else if (a == "--heads") opt.heads = std::atoll(v);
    else if (a == "--groups") opt.groups = std::atoll(v);
    else if (a == "--dim") opt.dim = std::atoll(v);
    else MT_FAIL("cp_ring_bench: unknown argument {}", a);
  }
  Device dev;
  const auto world = bench::gpu_world("cp_ring_bench", dev);
  const int cp = world->size();
  const bool root = world->rank() == 0;
  if (root) {
    fmt::print("CP {} attention layer, bf16, b = 1, {} heads of {} in {} groups, blocks on {}\n", cp, opt.heads,
               opt.dim, opt.groups,
               opt.fused && flash_attention_cudnn_available() ? "cuDNN (fused)" : "the FlashAttention-2 kernels");
    fmt::print("{:>7} {:>5} {:>4} | {:>8} {:>8} {:>8} | {:>9} {:>9} {:>8} {:>8} {:>7} | {:>9} {:>9} | {:>9} {:>7}\n",
               "seq", "type", "ring", "fwd ms", "bwd ms", "TF/s/GPU", "compute", "exposed", "other", "alone", "hidden",
               "serial ms", "vs serial", "1 GPU ms", "speedup");
  }
  bool ok = true;
  for (const int64_t s : opt.seqs)
    for (const std::string& type : opt.types)
      for (const std::string& ring_kind : opt.rings) {
        const bool ring = type == "p2p";
        if (!ring && ring_kind != opt.rings.front()) continue;  // no ring: one row
        const Row r = bench_one(opt, world, dev, s, type, ring ? ring_kind : "nccl");
        if (!r.skipped.empty()) {
          if (root)
            fmt::print("{:>7} {:>5} {:>4} | skipped: the copy-engine ring was refused: {}\n", s, type, ring_kind,
                       r.skipped);
          continue;
        }
        const double total = r.fwd + r.bwd;
        const double flops = 2.0 * opt.heads * static_cast<double>(s) * s * opt.dim * 3.5 / cp;
        const double other = total - r.compute - r.exposed;
        const double hidden = ring && r.alone > 0 ? 1.0 - r.exposed / r.alone : NAN;
        const double hideable = r.alone * (3.0 * cp - 3) / (3.0 * cp - 2);
        const double saved = ring && hideable > 0 ? (r.serial - total) / hideable : NAN;
        if (root) {
          fmt::print("{:>7} {:>5} {:>4} | {:>8.2f} {:>8.2f} {:>8.1f} | {:>9.2f} {:>9.3f} {:>8.2f} {:>8.3f} {:>6.0f}% | "
                     "{:>9.2f} {:>8.0f}% | {:>9.2f} {:>6.2f}x\n",
                     s, type, ring ? ring_kind : "-", r.fwd, r.bwd, flops / total * 1e-9, r.compute, r.exposed, other,
                     r.alone, ring ? 100 * hidden : NAN, ring ? r.serial : NAN, ring ? 100 * saved : NAN, r.one_gpu,
                     r.one_gpu / total);
          std::fflush(stdout);
        }
        if (ring && !(saved >= opt.min_hidden)) {
          ok = false;
          if (root)
            fmt::print("FAIL: seq {} p2p ({}): the overlapped layer ({:.3f} ms) saves {:.0f}% of the hideable ring "
                       "communication ({:.3f} ms) against the serialised ring ({:.3f} ms), below --min-hidden {:.0f}%: "
                       "the ring is serialised with the compute, or its exchanges are lost in the noise (see the "
                       "header)\n",
                       s, ring_kind, total, 100 * saved, hideable, r.serial, 100 * opt.min_hidden);
        }
      }
  if (root && ok)
    fmt::print("overlap check passed: every p2p row saves >= {:.0f}% of its hideable ring communication against the "
               "serialised ring\n",
               100 * opt.min_hidden);
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) { return mt::bench::run_main("cp_ring_bench", argc, argv, bench_main); }
