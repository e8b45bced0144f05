"""A model whose modules no probe pattern names is told so at attach, never left silent."""

from __future__ import annotations

import pytest
import torch
from spikeguard.examples.model import GPT
from spikeguard.workers.rank.sampling import Sampler, unprobed
from torch import nn


class Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.w(x).chunk(3, -1)
        return (q @ k.transpose(-1, -2)).softmax(-1) @ v


class Odd(nn.Module):
    """Blocks as ``stages.N``, attention ``mixer``, output ``readout``: no default matches."""

    def __init__(self) -> None:
        super().__init__()
        self.stages = nn.ModuleList(nn.Sequential(Mixer()) for _ in range(2))
        self.readout = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for s in self.stages:
            x = x + s(x)
        return self.readout(x)


def test_every_kind_that_found_nothing_says_what_it_looked_for_and_how_to_name_it() -> None:
    model = Odd()
    sampler = Sampler(model, sample_every=1, probe_patterns=None)
    lines = unprobed(sampler.probes, hf_attention=False, model=model)
    assert len(lines) == 3
    residual, attention, head = lines
    assert "no blocks" in residual and "*blocks.*" in residual and "'residual'" in residual
    assert "no attention modules" in attention and "*.self_attn" in attention
    assert "record_qk" in attention
    assert "no output layer" in head and "*lm_head*" in head


def test_patterns_that_name_the_modules_silence_it() -> None:
    model = Odd()
    patterns = {"residual": ["stages.*"], "attention": ["*.0"], "lm_head": ["readout"]}
    sampler = Sampler(model, sample_every=1, probe_patterns=patterns)
    lines = unprobed(sampler.probes, hf_attention=False, model=model)
    # the residual and head patterns match; the attention module has no q/k projections to
    # find, and a matched-but-unresolved module still counts (record_qk can feed it)
    assert lines == []


def test_a_model_the_defaults_know_says_nothing() -> None:
    model = GPT(seq_len=8, n_layer=1, d_model=16, n_head=2)
    sampler = Sampler(model, sample_every=1, probe_patterns=None)
    assert unprobed(sampler.probes, hf_attention=False, model=model) == []


def test_matched_by_name_but_measuring_nothing_is_said_at_the_first_sample() -> None:
    class Attn(nn.Module):  # named like attention, but no q/k projection to read
        def __init__(self) -> None:
            super().__init__()
            self.mix = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.mix(x)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.ModuleDict({"attn": Attn()}) for _ in range(1))
            self.lm_head = nn.Linear(8, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lm_head(x + self.blocks[0]["attn"](x))

    from spikeguard.workers.rank.sampling import silent_kinds

    model = Net()
    sampler = Sampler(model, sample_every=1, probe_patterns={"residual": ()})
    assert sampler.probes.unresolved_attention  # matched by name
    sampler.start_at(0)
    model(torch.randn(2, 4, 8))
    layers, _ = sampler.take(0, 1.0)
    lines = silent_kinds(sampler.probes, layers, hf_attention=False)
    assert len(lines) == 1 and "attn_entropy_min_norm" in lines[0] and "record_qk" in lines[0]


def test_a_hugging_face_model_inside_a_wrapper_gets_the_exact_qk_capture() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPTNeoXConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=16,
        attn_implementation="sdpa",
    )

    class Wrapper(nn.Module):  # what a user's own module (or a LightningModule) looks like
        def __init__(self) -> None:
            super().__init__()
            self.hf = transformers.GPTNeoXForCausalLM(cfg)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.hf(input_ids=x).logits

    model = Wrapper()
    sampler = Sampler(model, sample_every=1, probe_patterns=None)
    try:
        # NeoX's fused query_key_value is no projection the name convention reads: only the
        # attention-function capture measures it
        assert sampler.probes.attention_names == []
        sampler.start_at(0)
        model(torch.randint(0, 32, (2, 8)))
        layers, _ = sampler.take(0, 1.0)
        assert "attn_entropy_min_norm" in layers["hf.gpt_neox.layers.0.attention"]
    finally:
        sampler.remove()
