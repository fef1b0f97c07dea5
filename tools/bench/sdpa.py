#!/usr/bin/env python3
"""torch's scaled_dot_product_attention (causal, GQA) at the Qwen3.6-27B prefill attention shapes,
timed like crates/kernels/examples/bench_attention.rs (eager calls, wall clock over many calls
with a sync at the end), for a side-by-side table.

    python3 tools/bench/sdpa.py
"""
import torch
import torch.nn.functional as F
from timing import timeit

H, KH, D = 24, 4, 256


def main():
    print(f"torch {torch.__version__}")
    print("| prompt (torch SDPA) | backend | time | TFLOP/s |")
    print("|---|---|---|---|")
    for t in [1024, 8192, 32768]:
        q = torch.randn(1, H, t, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, KH, t, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(1, KH, t, D, device="cuda", dtype=torch.bfloat16)
        flops = 4.0 * D * H * t * (t + 1) / 2
        iters = 5 if t > 8192 else 20
        for name, backend in [("flash", torch.nn.attention.SDPBackend.FLASH_ATTENTION),
                              ("cudnn", torch.nn.attention.SDPBackend.CUDNN_ATTENTION),
                              ("efficient", torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION)]:
            try:
                with torch.nn.attention.sdpa_kernel(backend):
                    s = timeit(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                               iters)
                print(f"| {t} | {name} | {s * 1e3:.3f} ms | {flops / s / 1e12:.0f} |")
            except RuntimeError as e:
                print(f"| {t} | {name} | unavailable: {str(e).splitlines()[0][:80]} | |")


if __name__ == "__main__":
    main()
