"""Tests of spikeguard.workers.measure: effective rank, grades, attention entropy, log Z."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from spikeguard.workers import measure as S

torch.set_num_threads(1)

METHODS = ("svd", "gram", "lowrank")


def ref_erank(x: torch.Tensor, k: int = 32) -> float:
    """Independent reference: float64 svdvals, plain entropy formula."""
    s = torch.linalg.svdvals(x.reshape(-1, x.shape[-1]).double())[:k]
    p = s / s.sum()
    p = p[p > 0]
    return math.exp(float(-(p * p.log()).sum()))


def with_spectrum(rows: int, d: int, s: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """U diag(s) V^T with random orthonormal U (rows x r), V (d x r)."""
    g = torch.Generator().manual_seed(seed)
    r = s.numel()
    u = torch.linalg.qr(torch.randn(rows, r, generator=g, dtype=torch.float64)).Q
    v = torch.linalg.qr(torch.randn(d, r, generator=g, dtype=torch.float64)).Q
    return ((u * s.double()) @ v.T).float()


def realistic(rows: int, d: int, kind: str, seed: int = 0) -> torch.Tensor:
    """Activation-like matrices (spectrum shaped by a random mixing, not exact)."""
    g = torch.Generator().manual_seed(seed)
    r = min(rows, d)
    i = torch.arange(1, r + 1, dtype=torch.float32)
    if kind == "gauss":
        return torch.randn(rows, d, generator=g)
    if kind.startswith("pow"):
        s = i ** -float(kind[3:])
    elif kind == "outlier":  # power law with a few massive-activation directions
        s = i**-0.5
        s[:3] *= 30
    elif kind == "exp":
        s = torch.exp(-i / 10)
    elif kind.startswith("floor"):  # 8 strong directions over a flat noise floor
        s = torch.full((r,), float(kind[5:]))
        s[:8] = 1.0
    else:
        raise AssertionError(kind)
    return (torch.randn(rows, r, generator=g) * s) @ torch.randn(r, d, generator=g) / math.sqrt(d)


# -- effective rank: known spectra -------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("n", [16, 64])
def test_identity_has_ratio_one(method: str, n: int) -> None:
    assert S.effective_rank_ratio(torch.eye(n), method=method) == pytest.approx(1.0, rel=1e-6)
    assert S.effective_rank(torch.eye(n), method=method) == pytest.approx(min(n, 32), rel=1e-6)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shape", [(50, 40), (10, 20), (300, 200)])
def test_rank_one(method: str, shape: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape[0], 1, generator=g) @ torch.randn(1, shape[1], generator=g)
    assert S.effective_rank(x, method=method) == pytest.approx(1.0, rel=1e-4)
    assert S.effective_rank_ratio(x, method=method) == pytest.approx(1 / min(*shape, 32), rel=1e-4)


def geometric_erank(rho: float, n: int) -> float:
    """Closed form: p_i = c rho^i (i < n), H = -log c - log(rho) E[i]."""
    c = (1 - rho) / (1 - rho**n)
    mean_i = rho / (1 - rho) - n * rho**n / (1 - rho**n)
    return math.exp(-math.log(c) - math.log(rho) * mean_i)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("rho", [0.5, 0.8, 0.95])
@pytest.mark.parametrize("shape,r", [((96, 48), 48), ((600, 200), 64), ((40, 300), 20)])
def test_geometric_spectrum_matches_closed_form(
    method: str, rho: float, shape: tuple[int, int], r: int
) -> None:
    s = rho ** torch.arange(r, dtype=torch.float64)
    x = with_spectrum(*shape, s)
    n = min(r, 32)
    expected = geometric_erank(rho, n)
    assert S.effective_rank(x, method=method) == pytest.approx(expected, rel=1e-4)
    assert S.effective_rank_ratio(x, method=method) == pytest.approx(
        expected / min(*shape, 32), rel=1e-4
    )


def test_k_limits_the_spectrum() -> None:
    s = 0.9 ** torch.arange(40, dtype=torch.float64)
    x = with_spectrum(100, 60, s)
    assert S.effective_rank(x, 8) == pytest.approx(geometric_erank(0.9, 8), rel=1e-4)
    assert S.effective_rank_ratio(x, 8) == pytest.approx(geometric_erank(0.9, 8) / 8, rel=1e-4)


# -- effective rank: fast paths vs reference ---------------------------------------------


def test_auto_picks_by_shape() -> None:
    assert S.choose_method(4096, 64) == "svd"
    assert S.choose_method(64, 4096) == "svd"
    assert S.choose_method(2048, 512) == "gram"
    assert S.choose_method(512, 8192) == "gram"
    assert S.choose_method(8192, 1024) == "lowrank"
    assert S.choose_method(1024, 8192) == "lowrank"
    assert S.choose_method(4096, 4096) == "lowrank"


@pytest.mark.parametrize("shape", [(3000, 520), (520, 700)])
def test_lowrank_basis_never_outgrows_a_narrow_matrix(shape: tuple[int, int]) -> None:
    # 520 columns hold 10 blocks of 48 at most: the Krylov basis must stop growing before it
    # runs out of directions (an exhausted block would break the Rayleigh-Ritz step)
    x = realistic(*shape, "pow0.5")
    assert S.effective_rank(x, method="lowrank") == pytest.approx(ref_erank(x), rel=1e-3)


def test_lowrank_exact_on_a_rank_deficient_matrix() -> None:
    # rank 5 < block: every later Krylov block is numerically dependent on the first
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2048, 5, generator=g) @ torch.randn(5, 1024, generator=g)
    assert S.effective_rank(x, method="lowrank") == pytest.approx(ref_erank(x), rel=1e-4)


def test_nonfinite_found_whether_or_not_the_sum_overflows() -> None:
    x = realistic(600, 40, "pow0.5")
    big = (x / x.abs().max() * 1000 + 1000).half()  # finite, but its float16 sum is inf
    assert not math.isfinite(float(big.sum()))
    assert S.effective_rank(big) == pytest.approx(ref_erank(big.float()), rel=1e-3)
    for bad in (math.nan, math.inf, -math.inf):
        y = x.clone()
        y[17, 3] = bad
        assert math.isnan(S.effective_rank(y))


@pytest.mark.parametrize("shape", [(2048, 160), (160, 1536), (1024, 512), (300, 300)])
@pytest.mark.parametrize("kind", ["gauss", "pow0.5", "outlier", "floor0.01"])
def test_gram_agrees_with_svdvals(shape: tuple[int, int], kind: str) -> None:
    x = realistic(*shape, kind)
    ref = ref_erank(x)
    assert S.choose_method(*shape) == "gram"
    assert S.effective_rank(x) == pytest.approx(ref, rel=1e-5)
    assert S.effective_rank(x, method="svd") == pytest.approx(ref, rel=1e-5)


@pytest.mark.parametrize("kind", ["gauss", "pow0.3", "pow0.5", "pow1.0", "outlier", "exp"])
def test_lowrank_within_1e3_on_realistic_spectra(kind: str) -> None:
    # 2048 x 1024: the Krylov subspace (5 x 48) is a small part of the column space,
    # so this is the regime where a randomized method can be off.
    x = realistic(2048, 1024, kind)
    ref = ref_erank(x)
    assert S.effective_rank(x, method="lowrank") == pytest.approx(ref, rel=1e-3)


@pytest.mark.parametrize("floor", [0.01, 0.03])
def test_lowrank_noise_floor_tolerance(floor: float) -> None:
    # The documented weak case: a few strong directions over a flat noise floor.
    # The error is a few 1e-3 at most and always an *under*-estimate.
    x = realistic(2048, 1024, f"floor{floor}")
    ref = ref_erank(x)
    got = S.effective_rank(x, method="lowrank")
    assert -3e-3 < (got - ref) / ref <= 1e-6


def test_auto_uses_lowrank_above_gram_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(S, "GRAM_MAX_DIM", 256)
    x = realistic(768, 512, "pow0.5")
    assert S.choose_method(768, 512) == "lowrank"
    assert S.effective_rank(x) == S.effective_rank(x, method="lowrank")
    assert S.effective_rank(x) == pytest.approx(ref_erank(x), rel=1e-3)


def test_lowrank_is_deterministic_and_leaves_global_rng_alone() -> None:
    x = realistic(600, 400, "pow0.3")
    state = torch.get_rng_state()
    a = S.effective_rank(x, method="lowrank")
    assert torch.equal(state, torch.get_rng_state())
    assert S.effective_rank(x, method="lowrank") == a


def test_flattens_leading_dims_and_handles_dtypes() -> None:
    x = realistic(4 * 60, 48, "pow0.5").reshape(4, 60, 48)
    ref = ref_erank(x)
    assert S.effective_rank(x) == pytest.approx(ref, rel=1e-5)
    assert S.effective_rank_ratio(x) == pytest.approx(ref / 32, rel=1e-5)
    assert S.effective_rank(x.bfloat16()) == pytest.approx(ref, rel=2e-2)
    assert S.effective_rank(x.double()) == pytest.approx(ref, rel=1e-5)
    y = x.clone().requires_grad_(True)
    assert S.effective_rank(y * 2) == pytest.approx(ref, rel=1e-5)


@pytest.mark.parametrize("method", ["auto", *METHODS])
def test_zero_matrix_is_zero(method: str) -> None:
    assert S.effective_rank_ratio(torch.zeros(20, 10), method=method) == 0.0
    assert S.effective_rank(torch.zeros(200, 300), method=method) == 0.0


@pytest.mark.parametrize("method", ["auto", *METHODS])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_gives_nan(method: str, bad: float) -> None:
    x = torch.randn(30, 20)
    x[3, 4] = bad
    assert math.isnan(S.effective_rank_ratio(x, method=method))
    assert math.isnan(S.effective_rank(x, method=method))


def test_effective_rank_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        S.effective_rank(torch.randn(4, 4), 0)
    with pytest.raises(ValueError):
        S.effective_rank(torch.randn(4, 4), method="qr")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        S.effective_rank(torch.randn(0, 4))
    with pytest.raises(ValueError):
        S.effective_rank(torch.tensor(1.0))
    with pytest.raises(ValueError):  # arguments are checked before the finiteness test
        S.effective_rank(torch.full((4, 4), float("nan")), -1)


# -- grades ------------------------------------------------------------------------------


def test_grade_boundaries() -> None:
    t = S.DEFAULT_THRESHOLDS
    assert t == (0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1)
    for i, th in enumerate(t):
        assert S.grade_of(th) == 6 - i, th  # exactly at a threshold: not above it
        assert S.grade_of(th + 1e-9) == 7 - i, th
        assert S.grade_of(th - 1e-9) == 6 - i, th
    assert S.grade_of(0.7) == 6 and S.grade_of(0.7 + 1e-12) == 7
    assert S.grade_of(0.1) == 0 and S.grade_of(0.1 + 1e-12) == 1
    assert S.grade_of(1.0) == 7 and S.grade_of(0.0) == 0 and S.grade_of(-1.0) == 0
    assert S.grade_of(float("nan")) == 0


def test_grade_custom_thresholds_and_validation() -> None:
    t = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3)
    assert S.grade_of(0.85, t) == 6
    assert S.grade_of(0.3, t) == 0
    for bad in [
        (0.7, 0.6, 0.5, 0.4, 0.3, 0.2),
        (0.7, 0.6, 0.6, 0.4, 0.3, 0.2, 0.1),
        (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7),
        (1.0, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1),
        (0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.0),
        (0.7, 0.6, 0.5, 0.4, 0.3, 0.2, float("nan")),
    ]:
        with pytest.raises(ValueError):
            S.grade_of(0.5, bad)


def test_format_and_parse_grade() -> None:
    for g in range(8):
        assert S.format_grade(g) == f"S{g}"
        assert S.parse_grade(S.format_grade(g)) == g
    for bad_g in (-1, 8, True, 2.0):
        with pytest.raises(ValueError):
            S.format_grade(bad_g)  # type: ignore[arg-type]
    for bad_s in ("S8", "s5", "5", "S", "S05", " S5", "S-1", "", 5):
        with pytest.raises(ValueError, match="grade"):
            S.parse_grade(bad_s)  # type: ignore[arg-type]


# -- attention ---------------------------------------------------------------------------


def explicit_probs(
    q: torch.Tensor, k: torch.Tensor, causal: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        logits = logits.masked_fill(~mask, float("-inf"))
    return logits, torch.softmax(logits, -1)


def test_uniform_attention_has_log_keys_entropy() -> None:
    q, k = torch.zeros(2, 3, 6, 8), torch.randn(2, 3, 6, 8)
    st = S.attention_stats(q, k)
    expected = sum(math.log(i + 1) for i in range(6)) / 6
    assert st["attn_entropy_mean"] == pytest.approx(expected, rel=1e-5)
    assert st["attn_entropy_min"] == pytest.approx(expected, rel=1e-5)
    assert st["attn_entropy_min_norm"] == pytest.approx(1.0, rel=1e-5)
    assert st["max_logit"] == 0.0
    st = S.attention_stats(q, k, causal=False)
    assert st["attn_entropy_min"] == pytest.approx(math.log(6), rel=1e-5)
    assert st["attn_entropy_min_norm"] == pytest.approx(1.0, rel=1e-5)


def test_one_hot_attention_has_zero_entropy() -> None:
    q, k = torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4)
    q[..., 0] = 100.0
    k[:, :, 0, 0] = 100.0  # key 0 is visible to every query
    st = S.attention_stats(q, k)
    assert st["attn_entropy_mean"] < 1e-6
    assert st["attn_entropy_min_norm"] < 1e-6
    assert st["max_logit"] == pytest.approx(100 * 100 / 2, rel=1e-6)


def test_causal_mask_respected() -> None:
    q, k = torch.zeros(1, 2, 1, 4), torch.randn(1, 2, 5, 4)
    assert S.attention_stats(q, k)["attn_entropy_mean"] == 0.0  # query 0 sees key 0 only
    assert S.attention_stats(q, k, causal=False)["attn_entropy_mean"] == pytest.approx(
        math.log(5), rel=1e-5
    )
    # a huge logit on a future key must not leak into max_logit or the entropy
    q2, k2 = torch.zeros(1, 1, 4, 2), torch.zeros(1, 1, 4, 2)
    q2[0, 0, :3, 0] = 1.0  # queries 0..2 would all pick key 3 if they could see it
    k2[0, 0, 3, 0] = 1e4
    st = S.attention_stats(q2, k2)
    assert st["max_logit"] == 0.0
    assert st["attn_entropy_mean"] == pytest.approx(
        sum(math.log(n) for n in (1, 2, 3, 4)) / 4, rel=1e-5
    )
    assert S.attention_stats(q2, k2, causal=False)["max_logit"] == pytest.approx(1e4 / math.sqrt(2))


def test_matches_sdpa_probabilities() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 10, 8, generator=g) for _ in range(3))
    logits, probs = explicit_probs(q, k)
    # the explicit probabilities are the ones SDPA uses
    torch.testing.assert_close(probs @ v, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    head = torch.special.entr(probs).sum(-1).mean(dim=(0, 2))
    st = S.attention_stats(q, k)
    torch.testing.assert_close(torch.tensor(st["head_entropy"]), head)
    assert st["attn_entropy_mean"] == pytest.approx(float(head.mean()), rel=1e-5)
    assert st["attn_entropy_min"] == pytest.approx(float(head.min()), rel=1e-5)
    mean_log = sum(math.log(i + 1) for i in range(10)) / 10
    assert st["attn_entropy_min_norm"] == pytest.approx(float(head.min()) / mean_log, rel=1e-5)
    assert st["max_logit"] == pytest.approx(float(logits.max()), rel=1e-6)


def test_gqa_matches_repeat_interleave_and_sdpa() -> None:
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 6, 7, 8, generator=g)
    k = torch.randn(2, 2, 7, 8, generator=g)
    v = torch.randn(2, 2, 7, 8, generator=g)
    kr = k.repeat_interleave(3, dim=1)
    _, probs = explicit_probs(q, kr)
    torch.testing.assert_close(
        probs @ v.repeat_interleave(3, dim=1),
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
    )
    st = S.attention_stats(q, k)
    assert st["head_entropy"] == pytest.approx(S.attention_stats(q, kr)["head_entropy"], rel=1e-6)
    torch.testing.assert_close(
        torch.tensor(st["head_entropy"]), torch.special.entr(probs).sum(-1).mean(dim=(0, 2))
    )
    with pytest.raises(ValueError):
        S.attention_stats(q, torch.randn(2, 4, 7, 8))


def test_query_sampling_includes_last_row_and_is_deterministic() -> None:
    q, k = torch.zeros(1, 2, 200, 4), torch.zeros(1, 2, 200, 4)
    q[0, :, -1, 0] = 50.0  # only the last query row has a non-zero logit
    k[0, :, 0, 0] = 50.0
    for gen in (None, torch.Generator().manual_seed(3)):
        st = S.attention_stats(q, k, max_queries=8, generator=gen)
        assert st["max_logit"] == pytest.approx(50 * 50 / 2)
    g = torch.Generator().manual_seed(0)
    qr, kr = torch.randn(1, 2, 200, 4, generator=g), torch.randn(1, 2, 200, 4, generator=g)
    a = S.attention_stats(qr, kr, max_queries=8, generator=torch.Generator().manual_seed(5))
    b = S.attention_stats(qr, kr, max_queries=8, generator=torch.Generator().manual_seed(5))
    assert a == b
    state = torch.get_rng_state()
    S.attention_stats(qr, kr, max_queries=8)
    assert torch.equal(state, torch.get_rng_state())


def test_single_key_normalised_entropy_is_one() -> None:
    st = S.attention_stats(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))
    assert st["attn_entropy_min"] == 0.0 and st["attn_entropy_min_norm"] == 1.0


@pytest.mark.parametrize("where", ["q", "k"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_attention_non_finite_gives_nan(where: str, bad: float) -> None:
    q, k = torch.randn(1, 3, 5, 4), torch.randn(1, 3, 5, 4)
    (q if where == "q" else k)[0, 1, 2, 3] = bad
    st = S.attention_stats(q, k)
    for key in ("attn_entropy_mean", "attn_entropy_min", "attn_entropy_min_norm", "max_logit"):
        assert math.isnan(st[key])  # type: ignore[arg-type]
    assert len(st["head_entropy"]) == 3 and all(math.isnan(v) for v in st["head_entropy"])  # type: ignore[union-attr]


def test_attention_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError):
        S.attention_stats(torch.randn(3, 5, 4), torch.randn(3, 5, 4))
    with pytest.raises(ValueError):
        S.attention_stats(torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 8))


# -- log Z -------------------------------------------------------------------------------


def test_logz_matches_logsumexp() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, 50, generator=g) * 4
    ref = torch.logsumexp(x, -1)
    st = S.logz_stats(x)
    assert st["logz_mean"] == pytest.approx(float(ref.mean()), rel=1e-6)
    assert st["logz_max"] == pytest.approx(float(ref.max()), rel=1e-6)
    assert S.logz_stats(x, chunk_elements=100) == pytest.approx(st, rel=1e-6)
    assert S.logz_stats(x.bfloat16())["logz_max"] == pytest.approx(float(ref.max()), rel=2e-2)


def test_logz_non_finite() -> None:
    x = torch.randn(4, 10)
    x[1, 2] = float("nan")
    st = S.logz_stats(x)
    assert math.isnan(st["logz_mean"]) and math.isnan(st["logz_max"])
    y = torch.randn(4, 10)
    y[:, 0] = float("-inf")  # masked vocabulary entries are fine
    assert math.isfinite(S.logz_stats(y)["logz_max"])
