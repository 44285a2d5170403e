#!/usr/bin/env python3
"""The reference of bench/deepseek_v3.sh: transformers' own DeepseekV3ForCausalLM trained as its users
run it, on the GPU, beside megatron.cpp in the same device session (issue 43; docs/benchmarks.md
"DeepSeek-V3-shaped MoE").

Model: a DeepseekV3Config built here with the values of bench/deepseek_v3.sh's flags (printed as the
"config" line): vocabulary 50304 (megatron.cpp pads GPT-2's 50257 to it), untied, RMSNorm eps 1e-5,
MLA without a query latent (q_lora_rank None), kv_lora_rank, qk_nope_head_dim = --qk-head-dim,
qk_rope_head_dim = --qk-pos-emb-head-dim, v_head_dim, RoPE theta 10000 without scaling on
interleaved pairs (rope_interleave, as --rope-type rope), layer 0 dense (first_k_dense_replace 1,
intermediate_size = --ffn-hidden-size), the others n_routed_experts experts top-k with one shared
expert of moe_intermediate_size, sigmoid scores + e_score_correction_bias, n_group 4 / topk_group 2,
normalised top-k probabilities times routed_scaling_factor 2.5. transformers has no MTP (it drops
DeepSeek's MTP layer), so this trains WITHOUT MTP: compare it with megatron.cpp's no-MTP row. It has
no expert-bias update either (the bias stays 0), nor an auxiliary loss (megatron.cpp's runs have none).
Weights: transformers' own initialisation (normal, std 0.02), not megatron.cpp's: the losses are
comparable in trend only.

Training: fp32 parameters, bf16 autocast, torch.compile (default mode) of the forward + cross
entropy, AdamW (fused, lr 3e-4 constant after a 10-step linear warm-up, weight decay 0.1, betas
0.9/0.95 as ours), gradient clipping 1.0, global batch = micro-batch x accumulation steps as ours.
torch.compile is given --compile-budget-s seconds for its warm-up steps. If the whole model fails or
runs over (transformers' MoE block, with its data-dependent expert counts, does not compile as a
whole), the run compiles by region instead, in what is left of the budget: every decoder layer's attention
and norms, the dense layers' MLP and the MoE layers' shared expert, and the final norm (nn.Module.compile
of each), the routed experts and the router eager; if that fails too, eager. The "compile" lines
say which; the result line ends in "compiled", "regional" or "eager".
transformers' MoE block is its own expert implementation (a Python loop over the experts hit, or
what the installed version's default is): the reference as users run it.

Tokens: the demo data's .bin/.idx (Megatron's MMIDIDX format, read with numpy): the token stream of
the first 98% of the documents (the training split of --split 98,2,0) cut into consecutive windows
of seq + 1 tokens, in order. megatron.cpp trains on Megatron's shuffled samples of the same
documents: the same data, not the same order.

Prints "step N loss L ms T" per step, then
  reference: <median ms/step> ms/step, <tok/s> tok/s, peak mem <GiB> GiB, loss <first> -> <last>, <compiled|regional|eager>
(the median over the steps after --warmup). Exit status 1 on failure.

usage: python3 bench/hf_deepseek_train.py --data data/demo_text_document [--layers 16 --hidden 2048 ...]
"""
import argparse
import math
import signal
import struct
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
import transformers

MMIDIDX_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
                  8: np.uint16}


