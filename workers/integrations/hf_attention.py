"""The exact Q and K of Hugging Face attention, through transformers' attention-function registry.

A transformers decoder (Llama, Qwen, Mistral, OLMo, Gemma...) computes Q and K with its
projections, then applies rotary embeddings (RoPE) and, in some models, a QK-norm, and then calls
its attention function::

    attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, eager_attention_forward)
    attn_output, attn_weights = attention_interface(
        self, query_states, key_states, value_states, attention_mask, scaling=self.scaling, ...)

So the attention function receives the attention module, the Q and K the kernel uses (``[batch,
heads, seq, head_dim]``, K with ``num_key_value_heads`` heads under GQA), the mask the model built
for that implementation (None, a boolean mask for ``sdpa``, an additive float mask for ``eager``)
and the scaling. :func:`install` puts a wrapper in front of the registry's ``sdpa`` and
``eager`` entries (``eager`` is not in the registry: it is each modeling file's own
``eager_attention_forward``, the default of ``get_interface``; the wrapper finds it in the
attention class' ``forward`` globals and delegates to it). The wrapper hands (module, q, k, mask,
scaling) to :func:`~spikeguard.workers.probes.record_qk` and calls the original with the same
arguments: the model computes exactly what it computed before. Unarmed (most steps) the wrapper
costs one test of a list; armed, ``record_qk`` computes the entropies of the first call of each
module in that step.

The model's configuration is not touched (its ``_attn_implementation`` stays ``sdpa`` or
``eager``), so its masks, its ``output_attentions`` and every check transformers makes on the
implementation's name are unchanged. The wrappers are process-wide entries of the global
``ALL_ATTENTION_FUNCTIONS`` instance, counted per :func:`install`; the last :func:`uninstall`
puts back what was there. Modules of models not attached are not recorded (``record_qk`` only
knows the probed model's modules). A model with its own ``AttentionInterface`` instance, or
another implementation (flash attention, flex), is not captured: its attention modules keep the
projection capture of :mod:`~spikeguard.workers.probes`.
"""

from __future__ import annotations

import inspect
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import probes as _probes

WRAPPED = ("sdpa", "eager")
"""The implementations whose Q and K are captured."""

_lock = threading.Lock()
_installs = 0
_saved: dict[str, Any] = {}
"""What the global registry instance held locally under each wrapped key before the first
install (``_ABSENT`` when nothing)."""
_ABSENT = object()


def _registry() -> Any:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS


def is_hf_model(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers model (without importing transformers)."""
    return any(
        c.__module__.startswith("transformers.") and c.__name__ == "PreTrainedModel"
        for c in type(model).__mro__
    )


def _eager_of(module: nn.Module) -> Callable[..., Any] | None:
    """The modeling file's own ``eager_attention_forward``, as the module's ``forward`` sees it."""
    forward = getattr(type(module), "forward", None)
    if forward is not None:
        forward = inspect.unwrap(forward)  # past decorators (deprecate_kwarg...)
    fn = getattr(forward, "__globals__", {}).get("eager_attention_forward")
    if not callable(fn):
        fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    return fn if callable(fn) else None


def _causal(module: nn.Module, q: torch.Tensor, kwargs: dict[str, Any], impl: str) -> bool:
    """Whether a call without a mask is causal: SDPA's ``is_causal`` as transformers decides it
    (the module's ``is_causal``, more than one query); eager applies no mask at all."""
    if impl != "sdpa":
        return False
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    return bool(is_causal) and q.shape[2] > 1


def _wrapper(impl: str, original: Callable[..., Any] | None) -> Callable[..., Any]:
    """The registry entry for ``impl``: record on armed steps, then call the original."""

    def attention(
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        target = original if original is not None else _eager_of(module)
        if target is None:
            raise RuntimeError(f"spikeguard: no eager attention function for {type(module)}")
        if _probes._ARMED:
            scaling = kwargs.get("scaling")
            _probes.record_qk(
                module,
                query,
                key,
                causal=_causal(module, query, kwargs, impl),
                scale=None if scaling is None else float(scaling),
                mask=attention_mask,
            )
        return target(module, query, key, value, attention_mask, *args, **kwargs)

    attention.spikeguard_wrapped = impl  # type: ignore[attr-defined]
    return attention


def install() -> None:
    """Put the recording wrappers in front of ``sdpa`` and ``eager`` (counted; see module doc)."""
    global _installs
    with _lock:
        _installs += 1
        if _installs > 1:
            return
        registry = _registry()
        for impl in WRAPPED:
            local = registry._local_mapping
            _saved[impl] = local.get(impl, _ABSENT)
            original = registry.get(impl)
            if impl == "eager" and impl not in local:
                original = None  # each model's own eager_attention_forward
            registry[impl] = _wrapper(impl, original)


def uninstall() -> None:
    """Undo one :func:`install`; the last one restores the registry's entries."""
    global _installs
    with _lock:
        if _installs == 0:
            return
        _installs -= 1
        if _installs:
            return
        local = _registry()._local_mapping
        for impl in WRAPPED:
            before = _saved.pop(impl, _ABSENT)
            if before is _ABSENT:
                local.pop(impl, None)
            else:
                local[impl] = before


def installed() -> bool:
    """Whether the wrappers are in the registry now."""
    return _installs > 0
