"""Calibrating a policy's thresholds on recorded runs: pure search over :func:`~.engine.replay`.

``spikeguard policy calibrate`` is the tool a user runs after a first stable run on a new model:
a threshold that was tuned beside another model is either too tight there (false recoveries)
or too loose (late). For each rule with numeric knobs this module finds, by bisection over
replays of that rule alone (its action set to ``notify``, so that a firing does not end the
replayed generation; layers, ``for``, window and warm-in as in the base policy), the tightest
setting at which the rule stays silent on every stable run, moves it by a margin in the loose
direction, and reports what the result decides on diverging runs (the lead against their
onsets). Nothing here reads a file or prints: :mod:`.commands` does that.

A knob moves along its own *shape* (:func:`moved`) by a factor ``s``: ``s = 1`` is the base
value, ``s > 1`` looser, ``s < 1`` tighter; the search doubles ``s`` (or halves it) from 1 until
the rule's silence on the stable runs changes, then bisects between the two ends.

* a ratio below the median (``below_median: k``): ``k / s``;
* a ratio above the median (``above_median: k``): ``1 + (k - 1) · s`` (``k · s`` for k <= 1);
* a scale (``z_above``, ``z_below``, ``drops_by``, ``rises_by``): ``k · s``;
* a threshold (``below`` / ``above``): ``t ∓ |t| · (s - 1)`` for s >= 1 and
  ``t ± |t| · (1/s - 1)`` below (|t| taken as 1 at t = 0), so it can cross zero either way;
* on the grade signal, thresholds and changes are whole grades: rounded in the loose direction.

A rule with several knobs (``above_median`` AND ``z_above``, or an ``all:`` of two tests) has
them calibrated one after the other, in the order the rule writes them: each with the knobs
before it at their proposals and the ones after it at their base values. The last search so
sees the rule exactly as it is proposed, which is therefore silent on the stable runs; a knob
that another test of the rule keeps from ever firing is reported as unbounded and kept. The
proposal is the tightest silent value moved once more by the margin, along the same shapes
(``below_median: k_silent / margin``, ``above_median: 1 + (k_silent - 1) · margin``, ``z: z_silent
· margin``, …), so it is never tighter than the runs allow.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import yaml

from .conditions import AllOf, AnyOf, Change, Threshold, Trailing
from .engine import Decision, replay
from .evaluate import fmt
from .schema import Policy, Rule

__all__ = [
    "Calibration",
    "Knob",
    "KnobResult",
    "Lead",
    "Outcome",
    "RuleResult",
    "Run",
    "Search",
    "Settings",
    "calibrate",
    "calibrate_knob",
    "calibrate_rule",
    "knobs",
    "moved",
    "proposal",
    "render_policy",
    "render_report",
    "search",
]

Shape = Literal["ratio_below", "ratio_above", "scale", "threshold"]

GRADE_RANGE = {"below": (0.0, 8.0), "above": (-1.0, 7.0), "change": (1.0, 8.0)}
"""Where a whole-grade knob may go: ``grade < S0`` and ``grade > S7`` never hold, nor a change
of 8 grades (S0..S7), so these ends are silent; the other ends hold on every graded sample."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    """How far and how finely the search goes."""

    margin: float = 1.25
    """How far the proposal moves past the tightest silent setting, in the loose direction
    (1: no margin). A stable run is one sample of the model's noise: the next one peaks higher."""
    max_iterations: int = 12
    """Bisection steps per rule at most (each is one replay of the rule per stable run)."""
    tolerance: float = 0.01
    """Stop bisecting when every knob's two ends are within this fraction of each other (whole
    grades: one grade apart)."""
    max_expansions: int = 12
    """Doublings of ``s`` tried from the base to find the other end of the bracket (2^12 = a
    4096× move): past them the rule cannot be made silent (or never fires)."""


