// Context parallelism over NCCL (one rank per GPU under mpiexec; ctest runs it with 2 ranks, CP 2;
// -np 4 runs CP 4): the CP attention with its blocks on cuDNN's fused attention
// (--attention-backend fused) and on the FlashAttention-2 kernels (flash, the existing path), the
// p2p ring overlapped on its own stream, gives the losses and gradients of one GPU in bf16, for
// --cp-comm-type p2p, a2a and allgather, causal attention with grouped queries (GQA) and without
// (MHA), document masks (--reset-attention-mask, the kernels' fallback) and attention dropout
// (the fallback too), and multi-latent attention (MLA, docs/mla.md: DeepSeek-V3's head dims, queries
// and keys 128 + 64 rotated channels and values 128 padded to the packed head dim 192, which cuDNN
// takes on Hopper; YaRN; the flash runs on the kernels' CUDA-core path). A two-layer Llama-style
// model (RMSNorm, RoPE, SwiGLU; GQA: 16 heads of 64 in 4 query groups; MHA: 4 heads; MLA: 8 heads),
// sequence 1024,
// micro-batch 2, 2 micro-batches, 2 iterations; the one-GPU reference is computed on every rank
// with the same --attention-backend (fused: cuDNN's one-GPU attention), the data broadcast from
// rank 0.
//
// Tolerance, as tests/parallel/parallel_layouts_cuda_dist_test.cpp: the bf16 noise is measured
// (one GPU bf16 against one GPU fp32, per tensor and overall) and a layout may differ from the
// one-GPU bf16 run by max(2e-2, 3 × that noise) per weight matrix and overall, the loss by 2e-3
// relative. The fused and flash CP runs are also compared with each other (same bound). A block
// attending to the wrong keys, a missing dK/dV transfer or a wrong merge is off by O(1).
// cuDNN's execution count proves which path ran: in a fused run every block of the ring (forward
// and backward) runs on cuDNN where it applies (2 · iterations · micro-batches · layers · ring
// steps executions; MLA's head dim 192 on Hopper and newer only), in the fallback cases none.
//
// CopyEngineRingMatchesNcclRing: the p2p ring with its exchanges by copy-engine transfers
// (ContextParallelOptions::ring_copy_engine, selected here through MT_CP_RING=ce since the model
// builds its region from the configuration) against the same layout on NCCL's send/recv
// (MT_CP_RING=nccl): the exchange only moves bytes, so where the NCCL ring reproduces itself
// bitwise run to run (always under --deterministic-mode; cuDNN's and the kernels' default
// backwards and the embedding's atomics may not) the copy-engine run must equal it bitwise, losses
// and every gradient; otherwise the first iteration's loss (forward only) must, and the gradients
// agree within the bf16 bound. Both are also compared with one GPU as above. The process-wide
// count of copy-engine exchanges proves which path ran: 2P per layer and micro-batch (P − 1
// forward, P + 1 backward) for the copy-engine runs, none for the NCCL ones. The cases cover
// flash and fused blocks, GQA and MHA, documents, four layers (the protocol's acknowledgements
// across layers, micro-batches and two iterations) and, under -np 4, a2a+p2p (2 x 2).
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdlib>
#include <cstring>
#include <map>

#include "comm/bootstrap.h"
#include "core/device.h"
#include "model/gpt_model.h"
#include "ops/cuda/cudnn_attention.h"
#include "ops/elementwise.h"
#include "ops/flash_attention.h"
#include "parallel/context_parallel.h"
#include "parallel/process_groups.h"
#include "testing/gpu_world.h"
#include "testing/testing.h"
#include "train/train_step.h"
#include "train/training_setup.h"

