#!/usr/bin/env python3
"""Record HF transformers' logits processing on fixed logits, for the Rust sampler's tests.

    python tools/reference/sampler_reference.py --out crates/sampling/tests/fixtures/hf_sampler.json

For each case (logits row, prompt ids, output ids, parameters) this applies transformers' own
processors in the order `GenerationMixin._get_logits_processor` builds them for sampling:
RepetitionPenaltyLogitsProcessor (over prompt + output), then TemperatureLogitsWarper,
TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper, and records the penalised logits, the
warped logits and softmax(warped), all in float32. transformers has no presence/frequency
penalty; those follow vLLM's definition (logit -= frequency·count + presence·[count > 0], over the
output only, applied with the repetition penalty before temperature) and are computed here in
plain Python, independently of the Rust code.

A top-p cut that falls inside a run of tied probabilities makes transformers' kept set depend on
torch.sort's order among the tied values; such cases are flagged `tie_at_cut` (the Rust sampler
keeps the whole tie, see `Sampler::probs`). Random cases whose cumulative mass lands within 1e-4
of top_p (where f32 and f64 summation may disagree) are redrawn, so every other kept set is
decided by a margin.
"""
import argparse
import json
import math
import random

import torch
import transformers
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

VOCAB = 24


def floats(t):
    """A float32 row as JSON numbers, -inf as null."""
    return [None if math.isinf(v) and v < 0 else float(v) for v in t.tolist()]


def penalise(logits, prompt, output, p):
    x = torch.tensor([logits], dtype=torch.float32)
    if p["repetition_penalty"] != 1.0:
        ids = torch.tensor([prompt + output], dtype=torch.long)
        x = RepetitionPenaltyLogitsProcessor(penalty=p["repetition_penalty"])(ids, x)
    counts = {}
    for t in output:
        counts[t] = counts.get(t, 0) + 1
    pen = torch.zeros(VOCAB, dtype=torch.float32)
    for t, c in counts.items():
        pen[t] = p["presence_penalty"] + p["frequency_penalty"] * c
    return x - pen


def warp(x, p):
    ids = torch.zeros((1, 1), dtype=torch.long)  # warpers do not read input ids
    if p["temperature"] != 1.0:
        x = TemperatureLogitsWarper(p["temperature"])(ids, x)
    if p["top_k"] > 0:
        x = TopKLogitsWarper(top_k=p["top_k"])(ids, x)
    if p["top_p"] < 1.0:
        x = TopPLogitsWarper(top_p=p["top_p"])(ids, x)
    if p["min_p"] > 0.0:
        x = MinPLogitsWarper(min_p=p["min_p"])(ids, x)
    return x


def top_p_margin(x, p):
    """(distance of the cumulative mass to 1 - top_p at the cut, whether the cut splits a tie),
    computed on the scores the top-p warper sees."""
    ids = torch.zeros((1, 1), dtype=torch.long)
    if p["temperature"] != 1.0:
        x = TemperatureLogitsWarper(p["temperature"])(ids, x)
    if p["top_k"] > 0:
        x = TopKLogitsWarper(top_k=p["top_k"])(ids, x)
    if p["top_p"] >= 1.0:
        return math.inf, False
    s, _ = torch.sort(x[0], descending=False)
    cum = s.softmax(-1).cumsum(-1)
    thr = 1 - p["top_p"]
    margin = float((cum - thr).abs().min())
    removed = cum <= thr
    if not removed.any() or removed.all():
        return margin, False
    last_removed = int(removed.nonzero().max())
    tie = bool(s[last_removed] == s[last_removed + 1]) and bool(torch.isfinite(s[last_removed]))
    return margin, tie


def params(**over):
    p = dict(
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        min_p=0.0,
        repetition_penalty=1.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
    )
    p.update(over)
    return p


def record(name, logits, prompt, output, p):
    x = penalise(logits, prompt, output, p)
    w = warp(x.clone(), p)
    margin, tie = top_p_margin(x.clone(), p)
    return dict(
        name=name,
        logits=floats(torch.tensor(logits, dtype=torch.float32)),
        prompt=prompt,
        output=output,
        params=p,
        penalised=floats(x[0]),
        warped=floats(w[0]),
        probs=floats(w.softmax(-1)[0]),
        tie_at_cut=tie,
        top_p_margin=None if math.isinf(margin) else margin,
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rng = random.Random(20261201)
    cases = []

    # Hand-made: ties at a top-p cut, ties at a top-k cut, a -inf mask, a temperature that moves
    # the top-p cut (the cut on T = 1 probabilities would keep a different set).
    tie = [math.log(v) for v in (0.4, 0.2, 0.2, 0.2)] + [-30.0] * (VOCAB - 4)
    cases.append(record("tie_top_p_0.5", tie, [], [], params(top_p=0.5)))
    cases.append(record("tie_top_k_2", tie, [], [], params(top_k=2)))
    cases.append(record("tie_min_p_0.6", tie, [], [], params(min_p=0.6)))
    masked = [2.0, 1.0, -math.inf, 0.5] + [-1.0] * (VOCAB - 4)
    cases.append(record("mask_top_p", masked, [3], [0, 0], params(top_p=0.9, repetition_penalty=1.3)))
    spread = [3.0, 2.5, 2.0, 1.5, 1.0, 0.5] + [-2.0] * (VOCAB - 6)
    for t in (0.3, 0.6, 2.0):
        cases.append(record(f"temperature_{t}_moves_top_p", spread, [], [], params(temperature=t, top_p=0.8)))
        cases.append(record(f"temperature_{t}_top_k_min_p", spread, [], [], params(temperature=t, top_k=4, min_p=0.1)))

    # Large logits: the softmax must subtract the maximum before exponentiating.
    big = [60.0 + v for v in spread]
    cases.append(record("large_logits_temperature_0.5", big, [], [], params(temperature=0.5, top_p=0.95)))

    grid = [
        dict(temperature=t, top_k=k, top_p=tp, min_p=mp)
        for t in (0.4, 0.7, 1.0, 1.6)
        for k in (0, 5)
        for tp in (1.0, 0.6, 0.9)
        for mp in (0.0, 0.05, 0.3)
    ]
    penalties = [
        dict(),
        dict(repetition_penalty=1.3),
        dict(presence_penalty=0.8, frequency_penalty=0.3),
        dict(repetition_penalty=0.8, presence_penalty=-0.5, frequency_penalty=0.6),
        dict(presence_penalty=0.7),
        dict(frequency_penalty=0.4),
    ]
    n = 0
    while n < 160:
        g = grid[n % len(grid)]
        pen = penalties[(n // 3) % len(penalties)]
        p = params(**g, **pen)
        scale = rng.choice([0.5, 1.5, 3.0])
        logits = [rng.gauss(0.0, scale) for _ in range(VOCAB)]
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 6))]
        output = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 8))]
        c = record(f"random_{n}", logits, prompt, output, p)
        if c["top_p_margin"] is not None and c["top_p_margin"] < 1e-4:
            continue  # too close to the cut for f32 vs f64 summation; redraw
        assert not c["tie_at_cut"], "random logits tie"
        cases.append(c)
        n += 1

    meta = dict(transformers=transformers.__version__, torch=torch.__version__, vocab=VOCAB)
    with open(args.out, "w") as f:
        # One case per line: small diffs when the script changes.
        f.write('{"meta": ' + json.dumps(meta) + ',\n"cases": [\n')
        f.write(",\n".join(json.dumps(c) for c in cases))
        f.write("\n]}\n")
    print(f"wrote {len(cases)} cases to {args.out} ({meta})")


if __name__ == "__main__":
    main()
