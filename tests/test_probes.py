"""Tests of spikeguard.workers.probes on two tiny model styles (nanoGPT-like and blocks/q_proj)."""

from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch
import torch.nn.functional as F
from spikeguard.workers import measure as S
from spikeguard.workers import probes as P
from torch import nn

torch.set_num_threads(1)

ATTN_KEYS = {"attn_entropy_mean", "attn_entropy_min", "attn_entropy_min_norm", "max_logit"}


# -- model 1: nanoGPT style (transformer.h.{i}, fused attn.c_attn) --------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd = n_head, n_embd
        self._heads = n_head  # the forward's own copy (a test changes n_head)
        self.seen: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (z.view(b, t, self._heads, c // self._heads).transpose(1, 2) for z in (q, k, v))
        self.seen = (q.detach(), k.detach())
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(n, 4 * n), nn.Linear(4 * n, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class GPTBlock(nn.Module):
    def __init__(self, n: int, h: int) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = (
            nn.LayerNorm(n),
            CausalSelfAttention(n, h),
            nn.LayerNorm(n),
            MLP(n),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    def __init__(
        self, vocab: int = 50, n: int = 16, h: int = 4, layers: int = 2, block_size: int = 32
    ) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(vocab, n),
                wpe=nn.Embedding(block_size, n),
                h=nn.ModuleList([GPTBlock(n, h) for _ in range(layers)]),
                ln_f=nn.LayerNorm(n),
            )
        )
        self.lm_head = nn.Linear(n, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.shape[1]))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


# -- model 2: blocks.{i} with attn.q_proj / k_proj, GQA, tuple outputs, "head" --------------


class GQAAttention(nn.Module):
    def __init__(self, n: int, heads: int, kv_heads: int, rotate: bool = False) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, n // heads
        self.q_proj = nn.Linear(n, heads * self.head_dim)
        self.k_proj = nn.Linear(n, kv_heads * self.head_dim)
        self.v_proj = nn.Linear(n, kv_heads * self.head_dim)
        self.o_proj = nn.Linear(n, n)
        self.rotate = rotate
        self.seen: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.rotate:  # stands in for RoPE: what SDPA sees is not the projection output
            q = 3.0 * q.flip(-1)
            P.record_qk(self, q, k)
        self.seen = (q.detach(), k.detach())
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, n: int, rotate: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(n)
        self.attn = GQAAttention(n, heads=4, kv_heads=2, rotate=rotate)
        self.mlp = nn.Sequential(nn.Linear(n, 2 * n), nn.GELU(), nn.Linear(2 * n, n))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        x = x + self.attn(self.norm(x))
        return x + self.mlp(x), None


class TinyBlocks(nn.Module):
    def __init__(self, vocab: int = 40, n: int = 16, layers: int = 3, rotate: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, n)
        self.blocks = nn.ModuleList([Block(n, rotate) for _ in range(layers)])
        self.head = nn.Linear(n, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for blk in self.blocks:
            x, _ = blk(x)
        return self.head(x)


def tokens(vocab: int, b: int = 2, t: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(autouse=True)
def _disarm_leftovers() -> object:
    yield
    for p in list(P._ARMED):
        p.disarm()


@pytest.fixture
def gpt() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT().eval()


@pytest.fixture
def blocks() -> TinyBlocks:
    torch.manual_seed(0)
    return TinyBlocks().eval()


def block_outputs(model: nn.Module, names: list[str], idx: torch.Tensor) -> dict[str, torch.Tensor]:
    mods = dict(model.named_modules())
    out: dict[str, torch.Tensor] = {}
    hs = [
        mods[n].register_forward_hook(
            lambda m, a, o, n=n: out.__setitem__(n, (o[0] if isinstance(o, tuple) else o).detach())
        )
        for n in names
    ]
    with torch.no_grad():
        model(idx)
    for h in hs:
        h.remove()
    return out


# -- default patterns ----------------------------------------------------------------------


def test_default_patterns(gpt: TinyGPT, blocks: TinyBlocks) -> None:
    p = P.Probes(gpt, strict=True)
    assert p.residual_names == ["transformer.h.0", "transformer.h.1"]
    assert p.attention_names == ["transformer.h.0.attn", "transformer.h.1.attn"]
    assert p.lm_head_names == ["lm_head"] and p.unresolved_attention == []
    p = P.Probes(blocks, strict=True)
    assert p.residual_names == ["blocks.0", "blocks.1", "blocks.2"]
    assert p.attention_names == ["blocks.0.attn", "blocks.1.attn", "blocks.2.attn"]
    assert p.lm_head_names == ["head"] and p.unresolved_attention == []


def test_custom_patterns(gpt: TinyGPT) -> None:
    p = P.Probes(gpt, residual=["transformer.h.1"], attention=(), lm_head=())
    assert (p.residual_names, p.attention_names, p.lm_head_names) == (["transformer.h.1"], [], [])
    with p.sampling(0):
        gpt(tokens(50))
    assert list(p.collect()) == ["transformer.h.1"]
    with pytest.raises(TypeError):
        P.Probes(gpt, residual="*blocks.*")


# -- armed results equal the signals on the true tensors ----------------------------------


@pytest.mark.parametrize("style", ["gpt", "blocks"])
def test_armed_results_match_direct_computation(
    style: str, gpt: TinyGPT, blocks: TinyBlocks
) -> None:
    model: nn.Module = gpt if style == "gpt" else blocks
    vocab = 50 if style == "gpt" else 40
    idx = tokens(vocab)
    p = P.Probes(model, strict=True)
    with p.sampling(7), torch.no_grad():
        logits = model(idx)
    res = p.collect()
    assert p.errors == []
    assert set(res) == set(p.residual_names) | set(p.attention_names) | set(p.lm_head_names)
    outs = block_outputs(model, p.residual_names, idx)
    for name in p.residual_names:
        ratio = S.effective_rank_ratio(outs[name])
        assert res[name] == {
            "erank_ratio": pytest.approx(ratio, rel=1e-6),
            "grade": S.grade_of(ratio),
        }
        assert isinstance(res[name]["grade"], int)
    mods = dict(model.named_modules())
    for name in p.attention_names:
        q, k = mods[name].seen
        expected = S.attention_stats(q, k)
        expected.pop("head_entropy")
        assert set(res[name]) == ATTN_KEYS
        assert res[name] == pytest.approx(expected, rel=1e-5)
    (head,) = p.lm_head_names
    assert res[head] == pytest.approx(S.logz_stats(logits), rel=1e-6)
    assert p.collect() == {}


def test_record_qk_overrides_projection_capture() -> None:
    torch.manual_seed(0)
    model = TinyBlocks(rotate=True).eval()
    p = P.Probes(model, strict=True)
    for step in (0, 1):
        with p.sampling(step), torch.no_grad():
            model(tokens(40, seed=step))
        res = p.collect()
        for name in p.attention_names:
            att = dict(model.named_modules())[name]
            expected = S.attention_stats(*att.seen)
            expected.pop("head_entropy")
            assert res[name] == pytest.approx(expected, rel=1e-5)
            # ... and really differs from what the raw projections would give
            x_q = (att.seen[0] / 3.0).flip(-1)
            assert S.attention_stats(x_q, att.seen[1])["max_logit"] != pytest.approx(
                res[name]["max_logit"]
            )
    # after the first step the projection path is off: one computation per attention module
    calls = p.compute_calls
    with p.sampling(2), torch.no_grad():
        model(tokens(40))
    assert p.compute_calls - calls == 3 + 3 + 1


def test_record_qk_is_a_noop_unless_armed(blocks: TinyBlocks) -> None:
    p = P.Probes(blocks, strict=True)
    q, k = torch.randn(1, 4, 5, 4), torch.randn(1, 2, 5, 4)
    P.record_qk(blocks.blocks[0].attn, q, k)
    assert p.compute_calls == 0 and p.collect() == {}
    with p.sampling(0):
        P.record_qk(nn.Linear(2, 2), q, k)  # not part of the model: ignored
        P.record_qk(blocks.blocks[0].attn, q, k)
        P.record_qk(blocks.blocks[0].attn, q * 2, k)  # first call of the step wins
    res = p.collect()
    expected = S.attention_stats(q, k)
    expected.pop("head_entropy")
    assert res == {"blocks.0.attn": pytest.approx(expected)}
    assert p.compute_calls == 1


def test_fused_split_with_gqa_and_head_dim_only() -> None:
    x = torch.randn(2, 5, (4 + 2 * 2) * 3)
    q, k = P._AttnSpec(
        "a", nn.Module(), nn.Identity(), None, heads=4, kv_heads=2, head_dim=None
    ).qk(x, None)
    torch.testing.assert_close(q, x[..., :12].view(2, 5, 4, 3).transpose(1, 2))
    torch.testing.assert_close(k, x[..., 12:18].view(2, 5, 2, 3).transpose(1, 2))
    q, k = P._AttnSpec(
        "a", nn.Module(), nn.Identity(), None, heads=None, kv_heads=None, head_dim=2
    ).qk(x, None)
    assert q.shape == k.shape == (2, 4, 5, 2)  # no head count: equal thirds


# -- sampling: only armed steps compute, nothing retained otherwise -------------------------


def test_hooks_fire_only_on_sampled_steps(gpt: TinyGPT) -> None:
    p = P.Probes(gpt, strict=True)
    idx = tokens(50)
    with torch.no_grad():
        gpt(idx)
    assert p.compute_calls == 0 and p.collect() == {} and p._pending == {}
    p.arm(10)
    assert p.armed_step == 10
    with torch.no_grad():
        gpt(idx)
        gpt(idx)  # second forward in the same step (e.g. recomputation): nothing more
    assert p.compute_calls == 2 + 2 + 1
    p.disarm()
    assert p.armed_step is None and p.last_step == 10
    with torch.no_grad():
        gpt(idx)
    assert p.compute_calls == 5
    assert len(p.collect()) == 5
    p.arm(11)
    with torch.no_grad():
        gpt(idx)
    assert p.compute_calls == 10
    p.arm(12)  # re-arming drops the uncollected results of step 11
    assert p.collect() == {}


def test_split_projection_pending_is_released(blocks: TinyBlocks) -> None:
    p = P.Probes(blocks, strict=True)
    with p.sampling(0), torch.no_grad():
        blocks(tokens(40))
        assert p._pending == {}  # released as soon as K arrived, not only at disarm
    assert len(p.collect()) == 3 + 3 + 1


@pytest.mark.parametrize("armed", [False, True])
def test_no_tensors_retained(blocks: TinyBlocks, armed: bool) -> None:
    p = P.Probes(blocks, strict=True)
    refs: list[weakref.ref[torch.Tensor]] = []
    spies = [
        m.register_forward_hook(
            lambda mod, a, o: refs.append(weakref.ref(o[0] if isinstance(o, tuple) else o))
        )
        for m in (
            blocks.blocks[0],
            blocks.blocks[0].attn.q_proj,
            blocks.blocks[0].attn.k_proj,
            blocks.head,
        )
    ]
    if armed:
        p.arm(0)
    with torch.no_grad():
        out = blocks(tokens(40))
    p.disarm()
    del out
    for s in spies:
        s.remove()
    for m in blocks.modules():
        if hasattr(m, "seen"):
            m.seen = None
    gc.collect()
    assert len(refs) == 4 and all(r() is None for r in refs)
    assert p.compute_calls == (7 if armed else 0)


def test_sampling_context_disarms_on_error(gpt: TinyGPT) -> None:
    p = P.Probes(gpt)
    with pytest.raises(RuntimeError), p.sampling(3):
        raise RuntimeError("boom")
    assert p.armed_step is None and P._ARMED == []


def test_residual_rows_are_sampled_deterministically(gpt: TinyGPT) -> None:
    idx = tokens(50, b=4, t=30)
    res = []
    for _ in range(2):
        p = P.Probes(gpt, max_rows=20, attention=(), lm_head=(), seed=1, strict=True)
        with p.sampling(5), torch.no_grad():
            gpt(idx)
        res.append(p.collect())
        p.remove()
    assert res[0] == res[1]
    full = S.effective_rank_ratio(block_outputs(gpt, ["transformer.h.0"], idx)["transformer.h.0"])
    # 20 sampled rows of width 16: the ratio is relative to min(20, 16, 32) and differs from the
    # full one
    assert 0 < res[0]["transformer.h.0"]["erank_ratio"] <= 1
    assert res[0]["transformer.h.0"]["erank_ratio"] != pytest.approx(full, rel=1e-6)


def test_probing_leaves_global_rng_alone(gpt: TinyGPT) -> None:
    p = P.Probes(gpt, max_rows=10, max_queries=4, strict=True)
    state = torch.get_rng_state()
    with p.sampling(0), torch.no_grad():
        gpt(tokens(50, t=20))
    assert torch.equal(state, torch.get_rng_state())
    assert len(p.collect()) == 5


def test_errors_recorded_not_raised() -> None:
    model = TinyGPT(n=16, h=4)
    for blk in model.transformer.h:
        blk.attn.n_head = 5  # 48 is not 3 * 5 * head_dim: the fused split must fail
    p = P.Probes(model)
    with p.sampling(0), torch.no_grad():
        model(tokens(50))
    res = p.collect()
    assert "transformer.h.0.attn" not in res and "transformer.h.0" in res
    assert len(p.errors) == 2 and "cannot split" in p.errors[0]
    strict = P.Probes(model, strict=True)
    with pytest.raises(ValueError, match="cannot split"), strict.sampling(0), torch.no_grad():
        model(tokens(50))


def test_non_finite_activations_give_nan_not_exceptions(gpt: TinyGPT) -> None:
    with torch.no_grad():
        gpt.transformer.wte.weight[3] = float("nan")
    p = P.Probes(gpt, strict=True)
    idx = tokens(50)
    idx[0, 0] = 3
    with p.sampling(0), torch.no_grad():
        gpt(idx)
    res = p.collect()
    assert (
        math.isnan(res["transformer.h.0"]["erank_ratio"]) and res["transformer.h.0"]["grade"] == 0
    )
    assert math.isnan(res["transformer.h.1.attn"]["attn_entropy_min"])
    assert math.isnan(res["lm_head"]["logz_max"])


# -- removal -------------------------------------------------------------------------------


@pytest.mark.parametrize("style", ["gpt", "blocks"])
def test_remove_detaches_every_hook(style: str, gpt: TinyGPT, blocks: TinyBlocks) -> None:
    model: nn.Module = gpt if style == "gpt" else blocks
    idx = tokens(50 if style == "gpt" else 40)
    p = P.Probes(model, strict=True)
    assert sum(len(m._forward_hooks) for m in model.modules()) > 0
    p.remove()
    assert all(len(m._forward_hooks) == 0 for m in model.modules())
    p.arm(0)
    with torch.no_grad():
        model(idx)
    assert p.collect() == {} and p.compute_calls == 0
    p.remove()  # idempotent
