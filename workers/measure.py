"""Pure signal math: effective-rank ratio, grade, attention entropy, max logit, log Z.

Every function here is a pure function of its tensor arguments: no I/O, no
logging, no global state, and no draws from torch's global random generator
(the randomized SVD path uses a private, fixed-seed generator, so probing a
step never changes the training run's dropout masks or data order). Inputs
are detached, the math runs under :func:`torch.no_grad` on the tensors' own
device, and only the final scalars cross to the host (``.item()``).

Effective rank
--------------
For ``x`` of shape ``[..., d]`` flattened to ``rows x d`` and its top ``k``
singular values ``s_1 >= ... >= s_k`` (``k`` capped at ``min(rows, d)``),
``p_i = s_i / sum(s)``, ``H = -sum p_i log p_i`` and ``erank = exp(H)``; the
ratio is ``erank / min(rows, d, k)`` (1.0: the top-k directions carry equal
weight; ``1/min``: a single direction). Singular values below
``ZERO_RTOL * s_1`` (float32 round-off level) count as zero.

Three ways to get the singular values (``method=``), picked by shape in
``"auto"`` with ``m = min(rows, d)``:

* ``"svd"`` (``m <= SVD_MAX_DIM``): ``torch.linalg.svdvals`` in float32, the reference.
* ``"gram"`` (``m <= GRAM_MAX_DIM``): the Gram matrix of the smaller side
  (``x^T x`` or ``x x^T``) in float64 and ``torch.linalg.eigvalsh``; the
  square roots of the clamped eigenvalues. Exact to ~1e-7 relative on erank.
* ``"lowrank"`` (both sides larger than ``GRAM_MAX_DIM``): a randomized block
  Krylov method (block ``k + LOWRANK_OVERSAMPLE``, ``LOWRANK_DEPTH`` passes of
  ``x x^T``, each new block orthogonalised against the basis so far). The
  products ``x^T q`` of every basis block are computed on the way (they feed the
  next pass), so the Rayleigh-Ritz step needs no extra pass over ``x``: the
  singular values are those of ``x^T basis`` in an orthonormal frame of the basis
  (from the basis' small Gram matrix, which also drops the directions a
  rank-deficient ``x`` left dependent). Cost: ``2 * (LOWRANK_DEPTH + 1)`` products
  of ``x`` with a block, against a full ``m^2 * max(rows, d)`` for the exact paths.
  Measured relative erank errors (``bench/bench_erank.py``, ``tests/test_signals.py``):
  realistic spectra (power laws, massive-activation outliers, Gaussian,
  exponential) within 2e-5; the hard case, a few strong directions over a flat
  noise floor (a collapsing layer), comes out *low* (never high) by 1e-3 .. 2e-3
  at 2048 x 1024 / 8192 x 1024 and ~4e-3 at 3072 x 3072, growing slowly with size.
  ``"auto"`` takes it from ``m > GRAM_MAX_DIM`` (512) on: at 8192 x 1024 it is
  several times faster than the Gram path and svdvals (``bench/bench_erank.py``),
  and a 0.2 % error moves the ratio far less than the 0.1 between grades.
"""

from __future__ import annotations

from typing import Literal

import torch

from .contract.signals import GRADE_THRESHOLDS, format_grade, grade_of, parse_grade

__all__ = [
    "DEFAULT_THRESHOLDS",
    "GRAM_MAX_DIM",
    "LOWRANK_DEPTH",
    "LOWRANK_OVERSAMPLE",
    "SVD_MAX_DIM",
    "ZERO_RTOL",
    "Method",
    "attention_stats",
    "choose_method",
    "effective_rank",
    "effective_rank_ratio",
    "format_grade",
    "grade_of",
    "logz_stats",
    "parse_grade",
    "top_singular_values",
]

Method = Literal["auto", "svd", "gram", "lowrank"]

SVD_MAX_DIM = 128
"""``"auto"`` uses svdvals while ``min(rows, d)`` is at most this."""
GRAM_MAX_DIM = 512
"""``"auto"`` uses the float64 Gram path while ``min(rows, d)`` is at most this."""
LOWRANK_OVERSAMPLE = 16
"""Block size of the randomized path is ``k + LOWRANK_OVERSAMPLE``."""
LOWRANK_DEPTH = 3
"""Number of ``x x^T`` passes of the randomized block Krylov path."""
LOWRANK_SEED = 0x5EED
"""Seed of the private generator of the randomized path (results are deterministic)."""
ZERO_RTOL = 1e-6
"""Singular values below ``ZERO_RTOL * s_1`` are treated as exact zeros."""
DEFAULT_THRESHOLDS = GRADE_THRESHOLDS
"""Grade boundaries (the contract's): grade = number of thresholds strictly below the ratio."""

