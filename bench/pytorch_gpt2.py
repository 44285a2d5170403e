#!/usr/bin/env python3
"""PyTorch reference for bench/: the same architectures as megatron.cpp, bf16 autocast, fused
AdamW, SDPA flash attention, optional torch.compile. Trains on random tokens and prints
ms/step and tokens/s (median over the timed steps), for side-by-side runs with
`megatron pretrain` in one device session.
  --arch gpt2 (default): pre-LN, learned positions, tied embedding, biases, GELU-tanh MLP,
      vocab padded to 50304.
  --arch llama: RMSNorm, RoPE (rotate-half), SwiGLU (--ffn), grouped-query attention
      (--kv-heads), untied output layer, no biases.
  --experts E (llama only): every MLP is a mixture of experts as Megatron-Core's MoELayer with
      --topk (softmax over the selected logits), SwiGLU experts of --moe-ffn, the switch
      load-balancing loss (--aux-loss-coeff); the experts run as two grouped GEMMs
      (torch._grouped_mm over the expert-sorted tokens) when torch has it, else a loop over experts.

usage: python3 bench/pytorch_gpt2.py --micro-batch-size 16 --steps 30 [--compile] [--layers 12 --hidden 768 --heads 12]
       python3 bench/pytorch_gpt2.py --arch llama --layers 16 --hidden 2048 --heads 32 --kv-heads 8 --ffn 8192 ...
"""
import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def cross_entropy(logits, targets, loss_vocab):
    """fp32 cross entropy over the first loss_vocab columns (0: all): the padded vocabulary rows
    are outside the softmax, as in Megatron. They are masked with -inf rather than sliced off, so
    that the row width stays the aligned padded one (a slice to 50257 columns costs the compiled
    cross entropy ~1.5 ms per GPT-2 step on an H100)."""
    logits = logits.float()
    if loss_vocab and loss_vocab < logits.shape[-1]:
        mask = torch.zeros(logits.shape[-1], device=logits.device)
        mask[loss_vocab:] = float("-inf")
        logits = logits + mask
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.view(-1))


class Block(nn.Module):
    def __init__(self, h, n):
        super().__init__()
        self.n = n
        self.ln1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.ln2 = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, 4 * h)
        self.fc2 = nn.Linear(4 * h, h)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, self.n, 3, h // self.n).permute(3, 0, 2, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, layers, h, n, seq, vocab):
        super().__init__()
        self.wte = nn.Embedding(vocab, h)
        self.wpe = nn.Embedding(seq, h)
        self.blocks = nn.ModuleList([Block(h, n) for _ in range(layers)])
        self.lnf = nn.LayerNorm(h)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        logits = self.lnf(x) @ self.wte.weight.t()
        return cross_entropy(logits, targets, self.loss_vocab)


GROUPED_MM = hasattr(torch, "_grouped_mm")


class MoE(nn.Module):
    """Megatron-Core MoELayer (TopKRouter softmax after top-k, dropless) with SwiGLU experts."""

    def __init__(self, h, experts, topk, f, aux_coeff):
        super().__init__()
        self.e, self.k, self.f, self.aux_coeff = experts, topk, f, aux_coeff
        self.router = nn.Linear(h, experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(experts, 2 * f, h))
        self.w2 = nn.Parameter(torch.empty(experts, h, f))
        self.aux = None

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        T = x.shape[0]
        logits = self.router(x).float()
        topv, topi = logits.topk(self.k, dim=-1)
        probs = topv.softmax(dim=-1)
        flat = topi.flatten()
        counts = torch.bincount(flat, minlength=self.e)
        scores = logits.softmax(dim=-1)
        self.aux = self.aux_coeff * self.e / (self.k * T * T) * (scores.sum(0) * counts.float()).sum()
        order = flat.argsort(stable=True)
        token = order // self.k
        xs = x[token]
        if GROUPED_MM:  # bf16 operands (the norm's output is fp32 under autocast)
            xs = xs.to(torch.bfloat16)
            offs = counts.cumsum(0).to(torch.int32)
            h1 = torch._grouped_mm(xs, self.w1.to(xs.dtype).transpose(-2, -1), offs=offs)
            gate, up = h1.chunk(2, dim=-1)
            out = torch._grouped_mm(F.silu(gate) * up, self.w2.to(xs.dtype).transpose(-2, -1), offs=offs)
        else:
            outs, start = [], 0
            for e, n in enumerate(counts.tolist()):
                gate, up = (xs[start:start + n] @ self.w1[e].t()).chunk(2, dim=-1)
                outs.append((F.silu(gate) * up) @ self.w2[e].t())
                start += n
            out = torch.cat(outs)
        w = probs.flatten()[order].unsqueeze(-1).to(out.dtype)
        y = torch.zeros_like(x).index_add_(0, token, (out * w).to(x.dtype))
        return y.view(shape)