@dataclasses.dataclass(frozen=True)
class Run:
    """A recorded run: its rank messages (what ``policy replay`` reads) and, for a diverging
    run, the step its divergence began at."""

    label: str
    messages: Sequence[dict]
    onset: int | None = None


@dataclasses.dataclass(frozen=True)
class Knob:
    """One number in a rule's condition that the calibration may move."""

    path: tuple[str | int, ...]
    """Where it is in the condition's mapping form (``("all", 0, "below_median")``)."""
    signal: str
    base: float
    shape: Shape
    looser: int
    """+1 when a larger value is looser (fires less), -1 when a smaller one is."""
    whole: bool
    """A whole number of grades (thresholds and changes of the grade signal)."""

    @property
    def field(self) -> str:
        return str(self.path[-1])

    @property
    def label(self) -> str:
        return f"{self.signal} {self.field}"

    def show(self, value: float) -> str:
        """The value as the policy file writes it (grades as S0…S7)."""
        if self.signal == "grade" and self.shape == "threshold":
            return fmt("grade", value) if value.is_integer() and 0 <= value <= 7 else f"{value:g}"
        return f"{value:.4g}"


def _leaf_knobs(leaf: Any, path: tuple[str | int, ...]) -> list[Knob]:
    """The knobs of one test (none for non-finite, crash and hang tests)."""
    grade = getattr(leaf, "signal", None) == "grade"
    found: list[tuple[str, Shape, int, bool]] = []
    if isinstance(leaf, Threshold):
        found = [("below", "threshold", -1, grade), ("above", "threshold", +1, grade)]
    elif isinstance(leaf, Change):
        found = [("drops_by", "scale", +1, grade), ("rises_by", "scale", +1, grade)]
    elif isinstance(leaf, Trailing):
        found = [
            ("below_median", "ratio_below", -1, False),
            ("above_median", "ratio_above", +1, False),
            ("z_above", "scale", +1, False),
            ("z_below", "scale", +1, False),
        ]
    return [
        Knob(path + (name,), leaf.signal, float(value), shape, looser, whole)
        for name, shape, looser, whole in found
        if (value := getattr(leaf, name)) is not None
    ]


def knobs(cond: Any, path: tuple[str | int, ...] = ()) -> tuple[Knob, ...]:
    """Every numeric knob of a condition, in the order the rule writes them."""
    if isinstance(cond, (AllOf, AnyOf)):
        key = "all" if isinstance(cond, AllOf) else "any"
        return tuple(k for i, c in enumerate(cond.conditions) for k in knobs(c, path + (key, i)))
    return tuple(_leaf_knobs(cond, path))


def _whole(knob: Knob, value: float) -> float:
    """A whole-grade knob's value rounded in its loose direction and kept in its range."""
    lo, hi = GRADE_RANGE["change" if knob.shape == "scale" else knob.field]
    v = math.ceil(value - 1e-9) if knob.looser > 0 else math.floor(value + 1e-9)
    return float(min(hi, max(lo, v)))


def moved(knob: Knob, value: float, s: float) -> float:
    """``value`` moved by ``s`` along the knob's shape (see the module docstring): 1 keeps it,
    above 1 loosens, below 1 tightens."""
    if knob.shape == "ratio_below":
        out = value / s
    elif knob.shape == "ratio_above":
        out = 1 + (value - 1) * s if value > 1 else value * s
    elif knob.shape == "scale":
        out = value * s
    else:
        unit = abs(value) or 1.0
        out = value + knob.looser * unit * ((s - 1) if s >= 1 else -(1 / s - 1))
    return _whole(knob, out) if knob.whole else out


def _rounded(knob: Knob, value: float) -> float:
    """Three significant digits, rounded in the loose direction (a proposal never gets tighter
    by being shown)."""
    if knob.whole or value == 0 or not math.isfinite(value):
        return value
    exp = math.floor(math.log10(abs(value))) - 2
    units = value / 10.0**exp
    n = math.ceil(units - 1e-9) if knob.looser > 0 else math.floor(units + 1e-9)
    return float(f"{n}e{exp}")


