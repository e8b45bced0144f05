"""Forward hooks that compute the declared signals on sampled steps only.

``Probes(model)`` picks modules by fnmatch globs on ``model.named_modules()``
names and hooks them. Hooks do nothing until the probes are armed for a step
(``arm(step)`` / ``disarm()`` or ``with probes.sampling(step):``); unarmed, a
hook returns after one attribute test and keeps no tensor. Armed, each probed
module is evaluated once per step (the first forward call wins, so
activation-checkpoint recomputation and later micro-batches cost nothing), the
results are plain floats, and ``collect()`` hands them over (and clears them)
as ``{module name: {signal: value}}``. No I/O, no logging: a failing probe is
recorded in ``errors`` (or raised with ``strict=True``), never in the training loop.

Three kinds of probe (:data:`PROBE_KINDS`), each a list of patterns. A pattern selects the
outermost matching modules only (a module whose ancestor already matched is skipped), so
``*blocks.*`` selects ``blocks.3`` but not ``blocks.3.mlp``. Each kind computes the signals whose
declaration (:class:`~spikeguard.workers.contract.signals.SignalSpec`, in the torch-free contract)
names it as their ``probe``, with the math of :mod:`.measure`: a new signal of an existing kind is
its math there plus one declaration (``tests/test_signal_seam.py`` checks that every kind writes
exactly its declared signals).

``residual`` (default ``*blocks.*``, ``*layers.*``, ``h.*``, ``*.h.*``, ``*decoder.layers.*``)
    The block's output (first element of a tuple), flattened to ``rows x d``, at
    most ``max_rows`` rows drawn at random: ``erank_ratio`` and ``grade``.
``attention`` (default ``*.attn``, ``*.attention``, ``*.self_attn`` and the same without ``*.``)
    ``attn_entropy_mean``, ``attn_entropy_min``, ``attn_entropy_min_norm`` and
    ``max_logit`` from Q and K (SDPA never materialises the probabilities).
    Q and K come from one of two sources:

    1. Projection convention (automatic). The matched module, or its first
       descendant that qualifies, has children ``q_proj``/``k_proj`` (also
       ``query``/``key``, ``wq``/``wk``, ``to_q``/``to_k``) or a fused projection
       ``c_attn``/``qkv``/``qkv_proj``/``Wqkv`` whose output is ``[q | k | v]``
       along the last dim (nanoGPT, GPT-2, timm, MPT, Phi-3). Outputs are read as
       ``[batch, seq, heads * head_dim]``; the head count comes from ``n_head``/
       ``num_heads``/``n_heads``/``num_attention_heads`` (or ``head_dim``), the KV
       head count (GQA) from ``n_kv_head``/``num_kv_heads``/``num_key_value_heads``
       or the K width, on the module or its ``config``. Results are stored under
       the name of the module that owns the projections.
    2. Explicit opt-in: call ``spikeguard.workers.probes.record_qk(self, q, k)``
       inside your attention forward with the exact tensors you pass to SDPA.
       Unarmed it is one test of a module-level list. Use it whenever the
       projections are not what SDPA sees: **rotary embeddings (RoPE) and QK-norm
       are applied after the projections, so models that use them (Llama and
       most recent LMs) must use record_qk** to get true entropies. Once a module
       has called record_qk, its projection capture is switched off; ``attention=()``
       turns projection capture off everywhere (record_qk keeps working).
    3. Hugging Face models (automatic, through :func:`~spikeguard.workers.session.attach`):
       :mod:`spikeguard.workers.integrations.hf_attention` wraps transformers' attention
       functions and calls ``record_qk`` with the exact Q, K, mask and scaling each attention
       module hands its kernel (after RoPE and QK-norm), no edits to the model.

    Attention is taken as causal (``causal=True``; pass ``causal=False`` for
    encoders / ViTs, or per call to ``record_qk``).
``lm_head`` (default ``*lm_head*``, ``*head``)
    ``logz_mean`` and ``logz_max`` of the output logits (all positions).
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from . import measure
from .contract.signals import specs

__all__ = [
    "DEFAULT_ATTENTION",
    "DEFAULT_LM_HEAD",
    "DEFAULT_RESIDUAL",
    "PROBE_KINDS",
    "Probes",
    "record_qk",
]

PROBE_KINDS: tuple[str, ...] = ("residual", "attention", "lm_head")
"""The kinds of probe a :class:`Probes` hooks (one keyword argument each)."""


def declared_signals(kind: str) -> tuple[str, ...]:
    """The signals the declarations say probe ``kind`` computes (``SignalSpec.probe``)."""
    return tuple(s.name for s in specs(per_layer=True) if s.probe == kind)


DEFAULT_RESIDUAL: tuple[str, ...] = ("*blocks.*", "*layers.*", "h.*", "*.h.*", "*decoder.layers.*")
DEFAULT_ATTENTION: tuple[str, ...] = (
    "*.attn",
    "*.attention",
    "*.self_attn",
    "attn",
    "attention",
    "self_attn",
)
DEFAULT_LM_HEAD: tuple[str, ...] = ("*lm_head*", "*head")

_QK_PAIRS = (("q_proj", "k_proj"), ("query", "key"), ("wq", "wk"), ("to_q", "to_k"))
_FUSED = ("c_attn", "qkv", "qkv_proj", "Wqkv")
_HEADS = ("n_head", "num_heads", "n_heads", "num_attention_heads")
_KV_HEADS = ("n_kv_head", "n_kv_heads", "num_kv_heads", "num_key_value_heads")
_HEAD_DIM = ("head_dim", "head_size", "attention_head_size")

_ARMED: list[Probes] = []
"""Probes currently armed; :func:`record_qk` returns at once while it is empty."""


def record_qk(
    module: nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    causal: bool | None = None,
    scale: float | None = None,
    mask: torch.Tensor | None = None,
) -> None:
    """Hand the SDPA inputs of ``module`` (``[batch, heads, seq, head_dim]``) to every armed Probes.

    A no-op (one list test) when nothing is armed. ``causal``/``scale`` default to
    the Probes' ``causal`` and ``1/sqrt(head_dim)``; ``mask`` is the kernel's ``attn_mask``
    (boolean or additive, see :func:`.measure.attention_stats`), which replaces ``causal``.
    """
    if not _ARMED:
        return
    for probes in tuple(_ARMED):
        probes.record_qk(module, q, k, causal=causal, scale=scale, mask=mask)


def _select(
    named: list[tuple[str, nn.Module]], patterns: Iterable[str]
) -> list[tuple[str, nn.Module]]:
    """Outermost modules whose name matches one of ``patterns`` (pre-order, root excluded)."""
    pats = tuple(patterns)
    chosen: list[tuple[str, nn.Module]] = []
    names: set[str] = set()
    for name, mod in named:
        if not name or not any(fnmatch.fnmatchcase(name, p) for p in pats):
            continue
        parts = name.split(".")
        if any(".".join(parts[:i]) in names for i in range(1, len(parts))):
            continue
        names.add(name)
        chosen.append((name, mod))
    return chosen


def _first_int(mods: Iterable[nn.Module], attrs: tuple[str, ...]) -> int | None:
    for m in mods:
        for holder in (m, getattr(m, "config", None)):
            for a in attrs:
                v = getattr(holder, a, None) if holder is not None else None
                if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                    return v
    return None


def _first_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, (tuple, list)) and output:
        output = output[0]
    if isinstance(output, torch.Tensor) and output.is_floating_point() and output.numel() > 0:
        return output
    return None


class _AttnSpec:
    """How to get Q and K of one attention module from its projections."""

    def __init__(
        self,
        name: str,
        owner: nn.Module,
        q: nn.Module,
        k: nn.Module | None,
        heads: int | None,
        kv_heads: int | None,
        head_dim: int | None,
    ) -> None:
        self.name, self.owner, self.q, self.k = name, owner, q, k
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim

    def _dims(
        self, q_width: int, k_width: int | None, fused_width: int | None
    ) -> tuple[int, int, int]:
        """(heads, kv_heads, head_dim) for the observed widths; ValueError if inconsistent."""
        h, hk, d = self.heads, self.kv_heads, self.head_dim
        if fused_width is not None:
            if h is not None:
                d = fused_width // (h + 2 * (hk or h))
            elif d is not None:
                h = hk = fused_width // (3 * d)
            hk = hk or h
            if not (h and d and d * (h + 2 * hk) == fused_width):
                raise ValueError(
                    f"cannot split fused qkv of width {fused_width} (heads={h}, kv_heads={hk})"
                )
            return h, hk, d
        if d is None and h is not None and q_width % h == 0:
            d = q_width // h
        if d is None or q_width % d or k_width is None or k_width % d:
            raise ValueError(
                f"cannot split q width {q_width} / k width {k_width} into heads (head_dim={d})"
            )
        return q_width // d, k_width // d, d

    def qk(
        self, q_out: torch.Tensor, k_out: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Reshape projection output(s) to SDPA layout ``[batch, heads, seq, head_dim]``."""
        if q_out.ndim == 2:
            q_out = q_out.unsqueeze(0)
            k_out = None if k_out is None else k_out.unsqueeze(0)
        if q_out.ndim != 3 or (k_out is not None and k_out.ndim != 3):
            raise ValueError(
                f"expected projection outputs [batch, seq, width], got {tuple(q_out.shape)}"
            )
        if k_out is None:  # fused [q | k | v]
            h, hk, d = self._dims(0, None, q_out.shape[-1])
            q_out, k_out = q_out[..., : h * d], q_out[..., h * d : (h + hk) * d]
        else:
            h, hk, d = self._dims(q_out.shape[-1], k_out.shape[-1], None)
        b, t = q_out.shape[:2]
        return (
            q_out.reshape(b, t, h, d).transpose(1, 2),
            k_out.reshape(b, k_out.shape[1], hk, d).transpose(1, 2),
        )


