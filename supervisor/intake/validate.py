"""One report line to a message, or the reason it is dropped. Pure: no Ray, no I/O.

The collector calls :func:`parse` on every line a rank sends. A line is untrusted input: it may be
truncated, binary, nested thousands of levels deep, or hold numbers no float can hold. Whatever it
holds, :func:`parse` either returns a message the policy engine can read without raising, or
raises :class:`Rejected` with the reason the collector counts:

``oversize``      longer than :data:`~spikeguard.workers.contract.messages.MAX_LINE_BYTES`
``malformed``     not JSON, not an object, or nested deeper than ``MAX_DEPTH``
``bad_version``   another format version
``unknown_type``  a message type the contract does not name
``wrong_type``    a field the supervisor reads has the wrong type (a ``phases`` name that is
                  no phase name included)
``out_of_range``  an integer the supervisor reads is beyond ``MAX_SAFE_INT``, or a timing
                  (``step_time``, a phase's seconds) is not finite, negative or beyond
                  ``MAX_STEP_TIME_S``, or ``phases`` names more than ``MAX_PHASES``

Non-finite metric values (a NaN or infinite ``loss``) are data, not errors: detecting them is
what the non-finite rules are for. Fields the supervisor never reads (``extra``, the batch ids
inside a ``batch_ids`` answer) are only checked for depth.

Text is UTF-8: a line that is not (a stray byte, an encoded surrogate, UTF-16) is
``malformed``. A string escape of a lone surrogate (``"\\ud800"``) is valid JSON, but no UTF-8
writer can write the string it stands for: the first metrics scrape, report or journal line that
names it would fail. Every such character, in any key or value of the message, is replaced by
U+FFFD (the replacement character) at ingest, so nothing downstream ever holds one.
"""

from __future__ import annotations

import json
import re
from typing import Any

import orjson
from spikeguard.workers.contract.messages import (
    FORMAT_VERSION,
    MAX_DEPTH,
    MAX_LINE_BYTES,
    MAX_PHASES,
    MAX_SAFE_INT,
    MESSAGE_TYPES,
    is_phase_name,
    is_timing,
    may_hold_surrogate,
    replace_surrogates,
    too_deep,
)
from spikeguard.workers.contract.signals import STEP_SIGNALS

METRICS = STEP_SIGNALS
"""The per-step metrics (the declared step signals): a number (NaN and infinities included)
or null."""

_REQUIRED_INTS = ("rank", "gen", "step")
COUNTS = ("tokens", "total_steps")
"""Optional per-step counts of a heartbeat or report: an integer >= 0, or null."""