def read_tokens(prefix, split_fraction=0.98):
    """The tokens of the first split_fraction of the documents of a Megatron indexed dataset."""
    with open(prefix + ".idx", "rb") as f:
        magic = f.read(9)
        if magic != b"MMIDIDX\x00\x00":
            raise SystemExit(f"{prefix}.idx: not a Megatron indexed dataset (magic {magic!r})")
        (version,) = struct.unpack("<Q", f.read(8))
        (code,) = struct.unpack("<B", f.read(1))
        (n_seq,) = struct.unpack("<Q", f.read(8))
        (n_doc,) = struct.unpack("<Q", f.read(8))
        sizes = np.frombuffer(f.read(4 * n_seq), dtype=np.int32)
        pointers = np.frombuffer(f.read(8 * n_seq), dtype=np.int64)
        doc_idx = np.frombuffer(f.read(8 * n_doc), dtype=np.int64)
    dtype = MMIDIDX_DTYPES[code]
    tokens = np.memmap(prefix + ".bin", dtype=dtype, mode="r")
    docs = len(doc_idx) - 1
    last_seq = int(doc_idx[max(1, int(round(docs * split_fraction)))])  # sequences of the training documents
    end = (int(pointers[last_seq - 1]) // np.dtype(dtype).itemsize + int(sizes[last_seq - 1])) if last_seq > 0 else 0
    print(f"data: {prefix} (version {version}, {n_seq} sequences, {docs} documents): {end} training tokens")
    return np.asarray(tokens[:end], dtype=np.int64)


def make_config(a):
    c = dict(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn, moe_intermediate_size=a.moe_ffn,
             num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.heads,
             n_shared_experts=1, n_routed_experts=a.experts, routed_scaling_factor=2.5, kv_lora_rank=a.kv_lora,
             q_lora_rank=None, qk_rope_head_dim=a.qk_pos, v_head_dim=a.v_head, qk_nope_head_dim=a.qk_head,
             n_group=4, topk_group=2, num_experts_per_tok=a.topk, first_k_dense_replace=1, norm_topk_prob=True,
             max_position_embeddings=a.seq, rms_norm_eps=1e-5, tie_word_embeddings=False, rope_interleave=True,
             attention_bias=False, attention_dropout=0.0, initializer_range=0.02, use_cache=False,
             rope_parameters=dict(rope_type="default", rope_theta=10000.0))
    if int(transformers.__version__.split(".")[0]) < 5:  # transformers 4: rope_theta + rope_scaling
        c["rope_theta"] = c.pop("rope_parameters")["rope_theta"]
        c["rope_scaling"] = None
    return transformers.DeepseekV3Config(**c)


class CompileBudget(Exception):
    pass


def main():
    ap = argparse.ArgumentParser()
    for name, default in (("layers", 16), ("hidden", 2048), ("heads", 16), ("ffn", 8192), ("moe-ffn", 512),
                          ("experts", 64), ("topk", 6), ("kv-lora", 512), ("qk-head", 128), ("qk-pos", 64),
                          ("v-head", 128), ("seq", 4096), ("micro-batch-size", 1), ("global-batch-size", 8),
                          ("vocab", 50304), ("steps", 30), ("warmup", 5)):
        ap.add_argument("--" + name, type=int, default=default)
    ap.add_argument("--data", required=True, help="the indexed dataset's prefix (data/demo_text_document)")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--no-compile", action="store_true", help="eager from the start")
    ap.add_argument("--compile", choices=("auto", "regional"), default="auto",
                    help="auto: the whole model first, then by region; regional: by region from the start (the "
                         "whole model does not compile with transformers 5.17's grouped_mm experts)")
    ap.add_argument("--compile-budget-s", type=float, default=150.0,
                    help="seconds torch.compile may take for the warm-up steps before the run falls back to eager")
    a = ap.parse_args()
    if a.global_batch_size % a.micro_batch_size:
        raise SystemExit(f"--global-batch-size {a.global_batch_size} is not a multiple of --micro-batch-size "
                         f"{a.micro_batch_size}")
    accum = a.global_batch_size // a.micro_batch_size
    torch.manual_seed(1234)
    torch.backends.cuda.matmul.allow_tf32 = True
    dev = "cuda"
    cfg = make_config(a)
    print(f"config: transformers {transformers.__version__}, torch {torch.__version__}; {a.layers} layers, hidden {a.hidden}, "
          f"{a.heads} heads, MLA kv-lora {a.kv_lora} qk {a.qk_head}+{a.qk_pos} v {a.v_head}, dense ffn {a.ffn}, "
          f"{a.experts} experts top-{a.topk} (4 groups, top-2) + 1 shared, moe ffn {a.moe_ffn}, seq {a.seq}, "
          f"micro-batch {a.micro_batch_size}, global batch {a.global_batch_size}")
    print("note: transformers' DeepseekV3ForCausalLM has no MTP layer: the reference trains without MTP "
          "(compare with megatron.cpp's no-MTP row)")
    tokens = torch.from_numpy(read_tokens(a.data))
    window = a.seq + 1
    need = a.steps * a.global_batch_size
    n_windows = len(tokens) // window
    if n_windows < need:
        print(f"note: {n_windows} windows of {window} tokens for {need} samples: the stream repeats")
    with torch.device(dev):
        model = transformers.DeepseekV3ForCausalLM(cfg)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    mc = model.config
    print(f"parameters: {n_params / 1e9:.3f} B (fp32); attention implementation "
          f"{getattr(mc, '_attn_implementation', None) or 'default'}, experts implementation "
          f"{getattr(mc, '_experts_implementation', None) or 'default'}")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)

    def forward_loss(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=x).logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))

    compiled = not a.no_compile
    whole = compiled and a.compile == "auto"
    step_fn = torch.compile(forward_loss) if whole else forward_loss
    mode = "compiled" if compiled else "eager"

    def regions():
        # the modules regional compilation compiles: attention and norms of every layer, the dense
        # MLPs and the shared experts, the final norm (the routed experts and the router stay eager)
        out = [model.model.norm]
        for layer in model.model.layers:
            out += [layer.self_attn, layer.input_layernorm, layer.post_attention_layernorm]
            mlp = layer.mlp
            if hasattr(mlp, "experts"):
                if getattr(mlp, "shared_experts", None) is not None:
                    out.append(mlp.shared_experts)
            else:
                out.append(mlp)
        return out

    def batch(step, micro):
        rows = []
        for r in range(a.micro_batch_size):
            w = ((step * accum + micro) * a.micro_batch_size + r) % n_windows
            rows.append(tokens[w * window:(w + 1) * window])
        b = torch.stack(rows).to(dev, non_blocking=True)
        return b[:, :-1].contiguous(), b[:, 1:].contiguous()

    def train_step(step):
        for g in opt.param_groups:
            g["lr"] = a.lr * min(1.0, (step + 1) / 10)
        total = torch.zeros((), device=dev)
        for micro in range(accum):
            x, y = batch(step, micro)
            loss = step_fn(x, y) / accum
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    def on_alarm(signum, frame):
        raise CompileBudget()

    times, losses = [], []
    step = 0

    def warm_up(what, budget_s):
        # the warm-up steps (those not yet run) under the compile budget; True when they ran, else the
        # caller falls back (steps that ran count: the model and optimizer have taken them)
        nonlocal step
        signal.signal(signal.SIGALRM, on_alarm)
        signal.alarm(max(1, int(budget_s)))
        t0 = time.perf_counter()
        try:
            while step < max(1, min(a.warmup, a.steps)):
                torch.cuda.synchronize()
                t1 = time.perf_counter()
                losses.append(float(train_step(step)))
                torch.cuda.synchronize()
                print(f"step {step + 1} loss {losses[-1]:.4f} ms {(time.perf_counter() - t1) * 1e3:.1f}", flush=True)
                step += 1
            signal.alarm(0)
            print(f"compile: {what} warm-up ({step} steps) took {time.perf_counter() - t0:.1f} s")
            return True
        except Exception as e:  # noqa: BLE001 - any compile failure falls back
            signal.alarm(0)
            why = f"over its budget of {budget_s:.0f} s" if isinstance(e, CompileBudget) else \
                f"failed ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})"
            print(f"compile: {what} {why} after {time.perf_counter() - t0:.1f} s")
            torch._dynamo.reset()
            opt.zero_grad(set_to_none=True)
            return False

    t_compile = time.perf_counter()
    if compiled and not (whole and warm_up("torch.compile of the whole model", a.compile_budget_s)):
        step_fn = forward_loss
        compiled_regions = regions()
        for m in compiled_regions:
            m.compile()
        mode = "regional"
        print(f"compile: trying regional compilation ({len(compiled_regions)} modules: attention, norms, dense MLPs, "
              "shared experts; the routed experts and the router eager)")
        left = a.compile_budget_s - (time.perf_counter() - t_compile)  # the two attempts share the budget
        if left < 10 or not warm_up("regional torch.compile", left):
            for m in compiled_regions:
                m._compiled_call_impl = None  # nn.Module.compile's hook: back to the eager forward
            mode = "eager"
            print("compile: FALLING BACK TO EAGER")
    while step < a.steps:
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        losses.append(float(train_step(step)))
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t1) * 1e3
        print(f"step {step + 1} loss {losses[-1]:.4f} ms {ms:.1f}", flush=True)
        if step >= a.warmup:
            times.append(ms)
        step += 1
    if not times:
        raise SystemExit("FAIL: no timed steps (--steps must exceed --warmup)")
    if not all(math.isfinite(x) for x in losses):
        raise SystemExit(f"FAIL: non-finite loss {losses}")
    med = sorted(times)[len(times) // 2]
    tok = a.global_batch_size * a.seq / (med / 1e3)
    print("step times ms: " + " ".join(f"{t:.1f}" for t in times))
    print(f"reference: {med:.1f} ms/step, {tok:.0f} tok/s, peak mem {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB, "
          f"loss {losses[0]:.4f} -> {losses[-1]:.4f}, {mode}")
    sys.exit(0)


if __name__ == "__main__":
    main()
