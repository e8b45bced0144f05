"""Condition models: the tests a rule applies to a rank's report stream."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError
from spikeguard.workers.contract.signals import AGENT_SIGNALS, LAYER_SIGNALS, STEP_SIGNALS

from . import expr
from .base import _Model
from .values import DurationOf, Signal, fail, finite, parse_grade, show, suggest

# --- conditions ---------------------------------------------------------------------------

_KIND_KEYS = {
    ":threshold": ("below", "above"),
    ":change": ("drops_by", "rises_by"),
    ":trailing": ("above_median", "below_median", "z_above", "z_below"),
    ":peer": ("above_peer_median", "below_peer_median"),
    ":nonfinite": ("nonfinite",),
    ":crash": ("crash",),
    ":hang": ("hang",),
    ":all": ("all",),
    ":any": ("any",),
}
_ALL_CONDITION_KEYS = sorted(
    {k for keys in _KIND_KEYS.values() for k in keys}
    | {"signal", "within", "window", "median_of", "peers_within"}
)


class _Leaf(_Model):
    def leaves(self) -> list[_Leaf]:
        return [self]

    def signals(self) -> set[str]:
        sig = getattr(self, "signal", None)
        return {sig} if sig else set()

    def cadence(self) -> frozenset[str]:
        """The message types this condition is evaluated on."""
        if self.signals() & set(LAYER_SIGNALS):
            return frozenset({"report"})
        if self.signals() & set(AGENT_SIGNALS):
            return frozenset({"health"})  # the rank agent's NVML readings
        return frozenset({"heartbeat", "report"})


def _number_or_grade(data: dict, keys: tuple[str, ...]) -> dict:
    """Grades ``S3`` are allowed (and only allowed) for the grade signal."""
    data = dict(data)
    for key in keys:
        v = data.get(key)
        if isinstance(v, str):
            if data.get("signal") != "grade":
                fail(
                    f"{show(v)} is not a number"
                    + (" (grades S0…S7 only apply to the grade signal)" if v[:1] in "sS" else ""),
                    key,
                )
            try:
                data[key] = parse_grade(v)
            except PydanticCustomError:
                fail(f"expected a grade S0…S7 (S7 is healthy), got {show(v)}", key)
    return data


class Threshold(_Leaf):
    """Fires while the signal is strictly below (or above) a fixed value."""

    signal: Signal
    """The signal to compare: a per-layer signal (grade, erank_ratio, attn_entropy_*, max_logit,
    logz_*) or loss, grad_norm, lr."""
    below: float | None = Field(
        None,
        json_schema_extra={
            "anyOf": [{"type": "number"}, {"type": "string", "pattern": "^S[0-7]$"}]
        },
    )
    """Fire while the value is < this (strict). For the grade signal write S0…S7."""
    above: float | None = Field(
        None,
        json_schema_extra={
            "anyOf": [{"type": "number"}, {"type": "string", "pattern": "^S[0-7]$"}]
        },
    )
    """Fire while the value is > this (strict)."""

    @model_validator(mode="before")
    @classmethod
    def _grades(cls, data: Any) -> Any:
        return _number_or_grade(data, ("below", "above")) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _one(self) -> Threshold:
        if self.below is not None and self.above is not None:
            fail(
                "use either 'below' or 'above' (for a band, write any: with two conditions)",
                "above",
            )
        for key in ("below", "above"):
            if getattr(self, key) is not None:
                finite(getattr(self, key))
        return self


class Change(_Leaf):
    """Fires when the signal fell (or rose) by at least an amount within a short window."""

    signal: Signal
    """The signal to watch."""
    drops_by: float | None = Field(None, gt=0)
    """Fire when the value is at least this much below the highest value in the window (≥, not
    >)."""
    rises_by: float | None = Field(None, gt=0)
    """Fire when the value is at least this much above the lowest value in the window."""
    within: DurationOf("samples", "steps") = Field("2 samples", validate_default=True)  # type: ignore[valid-type]
    """The window that includes the current value: '2 samples' compares two consecutive samples."""

    @model_validator(mode="after")
    def _one(self) -> Change:
        if (self.drops_by is None) == (self.rises_by is None):
            fail("use either 'drops_by' or 'rises_by'", "rises_by")
        if self.within.value < 2 and self.within.unit == "samples":
            fail("'within' must span at least 2 samples (the current one and one before)", "within")
        if self.within.value < 1:
            fail("'within' must span at least 1 step", "within")
        return self


class Trailing(_Leaf):
    """Compares the value with the trailing median of the same series (ratio and/or robust
    z-score)."""

    signal: Signal
    """The signal to watch."""
    window: DurationOf("samples", "steps")  # type: ignore[valid-type]
    """Trailing window the median is taken over (values before the current one); it must be full
    before the rule can fire."""
    above_median: float | None = Field(None, gt=0)
    """Fire when value > this × median (e.g. 1.5 for a loss spike)."""
    below_median: float | None = Field(None, gt=0)
    """Fire when value < this × median (e.g. 0.5 for an entropy collapse)."""
    z_above: float | None = Field(None, gt=0)
    """Fire when (value − median) / (1.4826 × MAD) ≥ this. With a ratio, both must hold."""
    z_below: float | None = Field(None, gt=0)
    """Fire when (median − value) / (1.4826 × MAD) ≥ this. With a ratio, both must hold."""
    median_of: DurationOf("samples", "steps") | None = None  # type: ignore[valid-type]
    """Test the median of the latest values over this span (the current one included) instead of
    the current value alone, against the median of the window before them: a climb that noise
    hides step by step (a loss rising 0.3 nats over 50 steps) shows in a 20-step median, and a
    blip of a step or two does not."""

    @model_validator(mode="after")
    def _consistent(self) -> Trailing:
        up = self.above_median is not None or self.z_above is not None
        down = self.below_median is not None or self.z_below is not None
        if up and down:
            fail(
                "a trailing test watches one direction: use above_median/z_above or "
                "below_median/z_below"
            )
        if self.window.value < 3:
            fail("the window needs at least 3 values for a median", "window")
        if self.median_of is not None and self.median_of.unit != self.window.unit:
            fail(f"median_of is counted in {self.window.unit}, as the window is", "median_of")
        return self

    @property
    def rising(self) -> bool:
        return self.above_median is not None or self.z_above is not None


class PeerRelative(_Leaf):
    """Compares a rank's recent value of a per-rank signal with the median of the other ranks'
    (a straggler: a rank whose step time is well above its peers')."""

    signal: Signal
    """The per-rank signal to compare (step_time, loss, grad_norm, lr); not a per-layer one."""
    above_peer_median: float | None = Field(None, gt=1, allow_inf_nan=False)
    """Fire when the rank's value is at least this × the median of its peers' (> 1, e.g. 1.3)."""
    below_peer_median: float | None = Field(None, gt=0, lt=1, allow_inf_nan=False)
    """Fire when the rank's value is at most this × the median of its peers' (in (0, 1))."""
    min_step_share: float | None = Field(None, gt=0, lt=1, allow_inf_nan=False)
    """With ``above_peer_median``: fire only when the rank's excess over the peers' median is at
    least this share of the time between its steps (its pace over its latest ``median_of``
    steps, from the messages' own clock): what its peers wait for it, per step, as a share of
    the step. ``0.05``: a rank is not a straggler worth a warning unless it costs the job 5 % of
    its time, however large the ratio of two short computations (a millisecond of scheduling
    noise on a 3 ms forward is 1.3×)."""
    median_of: DurationOf("steps") = Field("5 steps", validate_default=True)  # type: ignore[valid-type]
    """The rank's value, and each peer's, is its median over its latest values in this many steps
    (the current one included; at least half of them reported), so one noisy step does not
    count."""
    peers_within: DurationOf("steps") = Field("100 steps", validate_default=True)  # type: ignore[valid-type]
    """A rank is a peer while its latest value is within this many steps of the furthest step any
    rank has reported in the generation; one that stopped reporting (or measuring) drops out.
    With no peer (a single-rank job) the condition never holds."""

    @model_validator(mode="before")
    @classmethod
    def _per_rank(cls, data: Any) -> Any:
        sig = data.get("signal") if isinstance(data, dict) else None
        if sig in LAYER_SIGNALS or sig in AGENT_SIGNALS:
            fail(
                f"a peer comparison reads a per-rank signal ({', '.join(STEP_SIGNALS)}); "
                f"{sig!r} is {'per layer' if sig in LAYER_SIGNALS else 'a reading of the agent'}",
                "signal",
            )
        return data

    @model_validator(mode="after")
    def _one(self) -> PeerRelative:
        if (self.above_peer_median is None) == (self.below_peer_median is None):
            fail("use either 'above_peer_median' or 'below_peer_median'", "below_peer_median")
        if self.min_step_share is not None and self.above_peer_median is None:
            fail("'min_step_share' weighs what a slow rank costs: use it with above_peer_median")
        if self.median_of.value < 1:
            fail("'median_of' must span at least 1 step", "median_of")
        if self.peers_within.value < 1:
            fail("'peers_within' must span at least 1 step", "peers_within")
        return self

    @property
    def factor(self) -> float:
        """The ratio to the peers' median: above_peer_median or below_peer_median."""
        f = self.above_peer_median if self.above_peer_median is not None else self.below_peer_median
        assert f is not None
        return f

    @property
    def rising(self) -> bool:
        return self.above_peer_median is not None

    @property
    def need(self) -> int:
        """How many values a rank's median needs: at least half of ``median_of``'s steps."""
        return (int(self.median_of.value) + 1) // 2


class NonFinite(_Leaf):
    """Fires when the signal is NaN or ±infinity."""

    signal: Signal
    """The signal to watch."""
    nonfinite: Literal[True]
    """Always true."""


class Crash(_Leaf):
    """Fires when a rank's process exited with a code other than 0 (the supervisor's ``exit``
    message) after it sent its first message; one that dies before is a launch failure, which the
    supervisor retries on its own (job ``timeouts.launch_retries``)."""

    crash: Literal[True]
    """Always true."""

    def cadence(self) -> frozenset[str]:
        return frozenset({"exit"})


class Hang(_Leaf):
    """Fires when the supervisor declares a rank hung (no heartbeat within its timeout)."""

    hang: Literal[True] | DurationOf("seconds")  # type: ignore[valid-type]
    """true for any hang the supervisor reports, or a minimum heartbeat age such as 5m."""

    @field_validator("hang", mode="before")
    @classmethod
    def _value(cls, v: Any) -> Any:
        if v is False:
            fail(
                "write 'hang: true' or a minimum heartbeat age like 'hang: 5m' "
                "(or remove the condition)"
            )
        return v

    def cadence(self) -> frozenset[str]:
        return frozenset({"hang"})


class _Group(_Model):
    """A list of conditions combined (``all:`` or ``any:``)."""

    @property
    def conditions(self) -> list[Any]:
        raise NotImplementedError

    def leaves(self) -> list[_Leaf]:
        return [leaf for c in self.conditions for leaf in c.leaves()]

    def signals(self) -> set[str]:
        return {s for c in self.conditions for s in c.signals()}


class AllOf(_Group):
    """Fires when every listed condition holds on the same message."""

    all: list[Condition] = Field(min_length=1)
    """Conditions that must all hold."""

    @property
    def conditions(self) -> list[Any]:
        return self.all

    def cadence(self) -> frozenset[str]:
        out = frozenset.intersection(*(c.cadence() for c in self.all))
        if not out:
            fail(
                "these conditions never arrive together (crash comes with exit messages, hang with "
                "hang messages, per-layer signals with reports, the gpu_* signals with the "
                "agent's health readings): combine them with any: instead"
            )
        return out

    @model_validator(mode="after")
    def _together(self) -> AllOf:
        self.cadence()
        return self


class AnyOf(_Group):
    """Fires when at least one listed condition holds."""

    any: list[Condition] = Field(min_length=1)
    """Conditions of which one must hold."""

    @property
    def conditions(self) -> list[Any]:
        return self.any

    def cadence(self) -> frozenset[str]:
        return frozenset.union(*(c.cadence() for c in self.any))


def _condition_input(v: Any) -> Any:
    if isinstance(v, str):
        return expr.parse(v)
    if isinstance(v, BaseModel):
        return v
    if not isinstance(v, dict):
        fail(f"expected a condition (a mapping, or a string like 'grade < S3'), got {show(v)}")
    kinds = [(tag, k) for tag, keys in _KIND_KEYS.items() for k in keys if k in v]
    if not kinds:
        for key in v:
            if key not in _ALL_CONDITION_KEYS:
                fail(f"unknown field {show(key)}{suggest(key, _ALL_CONDITION_KEYS)}", key, key=True)
        fail(
            "a condition needs a test: below/above, drops_by/rises_by, above_median/below_median/"
            "z_above/z_below, above_peer_median/below_peer_median, nonfinite, crash or hang, or a "
            "list under all:/any:"
        )
    if len({tag for tag, _ in kinds}) > 1:
        a, b = kinds[0][1], next(k for tag, k in kinds if tag != kinds[0][0])
        fail(
            f"a condition tests one thing, found {a!r} and {b!r}: combine tests with all: or any:",
            b,
        )
    return v


def _condition_kind(v: Any) -> str | None:
    if isinstance(v, dict):
        return next((tag for tag, keys in _KIND_KEYS.items() if any(k in v for k in keys)), None)
    tags: dict[type, str] = {
        Threshold: ":threshold",
        Change: ":change",
        Trailing: ":trailing",
        PeerRelative: ":peer",
        NonFinite: ":nonfinite",
        Crash: ":crash",
        Hang: ":hang",
        AllOf: ":all",
        AnyOf: ":any",
    }
    return tags.get(type(v))


_ConditionUnion = Annotated[
    Annotated[Threshold, Tag(":threshold")]
    | Annotated[Change, Tag(":change")]
    | Annotated[Trailing, Tag(":trailing")]
    | Annotated[PeerRelative, Tag(":peer")]
    | Annotated[NonFinite, Tag(":nonfinite")]
    | Annotated[Crash, Tag(":crash")]
    | Annotated[Hang, Tag(":hang")]
    | Annotated[AllOf, Tag(":all")]
    | Annotated[AnyOf, Tag(":any")],
    Discriminator(_condition_kind),
]
Condition = Annotated[
    _ConditionUnion,
    BeforeValidator(_condition_input, json_schema_input_type=str | _ConditionUnion),
]
"""A condition: a mapping (one test, or all:/any: of conditions) or a compact string (see expr)."""

AllOf.model_rebuild()
AnyOf.model_rebuild()
