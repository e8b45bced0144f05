"""Small value types of the policy language: grades, durations, signal names, choices.

Every validator here raises :func:`fail`, a ``PydanticCustomError`` whose message is already
the final human sentence; the loader adds the file position and the field path in front.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from typing import Annotated, Any, Literal, NoReturn

from pydantic import (
    BeforeValidator,
    PlainSerializer,
    PlainValidator,
    ValidationInfo,
    WithJsonSchema,
)
from pydantic_core import PydanticCustomError
from spikeguard.workers.contract.signals import SIGNALS, is_grade
from spikeguard.workers.contract.signals import format_grade as contract_format_grade
from spikeguard.workers.contract.signals import parse_grade as contract_parse_grade

from .limits import MAX_INT, int_problem


def fail(msg: str, at: str | int | tuple = (), *, key: bool = False) -> NoReturn:
    """Raise a validation error whose message is ``msg``.

    ``at`` names a key (or path) below the current location; ``key=True`` points the error at
    the key itself rather than its value (unknown fields)."""
    if not isinstance(at, tuple):
        at = (at,)
    raise PydanticCustomError("policy", "{msg}", {"msg": msg, "at": at, "key": key})


def show(v: Any) -> str:
    """A value as the user wrote it in YAML."""
    if v is True or v is False:
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, str):
        return repr(v) if len(v) <= 60 else repr(v[:57] + "...")
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, (list, tuple)):
        return "a list"
    if isinstance(v, dict):
        return "a mapping"
    return str(v)


def suggest(word: Any, choices: Any) -> str:
    """`` (did you mean 'x'?)`` for the closest choice, or an empty string."""
    if not isinstance(word, str):
        return ""
    close = difflib.get_close_matches(word, [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def one_of(values: tuple[str, ...]) -> str:
    quoted = [repr(v) for v in values]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]


def choose(v: Any, values: tuple[str, ...], what: str) -> str:
    """``v`` if it is one of ``values``; else a policy error naming the closest one (or all)."""
    if isinstance(v, str) and v in values:
        return v
    if not isinstance(v, str):
        fail(f"expected a {what} ({one_of(values)}), got {show(v)}")
    hint = suggest(v, values)
    fail(f"unknown {what} {show(v)}{hint}" + ("" if hint else f"; expected {one_of(values)}"))


def Choice(values: tuple[str, ...], what: str) -> Any:
    """A ``Literal`` of ``values`` whose error names the closest valid value."""
    check = BeforeValidator(lambda v: choose(v, values, what))
    return Annotated[Literal[values], check]  # type: ignore[valid-type]


def CallerChoice(key: str, default: tuple[str, ...], what: str) -> Any:
    """A name out of a set the caller of the validation chooses: the ``key`` entry of pydantic's
    validation context (``model_validate(data, context={key: names})``), else ``default``. The
    JSON Schema lists ``default`` under the title ``what`` (see :func:`caller_choices`)."""

    def check(v: Any, info: ValidationInfo) -> str:
        names = (info.context or {}).get(key)
        return choose(v, default if names is None else tuple(names), what)

    schema = {"title": what, "type": "string", "enum": list(default)}
    return Annotated[str, BeforeValidator(check), WithJsonSchema(schema)]


def caller_choices(schema: Any, what: str, names: tuple[str, ...]) -> Any:
    """``schema`` (a JSON Schema) with the names of every :func:`CallerChoice` titled ``what``
    replaced by ``names``: the schema of the policies a caller with those names accepts."""
    if isinstance(schema, list):
        return [caller_choices(s, what, names) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: caller_choices(v, what, names) for k, v in schema.items()}
    if out.get("title") == what and "enum" in out:
        out["enum"] = list(names)
    return out


SEVERITIES = ("info", "warn", "page")
"""The severities of a policy's alerts, mildest first (``notify.routes`` has one key each)."""

_SIGNAL_NAMES: Any = Literal[tuple(SIGNALS)]  # type: ignore[misc]
Signal = Annotated[
    _SIGNAL_NAMES,
    PlainValidator(
        lambda v: choose(v, tuple(SIGNALS), "signal"), json_schema_input_type=_SIGNAL_NAMES
    ),
]
"""A declared signal's name (``contract.signals``), checked against the declarations when a
policy is read, not when this module was imported: a signal declared later is one too. The
``Literal`` (the names declared at import) is what the JSON Schema lists."""
Action = Choice(("notify", "recover", "checkpoint", "stop"), "action")
Severity = Choice(SEVERITIES, "severity")


def _strict_bool(v: Any) -> bool:
    if v is True or v is False:
        return v
    if isinstance(v, str) and v.lower() in ("yes", "no", "on", "off", "y", "n"):
        fail(
            f"expected true or false, got {show(v)} (YAML 1.1 spellings like yes/no/on/off are"
            " plain strings in a policy)"
        )
    fail(f"expected true or false, got {show(v)}")


StrictBool = Annotated[bool, PlainValidator(_strict_bool), WithJsonSchema({"type": "boolean"})]

# --- grades -------------------------------------------------------------------------------

GRADE_PATTERN = r"^S[0-7]$"


