#!/usr/bin/env python3
"""Train qwen36-tiny: a small model of the exact `qwen3_5` architecture, with an MTP head.

Runs on the GPU machine (torch + transformers 5.17 + tokenizers) in a few minutes:

    python tools/train-tiny/train.py --out models/qwen36-tiny --seconds 240

* Corpus: the Python standard library sources of the interpreter running the script (its `.py`
  files), plus ChatML samples made from them (a function's docstring as the user turn, its source
  as the assistant turn). Files are split train/held-out by a hash of their path.
* Tokenizer: byte-level BPE trained with `tokenizers`, 4096 ids, ChatML special tokens.
* Model: transformers' own `Qwen3_5ForCausalLM` (GDN + gated attention, Hv/Hk = 2), and the MTP
  head of tools/reference/mtp_reference.py trained jointly to predict the token after next.
* Output: a model directory laid out like a real Qwen3.6 checkpoint (nested config,
  `model.language_model.*`, `lm_head`, `mtp.*`, bf16), tokenizer files, generation_config.json,
  the loss log, and `reference.safetensors` with outputs the Rust tests compare against
  (computed in f32 from the saved bf16 weights).
"""
import argparse
import ast
import hashlib
import json
import math
import os
import sys
import sysconfig
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "reference"))
from mtp_reference import Qwen35MtpHead  # noqa: E402

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
PROMPTS = ["def fibonacci(n):", "import os\n\ndef ", "class Stack:\n    def __init__(self):"]


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def corpus(limit_files=None):
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for d, _, names in os.walk(root):
        if "site-packages" in d or "test" in os.path.relpath(d, root).split(os.sep)[0:1]:
            continue
        files += [os.path.join(d, n) for n in sorted(names) if n.endswith(".py")]
    files.sort()
    if limit_files:
        files = files[:limit_files]
    train, held = [], []
    for path in files:
        try:
            text = open(path, encoding="utf-8").read()
        except (UnicodeDecodeError, OSError):
            continue
        h = int(hashlib.sha1(os.path.relpath(path, root).encode()).hexdigest(), 16)
        (held if h % 50 == 0 else train).append((path, text))
    if not held:  # tiny smoke-test corpora
        held.append(train.pop())
    return root, train, held


def chat_samples(text):
    """ChatML pairs: user asks for the function its docstring describes; assistant gives it."""
    out = []
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return out
    lines = text.splitlines()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and ast.get_docstring(node) and node.end_lineno - node.lineno < 40:
            doc = ast.get_docstring(node).strip().splitlines()[0]
            src = "\n".join(lines[node.lineno - 1 : node.end_lineno])
            out.append(
                f"<|im_start|>user\nWrite a Python function `{node.name}`: {doc}<|im_end|>\n"
                f"<|im_start|>assistant\n```python\n{src}\n```<|im_end|>\n"
            )
    return out


def train_tokenizer(texts, vocab):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def text_config(vocab):
    return dict(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=10,  # layers 3 and 7 are gated attention (full_attention_interval 4)
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [3, 3, 2], "mrope_interleaved": True},
        bos_token_id=None,
        eos_token_id=SPECIAL.index("<|endoftext|>"),
        pad_token_id=None,
    )