def proposal(knob: Knob, silent: float, margin: float) -> float:
    """The proposed value: the tightest silent one moved by ``margin`` in the loose direction
    (below_median: k / margin; above_median: 1 + (k - 1) · margin; z, drops_by: × margin)."""
    return _rounded(knob, moved(knob, silent, margin))


def _close(knob: Knob, a: float, b: float, tolerance: float) -> bool:
    if knob.whole:
        return abs(a - b) <= 1
    return abs(a - b) <= tolerance * max(abs(a), abs(b), 1e-12)


# --- the search -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Search:
    """Where the rule stops firing on the stable runs, along ``s``."""

    status: Literal["calibrated", "never fires", "cannot be silenced"]
    """calibrated: bracketed and bisected; never fires: silent however tight (the runs do not
    bound it: the base is kept); cannot be silenced: fires however loose (kept, and it will
    fire on this model)."""
    silent: float | None
    """The tightest ``s`` found silent (calibrated only)."""
    base_firing: Decision | None
    """What the base setting fired on a stable run first (None: silent there)."""
    replays: int
    """Oracle calls: each replays the rule over the stable runs (until one fires)."""


def search(
    fires: Callable[[float], Decision | None],
    converged: Callable[[float, float], bool],
    settings: Settings,
) -> Search:
    """Bisect ``s`` between a setting that fires (``fires(s)`` is its first decision) and one
    that is silent, starting at the base (s = 1) and doubling away from it to bracket."""
    calls = 0

    def at(s: float) -> Decision | None:
        nonlocal calls
        calls += 1
        return fires(s)

    base = at(1.0)
    fired_end, silent_end = (1.0, None) if base is not None else (None, 1.0)
    step = 2.0 if base is not None else 0.5  # loosen from a firing base, tighten a silent one
    s, expansions = 1.0, 0
    while (fired_end is None or silent_end is None) and expansions < settings.max_expansions:
        s, expansions = s * step, expansions + 1
        if at(s) is None:
            silent_end = s
        else:
            fired_end = s
    if silent_end is None:
        return Search("cannot be silenced", None, base, calls)
    if fired_end is None:
        return Search("never fires", None, base, calls)
    for _ in range(settings.max_iterations):
        if converged(fired_end, silent_end):
            break
        mid = math.sqrt(fired_end * silent_end)
        if at(mid) is None:
            silent_end = mid
        else:
            fired_end = mid
    return Search("calibrated", silent_end, base, calls)


# --- rules, as the search replays them ------------------------------------------------------


def _with(rule: Rule, values: Mapping[tuple[str | int, ...], float], *, probe: bool) -> Rule:
    """``rule`` with its knobs at ``values``; ``probe``: alone-worthy (action notify, no
    recovery overrides), so a firing does not end the replayed generation."""
    data = rule.model_dump(mode="json", by_alias=True, exclude_none=True)
    for path, value in values.items():
        node: Any = data["when"]
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    if probe:
        data["action"] = "notify"
        data.pop("recovery", None)
        data.pop("severity", None)
    return Rule.model_validate(data)


def _first_firing(policy: Policy, runs: Sequence[Run]) -> Decision | None:
    """The first decision (not a 'resolved' one) of ``policy`` over each run in turn."""
    for run in runs:
        for d in replay(policy, run.messages):
            if not d.resolved:
                return d
    return None


def _alone(base: Policy, rule: Rule) -> Policy:
    """The base policy with only ``rule`` (warm-in, recovery and notify settings as in it)."""
    return base.model_copy(update={"rules": [rule]})


@dataclasses.dataclass(frozen=True)
class KnobResult:
    knob: Knob
    search: Search
    silent: float | None
    """The tightest silent value (None unless the search calibrated it)."""
    proposed: float
    """The value written (the base when the search could not calibrate)."""


