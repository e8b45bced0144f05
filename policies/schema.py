"""The policy model: what a YAML policy file may say, validated by pydantic.

Every model forbids unknown fields (with a did-you-mean hint) and documents each field; the
docstrings become the JSON Schema descriptions (``spikeguard policy schema``). The condition
models live in :mod:`.conditions`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BeforeValidator,
    Discriminator,
    Field,
    Tag,
    WithJsonSchema,
    create_model,
    field_validator,
    model_validator,
)
from spikeguard.workers.contract.secret_scan import find_secret
from spikeguard.workers.contract.signals import LAYER_SIGNALS

from .base import _Model
from .conditions import (
    AllOf,
    AnyOf,
    Change,
    Condition,
    Crash,
    Hang,
    NonFinite,
    PeerRelative,
    Threshold,
    Trailing,
)
from .values import (
    Action,
    CallerChoice,
    Duration,
    DurationOf,
    Grade,
    Severity,
    StepCount,
    StrictBool,
    fail,
    show,
    suggest,
)

__all__ = [
    "DEFAULT_DESTINATIONS",
    "DEFAULT_ROUTES",
    "DEFAULT_SEVERITY",
    "DESTINATIONS",
    "AllOf",
    "AnyOf",
    "AtLeastRanks",
    "Change",
    "Condition",
    "Crash",
    "FractionOfRanks",
    "Hang",
    "NonFinite",
    "NotifySettings",
    "PeerRelative",
    "Policy",
    "RecoveryOverrides",
    "RecoverySettings",
    "Routes",
    "Rule",
    "SlackTarget",
    "Threshold",
    "Trailing",
]

DEFAULT_SEVERITY = {"notify": "warn", "recover": "warn", "checkpoint": "info", "stop": "page"}

# --- rank scope ---------------------------------------------------------------------------


class FractionOfRanks(_Model):
    """At least this fraction of the ranks (rounded up, at least one)."""

    fraction: float = Field(gt=0, le=1)
    """A number in (0, 1]; 0.5 of 8 ranks means at least 4."""


class AtLeastRanks(_Model):
    """At least this many ranks."""

    at_least: int = Field(ge=1)
    """A whole number of ranks."""


def _scope_input(v: Any) -> Any:
    if isinstance(v, str) and v not in ("any", "all"):
        fail(
            f"unknown rank scope {show(v)}{suggest(v, ('any', 'all'))}; expected 'any', 'all', "
            "{fraction: 0.5} or {at_least: 2}"
        )
    if isinstance(v, dict) and len(v) == 1 and next(iter(v)) not in ("fraction", "at_least"):
        key = next(iter(v))
        fail(
            f"unknown rank scope {show(key)}{suggest(key, ('fraction', 'at_least'))}; expected "
            "'any', 'all', {fraction: 0.5} or {at_least: 2}",
            key,
        )
    if not isinstance(v, (str, dict, FractionOfRanks, AtLeastRanks)) or (
        isinstance(v, dict) and len(v) != 1
    ):
        fail(f"expected 'any', 'all', {{fraction: 0.5}} or {{at_least: 2}}, got {show(v)}")
    return v


def _scope_kind(v: Any) -> str:
    if isinstance(v, str):
        return ":name"
    if isinstance(v, dict):
        return ":fraction" if "fraction" in v else ":at_least"
    return ":fraction" if isinstance(v, FractionOfRanks) else ":at_least"


RankScope = Annotated[
    Annotated[Literal["any", "all"], Tag(":name")]
    | Annotated[FractionOfRanks, Tag(":fraction")]
    | Annotated[AtLeastRanks, Tag(":at_least")],
    Discriminator(_scope_kind),
    BeforeValidator(_scope_input),
]

# --- recovery -----------------------------------------------------------------------------


def _lr_factors(v: Any) -> Any:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        v = [v]
    if not isinstance(v, list) or not v:
        fail(f"expected a non-empty list of factors like [0.5, 0.3], got {show(v)}")
    for i, f in enumerate(v):
        if (
            isinstance(f, bool)
            or not isinstance(f, (int, float))
            or not (0 < f <= 1)
            or not math.isfinite(f)
        ):
            fail(
                "each LR factor must be in (0, 1] (it multiplies the learning rate), "
                f"got {show(f)}",
                i,
            )
    return [float(f) for f in v]


_FACTOR_SCHEMA = {"type": "number", "exclusiveMinimum": 0, "maximum": 1}
LrFactors = Annotated[
    list[float],
    BeforeValidator(_lr_factors),
    WithJsonSchema(
        {"anyOf": [_FACTOR_SCHEMA, {"type": "array", "items": _FACTOR_SCHEMA, "minItems": 1}]}
    ),
]
Attempts = Annotated[int, Field(ge=1)]


def _one_of(*choices: str) -> BeforeValidator:
    """Accept one of ``choices`` (the type's ``Literal``); anything else is an error naming the
    value, a did-you-mean and the choices."""
    expected = " or ".join(repr(c) for c in choices)

    def check(v: Any) -> Any:
        if v in choices:
            return v
        fail(f"unknown value {show(v)}{suggest(v, choices)}; expected {expected}")

    return BeforeValidator(check)


OnExhausted = Annotated[Literal["stop", "hold"], _one_of("stop", "hold")]
SkipBy = Annotated[Literal["steps", "batch_ids"], _one_of("steps", "batch_ids")]


def lr_factor_for(factors: Sequence[float], attempt: int) -> float:
    """The LR factor of the ``attempt``-th recovery (0-based): ``factors[attempt]``, the last one
    repeating."""
    return factors[min(attempt, len(factors) - 1)]


class RecoverySettings(_Model):
    """What a ``recover`` decision does: kill, roll back, cut the LR, reset, probation, resume."""

    min_grade: Grade = 4
    """Roll back to the newest checkpoint whose grade is at least this (written S0…S7)."""
    min_steps_back: StepCount = 0
    """The checkpoint must be at least this many steps before the incident."""
    fallback_on_corrupt: StrictBool = True
    """When a checkpoint fails its checksum, fall back to the next older one that qualifies."""
    lr_factors: LrFactors = [0.5]  # noqa: RUF012 (pydantic copies field defaults)
    """LR factor per attempt, each in (0, 1]: attempt i uses lr_factors[min(i, len-1)], and the
    scale compounds across attempts."""
    reset_optimizer: StrictBool = True
    """Start the optimizer from fresh state on resume (its moments are often poisoned)."""
    skip_window: StepCount = 0
    """Skip the batches of this many steps before the incident on resume (0: skip none)."""
    skip_by: SkipBy = "steps"
    """How skip_window skips: 'steps' (those steps, when the data order repeats after a
    rollback) or 'batch_ids' (the batches the ranks recorded for those steps, by their ids,
    wherever they come up again; the steps when no rank answered in time)."""
    probation_steps: StepCount = 1000
    """Steps after a resume during which any recover decision counts as a failed attempt."""
    max_attempts: Attempts = 3
    """Recoveries allowed before the budget is spent."""
    max_incidents: Attempts = 10
    """Incidents allowed in one run (each with its own max_attempts); the next one escalates at
    once, so a fault that recurs every few thousand steps cannot loop forever."""
    on_exhausted: OnExhausted = "stop"
    """When the budget is spent: 'stop' the job and page, or 'hold' (keep it stopped for a
    human)."""
    grade_baseline: Annotated[Literal["run", "absolute"], _one_of("run", "absolute")] = "run"
    """What 'healthy' means for a rollback target when no checkpoint meets min_grade: 'run' (the
    run's own healthy baseline: the median grade of its graded checkpoints before the incident,
    capped at min_grade; a small healthy model grades S2-S3 and must not escalate at its first
    incident only because of the grade scale) or 'absolute' (min_grade only: nothing meets it,
    the incident escalates)."""
    recur_window_steps: StepCount = 2
    """A recover decision of the same rule within this many steps of the previous attempt's is a
    recurrence candidate (reports are asynchronous: a crashed rank's last step can lag a step)."""
    recur_tolerance: (
        Annotated[float, Field(ge=0, le=1, strict=True, allow_inf_nan=False)] | None
    ) = 1e-3
    """A recurrence also needs the same measured value: both non-finite, both absent (a crash, a
    hang), or equal within this relative tolerance; otherwise it is a new attempt, not a
    deterministic fault (after a rollback a windowed rule refills and can fire at the same
    sampled step by coincidence of the sampling grid). null: the value is not compared."""
    rewarm_steps: StepCount = 50
    """After an optimizer reset, ramp the LR multiplier linearly from 1/rewarm_steps of the plan's
    LR scale to all of it over the generation's first rewarm_steps optimizer steps (fresh Adam
    state at the full LR makes the first resumed steps jump); 0: the full LR at once."""
    probation_kinds: Annotated[Literal["own", "incident"], _one_of("own", "incident")] = "own"
    """A recover decision during probation: 'own' (a fault of the other kind, numerical against
    crash or hang, closes the incident as superseded and opens its own with its rule's settings;
    another rule of the same kind is the next attempt under the firing rule's settings) or
    'incident' (every one is the open incident's next attempt, with its settings)."""
    lr_restore_steps: StepCount = 0
    """When an incident's probation passes, give its LR cut back: the scale returns to what it
    was before the incident, linearly over this many steps (a permanent cut costs final loss);
    0: a cut is permanent."""

    def lr_factor(self, attempt: int) -> float:
        """The factor of attempt ``attempt`` (0-based)."""
        return lr_factor_for(self.lr_factors, attempt)

    def lr_scale(self, attempts: int) -> float:
        """The compounded LR scale after ``attempts`` recoveries (1.0 after none)."""
        return math.prod(self.lr_factor(i) for i in range(attempts))


def _overrides_of(settings: type[_Model], name: str, doc: str) -> Any:
    """A model with each field of ``settings`` optional, in the same order, of the same type (an
    override is validated exactly like the setting it overrides) and None by default: the one
    definition of a setting is its field in ``settings``."""
    fields: dict[str, Any] = {
        field: (
            info.rebuild_annotation() | None,
            Field(None, description=f"Override of recovery.{field}."),
        )
        for field, info in settings.model_fields.items()
    }
    return create_model(name, __base__=_Model, __module__=__name__, __doc__=doc, **fields)


RecoveryOverrides = _overrides_of(
    RecoverySettings,
    "RecoveryOverrides",
    "Per-rule changes to the policy's recovery settings; omitted fields keep the policy's\nvalue.",
)
"""A rule's ``recovery``: every field of :class:`RecoverySettings`, optional."""


# --- rules --------------------------------------------------------------------------------


def _layers(v: Any) -> Any:
    if isinstance(v, str):
        v = [v]
    if isinstance(v, list):
        for i, g in enumerate(v):
            if not isinstance(g, str) or not g.strip():
                fail(f"expected a layer name or glob like 'blocks.*.attn', got {show(g)}", i)
    return v


# --- destinations: the names notify.routes and a rule's notify may use -------------------

DEFAULT_ROUTES: dict[str, tuple[str, ...]] = {
    "info": ("console",),
    "warn": ("console", "slack", "alertmanager", "webhook"),
    "page": ("console", "slack", "alertmanager", "pagerduty", "webhook"),
}
"""Where each severity goes when a policy does not say: the supervisor's console, Slack, and the
pagers (Alertmanager, PagerDuty on pages only, the webhook). A destination the supervisor has not
configured (no ``SPIKEGUARD_PAGERDUTY_ROUTING_KEY``, …) builds no sink: routing to it costs
nothing."""
DESTINATIONS = "destinations"
"""The validation-context key of the names ``notify.routes`` may use: a supervisor passes the
names of its sinks (``load_policy(..., destinations=names)``); without it, a policy may route to
the names of the default routes only."""
DEFAULT_DESTINATIONS = tuple(dict.fromkeys(n for ns in DEFAULT_ROUTES.values() for n in ns))
"""The names the default routes use: what a policy loaded without a supervisor's names may use."""
Destination = CallerChoice(DESTINATIONS, DEFAULT_DESTINATIONS, "destination")
Destinations = Annotated[
    list[Destination],  # type: ignore[valid-type]
    BeforeValidator(
        lambda v: [v] if isinstance(v, str) else v,
        json_schema_input_type=Destination | list[Destination],  # type: ignore[valid-type]
    ),
]


class Rule(_Model):
    """When a condition holds (long enough, outside warm-in and cooldown), take an action."""

    _hints: ClassVar[dict[str, str]] = {
        "expr": "when",
        "alert": "name",
        "labels": "severity",
        "condition": "when",
        "if": "when",
        "then": "action",
    }

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$", max_length=80)
    """Unique name of the rule (letters, digits, - _ . :), shown in every decision."""
    description: str = ""
    """What the rule is for; shown by `policy explain`."""
    when: Condition
    """The condition: a mapping (one test, or all:/any: lists) or a compact string like
    'grade < S3'."""
    layers: (
        Annotated[list[str], BeforeValidator(_layers, json_schema_input_type=str | list[str])]
        | None
    ) = None
    """Glob(s) on layer names: each matching layer is tested on its own. Omitted: the rank's
    summary over all layers (min grade/entropy, max logit)."""
    ranks: RankScope = "any"
    """How many ranks must hold the condition: any, all, {fraction: 0.5} or {at_least: 2}."""
    for_: DurationOf("samples", "steps", "seconds") | None = Field(  # type: ignore[valid-type]
        None, alias="for"
    )
    """Persistence: the condition must hold for this long before firing ('2 samples', '20 steps',
    '30s'). Omitted: fire at once."""
    cooldown: DurationOf("steps", "seconds") | None = None  # type: ignore[valid-type]
    """After firing, the rule stays quiet for this long (steps of training seen, or time); it
    carries across relaunches."""
    warm_in: DurationOf("steps") | None = None  # type: ignore[valid-type]
    """No firing before this training step. Omitted: the policy's warm_in for rules on per-layer
    signals, none otherwise."""
    action: Action
    """notify, recover, checkpoint (save one now) or stop."""
    # None is filled from the action before validation
    severity: Severity = None  # type: ignore[assignment]
    """info, warn or page. Omitted: warn for notify and recover, info for checkpoint, page for
    stop."""
    recovery: RecoveryOverrides | None = None  # type: ignore[valid-type]
    """Overrides of the policy's recovery settings for this rule (action: recover only)."""
    notify: Destinations | None = None
    """Where this rule's alerts and incidents go ('[slack, pagerduty]'), instead of the
    destinations notify.routes gives its severity. Omitted: the routes decide."""

    @model_validator(mode="before")
    @classmethod
    def _default_severity(cls, data: Any) -> Any:
        if isinstance(data, dict) and "severity" not in data:
            # an unknown action gets its own error; do not add a second one about severity
            action = data.get("action")
            data = {
                **data,
                "severity": DEFAULT_SEVERITY.get(action, "warn")
                if isinstance(action, str)
                else "warn",
            }
        return data

    @model_validator(mode="after")
    def _coherent(self) -> Rule:
        if self.recovery is not None and self.action != "recover":
            fail(
                "'recovery' overrides only apply to action: recover "
                f"(this rule does {self.action})",
                "recovery",
            )
        if self.layers is not None and any(
            isinstance(leaf, PeerRelative) for leaf in self.when.leaves()
        ):
            fail(
                "'layers' does not apply to a peer comparison (above_peer_median/"
                "below_peer_median): it compares a rank's per-rank value with the other ranks'",
                "layers",
            )
        if self.layers is not None and not (self.when.signals() & set(LAYER_SIGNALS)):
            fail(
                "'layers' only applies to per-layer signals ("
                + ", ".join(LAYER_SIGNALS)
                + "); this condition reads none",
                "layers",
            )
        faults_only = self.when.cadence() <= {"exit", "hang"}
        if faults_only and self.recovery is not None:
            for name in ("min_grade", "min_steps_back"):
                if getattr(self.recovery, name) is not None:
                    fail(
                        f"'{name}' does not apply to crash and hang rules: they roll back to the "
                        "newest checkpoint that verifies, whatever its grade, at or before the "
                        "furthest step any rank reached",
                        ("recovery", name),
                    )
        if self.for_ is not None and self.when.cadence() <= {"exit", "hang"}:
            fail("'for' does not apply to crash and hang: they are events, not levels", "for")
        return self

    @property
    def uses_layer_signals(self) -> bool:
        return bool(self.when.signals() & set(LAYER_SIGNALS))


# --- notifications ------------------------------------------------------------------------


def _url(v: Any) -> Any:
    if v is not None and (not isinstance(v, str) or not re.match(r"^https?://\S+$", v)):
        fail(f"expected an http(s) URL, got {show(v)}")
    return v


Url = Annotated[str | None, BeforeValidator(_url)]


class SlackTarget(_Model):
    """Where Slack messages go. The token never goes here: set SLACK_BOT_TOKEN or
    SPIKEGUARD_SLACK_WEBHOOK_URL."""

    channel: str | None = Field(None, min_length=1)
    """Channel name or id such as '#training-alerts'. Omitted: $SPIKEGUARD_SLACK_CHANNEL."""
    mention: str | None = Field(None, min_length=1)
    """On-call user or group id (U…/S…) mentioned on page-severity messages."""
    runbook_url: Url = None
    """Link to the runbook, added to every message."""
    dashboard_url: Url = None
    """Link to the dashboard, added to every message."""


def _destination_keys(schema: dict[str, Any]) -> None:
    """The JSON Schema of a mapping keyed by destinations: its keys titled like every other
    destination, so the schema a supervisor prints lists its own sinks' names there too."""
    keys = schema.get("propertyNames")
    if isinstance(keys, dict) and "enum" in keys:
        keys["title"] = "destination"


class Routes(_Model):
    """Where each severity goes."""

    info: Destinations = list(DEFAULT_ROUTES["info"])  # noqa: RUF012 (pydantic copies defaults)
    """Destinations of info messages: a list of console and/or slack (or another sink the
    supervisor has)."""
    warn: Destinations = list(DEFAULT_ROUTES["warn"])  # noqa: RUF012 (pydantic copies defaults)
    """Destinations of warn messages."""
    page: Destinations = list(DEFAULT_ROUTES["page"])  # noqa: RUF012 (pydantic copies defaults)
    """Destinations of page messages (Slack ones @-mention slack.mention)."""


class NotifySettings(_Model):
    """Notification routing, in the spirit of Alertmanager routes."""

    slack: SlackTarget = SlackTarget()
    """Slack channel, on-call mention and links (no secrets)."""
    routes: Routes = Routes()
    """Which destinations each severity goes to."""
    repeat_interval: DurationOf("seconds") | None = Field(  # type: ignore[valid-type]
        "4h", validate_default=True
    )
    """Repeat a still-firing notification this often ('4h'); null never repeats."""
    repeat_intervals: dict[Destination, DurationOf("seconds") | None] = Field(  # type: ignore[valid-type]
        default_factory=dict, json_schema_extra=_destination_keys
    )
    """Per destination, how often it repeats a still-firing notification, instead of
    repeat_interval ('{pagerduty: 30m, slack: null}'); null: that destination never repeats."""
    send_resolved: StrictBool = True
    """Send a message when a notify rule's condition clears."""

    def destinations(self, severity: str) -> list[str]:
        return list(getattr(self.routes, severity))

    def repeat_interval_of(self, destination: str) -> Duration | None:
        """How often ``destination`` repeats a still-firing notification: its
        ``repeat_intervals`` entry when it has one, else ``repeat_interval``; None: never."""
        if destination in self.repeat_intervals:
            return self.repeat_intervals[destination]
        return self.repeat_interval


# --- the policy ---------------------------------------------------------------------------


class Policy(_Model):
    """A spikeguard policy: rules over the per-rank report stream, and what recovery means."""

    version: Literal[1]
    """Format version; always 1."""
    name: str = Field(min_length=1)
    """Name of the policy, shown in decisions and `policy explain`."""
    description: str = ""
    """What the policy is for, what it catches and what it costs."""
    warm_in: DurationOf("steps") = Field(  # type: ignore[valid-type]
        "300 steps", validate_default=True
    )
    """Rules on per-layer signals (grade, entropy, logits, …) stay quiet before this training
    step: the grade swings early in healthy runs."""
    rules: list[Rule]
    """The rules, evaluated in order on every message."""
    recovery: RecoverySettings = RecoverySettings()
    """What recover decisions do (rules may override parts)."""
    notify: NotifySettings = NotifySettings()
    """Where notifications go."""

    @field_validator("version", mode="before")
    @classmethod
    def _version(cls, v: Any) -> Any:
        if v != 1 or isinstance(v, bool):
            fail(f"unsupported version {show(v)}: this spikeguard reads 'version: 1'")
        return v

    @model_validator(mode="before")
    @classmethod
    def _no_secrets(cls, data: Any) -> Any:
        if isinstance(data, dict):
            found = find_secret(data)
            if found:
                fail(found.message("policy file"), found.path, key=found.in_key)
        return data

    @model_validator(mode="after")
    def _rules(self) -> Policy:
        if not self.rules:
            fail("a policy needs at least one rule", "rules")
        seen: dict[str, int] = {}
        for i, rule in enumerate(self.rules):
            if rule.name in seen:
                fail(
                    f"duplicate rule name {rule.name!r} (also rules[{seen[rule.name]}])",
                    ("rules", i, "name"),
                )
            seen[rule.name] = i
        return self

    def recovery_for(self, rule: Rule) -> RecoverySettings:
        """The recovery settings with ``rule``'s overrides applied."""
        if rule.recovery is None:
            return self.recovery
        return self.recovery.model_copy(update=rule.recovery.model_dump(exclude_none=True))
