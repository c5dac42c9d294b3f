"""A small pre-LayerNorm decoder-only transformer LM that calls a scheme's three hooks."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn

from posbench.attention import causal_attention
from posbench.config import ModelConfig
from posbench.errors import PosbenchError
from posbench.native import qkv_views
from posbench.native.layers import MLP, grad_layout, linear_add, norm_linear  # C-fused on CPU; see layers.py
from posbench.schemes import PositionalScheme, build_scheme


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, scheme: PositionalScheme):
        super().__init__()
        self.n_head, self.layer = cfg.n_head, layer
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.scheme = [scheme]  # a list, so the shared scheme is not registered once per layer

    def forward(self, x: torch.Tensor, pos: torch.Tensor, block, norm: Optional[nn.LayerNorm] = None) -> torch.Tensor:
        """attn(x), or with `norm`, x + attn(norm(x)): the LayerNorm, the projections and the
        residual then run in C-fused nodes on a CPU (layers.norm_linear, layers.linear_add)."""
        B, T, C = x.size()
        scheme = self.scheme[0]
        if norm is None:
            qkv, res = self.qkv(x), None  # (B, T, 3C)
        else:
            qkv, res = norm_linear(x, norm, self.qkv, self.proj.bias)  # res: x + the proj's bias, or None
        q, k, v = qkv_views(qkv, self.n_head)  # (B, nh, T, hs)
        q2, k2 = scheme.rotate(q, k, pos, self.layer)
        # unrotated, the attention kernel may take qkv whole (one gradient tensor, no split backward)
        packed = qkv if q2 is q and k2 is k else None

        def bias_fn(qb, kb, qpos, kpos):
            return scheme.bias(qb, kb, qpos, kpos, self.layer)

        def attend_fn(qb, kb, vb, qpos, kpos):
            return scheme.attend(qb, kb, vb, qpos, kpos, self.layer)

        y = causal_attention(q2, k2, v, pos, bias_fn, block, attend_fn, packed)  # (B, nh, T, hs)
        if norm is not None:
            return linear_add(y, self.proj, x, res)  # x + proj(y)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, scheme: PositionalScheme):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg, layer, scheme)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg.d_model, 4 * cfg.d_model)  # Linear, GELU, Linear: one C-fused node on CPU
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, pos, block):
        if self.drop.p == 0 or not self.training:  # the LayerNorms and residual adds fused in on CPU
            x = self.attn(x, pos, block, norm=self.ln1)  # x + attn(ln1(x))
            return self.mlp(x, self.ln2, residual=True)  # x + mlp(ln2(x))
        x = x + self.drop(self.attn(self.ln1(x), pos, block))
        return x + self.drop(self.mlp(x, self.ln2))


class TransformerLM(nn.Module):
    """forward(tokens[B, T]) -> logits[B, T, V], for any T the scheme can encode."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.scheme = build_scheme(cfg)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, i, self.scheme) for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied, as in GPT-2 and nanoGPT
        self.attn_block = 256  # queries per attention block once T exceeds it (linear memory)
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2's scaled init of residual projections
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))
        for blk in self.blocks:  # after the init, so the same seed gives the same values
            grad_layout(blk.mlp[0])
            if cfg.dropout == 0:  # qkv's gradient comes from norm_linear's node (with dropout, torch's)
                grad_layout(blk.attn.qkv)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    @property
    def max_len(self):
        return self.scheme.max_len

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        B, T = tokens.size()
        if self.max_len is not None and T > self.max_len:
            raise PosbenchError(
                f"scheme '{self.cfg.scheme}' cannot represent position {T - 1}: "
                f"it encodes at most {self.max_len} positions"
            )
        pos = self.scheme.positions(T, tokens.device)  # (T,)
        x = self.drop(self.scheme.embed(self.tok(tokens), pos))  # (B, T, C)
        block = self.attn_block if T > self.attn_block else None
        for blk in self.blocks:
            x = blk(x, pos, block)
        return self.head(self.ln_f(x))  # (B, T, V)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
