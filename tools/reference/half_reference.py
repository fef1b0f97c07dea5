#!/usr/bin/env python3
"""Record HF transformers' own half-precision steps on the fixture checkpoints.

    python tools/reference/half_reference.py --fixtures crates/model/tests/fixtures

For tiny-flat and tiny-nested this loads the checkpoint in float32, bfloat16 and float16
(transformers' `qwen3_5`, eager attention, torch fallback GDN kernels, CPU) and writes
`half_reference.safetensors` beside it with, for each dtype `{f32,bf16,f16}`:
  * `{dt}.prefill.hidden` [layers + 1, P + S, H] and `{dt}.prefill.logits` [P + S, V]: one forward
    over the first P + S prompt tokens (HF's `output_hidden_states`: the residual stream entering
    each layer, the last entry after the final norm);
  * `{dt}.decode.hidden` [S, layers + 1, H] and `{dt}.decode.logits` [S, V]: the first P tokens
    with a cache, then S one-token steps (HF's recurrent GDN path) over tokens P..P+S.
Everything is stored as float32 (the half values converted exactly). The Rust half-precision
tests compare their own bf16/f16 prefill, decode and verify steps with these, layer by layer.
"""
import argparse
import os

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration

P = 70  # more than one 64-token chunk
S = 6  # decode steps (the verify tests use the first 4 of them)


@torch.no_grad()
def record(model, ids: torch.Tensor, dt: str, out: dict) -> None:
    full = model(input_ids=ids[None, : P + S], use_cache=False, output_hidden_states=True)
    out[f"{dt}.prefill.hidden"] = torch.stack([h[0].float() for h in full.hidden_states]).contiguous()
    out[f"{dt}.prefill.logits"] = full.logits[0].float().contiguous()
    o = model(input_ids=ids[None, :P], use_cache=True)
    cache = o.past_key_values
    hidden, logits = [], []
    for s in range(S):
        o = model(
            input_ids=ids[None, P + s : P + s + 1],
            past_key_values=cache,
            use_cache=True,
            output_hidden_states=True,
        )
        cache = o.past_key_values
        hidden.append(torch.stack([h[0, -1].float() for h in o.hidden_states]))
        logits.append(o.logits[0, -1].float())
    out[f"{dt}.decode.hidden"] = torch.stack(hidden).contiguous()
    out[f"{dt}.decode.logits"] = torch.stack(logits).contiguous()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixtures", default="crates/model/tests/fixtures")
    args = ap.parse_args()
    torch.manual_seed(0)
    for name in ("tiny-flat", "tiny-nested"):
        d = os.path.join(args.fixtures, name)
        cfg = AutoConfig.from_pretrained(d)
        cls = Qwen3_5ForConditionalGeneration if hasattr(cfg, "text_config") else Qwen3_5ForCausalLM
        ids = load_file(os.path.join(d, "reference.safetensors"))["prompt0.ids"].long()
        out = {}
        for dt, torch_dt in (("f32", torch.float32), ("bf16", torch.bfloat16), ("f16", torch.float16)):
            model = cls.from_pretrained(d, dtype=torch_dt, attn_implementation="eager").eval()
            record(model, ids, dt, out)
        for dt in ("bf16", "f16"):
            for what in ("prefill", "decode"):
                a, b = out[f"{dt}.{what}.logits"], out[f"f32.{what}.logits"]
                err = ((a - b).abs().amax(-1) / b.abs().amax(-1)).max()
                print(f"{name} {dt} {what}: HF half vs HF f32 logits {err:.3e}")
        save_file(out, os.path.join(d, "half_reference.safetensors"),
                  metadata={"transformers": transformers.__version__, "torch": torch.__version__,
                            "script": "tools/reference/half_reference.py", "P": str(P), "S": str(S)})


if __name__ == "__main__":
    main()
