"""cuBLAS (torch.matmul) bf16 rate on the Qwen3.6-27B prefill projections at several row counts,
against the 8192^3 GEMM rate measured in the same run (CUDA events, 20 calls after 3 warm-ups)."""
import torch

def rate(m, k, n, calls=20):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        y = x @ w.t()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(calls):
        y = x @ w.t()
    e.record(); torch.cuda.synchronize()
    ms = s.elapsed_time(e) / calls
    return ms, 2 * m * k * n / ms / 1e9

_, peak = rate(8192, 8192, 8192)
print(f"8192^3: {peak:.0f} TFLOP/s")
shapes = {"gdn in_proj": (5120, 16480), "gdn out_proj": (6144, 5120), "attn qkv": (5120, 14336),
          "attn o_proj": (6144, 5120), "mlp gate_up": (5120, 34816), "mlp down": (17408, 5120)}
for m in (1024, 1088, 2048, 8192):
    tot = 0.0
    for name, (k, n) in shapes.items():
        ms, tf = rate(m, k, n)
        print(f"M={m:5d} {name:13s} {ms*1e3:8.1f} us {tf:5.0f} TFLOP/s {tf/peak:5.2f}")
