"""A small byte-level GPT for the diverging example.

Layout (the SDK's probes rely on these names):

- ``blocks.{i}.attn`` has ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` (``nn.Linear``)
  and an ``n_head`` attribute; Q and K are captured by forward hooks on
  ``q_proj`` / ``k_proj``.
- ``ln_f`` and ``lm_head`` at the top.

Attention goes through ``F.scaled_dot_product_attention`` (causal). ``qk_norm``
adds an RMSNorm over each head's q and k (with a learned gain), the known fix
for attention-logit growth. The attention forward hands the exact SDPA inputs
to ``spikeguard.workers.probes.record_qk`` (a no-op unless a probe is armed),
so the SDK's entropies and max logit are right with QK-norm as well.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

try:  # the SDK's explicit Q/K capture: exact for QK-norm too; a no-op unless a probe is armed
    from spikeguard.workers.probes import record_qk
except ImportError:  # pragma: no cover - the example also runs without the SDK

    def record_qk(module, q, k, **kw):  # type: ignore[misc]
        return None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, d_model: int, n_head: int, qk_norm: bool = False):
        super().__init__()
        assert d_model % n_head == 0
        self.n_head = n_head
        self.head_dim = d_model // n_head
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.o_proj = nn.Linear(d_model, d_model)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim)
            self.k_norm = RMSNorm(self.head_dim)
        # When True, the next forward also records the largest pre-softmax
        # (causal, scaled) attention logit in ``last_max_logit`` (a float).
        self.record_logits = False
        self.last_max_logit: float | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h, hd = self.n_head, self.head_dim
        q = self.q_proj(x).view(b, t, h, hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, h, hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, h, hd).transpose(1, 2)
        if self.qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        record_qk(self, q, k)  # what SDPA sees (after QK-norm), for the SDK's attention probes
        if self.record_logits:
            with torch.no_grad():
                logits = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
                mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
                self.last_max_logit = float(logits.masked_fill(~mask, float("-inf")).max())
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, d_model: int):
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, qk_norm: bool = False):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = Attention(d_model, n_head, qk_norm)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(
        self,
        vocab: int = 256,
        seq_len: int = 64,
        d_model: int = 64,
        n_layer: int = 3,
        n_head: int = 4,
        qk_norm: bool = False,
    ):
        super().__init__()
        self.seq_len = seq_len
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head, qk_norm) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        self.apply(self._init)
        # GPT-2 style: scale the residual projections by depth.
        for name, p in self.named_parameters():
            if name.endswith("o_proj.weight") or name.endswith("mlp.proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        _, t = idx.shape
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    def max_attn_logit(self) -> float | None:
        """Largest logit recorded by the last forward with ``record_logits`` on (over layers)."""
        vals = [b.attn.last_max_logit for b in self.blocks if b.attn.last_max_logit is not None]
        return max(vals) if vals else None

    def set_record_logits(self, on: bool) -> None:
        for b in self.blocks:
            b.attn.record_logits = on
            if not on:
                b.attn.last_max_logit = None
