"""Sums the kernel times of an ncu CSV (scripts/gpu-profile) per kernel name over the steps of a
run: a step starts at each launch of the marker kernel (a regex on the kernel name; e.g.
`argmax_merge`, which closes each greedy sampling, so a step runs from one sampling to the
next; the last step runs to the end of the file, which `--skip-last 1` leaves out). Prints the
last N steps' mean per kernel, slowest first, and the steps' mean total.

    python3 tools/bench/ncu_steps.py ncu.csv --marker argmax_merge --last 3 --skip-last 1
"""
import argparse
import collections
import csv
import re


def launches(path):
    """(kernel name, seconds) per launch, in launch order."""
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r and not r[0].startswith("==")]
    head = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
    cols = rows[head]
    name, metric, value = (cols.index(c) for c in ("Kernel Name", "Metric Name", "Metric Value"))
    out = []
    for r in rows[head + 1:]:
        if len(r) > value and r[metric] == "gpu__time_duration.sum":
            out.append((r[name], float(r[value].replace(",", "")) * 1e-9))
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("csv")
    p.add_argument("--marker", required=True, help="regex of the kernel that opens a step")
    p.add_argument("--last", type=int, default=4, help="steps to average (the last ones; >= 1)")
    p.add_argument("--skip-last", type=int, default=0, help="steps to leave out at the end")
    p.add_argument("--width", type=int, default=90)
    a = p.parse_args()
    if a.last < 1:
        raise SystemExit("--last must be at least 1")
    ks = launches(a.csv)
    starts = [i for i, (n, _) in enumerate(ks) if re.search(a.marker, n)]
    bounds = list(zip(starts, starts[1:] + [len(ks)]))
    if a.skip_last:
        bounds = bounds[: -a.skip_last]
    bounds = bounds[-a.last:]
    if not bounds:
        raise SystemExit(f"no step: {len(starts)} launches of a kernel matching {a.marker!r}")
    per = collections.defaultdict(float)
    calls = collections.Counter()
    for lo, hi in bounds:
        for n, t in ks[lo:hi]:
            name = re.sub(r"\(.*", "", n)
            per[name] += t / len(bounds)
            calls[name] += 1
    total = sum(per.values())
    print(f"{len(ks)} launches, {len(starts)} steps; mean of the last {len(bounds)}: "
          f"{total * 1e3:.3f} ms, {sum(calls.values()) / len(bounds):.0f} launches a step")
    for n, t in sorted(per.items(), key=lambda kv: -kv[1]):
        print(f"{t * 1e6:10.1f} us {100 * t / total:5.1f}% {calls[n] / len(bounds):6.1f}x  {n[: a.width]}")


if __name__ == "__main__":
    main()
