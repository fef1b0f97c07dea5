"""PyTorch reference of the Qwen3.5/3.6 MTP head, following vLLM's `qwen3_5_mtp` semantics.

    e  = embed_tokens(x_{i+1})                      # the main model's embedding
    u  = fc(cat[pre_fc_norm_embedding(e), pre_fc_norm_hidden(h_i)])   # embedding first
    y  = DecoderLayer_full_attention(u, position i)  # gated attention + MLP, own KV cache
    d  = mtp.norm(y)                                 # (1+w) norm of the full residual stream
    logits = lm_head(d)                              # the main model's lm_head

`h_i` is the target's final-norm hidden state at position i; chained draft steps feed `d` back as
the hidden. Built from transformers' own `Qwen3_5DecoderLayer` / `Qwen3_5RMSNorm`, so the layer
math is HF's. Used by make_fixtures.py (fixtures) and by tools/train-tiny (training the head).
"""
import copy

import torch
from torch import nn
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5DecoderLayer,
    Qwen3_5RMSNorm,
    Qwen3_5TextRotaryEmbedding,
)


class Qwen35MtpHead(nn.Module):
    """`mtp.*` of a Qwen3.5/3.6 checkpoint (parameter names match the checkpoint under `mtp.`)."""

    def __init__(self, text_config):
        super().__init__()
        cfg = copy.deepcopy(text_config)
        n = max(1, getattr(cfg, "mtp_num_hidden_layers", 1) or 1)
        cfg.layer_types = ["full_attention"] * n
        cfg._attn_implementation = "eager"
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(h, eps=eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(h, eps=eps)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(cfg, i) for i in range(n)])
        self.norm = Qwen3_5RMSNorm(h, eps=eps)
        self.rotary_emb = Qwen3_5TextRotaryEmbedding(config=cfg)

    def forward(self, embed_tokens, hidden, next_ids, step=0):
        """hidden: [B, T, H] at positions 0..T-1, next_ids: [B, T]. Full causal recompute (no cache).
        Returns d: [B, T, H] (post mtp.norm)."""
        b, t, _ = hidden.shape
        e = self.pre_fc_norm_embedding(embed_tokens(next_ids))
        x = self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden)], dim=-1))
        pos = torch.arange(t, device=hidden.device)[None, None, :].expand(3, b, t)
        cos_sin = self.rotary_emb(x, pos)
        mask = torch.full((t, t), float("-inf"), device=x.device, dtype=x.dtype).triu(1)[None, None]
        layer = self.layers[step % len(self.layers)]
        y = layer(x, position_embeddings=cos_sin, attention_mask=mask, position_ids=pos[0])
        return self.norm(y)