def _attn_spec(name: str, module: nn.Module) -> _AttnSpec | None:
    """Find the projections of an attention module (itself or its first qualifying descendant)."""
    for sub_name, sub in module.named_modules():
        children = dict(sub.named_children())
        full = f"{name}.{sub_name}" if sub_name else name
        mods = (sub, module)
        heads, kv, hd = (
            _first_int(mods, _HEADS),
            _first_int(mods, _KV_HEADS),
            _first_int(mods, _HEAD_DIM),
        )
        for qn, kn in _QK_PAIRS:
            if qn in children and kn in children:
                return _AttnSpec(full, sub, children[qn], children[kn], heads, kv, hd)
        for fn in _FUSED:
            if fn in children:
                return _AttnSpec(full, sub, children[fn], None, heads, kv, hd)
    return None


class Probes:
    """Forward hooks on a model's blocks, attention modules and LM head; see the module docstring.

    Args:
        model: the model to probe.
        residual, attention, lm_head: fnmatch patterns per probe kind (``()`` disables a kind).
        k: number of singular values of the effective rank.
        max_rows: rows of a block output sampled for the effective rank.
        max_queries: query rows sampled per attention module.
        max_batch: batch elements used for attention (the first ones).
        causal: attention masks of the projection convention (and record_qk's default).
        thresholds: grade thresholds (see :func:`measure.grade_of`).
        seed: seed of the private sampling generator (re-seeded per step from ``seed`` and the
            step).
        strict: raise probe errors instead of recording them in ``errors``.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        residual: Iterable[str] = DEFAULT_RESIDUAL,
        attention: Iterable[str] = DEFAULT_ATTENTION,
        lm_head: Iterable[str] = DEFAULT_LM_HEAD,
        k: int = 32,
        max_rows: int = 2048,
        max_queries: int = 64,
        max_batch: int = 8,
        causal: bool = True,
        thresholds: tuple[float, ...] = measure.DEFAULT_THRESHOLDS,
        seed: int = 0,
        strict: bool = False,
    ) -> None:
        for pats in (residual, attention, lm_head):
            if isinstance(pats, str):
                raise TypeError(f"patterns must be an iterable of strings, not the string {pats!r}")
        measure.grade_of(1.0, thresholds)  # validates the thresholds
        self.patterns: dict[str, tuple[str, ...]] = {
            "residual": tuple(residual),
            "attention": tuple(attention),
            "lm_head": tuple(lm_head),
        }
        """The patterns of each probe kind (what a kind that found nothing looked for)."""
        self.k, self.max_rows, self.max_queries, self.max_batch = (
            k,
            max_rows,
            max_queries,
            max_batch,
        )
        self.causal, self.thresholds, self.seed, self.strict = (
            causal,
            tuple(thresholds),
            seed,
            strict,
        )
        self.compute_calls = 0
        """How many times a heavy probe computation ran (for tests and overhead accounting)."""
        self.errors: list[str] = []
        """``"name: error"`` for every probe that failed (non-strict mode)."""
        self._step: int | None = None
        self._last_step: int | None = None
        self._gen: torch.Generator | None = None
        self._results: dict[str, dict[str, float]] = {}
        self._done: set[tuple[str, str]] = set()
        self._pending: dict[str, dict[str, torch.Tensor]] = {}
        self._explicit: set[str] = set()
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

        named = list(model.named_modules())
        self._names: dict[nn.Module, str] = {m: n for n, m in named}
        blocks = _select(named, self.patterns["residual"])
        attns = _select(named, self.patterns["attention"])
        taken = [n for n, _ in blocks] + [n for n, _ in attns]
        heads = [
            (n, m)
            for n, m in _select(named, self.patterns["lm_head"])
            if not any(n == t or n.startswith(t + ".") for t in taken)
        ]
        self.residual_names = [n for n, _ in blocks]
        self.lm_head_names = [n for n, _ in heads]
        self.attention_names: list[str] = []
        """Names under which projection-captured attention results appear."""
        self.unresolved_attention: list[str] = []
        """Matched attention modules whose Q/K could not be found (record_qk still works)."""

        for name, mod in blocks:
            self._hook(mod, self._residual_hook(name))
        for name, mod in heads:
            self._hook(mod, self._lm_head_hook(name))
        for name, mod in attns:
            spec = _attn_spec(name, mod)
            if spec is None or (spec.heads is None and spec.head_dim is None):
                self.unresolved_attention.append(name)
                continue
            self.attention_names.append(spec.name)
            if spec.k is None:
                self._hook(spec.q, self._proj_hook(spec, "fused"))
            else:
                self._hook(spec.q, self._proj_hook(spec, "q"))
                self._hook(spec.k, self._proj_hook(spec, "k"))

    # -- arming -------------------------------------------------------------------------
    @property
    def armed_step(self) -> int | None:
        """The step the probes are armed for, or None."""
        return self._step

    @property
    def last_step(self) -> int | None:
        """The most recently armed step (whose results :meth:`collect` returns)."""
        return self._last_step

    def arm(self, step: int) -> None:
        """Arm for ``step``: the next forward passes compute signals. Drops uncollected older
        results."""
        if self._step == step:
            return
        self._results.clear()
        self._done.clear()
        self._pending.clear()
        self._step = self._last_step = step
        self._gen = torch.Generator().manual_seed((self.seed * 1_000_003 + step) % (2**63))
        if self not in _ARMED:
            _ARMED.append(self)

    def disarm(self) -> None:
        """Stop computing; results of the armed step stay until :meth:`collect`."""
        self._step = None
        self._gen = None
        self._pending.clear()
        if self in _ARMED:
            _ARMED.remove(self)

    @contextlib.contextmanager
    def sampling(self, step: int) -> Iterator[Probes]:
        """``with probes.sampling(step): model(x)`` arms for the block and disarms after it."""
        self.arm(step)
        try:
            yield self
        finally:
            self.disarm()

    def collect(self) -> dict[str, dict[str, float]]:
        """``{module name: {signal: value}}`` of the last armed step, then cleared."""
        out, self._results = self._results, {}
        return out

    def remove(self) -> None:
        """Disarm and remove every hook."""
        self.disarm()
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # -- explicit Q/K -------------------------------------------------------------------
    def record_qk(
        self,
        module: nn.Module,
        q: torch.Tensor,
        k: torch.Tensor,
        *,
        causal: bool | None = None,
        scale: float | None = None,
        mask: torch.Tensor | None = None,
    ) -> None:
        """Attention signals of ``module`` from its SDPA inputs; no-op unless armed (see
        :func:`record_qk`)."""
        if self._step is None:
            return
        name = self._names.get(module)
        if name is None:
            return
        self._explicit.add(name)
        self._pending.pop(name, None)
        c = self.causal if causal is None else causal
        self._run(name, "explicit", lambda: self._attention(q, k, causal=c, scale=scale, mask=mask))

    # -- hooks --------------------------------------------------------------------------
    def _hook(self, module: nn.Module, fn: Callable[..., None]) -> None:
        self._handles.append(module.register_forward_hook(fn))

    def _run(self, name: str, kind: str, fn: Callable[[], dict[str, float]]) -> None:
        if (name, kind) in self._done:
            return
        self._done.add((name, kind))
        self.compute_calls += 1
        try:
            result = fn()
        except Exception as e:  # a probe must never break training
            if self.strict:
                raise
            self.errors.append(f"{name}: {type(e).__name__}: {e}")
            return
        self._results.setdefault(name, {}).update(result)

    def _residual_hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self._step is None:
                return
            x = _first_tensor(output)
            if x is not None and x.ndim >= 2:
                self._run(name, "residual", lambda: self._residual(x))

        return hook

    def _lm_head_hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self._step is None:
                return
            x = _first_tensor(output)
            if x is not None:
                self._run(name, "lm_head", lambda: measure.logz_stats(x))

        return hook

    def _proj_hook(self, spec: _AttnSpec, part: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if (
                self._step is None
                or spec.name in self._explicit
                or (spec.name, "attention") in self._done
            ):
                return
            x = _first_tensor(output)
            if x is None:
                return
            if part == "fused":
                self._run(spec.name, "attention", lambda: self._attention(*spec.qk(x, None)))
                return
            pending = self._pending.setdefault(spec.name, {})
            pending[part] = x.detach()
            if "q" in pending and "k" in pending:
                del self._pending[spec.name]
                self._run(
                    spec.name,
                    "attention",
                    lambda: self._attention(*spec.qk(pending["q"], pending["k"])),
                )

        return hook

    # -- computations -------------------------------------------------------------------
    def _residual(self, x: torch.Tensor) -> dict[str, float]:
        with torch.no_grad():
            flat = x.detach().reshape(-1, x.shape[-1])
            if flat.shape[0] > self.max_rows:
                idx = torch.randperm(flat.shape[0], generator=self._gen)[: self.max_rows]
                flat = flat.index_select(0, idx.to(flat.device))
            ratio = measure.effective_rank_ratio(flat, self.k)
        return {"erank_ratio": ratio, "grade": measure.grade_of(ratio, self.thresholds)}

    def _attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        *,
        causal: bool | None = None,
        scale: float | None = None,
        mask: torch.Tensor | None = None,
    ) -> dict[str, float]:
        if mask is not None and mask.ndim == 4 and mask.shape[0] > 1:
            mask = mask[: self.max_batch]
        stats = measure.attention_stats(
            q[: self.max_batch],
            k[: self.max_batch],
            causal=self.causal if causal is None else causal,
            max_queries=self.max_queries,
            generator=self._gen,
            scale=scale,
            mask=mask,
        )
        stats.pop("head_entropy")
        return stats  # type: ignore[return-value]
