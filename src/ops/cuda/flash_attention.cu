// CUDA implementation of ops/flash_attention.h: cuDNN's fused attention where
// FlashAttentionConfig::cudnn asks for it and it applies (ops/cuda/cudnn_attention.h), else the
// FlashAttention-2 kernels of ops/cuda/flash_attention_kernels.cuh with the causal mask policy
// (flash::CausalMask): qkv holds the queries, keys and values; out, lse and dqkv are overwritten.
#include "ops/cuda/cudnn_attention.h"
#include "ops/cuda/flash_attention_kernels.cuh"
#include "ops/flash_attention.h"

namespace mt::cuda {
namespace {

/// The kernels' view of one call: keys and values are the key/value heads of qkv (their rows
/// [s, b, g, qpg + 2, d]), lse is [b, n, s].
flash::Params make_params(const FlashAttentionConfig& cfg, const Tensor& qkv) {
  flash::Params p;
  p.q = qkv.data();
  p.kv = qkv.data();
  p.sq = p.sk = cfg.seq;
  p.B = cfg.batch;
  p.G = cfg.groups;
  p.qpg = cfg.queries_per_group;
  p.n = cfg.heads();
  p.d = cfg.head_dim;
  p.kv_heads = cfg.queries_per_group + 2;
  p.kv_first = cfg.queries_per_group;
  p.row_bh = cfg.seq;
  p.row_i = 1;
  p.scale = cfg.softmax_scale;
  p.scale_log2 = cfg.softmax_scale * flash::kLog2e;
  p.drop = flash_attention_dropout(cfg);
  p.doc = cfg.doc_start.empty() ? nullptr : cfg.doc_start.data_as<int32_t>();
  p.doc_stride = cfg.seq;
  return p;
}

}  // namespace

void flash_attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, const FlashAttentionConfig& cfg,
                             const Stream& stream) {
  if (cfg.cudnn && cudnn_attention_applies(cfg, qkv.dtype(), {qkv.data(), out.data()}) &&
      cudnn_attention_forward(out, lse, qkv, cfg, stream))
    return;
  flash::Params p = make_params(cfg, qkv);
  p.out = out.data();
  p.lse = lse.data_as<float>();
  flash::forward<flash::CausalMask>(p, qkv.dtype(), flash::mma_applies(p.d, {p.q, p.out}), cu(stream),
                                    "flash_attention_forward");
}

void flash_attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& out, const Tensor& lse,
                              const Tensor& qkv, const Tensor& workspace, const FlashAttentionConfig& cfg,
                              const Stream& stream) {
  if (cfg.cudnn && cudnn_attention_applies(cfg, qkv.dtype(), {qkv.data(), out.data(), dout.data(), dqkv.data()}) &&
      cudnn_attention_backward(dqkv, dout, out, lse, qkv, workspace, cfg, stream))
    return;
  flash::Params p = make_params(cfg, qkv);
  p.out = out.data();
  p.lse = lse.data_as<float>();
  p.dout = dout.data();
  p.dq = dqkv.data();
  p.dkv = dqkv.data();
  unsigned char* ws = static_cast<unsigned char*>(workspace.data());
  p.delta = reinterpret_cast<float*>(ws);
  p.dq_accum = reinterpret_cast<float*>(ws + flash_attention_dq_accum_offset(cfg));
  flash::backward<flash::CausalMask>(p, qkv.dtype(), flash::mma_applies(p.d, {p.q, p.out, p.dout, p.dq}),
                                     cfg.deterministic, cu(stream), "flash_attention_backward");
}

}  // namespace mt::cuda
