"""A rank's message as one JSON line: odd values converted where sensible, refused otherwise.

A training script hands the SDK whatever it has: tensors, numpy scalars, tuples as keys, sets.
:func:`encode_line` turns a message into plain JSON data first and raises :class:`Unencodable`
(with a reason) for what has no sensible JSON form, so the caller learns at once; the channel's
writer thread then only ever writes bytes. Conversions:

* numpy and torch scalars, and one-element arrays and tensors: ``.item()``;
* arrays and tensors of at most :data:`MAX_ARRAY_ELEMENTS` elements: ``.tolist()``; bigger ones
  are refused (a report line is no place for a weight matrix);
* tuples, sets and frozensets: lists; dict keys that are not strings: ``str(key)``;
* NaN and infinities: JSON ``NaN``/``Infinity`` (the supervisor reads them as data).

Refused: any other object, nesting deeper than
:data:`~spikeguard.workers.contract.messages.MAX_DEPTH` (a reference cycle included), integers
JSON cannot write, and lines longer than
:data:`~spikeguard.workers.contract.messages.MAX_LINE_BYTES`.
"""

from __future__ import annotations

import json
from typing import Any

from .contract.messages import MAX_DEPTH, MAX_LINE_BYTES

MAX_ARRAY_ELEMENTS = 64
"""The most elements an array or tensor may have to be sent as a list."""


class Unencodable(ValueError):
    """A message has no JSON form; ``reason`` says which value and why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def encode_line(msg: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
    """``msg`` as plain JSON data and as one newline-terminated UTF-8 line.

    Raises :class:`Unencodable` (and nothing else) when it cannot be sent.
    """
    try:
        data = plain(msg)
        text = json.dumps(data, separators=(",", ":"), allow_nan=True)
    except Unencodable:
        raise
    except Exception as e:  # e.g. an int too long for str(); a user type's method raising
        raise Unencodable(f"{type(e).__name__}: {e}") from None
    line = (text + "\n").encode()  # ensure_ascii: always valid UTF-8
    if len(line) - 1 > MAX_LINE_BYTES:
        raise Unencodable(f"the line is {len(line) - 1} bytes, more than {MAX_LINE_BYTES}")
    return data, line


def plain(value: Any, depth: int = 1) -> Any:
    """``value`` as JSON data (see the module docstring); ``depth`` is its nesting level."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, (dict, list, tuple, set, frozenset)):
        if depth > MAX_DEPTH:
            raise Unencodable(f"nested more than {MAX_DEPTH} levels (or a reference cycle)")
        if isinstance(value, dict):
            out = {}
            for key, item in value.items():
                name = key if isinstance(key, str) else str(key)
                out[name] = plain(item, depth + 1)
            return out
        return [plain(item, depth + 1) for item in value]
    if callable(getattr(value, "tolist", None)):
        return _array(value, depth)
    raise Unencodable(f"a {type(value).__qualname__} has no JSON form")


def _array(value: Any, depth: int) -> Any:
    """A numpy or torch value: a scalar via ``.item()``, a small array via ``.tolist()``."""
    n = _elements(value)
    if n is None:
        raise Unencodable(f"a {type(value).__qualname__} has no JSON form")
    if n == 1 and callable(getattr(value, "item", None)):
        return plain(value.item(), depth)
    if n > MAX_ARRAY_ELEMENTS:
        raise Unencodable(
            f"a {type(value).__qualname__} of {n} elements (at most {MAX_ARRAY_ELEMENTS} are sent)"
        )
    return plain(value.tolist(), depth)


def _elements(value: Any) -> int | None:
    """How many elements an array-like holds (torch: ``numel()``, numpy: ``size``), or None."""
    numel = getattr(value, "numel", None)
    if callable(numel):
        return _count(numel())
    return _count(getattr(value, "size", None))


def _count(n: Any) -> int | None:
    if isinstance(n, int) and not isinstance(n, bool):
        return n
    return None