@dataclasses.dataclass(frozen=True)
class Lead:
    """When a rule fires on a diverging run, against its onset."""

    run: str
    onset: int
    proposed: Decision | None
    """The rule's first firing with the proposed knobs (None: silent)."""
    base: Decision | None
    """The same with the base knobs."""

    @staticmethod
    def of(d: Decision | None, onset: int) -> int | None:
        """Steps before the onset it fired (negative: after it; None: it never did)."""
        return None if d is None else onset - d.step


@dataclasses.dataclass(frozen=True)
class RuleResult:
    index: int
    rule: Rule
    """The proposed rule (the base rule when nothing changed)."""
    knobs: tuple[KnobResult, ...]
    """One per numeric knob (none for crash, hang and non-finite tests)."""
    verified: bool
    """The proposed rule replays silent on every stable run."""
    leads: tuple[Lead, ...]

    @property
    def changed(self) -> bool:
        return any(k.proposed != k.knob.base for k in self.knobs)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What the whole proposed policy decides over one run."""

    run: Run
    decisions: tuple[Decision, ...]
    """Its decisions, 'resolved' ones left out."""


@dataclasses.dataclass(frozen=True)
class Calibration:
    base: Policy
    proposed: Policy
    stable: tuple[Run, ...]
    diverging: tuple[Run, ...]
    settings: Settings
    rules: tuple[RuleResult, ...]
    outcomes: tuple[Outcome, ...]


def calibrate_knob(
    knob: Knob,
    fires: Callable[[float], Decision | None],
    settings: Settings,
) -> KnobResult:
    """The tightest setting of ``knob`` at which ``fires(value)`` finds nothing, and the
    proposal it makes (the base, when the search could not bracket it)."""
    result = search(
        lambda s: fires(moved(knob, knob.base, s)),
        lambda a, b: _close(
            knob, moved(knob, knob.base, a), moved(knob, knob.base, b), settings.tolerance
        ),
        settings,
    )
    if result.silent is None:
        return KnobResult(knob, result, None, knob.base)
    silent = moved(knob, knob.base, result.silent)
    return KnobResult(knob, result, silent, proposal(knob, silent, settings.margin))


Values = Mapping[tuple[str | int, ...], float]


def calibrate_rule(
    base: Policy,
    index: int,
    stable: Sequence[Run],
    diverging: Sequence[Run],
    settings: Settings,
) -> RuleResult:
    """Calibrate the knobs of ``base.rules[index]`` on the stable runs, one after the other in
    the order the rule writes them: each with the knobs before it at their proposals and those
    after it at their base values, so the last search sees the rule exactly as proposed (and
    silent on the stable runs). Then replay the result over the diverging runs."""
    rule = base.rules[index]
    found = knobs(rule.when)
    base_values = {k.path: k.base for k in found}

    def first(values: Values, runs: Sequence[Run]) -> Decision | None:
        return _first_firing(_alone(base, _with(rule, values, probe=True)), runs)

    values = dict(base_values)
    chosen = []
    for k in found:

        def fires(v: float, path: tuple[str | int, ...] = k.path) -> Decision | None:
            return first({**values, path: v}, stable)

        done = calibrate_knob(k, fires, settings)
        values[k.path] = done.proposed
        chosen.append(done)
    proposed = _with(rule, values, probe=False) if found else rule
    verified = not found or first(values, stable) is None
    leads = tuple(
        Lead(
            run.label,
            run.onset if run.onset is not None else 0,
            first(values, [run]),
            first(base_values, [run]),
        )
        for run in diverging
    )
    return RuleResult(index, proposed, tuple(chosen), verified, leads)


def calibrate(
    base: Policy,
    stable: Sequence[Run],
    diverging: Sequence[Run] = (),
    *,
    settings: Settings = Settings(),
    name: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> Calibration:
    """Calibrate every rule of ``base`` on ``stable`` runs, then replay the proposed policy
    (named ``name``, default ``<base>-calibrated``) over every run. ``progress`` is told a line
    per rule before its search starts (a search replays the runs a dozen times or so)."""
    if not stable:
        raise ValueError("calibrate needs at least one stable run")
    results = []
    for i, rule in enumerate(base.rules):
        if progress is not None:
            found = knobs(rule.when)
            what = (
                "bisecting "
                + " and ".join(f"{k.field} {k.show(k.base)}" for k in found)
                + f" over {len(stable)} stable run{'s' if len(stable) != 1 else ''}"
                if found
                else "no numeric knob: kept as it is"
            )
            progress(f"[{i + 1}/{len(base.rules)}] {rule.name}: {what}")
        results.append(calibrate_rule(base, i, stable, diverging, settings))
    proposed = base.model_copy(
        update={"name": name or f"{base.name}-calibrated", "rules": [r.rule for r in results]}
    )
    outcomes = tuple(
        Outcome(run, tuple(d for d in replay(proposed, run.messages) if not d.resolved))
        for run in (*stable, *diverging)
    )
    return Calibration(
        base, proposed, tuple(stable), tuple(diverging), settings, tuple(results), outcomes
    )


# --- what it prints and writes -------------------------------------------------------------


def _verdict(k: KnobResult) -> str:
    """What the search says about the knob's base setting, in words."""
    s = k.search
    fired = s.base_firing
    base = "silent" if fired is None else f"fires at step {fired.step}"
    if s.status == "never fires":
        return f"base {base}; silent however tight (the rest of the rule as it is): base kept"
    if s.status == "cannot be silenced":
        return f"base {base}; fires however loose: base kept, it will fire on this model"
    if fired is not None:
        return f"base {base}: too tight for this model (a false alarm)"
    if (k.proposed - k.knob.base) * k.knob.looser < 0:
        return "base silent: it could be tighter"
    return "base silent, but within the margin of firing"


