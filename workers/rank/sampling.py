"""Probes and sampling: which steps are sampled, and what the latest sample said.

The probes are armed for the *next* step when that step is a sampled one (every
``sample_every`` steps), so the forward hooks do their work during that step's forward pass and
the step's report collects the result; on other steps the hooks return at once. The latest
sample (and the latest loss) is what a checkpoint is graded with.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch

from ..contract.logs import logger
from ..contract.signals import summarize
from ..probes import Probes

log = logger(__name__)

_LOOKED_FOR = {
    "residual": ("blocks (residual: grade, erank_ratio)", "*.stages.*"),
    "attention": ("attention modules (attention entropy, max logit)", "*.mixer"),
    "lm_head": ("output layer (log Z)", "*readout*"),
}
"""Per probe kind: what finding nothing costs, and an example pattern for the hint."""


def unprobed(probes: Probes, *, hf_attention: bool, model: torch.nn.Module) -> list[str]:
    """One line per probe kind that found no module in ``model``: what will not be reported and
    how to point the probe at the model's own names (said once, at attach, never silently).
    Attention found through the Hugging Face capture, or reported by ``record_qk`` later,
    counts as found."""
    found = {
        "residual": probes.residual_names,
        "attention": probes.attention_names or probes.unresolved_attention or hf_attention,
        "lm_head": probes.lm_head_names,
    }
    name = type(model).__name__
    lines = []
    for kind, (what, example) in _LOOKED_FOR.items():
        if found[kind]:
            continue
        patterns = ", ".join(probes.patterns[kind]) or "none"
        hint = (
            " (or call spikeguard.workers.probes.record_qk(self, q, k) in its forward)"
            if kind == "attention"
            else ""
        )
        lines.append(
            f"probes found no {what} in {name}: looked for {patterns}; those signals will not "
            f"be reported. Name yours with attach(model, probe_patterns={{'{kind}': "
            f"['{example}']}}){hint}"
        )
    return lines


_KIND_SIGNAL = {"residual": "grade", "attention": "attn_entropy_min_norm", "lm_head": "logz_max"}
"""One signal each probe kind reports whenever it works."""


def silent_kinds(
    probes: Probes, layers: Mapping[str, Mapping[str, Any]], *, hf_attention: bool
) -> list[str]:
    """One line per probe kind that found modules at attach but reported nothing in the first
    sample ``layers`` (an attention module whose Q and K no capture reaches): found by name is
    not measured, and a policy rule on those signals would never fire."""
    found = {
        "residual": bool(probes.residual_names),
        "attention": bool(probes.attention_names or probes.unresolved_attention or hf_attention),
        "lm_head": bool(probes.lm_head_names),
    }
    have = {sig for values in layers.values() for sig in values}
    lines = []
    for kind, signal in _KIND_SIGNAL.items():
        if found[kind] and signal not in have:
            what = _LOOKED_FOR[kind][0]
            hint = (
                ": their Q and K were not found (no q_proj/k_proj or fused qkv child, no Hugging "
                "Face attention function); call spikeguard.workers.probes.record_qk(self, q, k) "
                "in their forward"
                if kind == "attention"
                else ""
            )
            lines.append(
                f"the first sample has no {signal}: the {what} matched by name reported "
                f"nothing{hint}"
            )
    return lines


class Sampler:
    """The probes on ``model`` (``probe_patterns``: :class:`~..probes.Probes`'s keyword
    arguments) and the step they are armed for."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        sample_every: int,
        probe_patterns: Mapping[str, Any] | None,
    ) -> None:
        self.sample_every = sample_every
        self.probes = Probes(model, **(probe_patterns or {}))
        """The forward hooks (see :class:`~spikeguard.workers.probes.Probes`)."""
        self._qk_capture = install_qk_capture(model)
        """Whether the Hugging Face attention capture was installed for this model."""
        for line in unprobed(self.probes, hf_attention=self._qk_capture, model=model):
            log.warning(line)
        self.next_step = 0
        """The step the next report will be of."""
        self.last_loss: float | None = None
        """The loss of the latest step."""
        self._last: dict[str, Any] | None = None
        """The latest sample: its step, layers and summary."""

    def start_at(self, step: int) -> None:
        """The next step is ``step``: arm the probes for it if it is sampled, else disarm."""
        self.next_step = int(step)
        self.resume()

    def pause(self) -> None:
        """Stop the probes until :meth:`resume` (forward passes that are no training step)."""
        self.probes.disarm()

    def resume(self) -> None:
        """Arm the probes again for the next step, if it is a sampled one."""
        if self.next_step % self.sample_every == 0:
            self.probes.arm(self.next_step)
        else:
            self.probes.disarm()

    def take(self, step: int, loss: float | None) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """Note ``loss`` as the latest; if the probes were armed for ``step``, collect their
        sample and return its per-layer signals and summary (None on other steps). Arming for
        the step after is :meth:`start_at`'s."""
        self.last_loss = loss
        if self.probes.armed_step != step:
            return None
        layers = self.probes.collect()
        summary = summarize(layers)
        if self._last is None:  # the first sample: say what a probe that found modules missed
            for line in silent_kinds(self.probes, layers, hf_attention=self._qk_capture):
                log.warning(line)
        self._last = {"step": step, "layers": layers, "summary": summary}
        return layers, summary

    def layers(self) -> dict[str, Any]:
        """The per-layer signals of the latest sample ({} before the first)."""
        return (self._last or {}).get("layers", {})

    def grade_meta(self) -> dict[str, Any]:
        """The latest grade, loss and sample's summary, as a checkpoint's metadata records
        them."""
        sample = self._last or {}
        summary = sample.get("summary", {})
        grade = summary.get("grade")
        return {
            "loss": self.last_loss,
            "grade": None if grade is None else int(grade),
            "signals_step": sample.get("step"),
            "summary": summary,
        }

    def remove(self) -> None:
        """Remove the probes' hooks (and the attention capture, if this model installed it)."""
        self.probes.remove()
        if self._qk_capture:
            from ..integrations import hf_attention

            hf_attention.uninstall()
            self._qk_capture = False


def install_qk_capture(model: torch.nn.Module) -> bool:
    """For a Hugging Face model, or a model holding one (a wrapper, a LightningModule), capture
    the exact Q and K its attention kernel receives (after RoPE and QK-norm; see
    :mod:`..integrations.hf_attention`). False for any other model."""
    if "transformers" not in sys.modules:
        return False  # then it is no transformers model
    from ..integrations import hf_attention

    if not any(hf_attention.is_hf_model(m) for m in model.modules()):
        return False
    hf_attention.install()
    return True
