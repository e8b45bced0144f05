"""The Hugging Face attention capture: ``attach(model)`` on a transformers decoder reports the
entropies of the exact Q and K its attention kernel receives (after RoPE and QK-norm), equal to
the entropies of the probabilities ``eager`` attention materialises on the same inputs."""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from spikeguard.workers import attach  # noqa: E402
from spikeguard.workers.integrations import hf_attention  # noqa: E402

SEQ = 24


def _llama(impl: str) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA
        max_position_embeddings=64,
        rope_theta=10000.0,
        attn_implementation=impl,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _qwen3(impl: str) -> torch.nn.Module:
    cfg = transformers.Qwen3Config(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        attn_implementation=impl,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # a QK-norm that matters: weights far from the identity
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.2, 3.0)
            layer.self_attn.k_norm.weight.uniform_(0.2, 3.0)
    return model


def _reference(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> list[list[float]]:
    """Per layer, the per-head entropy of eager's materialised probabilities, averaged over
    batch and query rows (right padding: every query row sees at least one real key)."""
    saved = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, output_attentions=True)
    finally:
        model.set_attn_implementation(saved)
    per_layer = []
    for probs in out.attentions:  # [b, heads, s, s]
        ent = torch.special.entr(probs.double()).sum(-1)  # [b, heads, s]
        per_layer.append(ent.mean(dim=(0, 2)).tolist())
    return per_layer


@pytest.mark.parametrize("build", [_llama, _qwen3], ids=["llama", "qwen3-qknorm"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("padded", [False, True], ids=["full", "right-padded"])
def test_registry_capture_equals_eager_materialised_entropy(build, impl, padded) -> None:
    model = build(impl)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (3, SEQ), generator=g)
    mask = torch.ones_like(ids)
    if padded:
        mask[1, SEQ - 7 :] = 0
        mask[2, SEQ - 2 :] = 0
    ref = _reference(model, ids, mask)
    sg = attach(model, sample_every=1, probe_patterns={"attention": ()})  # no projection capture
    try:
        assert model.config._attn_implementation == impl  # the model is not switched
        with torch.no_grad(), sg.probes.sampling(0):
            model(input_ids=ids, attention_mask=mask)
        got = sg.probes.collect()
        assert not sg.probes.errors, sg.probes.errors
    finally:
        sg.close()
    names = [f"model.layers.{i}.self_attn" for i in range(len(ref))]
    assert sorted(n for n in got if n.endswith("self_attn")) == names
    for name, heads in zip(names, ref):
        assert got[name]["attn_entropy_mean"] == pytest.approx(sum(heads) / len(heads), abs=1e-4)
        assert got[name]["attn_entropy_min"] == pytest.approx(min(heads), abs=1e-4)
    # and the capture is gone: the registry holds what it held before
    assert not hf_attention.installed()
    registry = hf_attention._registry()
    assert "eager" not in registry._local_mapping
    assert not hasattr(registry["sdpa"], "spikeguard_wrapped")


def test_projection_capture_alone_is_wrong_on_rope_and_the_registry_fixes_it() -> None:
    """Why the capture exists: the projections' Q and K (before RoPE) give other entropies."""
    model = _llama("sdpa")
    with torch.no_grad():  # sharp attention, where the rotation matters
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(6.0)
            layer.self_attn.k_proj.weight.mul_(6.0)
    ids = torch.randint(0, 97, (2, SEQ), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    ref = _reference(model, ids, mask)[0]
    from spikeguard.workers.probes import Probes

    plain = Probes(model)  # projection capture only (no attach: no registry wrapper)
    with torch.no_grad(), plain.sampling(0):
        model(input_ids=ids, attention_mask=mask)
    before_rope = plain.collect()["model.layers.0.self_attn"]["attn_entropy_mean"]
    plain.remove()
    assert not math.isclose(before_rope, sum(ref) / len(ref), abs_tol=1e-2)

    sg = attach(model, sample_every=1)  # projection capture on, then overridden by the registry
    try:
        with torch.no_grad(), sg.probes.sampling(0):
            model(input_ids=ids, attention_mask=mask)
        got = sg.probes.collect()["model.layers.0.self_attn"]["attn_entropy_mean"]
    finally:
        sg.close()
    assert got == pytest.approx(sum(ref) / len(ref), abs=1e-4)


def test_unarmed_steps_record_nothing_and_the_output_is_unchanged() -> None:
    model = _llama("sdpa")
    ids = torch.randint(0, 97, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    sg = attach(model, sample_every=1000)
    try:
        sg.probes.disarm()
        calls = sg.probes.compute_calls
        with torch.no_grad():
            after = model(input_ids=ids).logits
        assert sg.probes.compute_calls == calls and sg.probes.collect() == {}
        assert torch.equal(before, after)
    finally:
        sg.close()
