"""Timing shared by the Python side-by-side benchmarks: eager calls, wall clock over many calls
with one device sync at the end (host launch cost included), as in the Rust examples."""
import time

import torch


def timeit(f, iters):
    """Seconds per call of `f` after 3 warm-up calls."""
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        f()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters
