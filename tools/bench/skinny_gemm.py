"""cuBLAS through torch on the Qwen3.6-27B decode projections at the row counts of batched decode
and verifies (16..128 rows): TB/s of bf16 weight bytes, each call reading another copy of the
weight (more than 300 MB of copies, so L2 holds none), for torch's cuBLAS path, its cuBLASLt path,
and TunableOp (every cuBLASLt algorithm tried, the fastest kept). Usage: python3 skinny_gemm.py"""
import os
import torch

SHAPES = {"gdn in_proj": (5120, 16480), "mlp gate_up": (5120, 34816), "mlp down": (17408, 5120),
          "gdn out_proj": (6144, 5120), "attn qkv": (5120, 14336)}
ROWS = (8, 16, 32, 48, 64, 128)


def tbps(m, k, n, calls=40):
    copies = max(2, -(-300_000_000 // (2 * k * n)))
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    for w in ws:
        y = x @ w.t()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for i in range(calls):
        y = x @ ws[i % copies].t()
    e.record()
    torch.cuda.synchronize()
    ms = s.elapsed_time(e) / calls
    del y
    return 2 * k * n / (ms * 1e-3) / 1e12


def table(label):
    print(f"| {label} | " + " | ".join(f"{m} rows" for m in ROWS) + " |")
    for name, (k, n) in SHAPES.items():
        print(f"| {name} {k}->{n} | " + " | ".join(f"{tbps(m, k, n):.2f}" for m in ROWS) + " |",
              flush=True)


n = torch.cuda.get_device_name()
print(f"{n}; torch {torch.__version__}; TB/s of bf16 weight bytes")
torch.backends.cuda.preferred_blas_library("cublas")
table("cuBLAS")
torch.backends.cuda.preferred_blas_library("cublaslt")
table("cuBLASLt")
if os.environ.get("TUNABLE", "1") == "1":
    torch.cuda.tunable.enable(True)
    torch.cuda.tunable.tuning_enable(True)
    table("TunableOp")
