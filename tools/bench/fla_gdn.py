#!/usr/bin/env python3
"""fla's Triton GDN kernels at the Qwen3.6-27B layer shapes, timed like examples/bench_gdn.rs
(eager calls, wall clock over many calls with a sync at the end), for a side-by-side table.

    PYTHONPATH=<fla-core wheel unpacked> python3 tools/bench/fla_gdn.py
"""
import torch
import torch.nn.functional as F
from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from timing import timeit

HK, HV, D = 16, 48, 128


def main():
    dev = "cuda"
    a_log = torch.rand(HV, device=dev) * 2.5
    dt_bias = torch.rand(HV, device=dev) - 3.0
    print("| case (fla) | time |")
    print("|---|---|")
    for name, b, t, chunk in [("decode B=1", 1, 1, False), ("decode B=8", 8, 1, False), ("decode B=64", 64, 1, False),
                              ("verify B=1 T=4", 1, 4, False), ("prefill B=1 T=1024 chunk", 1, 1024, True),
                              ("prefill B=1 T=8192 chunk", 1, 8192, True),
                              ("prefill B=1 T=32768 chunk", 1, 32768, True)]:
        q = F.normalize(torch.randn(b, t, HK, D, device=dev, dtype=torch.bfloat16), dim=-1)
        k = F.normalize(torch.randn(b, t, HK, D, device=dev, dtype=torch.bfloat16), dim=-1)
        # fla's GVA: q/k repeated to Hv heads (as vLLM/HF call it).
        q, k = q.repeat_interleave(HV // HK, 2), k.repeat_interleave(HV // HK, 2)
        v = torch.randn(b, t, HV, D, device=dev, dtype=torch.bfloat16)
        a = torch.randn(b, t, HV, device=dev)
        g = -a_log.exp() * F.softplus(a + dt_bias)
        beta = torch.rand(b, t, HV, device=dev, dtype=torch.bfloat16)
        s0 = torch.randn(b, HV, D, D, device=dev) * 0.1
        if chunk:
            f = lambda: chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True)
        else:
            f = lambda: fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True)
        s = timeit(f, 5 if t > 1000 else 200)
        print(f"| {name} | {s * 1e6:.1f} µs |")


if __name__ == "__main__":
    main()
