"""Observations to and from the journal's JSON.

The first event of every transition that changed the machine's state records the observations
that caused it (``obs``): what :func:`.machine.fold` replays after a restart. Fields marked
``journal=False`` (:data:`.model.EVENT_ONLY`) are left out: they only feed events, which record
them anyway.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .model import OBSERVATIONS, Observation, Settings


def encode(obs: Observation) -> dict[str, Any]:
    """``obs`` as plain JSON-able data: ``{"type": "Recover", "rule": ..., ...}``."""
    out: dict[str, Any] = {"type": type(obs).__name__}
    for f in dataclasses.fields(obs):
        if f.metadata.get("journal", True):
            out[f.name] = _plain(getattr(obs, f.name))
    return out


def decode(data: dict[str, Any]) -> Observation:
    """The inverse of :func:`encode`; ``ValueError`` for an unknown type or a malformed field."""
    cls = OBSERVATIONS.get(str(data.get("type")))
    if cls is None:
        raise ValueError(f"unknown observation type {data.get('type')!r}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            kwargs[f.name] = _revive(f.name, data[f.name])
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ValueError(f"malformed {cls.__name__} observation: {e}") from None


def _plain(value: Any) -> Any:
    if isinstance(value, Settings):
        return value.to_dict()
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def _revive(name: str, value: Any) -> Any:
    """Turn a field's JSON back into the type the dataclass declares (by field name: each name
    means the same thing in every observation)."""
    if name == "settings":
        return Settings.from_dict(value)
    if name == "skipped":
        return tuple((str(path), str(why)) for path, why in value)
    if name in ("ranks", "forced", "unreachable", "nodes"):
        return tuple(value)
    if name == "skip_steps" and value is not None:
        return (int(value[0]), int(value[1]))
    return value