class LlamaBlock(nn.Module):
    def __init__(self, h, n, g, f, moe=None):
        super().__init__()
        self.n, self.g, self.d = n, g, h // n
        self.ln1 = nn.RMSNorm(h, eps=1e-5)
        self.qkv = nn.Linear(h, (n + 2 * g) * self.d, bias=False)
        self.proj = nn.Linear(n * self.d, h, bias=False)
        self.ln2 = nn.RMSNorm(h, eps=1e-5)
        self.moe = moe
        if moe is None:
            self.fc1 = nn.Linear(h, 2 * f, bias=False)
            self.fc2 = nn.Linear(f, h, bias=False)

    def forward(self, x, cos, sin):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split([self.n * self.d, self.g * self.d, self.g * self.d], dim=-1)
        q = q.view(b, s, self.n, self.d).transpose(1, 2)
        k = k.view(b, s, self.g, self.d).transpose(1, 2)
        v = v.view(b, s, self.g, self.d).transpose(1, 2)

        def rot(t):
            t1, t2 = t.chunk(2, dim=-1)
            return t * cos + torch.cat((-t2, t1), dim=-1) * sin

        a = F.scaled_dot_product_attention(rot(q), rot(k), v, is_causal=True, enable_gqa=self.g != self.n)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, self.n * self.d))
        if self.moe is not None:
            return x + self.moe(self.ln2(x))
        gate, up = self.fc1(self.ln2(x)).chunk(2, dim=-1)
        return x + self.fc2(F.silu(gate) * up)


class Llama(nn.Module):
    def __init__(self, layers, h, n, g, f, seq, vocab, theta=10000.0, moe=None):
        super().__init__()
        self.wte = nn.Embedding(vocab, h)
        self.blocks = nn.ModuleList([LlamaBlock(h, n, g, f, MoE(h, *moe) if moe else None) for _ in range(layers)])
        self.lnf = nn.RMSNorm(h, eps=1e-5)
        self.out = nn.Linear(h, vocab, bias=False)
        d = h // n
        inv = 1.0 / (theta ** (torch.arange(0, d, 2).float() / d))
        ang = torch.outer(torch.arange(seq).float(), inv)
        emb = torch.cat((ang, ang), dim=-1)
        self.register_buffer("cos", emb.cos()[None, None], persistent=False)
        self.register_buffer("sin", emb.sin()[None, None], persistent=False)
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx, targets):
        x = self.wte(idx)
        for blk in self.blocks:
            x = blk(x, self.cos, self.sin)
        logits = self.out(self.lnf(x))
        loss = cross_entropy(logits, targets, self.loss_vocab)
        for blk in self.blocks:
            if blk.moe is not None:
                loss = loss + blk.moe.aux
        return loss