def parse_grade(v: Any) -> int:
    """``"S3"`` (or ``s3``) -> 3; an integer 0..7 is accepted as is (S7 is healthy, S0 the
    worst)."""
    if is_grade(v):
        return int(v)
    if isinstance(v, str):
        try:
            return contract_parse_grade(v.strip().upper())
        except ValueError:
            pass
    fail(f"expected a grade S0…S7 (S7 is healthy), got {show(v)}")


def format_grade(g: float) -> str:
    """A threshold on the grade as written in a policy: ``S3``, or the number if not a grade."""
    return contract_format_grade(int(g)) if float(g).is_integer() and 0 <= g <= 7 else f"{g:g}"


Grade = Annotated[
    int,
    PlainValidator(parse_grade),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string", "pattern": GRADE_PATTERN},
                {"type": "integer", "minimum": 0, "maximum": 7},
            ]
        }
    ),
]

# --- durations ----------------------------------------------------------------------------

Unit = Literal["steps", "samples", "seconds"]
_COUNT_RE = re.compile(r"^\s*(\d+)\s*(steps?|samples?)\s*$")
_TIME_RE = re.compile(r"^\s*(?=\d)(?:(\d+)h)?(?:(\d+)m(?!s))?(?:(\d+(?:\.\d+)?)s)?\s*$")
_TIME_PATTERN = r"^(\d+h)?(\d+m)?(\d+(\.\d+)?s)?$"
_COUNT_PATTERN = {"steps": r"^\d+ ?steps?$", "samples": r"^\d+ ?samples?$"}


@dataclasses.dataclass(frozen=True)
class Duration:
    """A span written ``200 steps``, ``5 samples``, ``30s``, ``10m`` or ``1h30m``."""

    value: float
    unit: Unit

    def __str__(self) -> str:
        if self.unit != "seconds":
            n = int(self.value)
            return f"{n} {self.unit[:-1] if n == 1 else self.unit}"
        s = self.value
        h, rest = divmod(s, 3600)
        m, sec = divmod(rest, 60)
        out = (f"{int(h)}h" if h else "") + (f"{int(m)}m" if m else "")
        if sec or not out:
            out += f"{sec:g}s"
        return out


def parse_duration(v: Any, units: tuple[str, ...]) -> Duration:
    if isinstance(v, Duration):
        d = v
    elif isinstance(v, str) and (m := _COUNT_RE.match(v)):
        unit = m.group(2) if m.group(2).endswith("s") else m.group(2) + "s"
        d = Duration(_bounded(m.group(1)), unit)  # type: ignore[arg-type]
    elif isinstance(v, str) and v.strip() and (m := _TIME_RE.match(v)):
        h, mi, s = m.groups()
        seconds: float = _bounded(h or "0") * 3600 + _bounded(mi or "0") * 60
        if s:
            _bounded(s.partition(".")[0])  # the whole seconds; the fraction cannot overflow
            seconds += float(s)
        if seconds > MAX_INT:
            fail(f"{show(v)} is too long: at most 2^53 ({MAX_INT}) seconds")
        d = Duration(seconds, "seconds")
    else:
        fail(
            f"expected a duration like {_examples(units)}, got {show(v)}"
            + (
                " (a bare number is ambiguous: add a unit)"
                if isinstance(v, (int, float)) and not isinstance(v, bool)
                else ""
            )
        )
    if d.unit not in units:
        fail(f"{str(d)!r} is measured in {d.unit}; here write {_examples(units)}")
    return d


def _bounded(digits: str) -> int:
    """The count written ``digits`` as an int; a policy error beyond 2^53 (checked before
    converting: ``int()`` refuses more than 4300 digits with an unhelpful message)."""
    problem = int_problem(digits)
    if problem is not None:
        fail(problem)
    return int(digits)


def _examples(units: tuple[str, ...]) -> str:
    ex = {"steps": "'200 steps'", "samples": "'5 samples'", "seconds": "'30s' or '10m'"}
    return " or ".join(ex[u] for u in units)


def DurationOf(*units: str) -> Any:
    """A :class:`Duration` field that accepts only the given units."""
    patterns = [
        {"type": "string", "pattern": _COUNT_PATTERN[u] if u != "seconds" else _TIME_PATTERN}
        for u in units
    ]
    return Annotated[
        Duration,
        PlainValidator(lambda v: parse_duration(v, units)),
        PlainSerializer(str, return_type=str),
        WithJsonSchema(patterns[0] if len(patterns) == 1 else {"anyOf": patterns}),
    ]


def _step_count(v: Any) -> int:
    if isinstance(v, int) and not isinstance(v, bool):
        if v < 0:
            fail(f"must be 0 or more steps, got {v}")
        if v > MAX_INT:
            fail(f"must be at most 2^53 ({MAX_INT}) steps")
        return v
    if isinstance(v, str) and (m := _COUNT_RE.match(v)) and m.group(2).startswith("step"):
        return _bounded(m.group(1))
    fail(f"expected a number of steps like 200 or '200 steps', got {show(v)}")


StepCount = Annotated[
    int,
    PlainValidator(_step_count),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "integer", "minimum": 0},
                {"type": "string", "pattern": _COUNT_PATTERN["steps"]},
            ]
        }
    ),
]

# --- numbers ------------------------------------------------------------------------------


def finite(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        fail(f"expected a number, got {show(v)}")
    if not math.isfinite(v):
        fail(f"expected a finite number, got {show(v)}")
    return float(v)