def _when(d: Decision | None, onset: int) -> str:
    if d is None:
        return "silent"
    lead = Lead.of(d, onset)
    gen = f" gen {d.generation}" if d.generation > 1 else ""
    return f"{d.step}{gen} ({lead:+d})"


def _knob_rows(r: RuleResult) -> list[list[str]]:
    if not r.knobs:
        return [[r.rule.name, "-", "-", "-", "-", "no numeric knob"]]
    return [
        [
            r.rule.name if i == 0 else "",
            k.knob.label,
            k.knob.show(k.knob.base),
            "-" if k.silent is None else k.knob.show(k.silent),
            k.knob.show(k.proposed),
            _verdict(k),
        ]
        for i, k in enumerate(r.knobs)
    ]


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


def _decisions(o: Outcome, limit: int = 12) -> str:
    if not o.decisions:
        return "silent"
    shown = [
        f"{d.rule} at step {d.step}"
        + (f" gen {d.generation}" if d.generation > 1 else "")
        + f" ({d.action})"
        for d in o.decisions[:limit]
    ]
    more = len(o.decisions) - limit
    return "; ".join(shown) + (f"; … and {more} more" if more > 0 else "")


def render_report(cal: Calibration) -> str:
    """The tables ``policy calibrate`` prints: knobs, leads, and the proposed policy's replay."""
    n = len(cal.stable)
    lines = [
        f"policy {cal.base.name!r} calibrated on {n} stable run{'s' if n != 1 else ''} "
        f"(margin {cal.settings.margin:g}):",
        "",
        *_table(
            [["rule", "knob", "base", "tightest silent", "proposed", "base on the stable runs"]]
            + [row for r in cal.rules for row in _knob_rows(r)]
        ),
    ]
    unverified = [r.rule.name for r in cal.rules if not r.verified]
    if unverified:
        lines += ["", "not silent on the stable runs with the proposal: " + ", ".join(unverified)]
    if cal.diverging:
        lines += [
            "",
            "first firing of each rule alone on the diverging runs: step (lead = onset - step; "
            "positive: before the onset), proposed [base]:",
            "",
            *_table(
                [["rule"] + [f"{run.label}@{run.onset}" for run in cal.diverging]]
                + [
                    [r.rule.name]
                    + [
                        f"{_when(lead.proposed, lead.onset)} [{_when(lead.base, lead.onset)}]"
                        for lead in r.leads
                    ]
                    for r in cal.rules
                ]
            ),
        ]
    lines += ["", f"the proposed policy {cal.proposed.name!r} replayed:"]
    for o in cal.outcomes:
        kind = "stable" if o.run.onset is None else f"diverging, onset {o.run.onset}"
        lines.append(f"  {o.run.label} ({kind}): {_decisions(o)}")
    return "\n".join(lines)


