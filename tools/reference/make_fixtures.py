#!/usr/bin/env python3
"""Write tiny random Qwen3.5/3.6 (`qwen3_5`) checkpoints and their HF transformers reference outputs.

Every number our Rust tests compare against comes from here: transformers' own `qwen3_5` model
(eager attention, torch fallback GDN kernels), run in float32 on CPU.

    python tools/reference/make_fixtures.py --out crates/model/tests/fixtures

Two models:
  * `tiny-flat`:   Qwen3_5ForCausalLM, flat config, explicit irregular `layer_types`, tied
                   embeddings, Hv/Hk = 2, dk != dv, one safetensors file.
  * `tiny-nested`: Qwen3_5ForConditionalGeneration, nested `text_config` (with a tiny vision tower
                   whose tensors the Rust loader must skip), names under `model.language_model.`,
                   untied lm_head, Hv/Hk = 3, several shards with an index.
  * `tiny-vocab`:  a 16-token vocabulary, for chi-square tests of (speculative) sampling.
Each gets a random MTP head (`mtp.*`, tools/reference/mtp_reference.py) and its reference logits.

Every weight is random, norm weights included (HF zero-inits the (1+w) norms, which would hide a
wrong convention). A_log and dt_bias follow the Mamba-style init real checkpoints start from.
For each model and prompt, `reference.safetensors` holds the prompt ids, HF's logits for every
prompt position, every layer's hidden state, and a greedy continuation made with HF's cache
(recurrent GDN decode), plus the top-1/top-2 logit margin at each greedy step.
"""
import argparse
import json
import math
import os
import sys

import torch
import transformers
from safetensors.torch import save_file
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mtp_reference import Qwen35MtpHead  # noqa: E402
from transformers import (
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5TextConfig,
)

PROMPT_LENS = (150, 77)  # > two 64-token chunks and not a multiple of 64; and a short second prompt
NEW_TOKENS = 48