def load_hf_gpt2(model, path):
    """Copies HF GPT-2 weights (Conv1D [in, out] matrices, c_attn columns q | k | v) into GPT, whose
    qkv rows are per head (q, k, v) as Megatron's; the vocabulary rows beyond the checkpoint's stay 0
    (megatron.cpp's padding rows are 0 and outside the softmax: the reference's vocabulary must then
    be the real one, --vocab 50257)."""
    import os
    from safetensors.torch import load_file
    sd = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            sd.update(load_file(os.path.join(path, f)))
    pre = "transformer." if "transformer.wte.weight" in sd else ""
    get = lambda k: sd[pre + k].float()
    h = model.wte.weight.shape[1]
    with torch.no_grad():
        model.wte.weight.zero_()
        w = get("wte.weight")
        model.wte.weight[:w.shape[0]].copy_(w)
        model.wpe.weight.copy_(get("wpe.weight")[:model.wpe.weight.shape[0]])
        model.lnf.weight.copy_(get("ln_f.weight"))
        model.lnf.bias.copy_(get("ln_f.bias"))
        for i, blk in enumerate(model.blocks):
            s = f"h.{i}."
            n = blk.n
            d = h // n
            w = get(s + "attn.c_attn.weight").t().reshape(3, n, d, h).permute(1, 0, 2, 3).reshape(3 * h, h)
            b = get(s + "attn.c_attn.bias").reshape(3, n, d).permute(1, 0, 2).reshape(3 * h)
            blk.qkv.weight.copy_(w)
            blk.qkv.bias.copy_(b)
            blk.proj.weight.copy_(get(s + "attn.c_proj.weight").t())
            blk.proj.bias.copy_(get(s + "attn.c_proj.bias"))
            blk.ln1.weight.copy_(get(s + "ln_1.weight"))
            blk.ln1.bias.copy_(get(s + "ln_1.bias"))
            blk.ln2.weight.copy_(get(s + "ln_2.weight"))
            blk.ln2.bias.copy_(get(s + "ln_2.bias"))
            blk.fc1.weight.copy_(get(s + "mlp.c_fc.weight").t())
            blk.fc1.bias.copy_(get(s + "mlp.c_fc.bias"))
            blk.fc2.weight.copy_(get(s + "mlp.c_proj.weight").t())
            blk.fc2.bias.copy_(get(s + "mlp.c_proj.bias"))