def _grades_as_written(knob_paths: Sequence[Knob], when: Any) -> Any:
    """The condition's mapping form with whole grade thresholds written S0…S7."""
    for k in knob_paths:
        if k.signal == "grade" and k.shape == "threshold":
            node = when
            for key in k.path[:-1]:
                node = node[key]
            v = node[k.field]
            if isinstance(v, float) and v.is_integer() and 0 <= v <= 7:
                node[k.field] = f"S{int(v)}"
    return when


def _rule_comment(r: RuleResult, cal: Calibration) -> list[str]:
    n = len(cal.stable)
    lines = [f"calibrated (margin {cal.settings.margin:g}, {n} stable run{'s' if n != 1 else ''}):"]
    for k in r.knobs:
        base = k.knob.show(k.knob.base)
        lines.append(
            f"  {k.knob.field}: base {base} kept ({k.search.status} on the stable runs)"
            if k.silent is None
            else f"  {k.knob.field}: base {base}, tightest silent {k.knob.show(k.silent)}, "
            f"proposed {k.knob.show(k.proposed)}"
        )
    for lead in r.leads:
        lines.append(f"  lead on {lead.run}@{lead.onset}: {_lead_words(lead)}")
    return lines


def _lead_words(lead: Lead) -> str:
    d = lead.proposed
    steps = Lead.of(d, lead.onset)
    if d is None or steps is None:
        return "silent"
    when = "before" if steps > 0 else "after" if steps < 0 else "at"
    return f"fires at step {d.step}, {abs(steps)} steps {when} the onset"


def _dump(data: Any) -> str:
    return yaml.safe_dump(data, sort_keys=False, width=100, allow_unicode=True)


def render_policy(cal: Calibration, raw: Mapping[str, Any] | None, header: Sequence[str]) -> str:
    """The proposed policy as YAML: ``raw`` (the base file's plain data, as its author wrote
    it; None: the validated base) with the changed rules' conditions replaced and a comment
    above each of them, ``header`` as a comment block on top. Validate it before writing."""
    data = dict(raw) if raw is not None else cal.base.model_dump(mode="json", by_alias=True)
    rules = list(data.get("rules") or [])
    if len(rules) != len(cal.rules):  # not the file the policy was loaded from
        rules = [r.rule.model_dump(mode="json", by_alias=True) for r in cal.rules]
    data["name"] = cal.proposed.name
    if isinstance(data.get("description"), str):  # a folded block's final newline, quoted
        data["description"] = data["description"].rstrip()
    out = [f"# {line}".rstrip() for line in header]
    for key, value in data.items():
        if key != "rules":
            out.append(_dump({key: value}).rstrip("\n"))
            continue
        out.append("rules:")
        for r, written in zip(cal.rules, rules):
            item = {
                k: v.rstrip() if k == "description" and isinstance(v, str) else v
                for k, v in written.items()
            }
            if r.changed:
                when = r.rule.when.model_dump(mode="json", by_alias=True, exclude_none=True)
                item["when"] = _grades_as_written([k.knob for k in r.knobs], when)
                out += [f"  # {line}" for line in _rule_comment(r, cal)]
            out += ["  " + line for line in _dump([item]).rstrip("\n").splitlines()]
            out.append("")
    return "\n".join(out).rstrip("\n") + "\n"