namespace mt {
namespace {

using testing::OwnedTensor;

constexpr int kIters = 2, kMicro = 2;
constexpr int64_t kSeq = 1024, kMb = 2, kVocab = 250;

struct Case {
  std::string type = "p2p";  // --cp-comm-type
  bool fused = true;         // --attention-backend fused (else flash)
  bool gqa = true;           // 16 heads in 4 query groups (else 4 heads, MHA)
  bool docs = false;         // --reset-attention-mask + --reset-position-ids
  float dropout = 0.f;       // --attention-dropout
  bool mla = false;          // --multi-latent-attention (with gqa false: MLA gives every head its keys)
  int64_t layers = 2;        // --num-layers
  bool deterministic = false;    // --deterministic-mode (the blocks then run on the kernels)
  std::vector<int> hierarchical; // --hierarchical-context-parallel-sizes (a2a+p2p)
  bool cudnn_blocks() const { return fused && type != "allgather" && !docs && dropout == 0.f && !deterministic; }
  std::string reference_key() const {
    return fmt::format("{}{}{}{}{}{}{}", fused, gqa, docs, dropout, mla, layers, deterministic);
  }
  std::string name() const {
    return fmt::format("{}_{}{}{}{}{}{}", type, fused ? "fused" : "flash", gqa ? "_gqa" : mla ? "_mla" : "_mha",
                       docs ? "_docs" : "", dropout > 0.f ? "_dropout" : "",
                       layers != 2 ? fmt::format("_{}layers", layers) : "", deterministic ? "_deterministic" : "");
  }
};

// A multi-latent attention case (causal, no dropout) of `type` on cuDNN (fused) or the kernels.
Case mla_case(const char* type, bool fused) {
  Case z{type, fused, false};
  z.mla = true;
  return z;
}

TransformerConfig config(const Case& z) {
  TransformerConfig c;
  c.num_layers = z.layers;
  c.deterministic_mode = z.deterministic;
  c.hierarchical_context_parallel_sizes = z.hierarchical;
  c.hidden_size = z.gqa || z.mla ? 1024 : 256;
  // head dim 64; GQA as the Llama-style 1.18B (4 queries per group); MLA: 8 heads of 192 (packed)
  c.num_attention_heads = z.gqa ? 16 : z.mla ? 8 : 4;
  c.num_query_groups = z.gqa ? 4 : 0;
  if (z.mla) {  // DeepSeek-V3's latents and head dims; YaRN x4 beyond 256 original positions
    c.multi_latent_attention = true;
    c.q_lora_rank = 512;
    c.kv_lora_rank = 512;
    c.qk_head_dim = 128;
    c.qk_pos_emb_head_dim = 64;
    c.v_head_dim = 128;
    c.rotary_scaling_factor = 4.f;
    c.original_max_position_embeddings = 256;
    c.mscale_all_dim = 1.f;
  }
  c.ffn_hidden_size = 2 * c.hidden_size;
  c.gated_linear_unit = true;
  c.normalization = Normalization::kRMSNorm;
  c.position_embedding_type = PositionEmbeddingType::kRope;
  c.untie_embeddings_and_output_weights = true;
  c.add_bias_linear = false;
  c.seq_length = kSeq;
  c.max_position_embeddings = kSeq;
  c.vocab_size = kVocab;
  c.make_vocab_size_divisible_by = 64;
  c.hidden_dropout = 0.f;
  c.attention_dropout = z.dropout;
  c.attention_backend = z.fused ? AttentionBackend::kFused : AttentionBackend::kFlash;
  c.cp_comm_type = z.type;
  return c;
}

struct Data {
  std::vector<int32_t> tokens, labels, positions;  // per micro-batch [S, mb]
  std::vector<int32_t> doc;                         // per micro-batch [mb, S]
};

Data make_data(bool docs) {
  Data d;
  const int64_t n = kMicro * kSeq * kMb;
  d.tokens = testing::randint(n, 0, kVocab);
  d.labels = testing::randint(n, 0, kVocab);
  d.positions.resize(static_cast<size_t>(n));
  d.doc.resize(static_cast<size_t>(n));
  for (int m = 0; m < kMicro; ++m)
    for (int64_t b = 0; b < kMb; ++b)
      for (int64_t i = 0; i < kSeq; ++i) {
        // documents of 300 + 77·b tokens (crossing the CP chunk boundaries), else one sequence
        const int32_t start = docs ? static_cast<int32_t>(i / (300 + 77 * b) * (300 + 77 * b)) : 0;
        d.doc[(m * kMb + b) * kSeq + i] = start;
        d.positions[(m * kSeq + i) * kMb + b] = static_cast<int32_t>(i) - start;
      }
  return d;
}

struct RunResult {
  std::vector<double> losses;
  std::map<std::string, std::vector<float>> grads;
  int64_t cudnn_executions = 0;
  int64_t ring_copy_engine_exchanges = 0;
};

// `world` of size CP (or one GPU): 2 iterations of the model on this rank's share of the data.
RunResult train(const std::shared_ptr<Communicator>& world, const Case& z, DType dtype, Device dev, const Data& D) {
  const int cp = world->size();
  const int64_t sl = kSeq / cp;
  ModelSetupOptions o;
  o.model = config(z);
  if (cp == 1) {  // the one-GPU reference: no CP levels
    o.model.cp_comm_type = "p2p";
    o.model.hierarchical_context_parallel_sizes.clear();
  }
  if (dtype == DType::kF32) o.model.attention_backend = AttentionBackend::kFlash;  // cuDNN has no fp32
  o.parallel.cp = cp;
  o.num_microbatches = kMicro;
  o.micro_batch_size = kMb;
  o.dtype = dtype;
  o.device = dev;
  o.optim.eps = 1e-5f;
  Stream st(dev);
  ModelSetup setup(world, o, st);
  GPTModel& model = setup.model();
  model.params().initialize(4321, st);
  const int r = setup.groups().cp->rank();
  std::vector<OwnedTensor> own;
  std::vector<MicroBatch> mbs;
  for (int m = 0; m < kMicro; ++m) {
    std::vector<int32_t> t(sl * kMb), l(sl * kMb), p(sl * kMb), ds(kMb * sl);
    const int64_t off = m * kSeq * kMb;
    cp_shard_rows(t.data(), D.tokens.data() + off, kSeq, kMb, cp, r);
    cp_shard_rows(l.data(), D.labels.data() + off, kSeq, kMb, cp, r);
    cp_shard_rows(p.data(), D.positions.data() + off, kSeq, kMb, cp, r);
    cp_shard_columns(ds.data(), D.doc.data() + off, kMb, kSeq, cp, r);
    own.push_back(testing::make_int_tensor(t, dev, {sl, kMb}, st));
    own.push_back(testing::make_int_tensor(l, dev, {sl, kMb}, st));
    own.push_back(testing::make_int_tensor(p, dev, {sl, kMb}, st));
    own.push_back(testing::make_int_tensor(ds, dev, {kMb, sl}, st));
  }
  for (int m = 0; m < kMicro; ++m) {
    MicroBatch b{own[4 * m].t, own[4 * m + 1].t, Tensor()};
    b.position_ids = own[4 * m + 2].t;
    if (z.docs) b.doc_start = own[4 * m + 3].t;
    b.loss_weight = 1.0f / static_cast<float>(kSeq * kMb * kMicro);  // the whole sequence's tokens
    mbs.push_back(b);
  }
  OwnedTensor loss(DType::kF32, dev, {1});
  RunResult res;
  st.synchronize();
  const int64_t before = cuda::cudnn_attention_executions(), ce_before = cp_ring_copy_engine_exchanges();
  for (int it = 0; it < kIters; ++it) {
    fill(loss, 0.f, st);
    train_step(model, setup.executor(), setup.train_plan(), setup.optimizer(), mbs, {99, it, 1e-3f, 0, 1}, loss, st);
    world->all_reduce(loss, ReduceOp::kSum, st);  // each CP rank's loss covers its tokens
    res.losses.push_back(testing::to_host(loss, st)[0]);
  }
  st.synchronize();
  res.cudnn_executions = cuda::cudnn_attention_executions() - before;
  res.ring_copy_engine_exchanges = cp_ring_copy_engine_exchanges() - ce_before;
  const ParamStore& P = model.params();
  for (size_t i = 0; i < P.size(); ++i) {
    if (P.info(i).shape.size() != 2) continue;  // weight matrices (norm weights: within "all")
    res.grads[P.info(i).name] = testing::to_host(P.grad(i), st);
  }
  return res;
}

double all_rel_err(const std::map<std::string, std::vector<float>>& a,
                   const std::map<std::string, std::vector<float>>& b) {
  std::vector<float> x, y;
  for (const auto& [name, g] : a) {
    x.insert(x.end(), g.begin(), g.end());
    y.insert(y.end(), b.at(name).begin(), b.at(name).end());
  }
  return testing::rel_err(x, y);
}

TEST(ContextParallelNccl, Bf16LayoutsMatchOneGpu) {
  MT_REQUIRE_CUDA();
  const testing::GpuWorld& w = testing::gpu_world({2, 4});
  if (!w.comm) {
    std::fprintf(stderr, "SKIPPED: cp_layouts_np2_cuda_dist_test: %s\n", w.skip.c_str());
    GTEST_SKIP() << w.skip;
  }
  const Device dev = w.dev;
  const std::shared_ptr<Communicator>& world = w.comm;
  const int cp = world->size();
  const bool cudnn = flash_attention_cudnn_available();
  const bool hopper = compute_capability(dev) >= 90;  // cuDNN's head dims above 128 (MLA's 192)
  if (!cudnn && world->rank() == 0) std::printf("NOTE: this build has no cuDNN: the fused cases run the kernels\n");
  std::vector<Case> cases;
  for (const char* type : {"p2p", "a2a"})
    for (bool fused : {false, true}) cases.push_back(Case{type, fused});  // flash first: fused is compared with it
  cases.push_back(Case{"allgather", true});
  cases.push_back(Case{"p2p", true, false});                 // MHA
  cases.push_back(Case{"a2a", true, false});
  cases.push_back(Case{"p2p", true, true, true});            // document masks: the kernels
  cases.push_back(Case{"a2a", true, true, true});
  cases.push_back(Case{"p2p", false, true, true});
  cases.push_back(Case{"p2p", true, true, false, 0.1f});     // attention dropout: the kernels
  cases.push_back(Case{"a2a", true, true, false, 0.1f});
  for (const char* type : {"p2p", "a2a"})  // multi-latent attention: flash first, fused compared with it
    for (bool fused : {false, true}) cases.push_back(mla_case(type, fused));
  const auto one = std::make_shared<SingleRankCommunicator>("one");
  std::map<std::string, Data> data;
  struct Reference {
    RunResult bf16, fp32;
    std::map<std::string, double> noise;
    double noise_all = 0;
  };
  std::map<std::string, Reference> refs;
  std::map<std::string, RunResult> cp_runs;  // by name: fused against flash
  for (const Case& z : cases) {
    const std::string dkey = fmt::format("{}{}", z.docs, z.gqa);
    if (!data.count(dkey)) {
      Data d = make_data(z.docs);
      for (auto* v : {&d.tokens, &d.labels})
        MPI_Bcast(v->data(), static_cast<int>(v->size()), MPI_INT32_T, 0, MPI_COMM_WORLD);
      data[dkey] = std::move(d);
    }
    const Data& D = data.at(dkey);
    if (!refs.count(z.reference_key())) {
      Reference ref;
      ref.bf16 = train(one, z, DType::kBF16, dev, D);
      ref.fp32 = train(one, z, DType::kF32, dev, D);
      for (const auto& [name, g] : ref.bf16.grads) ref.noise[name] = testing::rel_err(g, ref.fp32.grads.at(name));
      ref.noise_all = all_rel_err(ref.bf16.grads, ref.fp32.grads);
      refs[z.reference_key()] = std::move(ref);
    }
    const Reference& ref = refs.at(z.reference_key());
    const RunResult par = train(world, z, DType::kBF16, dev, D);
    const std::string name = fmt::format("cp{}_{}", cp, z.name());
    for (int it = 0; it < kIters; ++it)
      EXPECT_NEAR(par.losses[it], ref.bf16.losses[it], 2e-3 * ref.bf16.losses[it]) << name << " iteration " << it;
    for (const auto& [pname, g] : par.grads)
      EXPECT_LT(testing::rel_err(g, ref.bf16.grads.at(pname)), std::max(2e-2, 3 * ref.noise.at(pname)))
          << name << " grad " << pname << " (bf16 noise " << ref.noise.at(pname) << ")";
    const double eg = all_rel_err(par.grads, ref.bf16.grads);
    EXPECT_LT(eg, std::max(2e-2, 3 * ref.noise_all)) << name << " (bf16 noise " << ref.noise_all << ")";
    // Which path ran: every block of every ring step on cuDNN, or none.
    const int64_t steps = z.type == "p2p" ? cp : 1;
    const int64_t want = z.cudnn_blocks() && cudnn && (hopper || !z.mla) ? 2 * kIters * kMicro * 2 * steps : 0;
    EXPECT_EQ(par.cudnn_executions, want) << name;
    std::printf("[%s] rank %d: loss %.6f vs one GPU %.6f, all gradients rel err %.2e (bf16 noise %.2e), cuDNN "
                "executions %lld\n",
                name.c_str(), world->rank(), par.losses.back(), ref.bf16.losses.back(), eg, ref.noise_all,
                static_cast<long long>(par.cudnn_executions));
    cp_runs[z.name()] = par;
    if (z.fused && z.type != "allgather") {  // fused against the existing (flash) CP path, where run
      Case f = z;
      f.fused = false;
      if (cp_runs.count(f.name())) {
        const double e = all_rel_err(par.grads, cp_runs.at(f.name()).grads);
        EXPECT_LT(e, std::max(2e-2, 3 * ref.noise_all)) << name << " against the flash CP run";
      }
    }
  }
}

// MT_CP_RING=value while in scope (the CP region reads it at construction), then as before.
class RingEnv {
 public:
  explicit RingEnv(const char* value) {
    if (const char* v = std::getenv("MT_CP_RING")) old_ = v, had_ = true;
    setenv("MT_CP_RING", value, 1);
  }
  ~RingEnv() {
    if (had_) setenv("MT_CP_RING", old_.c_str(), 1);
    else unsetenv("MT_CP_RING");
  }

