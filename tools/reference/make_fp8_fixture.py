#!/usr/bin/env python3
"""Write `tiny-fp8`: the `tiny-flat` fixture quantized to FP8 in the format of Qwen's `-FP8`
checkpoints (HF FineGrainedFP8), with HF transformers' reference outputs.

    python tools/reference/make_fp8_fixture.py --fixtures crates/model/tests/fixtures

The format: `quantization_config = {quant_method: "fp8", fmt: "e4m3", activation_scheme:
"dynamic", weight_block_size: [32, 32], modules_to_not_convert: [...]}`; every linear weight that
Qwen's FP8 checkpoints quantize (attention q/k/v/o, MLP gate/up/down, GDN in_proj_qkv/in_proj_z/
out_proj, in the main layers and the MTP layer) becomes `weight` in float8_e4m3fn `[out, in]` and
`weight_scale_inv` `[ceil(out/32), ceil(in/32)]`, a multiplier (amax/448 per block); GDN
in_proj_a/in_proj_b, mtp.fc, embeddings and norms stay f32, as in the official checkpoints. The
scales are bf16 in the main layers (as in the official 27B) and f32 in the MTP layer, so both
dtypes are read. 32x32 blocks (not 128) give the tiny shapes several blocks per weight.

The reference is the dequantized model: `w = f32(q) * scale[i // 32, j // 32]` loaded into
transformers' own `Qwen3_5ForCausalLM` (f32, eager, CPU): its logits, hidden states and a
48-token greedy continuation for tiny-flat's two prompts, HF's bf16 error on prompt 0, and the
MTP head's logits (tools/reference/mtp_reference.py). `dense/` holds that dequantized checkpoint
in f32 (for the test that our FP8 model equals a dense model of the same weights). The script also
loads the FP8 checkpoint through transformers' own FP8 support where it can and records how far
its weights are from the dequantization above (`hf_fp8_weight_max_abs_diff`), checking the
format against transformers itself.
"""
import argparse
import json
import os
import re
import shutil
import sys

import torch
import transformers
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_fixtures import reference_outputs  # noqa: E402
from mtp_reference import Qwen35MtpHead  # noqa: E402
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig  # noqa: E402

BLOCK = (32, 32)
E4M3_MAX = 448.0
QUANTIZED = re.compile(
    r"(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj|linear_attn\.(in_proj_qkv|in_proj_z|out_proj))\.weight$"
)
NOT_CONVERTED = re.compile(r"(linear_attn\.in_proj_[ab]|mtp\.fc)\.weight$")


