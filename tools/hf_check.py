#!/usr/bin/env python3
"""Hugging Face interchange check (issues 13 and 15): for GPT2LMHeadModel, LlamaForCausalLM,
Qwen2ForCausalLM, Qwen3ForCausalLM and the mixture-of-experts MixtralForCausalLM,
Qwen3MoeForCausalLM and Qwen2MoeForCausalLM, a small random model made here with transformers' save_pretrained is imported
with `megatron import-hf`; megatron.cpp's fp32 logits on fixed tokens (`megatron logits`) must
equal transformers' (relative error < 1e-4); the model exported back with `megatron export-hf`
(fp32, sharded) must load in transformers with the same logits.

usage: python3 tools/hf_check.py BUILD/megatron WORKDIR [--device cuda] [--moe-device cpu]
       [--only NAME ...]
Prints one line per model and exits non-zero on any mismatch. The MoE models run on
--moe-device (default cpu: megatron.cpp's MoE routing has no CUDA kernels yet).
"""
import argparse
import os
import subprocess
import sys

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM


def configs():
    """(label, architecture, config) of each model checked."""
    common = dict(vocab_size=1000, tie_word_embeddings=False)
    moe = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=128, rope_theta=1000000.0, num_experts_per_tok=2, **common)
    return [
        ("GPT2LMHeadModel", "GPT2LMHeadModel",
         transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=1000, n_inner=None,
                                 activation_function="gelu_new")),
        ("LlamaForCausalLM", "LlamaForCausalLM",
         transformers.LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=8,
                                  num_key_value_heads=2, max_position_embeddings=128, rope_theta=10000.0,
                                  rms_norm_eps=1e-5, **common)),
        ("Qwen2ForCausalLM", "Qwen2ForCausalLM",
         transformers.Qwen2Config(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=128, rope_theta=1000000.0,
                                  rms_norm_eps=1e-6, vocab_size=1000, tie_word_embeddings=True)),
        ("Qwen3ForCausalLM", "Qwen3ForCausalLM",
         transformers.Qwen3Config(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
                                  rope_theta=1000000.0, rms_norm_eps=1e-6, **common)),
        # 8 experts, top-2, renormalised (Megatron: softmax over the selected logits).
        ("MixtralForCausalLM", "MixtralForCausalLM",
         transformers.MixtralConfig(intermediate_size=96, num_local_experts=8, rms_norm_eps=1e-5, sliding_window=None,
                                    **moe)),
        # Layer 1 dense (mlp_only_layers), head dim 32 != h/n, QK-norm, renormalised top-k.
        ("Qwen3MoeForCausalLM", "Qwen3MoeForCausalLM",
         transformers.Qwen3MoeConfig(intermediate_size=160, moe_intermediate_size=48, num_experts=8, head_dim=32,
                                     norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
                                     rms_norm_eps=1e-6, **moe)),
        # norm_topk_prob=False (transformers' default): softmax over all experts, top-k, not
        # renormalised = Megatron's --moe-router-pre-softmax.
        ("Qwen3MoeForCausalLM-no-norm", "Qwen3MoeForCausalLM",
         transformers.Qwen3MoeConfig(intermediate_size=160, moe_intermediate_size=48, num_experts=8, head_dim=32,
                                     norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[],
                                     rms_norm_eps=1e-6, **moe)),
        # Qwen 2 MoE: QKV bias, no QK-norm, not renormalised (its default), layer 1 dense, and a
        # shared expert scaled by sigmoid(shared_expert_gate(x)) (--moe-shared-expert-gate).
        ("Qwen2MoeForCausalLM", "Qwen2MoeForCausalLM",
         transformers.Qwen2MoeConfig(intermediate_size=160, moe_intermediate_size=48, shared_expert_intermediate_size=96,
                                     num_experts=8, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[1],
                                     rms_norm_eps=1e-6, **moe)),
    ]


MOE = ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")


def randomize(model, gen):
    # Larger than the default init so that every path moves the logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name or name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("gate.weight") and p.dim() == 2:
                # MoE router: well separated logits, so that no top-k choice hangs on rounding.
                p.copy_(1.0 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))


def rel(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def run(cmd):
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        print(r.stdout)
        raise SystemExit(f"command failed ({r.returncode}): {' '.join(cmd)}")
    return r.stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("megatron")
    ap.add_argument("workdir")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--moe-device", default="cpu", help="device of `megatron logits` for the MoE models")
    ap.add_argument("--only", nargs="*", help="labels of the models to check (default: all)")
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    gen = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, 1000, (1, 24), generator=gen)
    failures = 0
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    for label, arch, cfg in configs():
        if args.only and label not in args.only:
            continue
        cfg.architectures = [arch]
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32).eval()
        randomize(model, gen)
        model.tie_weights()
        hf_dir = os.path.join(args.workdir, label)
        model.save_pretrained(hf_dir, safe_serialization=True)
        with torch.no_grad():
            ref = model(tokens).logits[0].float().numpy()
        ck = os.path.join(args.workdir, label + "_ckpt")
        run([args.megatron, "import-hf", "--hf-dir", hf_dir, "--save", ck])
        out = os.path.join(args.workdir, label + "_logits.bin")
        run([args.megatron, "logits", "--load", ck, "--token-ids", " ".join(map(str, tokens[0].tolist())),
             "--output", out, "--device", args.moe_device if arch in MOE else args.device])
        ours = np.fromfile(out, dtype=np.float32).reshape(ref.shape)
        e_import = rel(ours, ref)
        exp_dir = os.path.join(args.workdir, label + "_export")
        run([args.megatron, "export-hf", "--load", ck, "--hf-dir", exp_dir, "--hf-dtype", "fp32",
             "--max-shard-size", "200000"])
        back = AutoModelForCausalLM.from_pretrained(exp_dir, torch_dtype=torch.float32).eval()
        with torch.no_grad():
            again = back(tokens).logits[0].float().numpy()
        e_export = rel(again, ref)
        ok = e_import < 1e-4 and e_export < 1e-6
        failures += 0 if ok else 1
        shards = len([f for f in os.listdir(exp_dir) if f.endswith(".safetensors")])
        print(f"{label:27s} import: megatron.cpp vs transformers logits rel {e_import:.2e} | export ({shards} shards) "
              f"loaded by transformers: rel {e_export:.2e} | {'OK' if ok else 'FAIL'}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
