"""The divergence zoo's models: several families, each small enough for one CPU core.

Every model maps ``[batch, seq]`` byte ids to ``[batch, seq, 256]`` logits and has an output
layer reachable as :func:`head_params` (the logit blow-up case raises its LR alone). None of them
was written for spikeguard: the Hugging Face ones are built from their configs with random
weights, exactly as a user's would be, and the ``unnamed`` one names its modules the way no probe
default looks for.

======== ==================================================================================
name     what it is
======== ==================================================================================
gpt      the example GPT (:mod:`spikeguard.examples.model`): learned positions, no QK-norm
gpt-qk   the same with RMSNorm on q and k per head (the known fix)
qwen3    ``Qwen3ForCausalLM``: RoPE, QK-norm, GQA (4 query heads, 2 KV heads), SwiGLU
neox     ``GPTNeoXForCausalLM``: partial RoPE, parallel residual, fused ``query_key_value``
gemma    ``GemmaForCausalLM``: RoPE, GQA, GeGLU, tied embeddings scaled by sqrt(d)
unnamed  a transformer whose blocks are ``stages.N``, attention ``mix`` with one fused
         ``w`` projection and an output layer ``readout``: no default probe pattern matches
         any of it, so only loss and grad norm report (``attach`` says so)
======== ==================================================================================
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 256
D_MODEL = 64
N_LAYER = 3
N_HEAD = 4


class ByteLM(nn.Module):
    """A Hugging Face causal LM behind the zoo's interface (``forward(x) -> logits``)."""

    def __init__(self, hf: nn.Module):
        super().__init__()
        self.hf = hf

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=x, use_cache=False).logits


class _GPT(nn.Module):
    def __init__(self, seq_len: int, qk_norm: bool):
        super().__init__()
        from spikeguard.examples.model import GPT

        self.inner = GPT(seq_len=seq_len, qk_norm=qk_norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)[0]


def gpt(seq_len: int, qk_norm: bool = False) -> nn.Module:
    """The example GPT; its blocks are ``inner.blocks.N`` and attention ``inner.blocks.N.attn``."""
    return _GPT(seq_len, qk_norm)


def _shape(seq_len: int) -> dict:
    """The size every Hugging Face family of the zoo shares (its config's common fields)."""
    return dict(
        vocab_size=VOCAB,
        hidden_size=D_MODEL,
        intermediate_size=4 * D_MODEL,
        num_hidden_layers=N_LAYER,
        num_attention_heads=N_HEAD,
        max_position_embeddings=2 * seq_len,
        attn_implementation="sdpa",
    )


def qwen3(seq_len: int) -> nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        **_shape(seq_len),
        num_key_value_heads=2,
        head_dim=D_MODEL // N_HEAD,
        tie_word_embeddings=False,
    )
    return ByteLM(Qwen3ForCausalLM(cfg))


def neox(seq_len: int) -> nn.Module:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cfg = GPTNeoXConfig(
        **_shape(seq_len),
        rotary_pct=0.5,
        use_parallel_residual=True,
        tie_word_embeddings=False,
    )
    return ByteLM(GPTNeoXForCausalLM(cfg))


def gemma(seq_len: int) -> nn.Module:
    from transformers import GemmaConfig, GemmaForCausalLM

    cfg = GemmaConfig(**_shape(seq_len), num_key_value_heads=1, head_dim=D_MODEL // N_HEAD)
    return ByteLM(GemmaForCausalLM(cfg))


class _Mix(nn.Module):
    """Causal self-attention computed inline from one fused projection named ``w``."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.w = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.w(x).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        return self.out((att @ v).transpose(1, 2).reshape(b, t, d))


class _Stage(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.mix = _Mix(d, heads)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mix(self.n1(x))
        return x + self.ff(self.n2(x))


class Unnamed(nn.Module):
    """A pre-norm transformer with names no probe default matches (see the module docstring)."""

    def __init__(self, seq_len: int):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Parameter(torch.randn(seq_len, D_MODEL) * 0.02)
        self.stages = nn.ModuleList(_Stage(D_MODEL, N_HEAD) for _ in range(N_LAYER))
        self.norm = nn.LayerNorm(D_MODEL)
        self.readout = nn.Linear(D_MODEL, VOCAB, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos[: x.shape[1]]
        for s in self.stages:
            h = s(h)
        return self.readout(self.norm(h))


MODELS: dict[str, Callable[[int], nn.Module]] = {
    "gpt": lambda seq: gpt(seq, qk_norm=False),
    "gpt-qk": lambda seq: gpt(seq, qk_norm=True),
    "qwen3": qwen3,
    "neox": neox,
    "gemma": gemma,
    "unnamed": Unnamed,
}
"""Model name (as cases name them) -> builder of ``seq_len``."""

HEAD_NAMES = ("lm_head", "embed_out", "readout")
"""Parameter-name parts of the output layers (tied Gemma: its embedding is its output layer)."""


def head_params(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(output-layer parameters, the rest): the logit blow-up case gives the first its own LR."""
    head, rest = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        is_head = any(h in name for h in HEAD_NAMES) or name.endswith("embed_tokens.weight")
        (head if is_head else rest).append(p)
    return head, rest


def build(name: str, seq_len: int, seed: int) -> nn.Module:
    """Model ``name`` with the weights of ``seed``."""
    torch.manual_seed(seed)
    return MODELS[name](seq_len)


def loss_of(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