class Rejected(ValueError):
    """A line the collector drops; ``reason`` is what it is counted under."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def parse(line: bytes | str) -> dict[str, Any]:
    """The message on ``line``, validated; raises :class:`Rejected` (never anything else)."""
    return read(line)[0]


def read(line: bytes | str) -> tuple[dict[str, Any], bool]:
    """The message on ``line``, validated, and whether it was repaired (a lone surrogate
    replaced, see the module docstring): then ``line`` no longer says what the message holds,
    and ``reports.jsonl`` must encode the message again. Raises :class:`Rejected` (never
    anything else)."""
    if len(line) > MAX_LINE_BYTES:
        raise Rejected("oversize")
    msg = _fast_loads(line)  # orjson refuses lone surrogates: what it reads needs no repair
    repaired = False
    if msg is None:
        try:
            text = line.decode("utf-8-sig") if isinstance(line, bytes) else line
            msg = json.loads(text)
        except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
            raise Rejected("malformed") from None
        if type(msg) is not dict:
            raise Rejected("malformed")
        if _nested(msg) and too_deep(msg, MAX_DEPTH):
            raise Rejected("malformed")
        if may_hold_surrogate(text):
            found: list[bool] = []
            msg = replace_surrogates(msg, found)
            repaired = bool(found)
    why = problem(msg)
    if why is not None:
        raise Rejected(why)
    return msg, repaired


_LONG_DIGITS = re.compile(rb"[0-9]{19}")
"""A run of digits as long as the shortest integer orjson reads as a float (beyond 64 bits)."""
_CONVERTED = float(2**63)
"""orjson reads an integer literal beyond [-2**63, 2**64) as a float at least this large."""


def _fast_loads(line: bytes | str) -> dict[str, Any] | None:
    """The object on ``line`` as ``json.loads`` reads it, by orjson (5x faster), if it is one
    that needs no depth walk or orjson reads as json does; None otherwise (``json`` decides).

    orjson refuses what json reads differently or does not read (NaN and infinities, lone
    surrogates, a byte-order mark, nesting past 1024 levels), and reads an integer beyond 64
    bits as a float: a flat message with a float that large, or a nested one with a run of 19
    digits in its line, goes to json too."""
    if type(line) is not bytes:
        return None
    try:
        msg = orjson.loads(line)
    except Exception:  # json.loads answers (or raises)
        return None
    if type(msg) is not dict:
        return None
    for value in msg.values():
        t = type(value)
        if t is dict or t is list:  # nested: walked for depth, scanned for long integers
            if too_deep(msg, MAX_DEPTH) or _LONG_DIGITS.search(line):
                return None
            return msg
        if t is float and (value >= _CONVERTED or value <= -_CONVERTED):
            return None
    return msg


def _nested(msg: dict[str, Any]) -> bool:
    """Whether a value of ``msg`` is an object or a list (most messages are flat)."""
    return any(type(value) is dict or type(value) is list for value in msg.values())


def problem(msg: dict[str, Any]) -> str | None:
    """Why the decoded message ``msg`` is unusable (a reason of the module docstring), or None."""
    if msg.get("v") != FORMAT_VERSION:
        return "bad_version"
    if msg.get("type") not in MESSAGE_TYPES:
        return "unknown_type"
    for key in _REQUIRED_INTS:
        if type(msg.get(key)) is not int:  # JSON gives int, bool or something else
            return "wrong_type"
    for key in METRICS:
        t = type(msg.get(key))
        if not (t is float or t is int or t is type(None)):
            return "wrong_type"
    if msg["type"] == "dropped" and not (msg.get("count") is None or _is_int(msg["count"])):
        return "wrong_type"
    for key in COUNTS:
        if not _count_or_null(msg.get(key)):
            return "wrong_type"
    if msg["type"] == "batch_ids":
        why = _batch_ids_problem(msg)
        if why is not None:
            return why
    if "step_time" in msg or "phases" in msg:
        why = _timing_problem(msg)
        if why is not None:
            return why
    why = _summary_problem(msg)
    if why is None:
        why = _layers_problem(msg)
    if why is None:
        why = _range_problem(msg.values())
    return why


def _summary_problem(msg: dict[str, Any]) -> str | None:
    if "summary" not in msg:
        return None
    summary = msg["summary"]
    if not isinstance(summary, dict):
        return "wrong_type"
    for name, value in summary.items():
        if name == "worst_layer":
            if value is not None and not isinstance(value, str):
                return "wrong_type"
        elif not _number_or_null(value):
            return "wrong_type"
    return _range_problem(summary.values())


def _layers_problem(msg: dict[str, Any]) -> str | None:
    if "layers" not in msg:
        return None
    layers = msg["layers"]
    if not isinstance(layers, dict):
        return "wrong_type"
    for name, signals in layers.items():
        if not isinstance(name, str) or not isinstance(signals, dict):
            return "wrong_type"
        for signal, value in signals.items():
            if not isinstance(signal, str) or not _number_or_null(value):
                return "wrong_type"
        why = _range_problem(signals.values())
        if why is not None:
            return why
    return None


def _timing_problem(msg: dict[str, Any]) -> str | None:
    """``step_time`` a timing or null, ``phases`` null or at most ``MAX_PHASES`` phase names
    each with a timing (see :func:`~spikeguard.workers.contract.messages.is_timing`)."""
    why = _timing_value_problem(msg.get("step_time"))
    if why is not None:
        return why
    phases = msg.get("phases")
    if phases is None:
        return None
    if type(phases) is not dict:
        return "wrong_type"
    if len(phases) > MAX_PHASES:
        return "out_of_range"
    for name, seconds in phases.items():
        if not is_phase_name(name) or seconds is None:
            return "wrong_type"
        why = _timing_value_problem(seconds)
        if why is not None:
            return why
    return None


def _timing_value_problem(value: Any) -> str | None:
    """Why ``value`` is no timing (null is none: absent), or None."""
    if value is None or is_timing(value):
        return None
    return "out_of_range" if _number_or_null(value) else "wrong_type"


def _batch_ids_problem(msg: dict[str, Any]) -> str | None:
    """A ``batch_ids`` answer: ``request`` an integer, ``window`` and ``truncated`` integers >= 0
    or null, ``entries`` a list of [step, batch ids] pairs (the ids are the script's own JSON)."""
    if not _is_int(msg.get("request")):
        return "wrong_type"
    for key in ("window", "truncated"):
        if not _count_or_null(msg.get(key)):
            return "wrong_type"
    entries = msg.get("entries")
    if not isinstance(entries, list):
        return "wrong_type"
    for entry in entries:
        if not isinstance(entry, list) or len(entry) != 2 or not _is_int(entry[0]):
            return "wrong_type"
        if abs(entry[0]) > MAX_SAFE_INT:
            return "out_of_range"
    return _range_problem([msg["request"], msg.get("window"), msg.get("truncated")])


def _range_problem(values: Any) -> str | None:
    """``out_of_range`` when one of ``values`` is an integer beyond ``MAX_SAFE_INT``."""
    for value in values:
        if type(value) is int and (value > MAX_SAFE_INT or value < -MAX_SAFE_INT):
            return "out_of_range"
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _count_or_null(value: Any) -> bool:
    return value is None or (_is_int(value) and value >= 0)


def _number_or_null(value: Any) -> bool:
    if value is None:
        return True
    return isinstance(value, (int, float)) and not isinstance(value, bool)