def randomise(model: torch.nn.Module, gen: torch.Generator, v_heads_scale: float = 1.0) -> None:
    """Give every parameter a random value with a scale that keeps activations O(1)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                # A in [1, 16] as HF/Mamba init; softplus(dt_bias) = dt in [1e-3, 1e-1] (log-uniform).
                a = torch.empty(p.shape).uniform_(1.0, 16.0, generator=gen)
                p.copy_(a.log())
            elif name.endswith("dt_bias"):
                dt = torch.exp(
                    torch.empty(p.shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen)
                )
                p.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))  # plain weight around 1
            elif "norm" in name and p.ndim == 1:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))  # (1+w) norms: w around 0
            elif name.endswith("conv1d.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name.endswith("lm_head.weight"):
                p.copy_(2.0 * torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
            elif p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))


def text_kwargs(**over):
    base = dict(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=24,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        rms_norm_eps=1e-6,
        max_position_embeddings=1024,
        hidden_act="silu",
        attention_bias=False,
    )
    base.update(over)
    return base


@torch.no_grad()
def reference_outputs(model, ids: torch.Tensor):
    out = model(input_ids=ids, use_cache=False, output_hidden_states=True)
    logits = out.logits[0].float()
    hidden = torch.stack([h[0].float() for h in out.hidden_states])  # [layers+1, T, H]
    gen = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        use_cache=True,
        output_logits=True,
        return_dict_in_generate=True,
        eos_token_id=None,
        pad_token_id=0,
    )
    new = gen.sequences[0, ids.shape[1]:]
    step_logits = torch.stack([l[0].float() for l in gen.logits])  # [N, V]
    top2 = step_logits.topk(2, dim=-1).values
    margins = top2[:, 0] - top2[:, 1]
    return logits, hidden, new, margins


def write_model(kind: str, out_dir: str, seed: int) -> None:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    os.makedirs(out_dir, exist_ok=True)
    if kind == "tiny-vocab":
        # A 16-token vocabulary: distributions small enough for chi-square tests of sampling.
        cfg = Qwen3_5TextConfig(
            **text_kwargs(
                vocab_size=16,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=3,
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=16,
                linear_num_key_heads=1,
                linear_num_value_heads=2,
                linear_key_head_dim=8,
                linear_value_head_dim=12,
                layer_types=["linear_attention", "full_attention", "linear_attention"],
                tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            )
        )
        model = Qwen3_5ForCausalLM(cfg)
        shard = None
    elif kind == "tiny-flat":
        cfg = Qwen3_5TextConfig(
            **text_kwargs(
                num_hidden_layers=6,
                # Irregular on purpose: never assume "every 4th layer".
                layer_types=[
                    "linear_attention",
                    "full_attention",
                    "linear_attention",
                    "linear_attention",
                    "full_attention",
                    "linear_attention",
                ],
                tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
            )
        )
        model = Qwen3_5ForCausalLM(cfg)
        shard = None
    else:
        text = text_kwargs(
            num_hidden_layers=5,  # layer_types derived by HF from full_attention_interval=4
            num_attention_heads=4,
            num_key_value_heads=1,
            linear_num_key_heads=2,
            linear_num_value_heads=6,
            linear_key_head_dim=16,
            linear_value_head_dim=32,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000000.0,
                "partial_rotary_factor": 0.25,
                "mrope_section": [2, 1, 1],
                "mrope_interleaved": True,
            },
        )
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                      patch_size=4, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)
        cfg = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
        model = Qwen3_5ForConditionalGeneration(cfg)
        shard = "200KB"
    model.config._attn_implementation = "eager"
    model = model.float().eval()
    randomise(model, gen)
    if shard:
        model.save_pretrained(out_dir, max_shard_size=shard)
    else:
        model.save_pretrained(out_dir)
    # The text config is what the Rust side must honour; keep `mamba_ssm_dtype` explicit like the 27B.
    cfg_path = os.path.join(out_dir, "config.json")
    with open(cfg_path) as f:
        cfg_json = json.load(f)
    (cfg_json.get("text_config", cfg_json))["mamba_ssm_dtype"] = "float32"
    with open(cfg_path, "w") as f:
        json.dump(cfg_json, f, indent=2, sort_keys=True)

    vocab = model.config.get_text_config().vocab_size
    tensors = {}
    for i, plen in enumerate(PROMPT_LENS):
        ids = torch.randint(0, vocab, (1, plen), generator=gen)
        logits, hidden, new, margins = reference_outputs(model, ids)
        tensors[f"prompt{i}.ids"] = ids[0].to(torch.int64).contiguous()
        tensors[f"prompt{i}.logits"] = logits.contiguous()
        tensors[f"prompt{i}.hidden"] = hidden.contiguous()
        tensors[f"prompt{i}.greedy"] = new.to(torch.int64).contiguous()
        tensors[f"prompt{i}.greedy_margin"] = margins.contiguous()
        print(f"{kind} prompt{i}: T={plen} min greedy top1-top2 margin {margins.min():.4f} "
              f"logit range {logits.abs().max():.2f}", file=sys.stderr)
    # HF's own half-precision error on prompt 0 (max over rows of max|Δ| / max|ref|): the yardstick
    # for our bf16/f16 tolerance (ours must be within a small factor of the reference's own).
    cls = type(model)
    ref = tensors["prompt0.logits"]
    for dt, key in [(torch.bfloat16, "bf16"), (torch.float16, "f16")]:
        half = cls.from_pretrained(out_dir, dtype=dt, attn_implementation="eager").eval()
        lg = half(input_ids=tensors["prompt0.ids"][None]).logits[0].float()
        err = ((lg - ref).abs().amax(-1) / ref.abs().amax(-1)).max()
        tensors[f"prompt0.hf_{key}_rel_err"] = err.reshape(1).contiguous()
        print(f"{kind}: HF {key} vs HF f32 logits error {err:.3e}", file=sys.stderr)
    add_mtp_head(model, out_dir, gen, tensors)
    save_file(tensors, os.path.join(out_dir, "reference.safetensors"),
              metadata={"transformers": transformers.__version__, "torch": torch.__version__,
                        "seed": str(seed), "script": "tools/reference/make_fixtures.py"})


MTP_CHAIN = 3


@torch.no_grad()
def add_mtp_head(model, out_dir: str, gen: torch.Generator, tensors: dict) -> None:
    """Adds random `mtp.*` weights to the checkpoint and the reference MTP logits for prompt 0:
    `prompt0.mtp_logits` [T, V] for the pairs (h_i, x_{i+1}) with x_T the first greedy token, and
    `prompt0.mtp_chain_{ids,logits}` for MTP_CHAIN chained greedy draft steps after it."""
    text_cfg = model.config.get_text_config()
    text_cfg.mtp_num_hidden_layers = 1
    head = Qwen35MtpHead(text_cfg).float().eval()
    randomise(head, gen)
    lm = model.model.language_model if hasattr(model.model, "language_model") else model.model
    embed, lm_head = lm.embed_tokens, model.lm_head

    ids = tensors["prompt0.ids"]
    hidden = tensors["prompt0.hidden"][-1]  # HF's final-norm hidden states [T, H]
    nxt = torch.cat([ids[1:], tensors["prompt0.greedy"][:1]])
    d = head(embed, hidden[None], nxt[None])[0]
    tensors["prompt0.mtp_logits"] = lm_head(d).float().contiguous()
    chain_h, chain_ids, chain_logits = hidden, nxt, []
    last_d, last_tok = d[-1], lm_head(d[-1]).argmax()
    for step in range(MTP_CHAIN):
        chain_h = torch.cat([chain_h, last_d[None]])
        chain_ids = torch.cat([chain_ids, last_tok[None]])
        out = head(embed, chain_h[None], chain_ids[None], step=step + 1)[0]
        last_d = out[-1]
        row = lm_head(last_d).float()
        chain_logits.append(row)
        last_tok = row.argmax()
    tensors["prompt0.mtp_chain_ids"] = chain_ids[len(nxt):].to(torch.int64).contiguous()
    tensors["prompt0.mtp_chain_logits"] = torch.stack(chain_logits).contiguous()

    mtp = {f"mtp.{k}": v.contiguous() for k, v in head.state_dict().items() if "rotary_emb" not in k}
    index_path = os.path.join(out_dir, "model.safetensors.index.json")
    if os.path.exists(index_path):
        save_file(mtp, os.path.join(out_dir, "model-mtp.safetensors"), metadata={"format": "pt"})
        with open(index_path) as f:
            index = json.load(f)
        index["weight_map"].update({k: "model-mtp.safetensors" for k in mtp})
        with open(index_path, "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
    else:
        from safetensors.torch import load_file
        path = os.path.join(out_dir, "model.safetensors")
        allw = load_file(path)
        allw.update(mtp)
        save_file(allw, path, metadata={"format": "pt"})
    cfg_path = os.path.join(out_dir, "config.json")
    with open(cfg_path) as f:
        cfg_json = json.load(f)
    (cfg_json.get("text_config", cfg_json))["mtp_num_hidden_layers"] = 1
    with open(cfg_path, "w") as f:
        json.dump(cfg_json, f, indent=2, sort_keys=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="crates/model/tests/fixtures")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    write_model("tiny-flat", os.path.join(args.out, "tiny-flat"), seed=1234)
    write_model("tiny-nested", os.path.join(args.out, "tiny-nested"), seed=5678)
    write_model("tiny-vocab", os.path.join(args.out, "tiny-vocab"), seed=91011)


if __name__ == "__main__":
    main()