 private:
  std::string old_;
  bool had_ = false;
};

bool bitwise_equal(const RunResult& a, const RunResult& b, std::string* first_difference) {
  for (size_t i = 0; i < a.losses.size(); ++i)
    if (std::memcmp(&a.losses[i], &b.losses[i], sizeof(double)) != 0) {
      *first_difference = fmt::format("loss of iteration {}: {:.9g} vs {:.9g}", i, a.losses[i], b.losses[i]);
      return false;
    }
  for (const auto& [name, g] : a.grads) {
    const std::vector<float>& h = b.grads.at(name);
    if (g.size() != h.size() || std::memcmp(g.data(), h.data(), g.size() * sizeof(float)) != 0) {
      *first_difference = fmt::format("gradient {} (rel err {:.2e})", name, testing::rel_err(g, h));
      return false;
    }
  }
  return true;
}

TEST(ContextParallelNccl, CopyEngineRingMatchesNcclRing) {
  MT_REQUIRE_CUDA();
  const testing::GpuWorld& w = testing::gpu_world({2, 4});
  if (!w.comm) GTEST_SKIP() << w.skip;
  const Device dev = w.dev;
  const std::shared_ptr<Communicator>& world = w.comm;
  const int cp = world->size();
  std::vector<Case> cases;
  {
    Case z{"p2p", false, true, true};  // flash blocks, GQA, documents, deterministic, four layers
    z.deterministic = true;
    z.layers = 4;
    cases.push_back(z);
  }
  cases.push_back(Case{"p2p", true});          // cuDNN blocks, GQA
  cases.push_back(Case{"p2p", true, true, true});  // documents: the kernels' default backward
  {
    Case z{"p2p", false, false};  // MHA, flash, deterministic
    z.deterministic = true;
    cases.push_back(z);
  }
  if (cp == 4) {  // a2a+p2p: all-to-alls in pairs, the copy-engine ring across them
    Case z{"a2a+p2p", false, true, true};
    z.deterministic = true;
    z.hierarchical = {2, 2};
    cases.push_back(z);
    Case f{"a2a+p2p", true};
    f.hierarchical = {2, 2};
    cases.push_back(f);
  }
  const auto one = std::make_shared<SingleRankCommunicator>("one");
  for (const Case& z : cases) {
    Data D = make_data(z.docs);
    for (auto* v : {&D.tokens, &D.labels})
      MPI_Bcast(v->data(), static_cast<int>(v->size()), MPI_INT32_T, 0, MPI_COMM_WORLD);
    const RunResult ref = train(one, z, DType::kBF16, dev, D), ref32 = train(one, z, DType::kF32, dev, D);
    const double noise = all_rel_err(ref.grads, ref32.grads), bound = std::max(2e-2, 3 * noise);
    RunResult nccl[2], ce;
    for (RunResult& r : nccl) {
      RingEnv e("nccl");
      r = train(world, z, DType::kBF16, dev, D);
    }
    {
      RingEnv e("ce");
      ce = train(world, z, DType::kBF16, dev, D);
    }
    const std::string name = fmt::format("cp{}_{}{}_ce", cp, z.name(), z.hierarchical.empty() ? "" : "_2x2");
    const int p = z.hierarchical.empty() ? cp : z.hierarchical[1];
    const int64_t want = int64_t{kIters} * kMicro * z.layers * 2 * p;
    EXPECT_EQ(ce.ring_copy_engine_exchanges, want) << name << ": copy-engine exchanges (0: refused, see the log)";
    EXPECT_EQ(nccl[0].ring_copy_engine_exchanges, 0) << name;
    // Against one GPU, as the layouts above.
    for (int it = 0; it < kIters; ++it)
      EXPECT_NEAR(ce.losses[it], ref.losses[it], 2e-3 * ref.losses[it]) << name << " iteration " << it;
    const double eg = all_rel_err(ce.grads, ref.grads);
    EXPECT_LT(eg, bound) << name << " against one GPU (bf16 noise " << noise << ")";
    // Against the NCCL ring: bitwise where that reproduces itself.
    std::string diff;
    const bool reproducible = bitwise_equal(nccl[0], nccl[1], &diff);
    if (z.deterministic) EXPECT_TRUE(reproducible) << name << ": --deterministic-mode runs differ: " << diff;
    if (reproducible) {
      EXPECT_TRUE(bitwise_equal(ce, nccl[0], &diff)) << name << ": the copy-engine ring differs from NCCL's: " << diff;
    } else {
      std::printf("[%s] NOTE: the NCCL ring is not reproducible run to run (%s): compared within the bf16 bound\n",
                  name.c_str(), diff.c_str());
      EXPECT_EQ(std::memcmp(&ce.losses[0], &nccl[0].losses[0], sizeof(double)), 0)
          << name << ": first loss " << ce.losses[0] << " vs NCCL ring " << nccl[0].losses[0];
      EXPECT_LT(all_rel_err(ce.grads, nccl[0].grads), bound) << name << " against the NCCL ring";
    }
    std::printf("[%s] rank %d: loss %.6f vs NCCL ring %.6f vs one GPU %.6f, gradients rel err %.2e to one GPU, %s, "
                "%lld copy-engine exchanges\n",
                name.c_str(), world->rank(), ce.losses.back(), nccl[0].losses.back(), ref.losses.back(), eg,
                reproducible ? "bitwise checked" : "NCCL not reproducible",
                static_cast<long long>(ce.ring_copy_engine_exchanges));
  }
}

}  // namespace
}  // namespace mt