def load_hf_llama(model, path):
    """Copies HF LlamaForCausalLM weights (as `megatron export-hf` writes them) into Llama: the
    fused qkv rows are q | k | v, fc1's rows gate | up; vocabulary rows beyond the checkpoint's
    stay 0."""
    import os
    from safetensors.torch import load_file
    sd = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            sd.update(load_file(os.path.join(path, f)))
    get = lambda k: sd[k].float()
    with torch.no_grad():
        for dst, key in ((model.wte.weight, "model.embed_tokens.weight"), (model.out.weight, "lm_head.weight")):
            w = get(key)
            dst.zero_()
            dst[:w.shape[0]].copy_(w)
        model.lnf.weight.copy_(get("model.norm.weight"))
        for i, blk in enumerate(model.blocks):
            s = f"model.layers.{i}."
            blk.qkv.weight.copy_(torch.cat([get(s + f"self_attn.{p}_proj.weight") for p in "qkv"]))
            blk.proj.weight.copy_(get(s + "self_attn.o_proj.weight"))
            blk.ln1.weight.copy_(get(s + "input_layernorm.weight"))
            blk.ln2.weight.copy_(get(s + "post_attention_layernorm.weight"))
            blk.fc1.weight.copy_(torch.cat([get(s + "mlp.gate_proj.weight"), get(s + "mlp.up_proj.weight")]))
            blk.fc2.weight.copy_(get(s + "mlp.down_proj.weight"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--micro-batch-size", type=int, default=16)
    ap.add_argument("--seq-length", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--arch", choices=["gpt2", "llama"], default="gpt2")
    ap.add_argument("--kv-heads", type=int, default=0, help="llama: key/value heads (0 = heads)")
    ap.add_argument("--ffn", type=int, default=0, help="llama: SwiGLU hidden size (0 = 4h)")
    ap.add_argument("--experts", type=int, default=0, help="llama: experts per MoE layer (0 = dense)")
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--moe-ffn", type=int, default=0, help="expert SwiGLU hidden size (0 = --ffn)")
    ap.add_argument("--aux-loss-coeff", type=float, default=1e-2)
    ap.add_argument("--grad-accum", type=int, default=1,
                    help="micro-batches accumulated per optimizer step (global batch = grad-accum x micro-batch)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--init-hf", default="",
                    help="gpt2: start from these weights (a `megatron export-hf` directory, HF GPT-2 names)")
    ap.add_argument("--samples", default="",
                    help="train on these int32 [n, seq + 1] samples in order (bench/train_samples_bench) instead "
                         "of random tokens, with Megatron's optimizer settings (--lr constant, weight decay 0.1 on "
                         "the matrices only, clip 1.0), and print every step's loss")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--loss-vocab", type=int, default=0,
                    help="cross entropy over the first N vocabulary columns only (the real vocabulary; 0 = all)")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--compile-mode", default="default",
                    help="torch.compile mode: default, or reduce-overhead (CUDA graphs of the compiled regions)")
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    dev = "cuda"
    if a.arch == "llama":
        moe = (a.experts, a.topk, a.moe_ffn or a.ffn or 4 * a.hidden, a.aux_loss_coeff) if a.experts else None
        model = Llama(a.layers, a.hidden, a.heads, a.kv_heads or a.heads, a.ffn or 4 * a.hidden, a.seq_length,
                      a.vocab, moe=moe).to(dev)
    else:
        model = GPT(a.layers, a.hidden, a.heads, a.seq_length, a.vocab).to(dev)
    model.loss_vocab = a.loss_vocab
    samples = None
    if a.init_hf:
        (load_hf_llama if a.arch == "llama" else load_hf_gpt2)(model, a.init_hf)
    if a.samples:
        import numpy as np
        samples = torch.from_numpy(np.fromfile(a.samples, dtype=np.int32).reshape(-1, a.seq_length + 1)).long().to(dev)
        # Megatron: no weight decay on biases and 1-D parameters (norms)
        groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
                  {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
        opt = torch.optim.AdamW(groups, lr=a.lr, betas=(0.9, 0.999), eps=1e-8, fused=True)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.1, fused=True)
    step_fn = model
    if a.compile:
        step_fn = torch.compile(model, mode=a.compile_mode)
    B, S, G = a.micro_batch_size, a.seq_length, a.grad_accum
    times = []
    for i in range(a.warmup + a.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step_loss = 0.0
        for k in range(G):  # Megatron's loss: the mean over the step's micro-batches
            j = i * G + k
            if samples is not None:
                batch = samples[j * B:(j + 1) * B]
                x, y = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
            else:
                x = torch.randint(0, 50257, (B, S), device=dev)
                y = torch.randint(0, 50257, (B, S), device=dev)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = step_fn(x, y) / G
            loss.backward()
            step_loss = step_loss + loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if samples is not None:
            print(f"step {i + 1} loss {float(step_loss):.6f}")
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
    print("step times ms: " + " ".join(f"{t * 1e3:.2f}" for t in times))
    times.sort()
    med = times[len(times) // 2]
    moe = f" experts={a.experts} topk={a.topk} grouped_mm={GROUPED_MM}" if a.experts else ""
    print(f"pytorch {a.arch} layers={a.layers} hidden={a.hidden}{moe} mb={B} seq={S} compile={a.compile}"
          f"{'/' + a.compile_mode if a.compile else ''}: "
          f" grad_accum={G}: {med*1e3:.1f} ms/step, {G*B*S/med:.0f} tok/s, peak mem {torch.cuda.max_memory_allocated()/2**30:.1f} GiB")


if __name__ == "__main__":
    main()
