"""The transformer: a small pre-LayerNorm decoder-only LM, plain PyTorch, that calls a scheme's hooks.

Edit this file to change the model: the MLP, the norm, the init. Positional schemes plug in
through their hooks (posbench/schemes/), and attention through the backend named by
model.attention (posbench/attention.py).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
from torch.nn import functional as F

from posbench.attention import backend_for, causal_attention
from posbench.config import ModelConfig
from posbench.errors import PosbenchError
from posbench.schemes import PositionalScheme, build_scheme
from posbench.schemes.distance import has_table
from posbench.schemes.training_free import VARIANTS as TRAINING_FREE

Norm = nn.LayerNorm  # every block's two norms and the final one; nn.RMSNorm works as well


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, scheme: PositionalScheme):
        super().__init__()
        self.n_head, self.layer = cfg.n_head, layer
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.scheme = [scheme]  # a list, so the shared scheme is not registered once per layer

    def forward(self, x: torch.Tensor, pos: torch.Tensor, backend: str, block) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        scheme = self.scheme[0]
        scheme.observe(x, pos, self.layer)  # what a data-dependent scheme reads from the input (FoX's gates)
        if scheme.remap is not None:  # a training-free variant at evaluation: its own eager attention
            y = scheme.remap.attention(q, k, v, pos, scheme, self.layer, block)  # (B, nh, T, hs)
        else:
            q, k = scheme.rotate(q, k, pos, self.layer)
            y = causal_attention(q, k, v, pos, scheme, self.layer, backend, block)  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, C)  # heads side by side again
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, scheme: PositionalScheme):
        super().__init__()
        self.ln1 = Norm(cfg.d_model)
        self.attn = Attention(cfg, layer, scheme)
        self.ln2 = Norm(cfg.d_model)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, pos, backend, block):
        x = x + self.drop(self.attn(self.ln1(x), pos, backend, block))
        x = x + self.drop(self.mlp(self.ln2(x)))
        return x


class TransformerLM(nn.Module):
    """forward(tokens[B, T]) -> logits[B, T, V], for any T the scheme can encode."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.scheme = build_scheme(cfg)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, i, self.scheme) for i in range(cfg.n_layer))
        self.ln_f = Norm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied, as in GPT-2 and nanoGPT
        self.attn_block = 256  # queries per attention block once T exceeds it (linear memory)
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if name.startswith("blocks.") and name.endswith("proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    @property
    def max_len(self):
        return self.scheme.max_len

    def backend(self, device: torch.device, compiled: bool = False, variant: Optional[str] = None) -> str:
        """The attention backend model.attention runs as on `device` (see attention.backend_for);
        under a training-free `variant`, eager: its remap computes attention itself (Attention)."""
        if variant in TRAINING_FREE:
            return "eager"
        dtype, table = self.tok.weight.dtype, has_table(self.scheme)
        return backend_for(self.cfg.attention, device, self.cfg.head_dim, compiled, dtype, table)

    def forward(self, tokens: torch.Tensor, pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`pos`: the position ids to use instead of the scheme's own (PoSE's skipped ones), (T,)
        for every row, or (B, T), each row its own, for a scheme whose hooks take them (RoPE)."""
        B, T = tokens.size()
        if pos is not None and pos.dim() == 2 and not self.scheme.per_row_positions:
            raise PosbenchError(
                f"scheme '{self.cfg.scheme}' takes one row of positions for the whole batch, not one per row (B, T)"
            )
        if self.max_len is not None and T > self.max_len:
            raise PosbenchError(
                f"scheme '{self.cfg.scheme}' cannot represent position {T - 1}: "
                f"it encodes at most {self.max_len} positions"
            )
        backend = self.backend(tokens.device)
        pos = self.scheme.positions(T, tokens.device) if pos is None else pos  # (T,) or (B, T)
        x = self.drop(self.scheme.embed(self.tok(tokens), pos))  # (B, T, C)
        block = self.attn_block if T > self.attn_block else None
        for blk in self.blocks:
            x = blk(x, pos, backend, block)
        return self.head(self.ln_f(x))  # (B, T, V)

    # --- what scoring asks of a model (posbench/evaluate.py); posbench/pretrained.py answers it too

    @property
    def eval_variants(self) -> tuple[str, ...]:
        """The evaluation-time variants its scheme declares (rope: linear, ntk, dynamic, yarn, llama3,
        longrope) and the training-free ones it takes (posbench/schemes/training_free.py)."""
        return tuple(v for v in self.scheme.eval_variants if v not in TRAINING_FREE or not self.scheme.refuses(v))

    def eval_variant(self, name: Optional[str], length: int, factor: Optional[float] = None):
        """A context in which the model scores as variant `name` at `length` (None: as trained)."""
        return self.scheme.eval_variant(name, self.cfg.train_len, length, factor)

    def token_losses(self, win: torch.Tensor) -> torch.Tensor:
        """Each target's loss in nats, (b, T), for windows of tokens (b, T + 1)."""
        logits = self(win[:, :-1])  # (b, T, V)
        nll = F.cross_entropy(logits.float().flatten(0, 1), win[:, 1:].flatten(), reduction="none")
        return nll.view(win.size(0), -1)