def batches(ids, batch, seq, gen, device):
    n = (len(ids) - 1) // seq
    while True:
        idx = torch.randint(0, n, (batch,), generator=gen) * seq
        x = torch.stack([ids[i : i + seq + 1] for i in idx.tolist()]).to(device)
        yield x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=float, default=240)
    ap.add_argument("--max-steps", type=int, default=100000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--limit-files", type=int, default=None, help="smoke tests only")
    args = ap.parse_args()
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    import transformers

    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    os.makedirs(args.out, exist_ok=True)
    t_start = time.time()

    root, train_files, held_files = corpus(args.limit_files)
    chats = [c for _, t in train_files for c in chat_samples(t)]
    train_texts = [t for _, t in train_files] + chats
    log(f"corpus: {len(train_files)} train files, {len(held_files)} held-out, {len(chats)} chat samples, "
        f"{sum(map(len, train_texts)) / 1e6:.1f} MB train text from {root}")
    tok = train_tokenizer(train_texts, args.vocab)
    eot = tok.token_to_id("<|endoftext|>")
    enc = tok.encode_batch(train_texts)
    train_ids = torch.tensor([i for e in enc for i in e.ids + [eot]], dtype=torch.long)
    held_ids = torch.tensor([i for e in tok.encode_batch([t for _, t in held_files]) for i in e.ids + [eot]],
                            dtype=torch.long)
    log(f"tokens: {len(train_ids) / 1e6:.2f} M train, {len(held_ids) / 1e3:.0f} k held-out "
        f"({sum(map(len, train_texts)) / len(train_ids):.2f} bytes/token); {time.time() - t_start:.0f}s")

    tcfg = Qwen3_5TextConfig(**text_config(tok.get_vocab_size()))
    tcfg.mtp_num_hidden_layers = 1
    model = Qwen3_5ForCausalLM(tcfg).to(dev)
    head = Qwen35MtpHead(tcfg).to(dev)
    n_main = sum(p.numel() for p in model.parameters())
    n_mtp = sum(p.numel() for p in head.parameters())
    log(f"params: main {n_main / 1e6:.2f} M, mtp {n_mtp / 1e6:.2f} M; GDN kernels from "
        f"{sys.modules[type(model).__module__].torch_chunk_gated_delta_rule.__module__}")
    params = list(model.parameters()) + list(head.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    it = batches(train_ids, args.batch, args.seq, gen, dev)
    embed, lm_head = model.model.embed_tokens, model.lm_head
    loss_log = []
    t0 = time.time()
    step = 0
    warmup = 50
    while step < args.max_steps and time.time() - t0 < args.seconds:
        # Cosine schedule over the time budget (the step count is not known in advance).
        frac = min(1.0, (time.time() - t0) / args.seconds)
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        x = next(it)
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
            h = model.model(input_ids=x[:, :-1]).last_hidden_state  # final-norm hidden
            logits = lm_head(h).float()
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
            # MTP: pair (h_t, x_{t+1}) predicts x_{t+2}.
            d = head(embed, h[:, :-1], x[:, 1:-1])
            mlogits = lm_head(d).float()
            mtp_loss = F.cross_entropy(mlogits.reshape(-1, mlogits.shape[-1]), x[:, 2:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        (loss + 0.5 * mtp_loss).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 25 == 0:
            loss_log.append({"step": step, "seconds": round(time.time() - t0, 1), "lr": lr,
                             "loss": round(loss.item(), 4), "mtp_loss": round(mtp_loss.item(), 4)})
            log(json.dumps(loss_log[-1]))
        step += 1
    tokens_seen = step * args.batch * args.seq
    log(f"trained {step} steps, {tokens_seen / 1e6:.1f} M tokens in {time.time() - t0:.0f}s")

    # Round to bf16 (what ships), then evaluate everything in f32 from those weights.
    model = model.to(torch.bfloat16).float().eval()
    head = head.to(torch.bfloat16).float().eval()
    embed, lm_head = model.model.embed_tokens, model.lm_head
    save(args, model, head, tok, tcfg, transformers.__version__)
    reference(args, model, head, tok, held_ids, dev, loss_log, step, tokens_seen, n_main, n_mtp)
    log(f"done in {time.time() - t_start:.0f}s")


def save(args, model, head, tok, tcfg, tf_version):
    from safetensors.torch import save_file

    tensors = {}
    for k, v in model.state_dict().items():
        name = k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k
        tensors[name] = v.to(torch.bfloat16).contiguous().cpu()
    for k, v in head.state_dict().items():
        if "rotary_emb" not in k:
            tensors[f"mtp.{k}"] = v.to(torch.bfloat16).contiguous().cpu()
    # Shards of at most 12 MB with an index, like a real multi-file checkpoint.
    shards, cur, size = [], {}, 0
    for k in sorted(tensors):
        nbytes = tensors[k].numel() * 2
        if cur and size + nbytes > 12_000_000:
            shards.append(cur)
            cur, size = {}, 0
        cur[k] = tensors[k]
        size += nbytes
    shards.append(cur)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(args.out, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * 2 for t in tensors.values())
    with open(os.path.join(args.out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
    text = tcfg.to_dict()
    for k in ["architectures", "transformers_version", "dtype", "torch_dtype", "_name_or_path", "output_attentions",
              "output_hidden_states", "return_dict", "chunk_size_feed_forward", "problem_type", "id2label",
              "label2id", "tokenizer_class", "use_cache"]:
        text.pop(k, None)
    text["model_type"] = "qwen3_5_text"
    text["mamba_ssm_dtype"] = "float32"
    text["mtp_num_hidden_layers"] = 1
    text["mtp_use_dedicated_embeddings"] = False
    text["dtype"] = "bfloat16"
    cfg = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text,
        "vision_config": {"model_type": "qwen3_5_vision", "depth": 1, "hidden_size": 64, "intermediate_size": 128,
                          "num_heads": 2, "out_hidden_size": 256, "patch_size": 16, "spatial_merge_size": 2,
                          "temporal_patch_size": 2},
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
        "transformers_version": tf_version,
    }
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    im_end, eot = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    gen_cfg = {"bos_token_id": eot, "eos_token_id": [im_end, eot], "pad_token_id": eot, "do_sample": True,
               "temperature": 0.7, "top_k": 20, "top_p": 0.9, "repetition_penalty": 1.05,
               "transformers_version": tf_version}
    with open(os.path.join(args.out, "generation_config.json"), "w") as f:
        json.dump(gen_cfg, f, indent=2)
    # The trainer registers every added token as special; `<think>`/`</think>` are plain text, as in
    # Qwen's own tokenizer (decoding with skip_special_tokens keeps them, so reasoning can be parsed).
    tok_json = json.loads(tok.to_str())
    for t in tok_json["added_tokens"]:
        t["special"] = t["content"].startswith("<|")
    with open(os.path.join(args.out, "tokenizer.json"), "w") as f:
        json.dump(tok_json, f, indent=2, ensure_ascii=False)
    added = {str(tok.token_to_id(s)): {"content": s, "special": s.startswith("<|"), "lstrip": False,
                                       "rstrip": False, "normalized": False, "single_word": False} for s in SPECIAL}
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False, "bos_token": None,
               "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
               "model_max_length": 4096, "added_tokens_decoder": added, "chat_template": CHAT_TEMPLATE}
    with open(os.path.join(args.out, "tokenizer_config.json"), "w") as f:
        json.dump(tok_cfg, f, indent=2)


@torch.no_grad()
def reference(args, model, head, tok, held_ids, dev, loss_log, steps, tokens_seen, n_main, n_mtp):
    """Outputs the Rust tests compare against, in f32 from the saved bf16 weights, on CPU
    (deterministic, and what the Rust CPU tests run)."""
    from safetensors.torch import save_file

    model, head = model.cpu(), head.cpu()
    embed, lm_head = model.model.embed_tokens, model.lm_head
    out = {}
    # Held-out loss: mean next-token NLL over the first 4 x 512-token windows of held-out text.
    w4 = min(4, (len(held_ids) - 1) // 512)
    win = held_ids[: w4 * 512 + 1]
    nll, n = 0.0, 0
    for i in range(w4):
        x = win[i * 512 : (i + 1) * 512 + 1][None]
        lg = model(input_ids=x[:, :-1]).logits.float()
        nll += F.cross_entropy(lg[0], x[0, 1:], reduction="sum").item()
        n += 512
    out["heldout.ids"] = win.clone()
    out["heldout.mean_nll"] = torch.tensor([nll / n], dtype=torch.float64)
    # Longer held-out estimate for the model card.
    w64 = min(64, (len(held_ids) - 1) // 512)
    big = held_ids[: w64 * 512 + 1]
    nll_big = 0.0
    for i in range(w64):
        x = big[i * 512 : (i + 1) * 512 + 1][None]
        nll_big += F.cross_entropy(model(input_ids=x[:, :-1]).logits.float()[0], x[0, 1:], reduction="sum").item()
    heldout_loss = nll_big / (w64 * 512)
    # Greedy continuations (HF generate with its cache: recurrent GDN decode).
    accepts, total = 0, 0
    for p, text in enumerate(PROMPTS):
        ids = torch.tensor([tok.encode(text).ids])
        g = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, min_new_tokens=64,
                           do_sample=False, eos_token_id=None, pad_token_id=0)
        out[f"prompt{p}.ids"] = ids[0].clone()
        out[f"prompt{p}.greedy"] = g[0, ids.shape[1]:].clone()
        # MTP acceptance at draft position 1 along the greedy path (teacher-forced on it, which is
        # what greedy speculative decoding with k = 1 sees): draft from (h_t, x_{t+1}) vs x_{t+2}.
        seq = g[0][None]
        h = model.model(input_ids=seq).last_hidden_state
        d = head(embed, h[:, :-1], seq[:, 1:])
        draft = lm_head(d).argmax(-1)[0]  # predicts seq[t+2]
        start = ids.shape[1] - 1  # first pair whose next token is generated
        ok = (draft[start:-1] == seq[0, start + 2:]).sum().item()
        accepts += ok
        total += seq.shape[1] - start - 2
    out["mtp.accept_pos1"] = torch.tensor([accepts / total], dtype=torch.float64)
    save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(args.out, "..", "qwen36-tiny.reference.safetensors"))
    summary = {"steps": steps, "tokens_seen": tokens_seen, "params_main": n_main, "params_mtp": n_mtp,
               "heldout_loss_nats": heldout_loss, "heldout_ppl": math.exp(heldout_loss),
               "heldout_tokens": w64 * 512, "mtp_accept_pos1_greedy": accepts / total,
               "final_train_loss": loss_log[-1]["loss"] if loss_log else None, "loss_log": loss_log}
    with open(os.path.join(args.out, "..", "qwen36-tiny.training.json"), "w") as f:
        json.dump(summary, f, indent=1)
    log(json.dumps({k: v for k, v in summary.items() if k != "loss_log"}))


if __name__ == "__main__":
    main()