def quantize(w: torch.Tensor, scale_dtype: torch.dtype):
    """Block-wise e4m3: per block s = amax / 448 (rounded to `scale_dtype`), q = w / s."""
    o, i = w.shape
    bo, bi = BLOCK
    ob, ib = -(-o // bo), -(-i // bi)
    pad = torch.zeros(ob * bo, ib * bi, dtype=torch.float32)
    pad[:o, :i] = w.float()
    blocks = pad.view(ob, bo, ib, bi)
    scale = (blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / E4M3_MAX).to(scale_dtype)
    s = scale.float()[:, None, :, None]
    q = (blocks / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(ob * bo, ib * bi)[:o, :i].contiguous(), scale.contiguous()


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    o, i = q.shape
    bo, bi = BLOCK
    s = scale.float().repeat_interleave(bo, 0).repeat_interleave(bi, 1)[:o, :i]
    return q.float() * s


@torch.no_grad()
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixtures", default="crates/model/tests/fixtures")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    src = os.path.join(args.fixtures, "tiny-flat")
    out = os.path.join(args.fixtures, "tiny-fp8")
    dense_dir = os.path.join(out, "dense")
    os.makedirs(dense_dir, exist_ok=True)

    weights = load_file(os.path.join(src, "model.safetensors"))
    fp8, dense, not_converted = {}, {}, []
    for name, w in weights.items():
        if QUANTIZED.search(name):
            q, scale = quantize(w, torch.float32 if name.startswith("mtp.") else torch.bfloat16)
            module = name[: -len(".weight")]
            fp8[name], fp8[module + ".weight_scale_inv"] = q, scale
            dense[name] = dequantize(q, scale)
        else:
            if NOT_CONVERTED.search(name):
                not_converted.append(name[: -len(".weight")])
            fp8[name] = w
            dense[name] = w.float()
    save_file(fp8, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    save_file(dense, os.path.join(dense_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        cfg_json = json.load(f)
    with open(os.path.join(dense_dir, "config.json"), "w") as f:
        json.dump(cfg_json, f, indent=2, sort_keys=True)
    cfg_json["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(BLOCK),
        "modules_to_not_convert": sorted(not_converted) + ["lm_head"],
    }
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg_json, f, indent=2, sort_keys=True)
    shutil.copy(os.path.join(src, "generation_config.json"), out)

    # The reference: transformers' model of the dequantized weights, f32, eager, on the CPU.
    cfg = Qwen3_5TextConfig.from_pretrained(dense_dir)
    cfg._attn_implementation = "eager"
    model = Qwen3_5ForCausalLM(cfg).float().eval()
    missing, unexpected = model.load_state_dict(
        {k: v for k, v in dense.items() if not k.startswith("mtp.")}, strict=False
    )
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    model.tie_weights()
    ref = load_file(os.path.join(src, "reference.safetensors"))
    tensors = {}
    for i in range(2):
        ids = ref[f"prompt{i}.ids"][None]
        logits, hidden, new, margins = reference_outputs(model, ids)
        tensors[f"prompt{i}.ids"] = ids[0].contiguous()
        tensors[f"prompt{i}.logits"] = logits.contiguous()
        tensors[f"prompt{i}.hidden"] = hidden.contiguous()
        tensors[f"prompt{i}.greedy"] = new.to(torch.int64).contiguous()
        tensors[f"prompt{i}.greedy_margin"] = margins.contiguous()
        print(f"tiny-fp8 prompt{i}: T={ids.shape[1]} min greedy margin {margins.min():.4f}; "
              f"logits vs tiny-flat's f32 model {(logits - ref[f'prompt{i}.logits']).abs().max():.3e}",
              file=sys.stderr)
    half = Qwen3_5ForCausalLM.from_pretrained(dense_dir, dtype=torch.bfloat16, attn_implementation="eager").eval()
    lg = half(input_ids=tensors["prompt0.ids"][None]).logits[0].float()
    r0 = tensors["prompt0.logits"]
    err = ((lg - r0).abs().amax(-1) / r0.abs().amax(-1)).max()
    tensors["prompt0.hf_bf16_rel_err"] = err.reshape(1).contiguous()
    print(f"tiny-fp8: HF bf16 vs HF f32 logits error {err:.3e}", file=sys.stderr)

    # The MTP head of the dequantized weights, as make_fixtures.py's add_mtp_head computes it.
    head = Qwen35MtpHead(cfg).float().eval()
    head.load_state_dict({k[len("mtp."):]: v for k, v in dense.items() if k.startswith("mtp.")}, strict=False)
    embed, lm_head = model.model.embed_tokens, model.lm_head
    ids, hidden = tensors["prompt0.ids"], tensors["prompt0.hidden"][-1]
    nxt = torch.cat([ids[1:], tensors["prompt0.greedy"][:1]])
    d = head(embed, hidden[None], nxt[None])[0]
    tensors["prompt0.mtp_logits"] = lm_head(d).float().contiguous()

    # The format against transformers' own FP8 loading (dequantized on a machine without an FP8
    # GPU), where this transformers version can.
    diff = float("nan")
    try:
        from transformers import FineGrainedFP8Config

        hf = Qwen3_5ForCausalLM.from_pretrained(
            out, quantization_config=FineGrainedFP8Config(dequantize=True), dtype=torch.float32,
            device_map="cpu",
        )
        sd = hf.state_dict()
        diff = max((sd[k].float() - dense[k]).abs().max().item() for k in dense if k in sd and QUANTIZED.search(k))
        print(f"tiny-fp8: transformers' FP8 load vs our dequantization: max |dw| {diff:.3e}", file=sys.stderr)
    except Exception as e:  # noqa: BLE001 - record why, keep the fixture
        print(f"tiny-fp8: transformers' FP8 load not compared: {type(e).__name__}: {e}", file=sys.stderr)
    tensors["hf_fp8_weight_max_abs_diff"] = torch.tensor([diff], dtype=torch.float32)
    save_file(tensors, os.path.join(out, "reference.safetensors"),
              metadata={"transformers": transformers.__version__, "torch": torch.__version__,
                        "script": "tools/reference/make_fp8_fixture.py"})


if __name__ == "__main__":
    main()
