#!/usr/bin/env python3
"""PyTorch reference for bench/flash_attention_bench.cpp: the same shapes and table for
torch.nn.functional.scaled_dot_product_attention with the flash backend (FlashAttention-2 inside
PyTorch), causal, bf16, q/k/v [b, n, s, d].

    python3 bench/flash_attention_torch.py [--iters 20] [--tokens 16384] [--hidden 2048]
                                           [--dims 64,128] [--seqs 1024,2048,4096,8192]

FLOPs: causal forward 2*b*n*s^2*d, backward 2.5x forward. Times: median of CUDA events around one
call after 3 warm-ups (backward: around out.backward(dout), the forward not timed).
"""
import argparse
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def time_ms(fn, iters, pre=None):
    for _ in range(3):
        if pre:
            pre()
        fn()
    times = []
    for _ in range(iters):
        if pre:
            pre()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--seqs", default="1024,2048,4096,8192")
    a = ap.parse_args()
    print(f"torch {torch.__version__} SDPA (flash backend), causal, bf16, tokens b*s = {a.tokens}, n*d = {a.hidden}")
    print(f"{'d':>4} {'s':>6} {'b':>4} {'n':>4} | {'fwd ms':>9} {'fwd TF/s':>9} | {'bwd ms':>9} {'bwd TF/s':>9}")
    for d in [int(x) for x in a.dims.split(",")]:
        for s in [int(x) for x in a.seqs.split(",")]:
            b, n = max(1, a.tokens // s), a.hidden // d
            q, k, v = (torch.randn(b, n, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
            dout = torch.randn(b, n, s, d, device="cuda", dtype=torch.bfloat16)
            state = {}
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                def fwd():
                    with torch.no_grad():
                        F.scaled_dot_product_attention(q, k, v, is_causal=True)

                def pre():
                    for t in (q, k, v):
                        t.grad = None
                    state["out"] = F.scaled_dot_product_attention(q, k, v, is_causal=True)

                def bwd():
                    state["out"].backward(dout)

                tf = time_ms(fwd, a.iters)
                tb = time_ms(bwd, a.iters, pre)
            flops = 2.0 * b * n * s * s * d
            print(f"{d:>4} {s:>6} {b:>4} {n:>4} | {tf:>9.3f} {flops / tf * 1e-9:>9.1f} | {tb:>9.3f} "
                  f"{2.5 * flops / tb * 1e-9:>9.1f}", flush=True)
            del q, k, v, dout, state


if __name__ == "__main__":
    main()
