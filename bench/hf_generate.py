#!/usr/bin/env python3
"""Hugging Face transformers side of bench/generate_hf.sh: greedy generate tokens/s for a GPT-2
model directory at the given batch sizes (same prompt in every row, exactly --new-tokens new
tokens, KV cache on), after one warm-up call. Also writes the model with --make-random DIR (GPT-2
124M, random weights, seed 0) when no pretrained copy is available offline."""
import argparse
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--vocab", required=True, help="GPT-2 encoder.json")
    ap.add_argument("--merges", required=True, help="GPT-2 vocab.bpe")
    ap.add_argument("--make-random", action="store_true")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt", default="The quick brown fox jumps over the lazy dog. In the beginning")
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args()
    tok = GPT2TokenizerFast(vocab_file=a.vocab, merges_file=a.merges)
    if a.make_random:
        torch.manual_seed(0)
        GPT2LMHeadModel(GPT2Config()).save_pretrained(a.model, safe_serialization=True)
        tok.save_pretrained(a.model)
        print(f"wrote a random GPT-2 124M to {a.model}")
        return
    dt = getattr(torch, a.dtype)
    model = GPT2LMHeadModel.from_pretrained(a.model, torch_dtype=dt).cuda().eval()
    # Token ids from the GPT-2 BPE files through the tokenizers library (GPT2TokenizerFast built from
    # vocab/merges files returned no ids with transformers 5.17).
    from tokenizers import Tokenizer, models, pre_tokenizers
    bpe = Tokenizer(models.BPE.from_file(a.vocab, a.merges))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    prompt_ids = bpe.encode(a.prompt).ids
    assert prompt_ids, "the prompt encoded to no tokens"
    for b in a.batch:
        ids = torch.tensor([prompt_ids] * b, dtype=torch.long).cuda()
        kw = dict(max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, do_sample=False, use_cache=True,
                  pad_token_id=tok.eos_token_id)
        with torch.no_grad():
            model.generate(ids, **kw)  # warm-up
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = model.generate(ids, **kw)
            torch.cuda.synchronize()
            dt_s = time.perf_counter() - t
        new = (out.shape[1] - ids.shape[1]) * b
        print(f"hf batch {b}: {new} tokens in {dt_s:.3f} s: {new / dt_s:.1f} tokens/s ({a.dtype})")


if __name__ == "__main__":
    main()