_METHODS = ("auto", "svd", "gram", "lowrank")


def choose_method(rows: int, d: int) -> str:
    """The path ``method="auto"`` takes for a ``rows x d`` matrix."""
    m = min(rows, d)
    if m <= SVD_MAX_DIM:
        return "svd"
    if m <= GRAM_MAX_DIM:
        return "gram"
    return "lowrank"


def _as_matrix(x: torch.Tensor) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.ndim == 0:
        raise ValueError("effective rank needs a tensor of shape [..., d], got a scalar")
    if x.numel() == 0:
        raise ValueError(f"effective rank of an empty tensor (shape {tuple(x.shape)})")
    return x.detach().reshape(-1, x.shape[-1])


def _wide_dtype(device: torch.device) -> torch.dtype:
    """float64 for accuracy, except on MPS which has none."""
    return torch.float32 if device.type == "mps" else torch.float64


def _svd_values(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.svdvals(x.float())


def _gram_values(x: torch.Tensor) -> torch.Tensor:
    # float64 keeps the squared condition number of the Gram matrix harmless.
    xd = x.to(_wide_dtype(x.device))
    gram = xd.T @ xd if x.shape[0] >= x.shape[1] else xd @ xd.T
    eig = torch.linalg.eigvalsh(gram)  # ascending
    return eig.flip(0).clamp_min(0).sqrt()


def _lowrank_values(x: torch.Tensor, k: int) -> torch.Tensor:
    xf = x.float()
    rows, d = xf.shape
    block = min(k + LOWRANK_OVERSAMPLE, rows, d)
    depth = min(LOWRANK_DEPTH, min(rows, d) // block - 1)  # the basis never outgrows the matrix
    gen = torch.Generator(device=xf.device)
    gen.manual_seed(LOWRANK_SEED)
    omega = torch.randn(d, block, generator=gen, device=xf.device, dtype=xf.dtype)
    q = torch.linalg.qr(xf @ omega).Q
    basis = q
    projected = []  # x^T q for every block q of the basis: x^T basis, block by block
    for i in range(depth + 1):
        w = (q.T @ xf).T  # x^T q (q^T x reads x row by row: faster than x.T @ q)
        projected.append(w)
        if i == depth:
            break
        z = xf @ w
        for _ in range(2):  # block Gram-Schmidt against the basis so far, twice
            z = z - basis @ (basis.T @ z)
        q = torch.linalg.qr(z).Q
        basis = torch.cat([basis, q], dim=1)
    # Rayleigh-Ritz: the singular values of basis^T x are those of (x^T basis) restricted to an
    # orthonormal frame of the basis; the basis' own Gram gives that frame, and drops the
    # directions a rank-deficient x left numerically dependent.
    wide = _wide_dtype(xf.device)
    gram = (basis.T @ basis).to(wide)
    evals, evecs = torch.linalg.eigh(gram)
    keep = evals > evals.max() * 1e-6
    frame = evecs[:, keep] / evals[keep].sqrt()
    b = torch.cat(projected, dim=1).to(wide) @ frame
    return torch.linalg.eigvalsh(b.T @ b).flip(0).clamp_min(0).sqrt()


def _all_finite(x: torch.Tensor) -> bool:
    """No NaN or infinity in ``x``: one sum (a non-finite element makes it non-finite), and the
    element-wise test only when the sum is not finite (it may have overflowed)."""
    if bool(torch.isfinite(x.sum())):
        return True
    return bool(torch.isfinite(x).all())


def _check_k_method(k: int, method: str) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, got {method!r}")


def top_singular_values(x: torch.Tensor, k: int = 32, *, method: Method = "auto") -> torch.Tensor:
    """The top ``min(k, rows, d)`` singular values of ``x`` flattened to ``rows x d``.

    Descending, on ``x``'s device, float32 or float64 depending on the path.
    No finiteness check (see :func:`effective_rank`).
    """
    _check_k_method(k, method)
    with torch.no_grad():
        mat = _as_matrix(x)
        chosen = choose_method(*mat.shape) if method == "auto" else method
        if chosen == "svd":
            s = _svd_values(mat)
        elif chosen == "gram":
            s = _gram_values(mat)
        else:
            s = _lowrank_values(mat, k)
        return s[: min(k, *mat.shape)]


def _erank_tensor(s: torch.Tensor) -> torch.Tensor:
    """exp(entropy) of the normalised singular values ``s`` (descending); 0 for all zeros."""
    s = s.to(_wide_dtype(s.device))
    s = torch.where(s > s[0] * ZERO_RTOL, s, torch.zeros_like(s))
    total = s.sum()
    p = s / total.clamp_min(torch.finfo(s.dtype).tiny)
    erank = torch.exp(torch.special.entr(p).sum())
    return torch.where(total > 0, erank, torch.zeros_like(erank))


def effective_rank(x: torch.Tensor, k: int = 32, *, method: Method = "auto") -> float:
    """Effective rank (``exp`` of the entropy of the top-k normalised singular values).

    In ``[0, min(rows, d, k)]``: 0.0 for an all-zero ``x``; ``nan`` when ``x``
    holds a NaN or infinity (no exception). Raises ``ValueError`` for a scalar
    or empty ``x``, a bad ``k`` or an unknown ``method``.
    """
    _check_k_method(k, method)
    with torch.no_grad():
        mat = _as_matrix(x)
        if not _all_finite(mat):
            return float("nan")
        return float(_erank_tensor(top_singular_values(mat, k, method=method)).item())


def effective_rank_ratio(x: torch.Tensor, k: int = 32, *, method: Method = "auto") -> float:
    """``effective_rank(x, k) / min(rows, d, k)``, in ``[0, 1]``; ``nan`` for non-finite ``x``."""
    erank = effective_rank(x, k, method=method)
    rows = x.numel() // x.shape[-1]
    return erank / min(rows, x.shape[-1], k)


def _query_rows(
    seq: int, max_queries: int, generator: torch.Generator | None, device: torch.device
) -> torch.Tensor:
    """Indices of the sampled query rows (sorted, always including the last)."""
    if seq <= max_queries:
        return torch.arange(seq, device=device)
    if generator is None:  # evenly spaced; never touches the global RNG
        idx = torch.linspace(0, seq - 1, max_queries).round().long()
    else:
        picked = torch.randperm(seq - 1, generator=generator, device=generator.device)[
            : max_queries - 1
        ]
        idx = torch.cat([picked.cpu(), torch.tensor([seq - 1])])
    return idx.unique().to(device)  # unique() also sorts


def attention_stats(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    causal: bool = True,
    max_queries: int = 64,
    generator: torch.Generator | None = None,
    scale: float | None = None,
    mask: torch.Tensor | None = None,
) -> dict[str, float | list[float]]:
    """Attention-entropy signals from the query and key tensors of an SDPA call.

    ``q``: ``[batch, heads, seq_q, head_dim]``, ``k``: ``[batch, kv_heads, seq_k,
    head_dim]`` as passed to ``F.scaled_dot_product_attention`` (``kv_heads`` must
    divide ``heads``; query head ``h`` uses key head ``h // (heads // kv_heads)``,
    as ``repeat_interleave`` / ``enable_gqa`` do). Only ``max_queries`` query rows
    are evaluated: all of them when ``seq_q <= max_queries``, else a random subset
    drawn from ``generator`` (evenly spaced rows without one, so the global RNG is
    never used), always including the last row. Logits are ``q k^T * scale``
    (default ``1/sqrt(head_dim)``); with ``causal`` query ``i`` sees keys ``<= i``
    (SDPA's ``is_causal``, top-left aligned).

    ``mask`` (instead of ``causal``): the ``attn_mask`` the kernel got, broadcastable to
    ``[batch, heads, seq_q, seq_k]``: boolean (True: the key is attended, SDPA's convention) or
    additive float (added to the logits; a value below half the dtype's minimum masks the key,
    as Hugging Face's eager masks do). Query rows that see no key at all (padding) are left out
    of every mean.

    Returns ``attn_entropy_mean`` / ``attn_entropy_min`` (mean / min over heads of
    the per-head entropy, itself averaged over batch and sampled rows, in nats),
    ``attn_entropy_min_norm`` (the min-head entropy divided by the mean of
    ``log(#visible keys)`` over the sampled rows; 1.0 = uniform; 1.0 when every
    sampled row sees a single key), ``max_logit`` (over visible positions of the
    sampled rows) and ``head_entropy`` (list per head). Non-finite ``q``/``k``:
    every value is NaN, no exception.
    """
    if q.ndim != 4 or k.ndim != 4:
        raise ValueError(
            "q and k must be [batch, heads, seq, head_dim], "
            f"got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    b, hq, sq, dim = q.shape
    bk, hk, sk, dk = k.shape
    if bk != b or dk != dim or hk < 1 or hq % hk != 0 or sq < 1 or sk < 1:
        raise ValueError(f"incompatible q {tuple(q.shape)} and k {tuple(k.shape)}")
    if max_queries < 1:
        raise ValueError(f"max_queries must be >= 1, got {max_queries}")
    with torch.no_grad():
        q, k = q.detach(), k.detach()
        if not (bool(torch.isfinite(q).all()) and bool(torch.isfinite(k).all())):
            nan = float("nan")
            return {
                "attn_entropy_mean": nan,
                "attn_entropy_min": nan,
                "attn_entropy_min_norm": nan,
                "max_logit": nan,
                "head_entropy": [nan] * hq,
            }
        rows = _query_rows(sq, max_queries, generator, q.device)
        qs = q.index_select(2, rows).float()
        group = hq // hk
        logits = qs.reshape(b, hk, group, rows.numel(), dim) @ k.float().unsqueeze(2).transpose(
            -1, -2
        )
        logits = logits.reshape(b, hq, rows.numel(), sk) * (
            scale if scale is not None else dim**-0.5
        )
        visible = _visible(rows, sk, causal, mask, q.device)  # [b|1, hq|1, rows, sk]
        if mask is not None and mask.is_floating_point():
            logits = logits + mask.detach().index_select(-2, rows).float()
        logits = logits.masked_fill(~visible, float("-inf"))
        full = visible.expand(b, hq, rows.numel(), sk)
        counts = full.sum(-1)  # [b, hq, rows]
        seen = counts > 0
        probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
        row_entropy = torch.special.entr(probs).sum(-1)  # [b, hq, rows]
        n_rows = seen.sum(dim=(0, 2)).clamp(min=1)
        head_entropy = (row_entropy * seen).sum(dim=(0, 2)) / n_rows  # [hq]
        log_keys = counts.clamp(min=1).to(_wide_dtype(q.device)).log()
        mean_log_keys = (log_keys * seen).sum() / seen.sum().clamp(min=1)
        ent_min = head_entropy.min()
        norm = (
            ent_min.to(mean_log_keys.dtype) / mean_log_keys
            if float(mean_log_keys) > 0
            else torch.tensor(1.0)
        )
        max_logit = logits.masked_fill(~full, float("-inf")).max()
        return {
            "attn_entropy_mean": float(head_entropy.mean().item()),
            "attn_entropy_min": float(ent_min.item()),
            "attn_entropy_min_norm": float(norm.item()),
            "max_logit": float(max_logit.item()),
            "head_entropy": [float(v) for v in head_entropy.tolist()],
        }


def _visible(
    rows: torch.Tensor,
    sk: int,
    causal: bool,
    mask: torch.Tensor | None,
    device: torch.device,
) -> torch.Tensor:
    """Which keys each sampled query row attends to, ``[batch|1, heads|1, rows, sk]`` (bool)."""
    if mask is None:
        keys = torch.arange(sk, device=device)
        if causal:
            return (keys[None, :] <= rows[:, None])[None, None]
        return torch.ones(1, 1, rows.numel(), sk, dtype=torch.bool, device=device)
    m = mask.detach()
    while m.ndim < 4:
        m = m.unsqueeze(0)
    if m.ndim != 4 or m.shape[-1] != sk:
        raise ValueError(f"attention mask of shape {tuple(mask.shape)} does not fit {sk} keys")
    m = m.index_select(-2, rows.to(m.device)).to(device)
    if m.dtype == torch.bool:
        return m
    return m > torch.finfo(m.dtype).min / 2


def logz_stats(logits: torch.Tensor, *, chunk_elements: int = 1 << 26) -> dict[str, float]:
    """``logz_mean`` / ``logz_max`` of ``log Z = logsumexp(logits, -1)`` over all positions.

    ``logits``: ``[..., vocab]``, processed in float32 in row chunks of at most
    ``chunk_elements`` elements (bounds the extra memory for large vocabularies).
    NaN anywhere gives NaN out (an infinite logit gives an infinite log Z); no exception.
    """
    if logits.ndim == 0 or logits.numel() == 0:
        raise ValueError(
            f"logits must be a non-empty [..., vocab] tensor, got shape {tuple(logits.shape)}"
        )
    with torch.no_grad():
        flat = logits.detach().reshape(-1, logits.shape[-1])
        step = max(1, chunk_elements // flat.shape[1])
        parts = [
            torch.logsumexp(flat[i : i + step].float(), dim=-1)
            for i in range(0, flat.shape[0], step)
        ]
        logz = torch.cat(parts)
        return {"logz_mean": float(logz.mean().item()), "logz_max": float(logz.max().item())}
