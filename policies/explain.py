"""``policy explain``: a policy in plain words — what fires when, and what it does."""

from __future__ import annotations

from typing import Any

from spikeguard.workers.contract.signals import spec_of

from .conditions import (
    AllOf,
    AnyOf,
    Change,
    Crash,
    Hang,
    NonFinite,
    PeerRelative,
    Threshold,
    Trailing,
)
from .schema import AtLeastRanks, FractionOfRanks, Policy, RecoverySettings, Rule
from .values import format_grade

_OVER_LAYERS = {"min": "lowest over", "max": "highest over", "mean": "mean over", "last": "last of"}
"""A per-layer signal's aggregation (``SignalSpec.aggregate``) in words."""


def _value(signal: str, v: float) -> str:
    return format_grade(v) if signal == "grade" else f"{v:g}"


def _subject(signal: str, layers: list[str] | None) -> str:
    """The signal as its declaration names it, and which of its layers the rule reads."""
    spec = spec_of(signal)
    name = spec.display
    if not spec.per_layer:
        return name
    if layers is None:
        return f"{name} ({_OVER_LAYERS[spec.aggregate]} the rank's layers)"
    if layers == ["*"]:
        return f"{name} of any layer"
    return f"{name} of any layer matching {' or '.join(repr(g) for g in layers)}"


def describe(cond: Any, layers: list[str] | None = None, nested: bool = False) -> str:
    """One condition in words."""
    if isinstance(cond, (AllOf, AnyOf)):
        word = " and " if isinstance(cond, AllOf) else " or "
        text = word.join(describe(c, layers, True) for c in cond.conditions)
        return f"({text})" if nested and len(cond.conditions) > 1 else text
    if isinstance(cond, Crash):
        return "a rank's process exits with a non-zero code"
    if isinstance(cond, Hang):
        return (
            "the supervisor declares a rank hung (no heartbeat within its timeout)"
            if cond.hang is True
            else f"a rank has sent no heartbeat for {cond.hang} or more"
        )
    s = _subject(cond.signal, layers)
    if isinstance(cond, NonFinite):
        return f"{s} is NaN or infinite"
    if isinstance(cond, Threshold):
        if cond.below is not None:
            return f"{s} is below {_value(cond.signal, cond.below)}"
        return f"{s} is above {_value(cond.signal, cond.above)}"  # type: ignore[arg-type]
    if isinstance(cond, Change):
        if cond.drops_by is not None:
            return f"{s} falls by {_value('', cond.drops_by)} or more within {cond.within}"
        return f"{s} rises by {_value('', cond.rises_by)} or more within {cond.within}"  # type: ignore[arg-type]
    if isinstance(cond, Trailing):
        parts = []
        base = f"its median over the previous {cond.window}"
        if cond.median_of is not None:
            s = f"the median of {s} over the last {cond.median_of}"
            base = f"the median over the {cond.window} before them"
        if cond.above_median is not None:
            parts.append(f"{s} rises above {cond.above_median:g}× {base}")
        if cond.below_median is not None:
            parts.append(f"{s} falls below {cond.below_median:g}× {base}")
        if cond.z_above is not None:
            parts.append(
                ("with" if parts else f"{s} rises")
                + f" a robust z-score of {cond.z_above:g} or more"
                + ("" if parts else f" against {base}")
            )
        if cond.z_below is not None:
            parts.append(
                ("with" if parts else f"{s} falls")
                + f" a robust z-score of −{cond.z_below:g} or less"
                + ("" if parts else f" against {base}")
            )
        return " ".join(parts)
    if isinstance(cond, PeerRelative):
        side = "at least" if cond.above_peer_median is not None else "at most"
        return (
            f"a rank's {s.removeprefix('the ')} (its median over the last {cond.median_of}) is "
            f"{side} {cond.factor:g}× the median of its peers' (the other ranks that reported "
            f"it within the last {cond.peers_within}; never on a single rank)"
            + (
                f", and its excess over that median is at least {cond.min_step_share:.0%} of "
                "the time between its steps (what its peers wait for it)"
                if cond.min_step_share is not None
                else ""
            )
        )
    raise TypeError(type(cond).__name__)


def _scope(rule: Rule) -> str:
    r = rule.ranks
    if r == "any":
        return "on any rank (one decision per rank)"
    if r == "all":
        return "on all ranks at once"
    if isinstance(r, FractionOfRanks):
        return f"on at least {r.fraction:g} of the ranks"
    assert isinstance(r, AtLeastRanks)
    return f"on at least {r.at_least} ranks"


def explain_rule(rule: Rule, policy: Policy, index: int) -> list[str]:
    effect = {
        "notify": "notifies",
        "recover": "recovers (kill, roll back, resume)",
        "checkpoint": "asks for a checkpoint now",
        "stop": "stops the job",
    }[rule.action]
    lines = [f"{index}. {rule.name}: {effect}, severity {rule.severity}."]
    if rule.description:
        lines.append(f"   {rule.description.strip()}")
    when = f"   Fires when {describe(rule.when, rule.layers)}, {_scope(rule)}"
    if rule.for_ is not None:
        when += f", held for {rule.for_}"
    lines.append(when + ".")
    extra = []
    warm = (
        rule.warm_in.value
        if rule.warm_in is not None
        else (policy.warm_in.value if rule.uses_layer_signals else 0)
    )
    extra.append(
        f"quiet before step {int(warm)} (warm-in)" if warm else "active from the first step"
    )
    windows = [str(leaf.window) for leaf in rule.when.leaves() if isinstance(leaf, Trailing)]
    if windows:
        extra.append(
            f"needs {' / '.join(sorted(set(windows)))} of history first, again after every relaunch"
        )
    if any(isinstance(leaf, PeerRelative) for leaf in rule.when.leaves()):
        extra.append("compares ranks of the same generation only, afresh after every relaunch")
    if rule.cooldown is not None:
        extra.append(f"after firing, quiet for {rule.cooldown}")
    if rule.action == "notify":
        extra.append(
            "fires once per episode"
            + (", with a resolved message when it clears" if policy.notify.send_resolved else "")
        )
    lines.append("   " + "; ".join(extra).capitalize() + ".")
    if rule.action == "recover" and rule.when.cadence() & {"exit", "hang"}:
        lines.append(
            "   On a crash or a hang: roll back to the newest checkpoint that verifies, whatever "
            "its grade, at or before the furthest step any rank reached (from step 0 when there "
            "is none); each relaunch waits a backoff (the job's timeouts.restart_backoff_s)."
        )
    if rule.recovery is not None:
        changed = rule.recovery.model_dump(exclude_none=True)
        lines.append(
            "   Recovery for this rule: " + ", ".join(f"{k} {v}" for k, v in changed.items()) + "."
        )
    return lines


def _in_probation(rs: RecoverySettings) -> str:
    """What a recover decision during probation does (``probation_kinds``)."""
    if rs.probation_kinds == "own":
        return (
            "a fault of the other kind in it, a divergence after a crash or a crash after a "
            "divergence, opens its own incident with its rule's settings; another rule of the "
            "same kind is the next attempt, with that rule's settings"
        )
    return "any recover decision in it is the incident's next attempt, with its settings"


def _recurrence(rs: RecoverySettings) -> str:
    """When a firing in probation is taken for a deterministic fault (and fails fast)."""
    window = f"firing again within {rs.recur_window_steps} steps of the last attempt's step"
    if rs.recur_tolerance is None:
        return f"the same rule {window}, whatever it measures, fails fast as deterministic"
    return (
        f"the same rule {window}, measuring the same (within {rs.recur_tolerance:.2g} relative; "
        "both non-finite; or nothing, for a crash or a hang), fails fast as deterministic"
    )


def explain_recovery(rs: RecoverySettings) -> str:
    factors = ", ".join(f"{f:g}" for f in rs.lr_factors)
    parts = [
        "kill the ranks and roll back to the newest checkpoint graded "
        f"{format_grade(rs.min_grade)} or better (crashes and hangs: any grade)"
        + (
            f" and at least {rs.min_steps_back} steps before the incident"
            if rs.min_steps_back
            else ""
        )
        + (
            ", or, when none is, at the run's own healthy baseline (the median grade of its "
            "checkpoints before the incident)"
            if rs.grade_baseline == "run"
            else ", escalating when none is (the absolute grade only)"
        ),
        "falling back to an older one when its checksum fails"
        if rs.fallback_on_corrupt
        else "giving up when its checksum fails",
        (
            f"multiply the LR by {factors} on every attempt"
            if len(rs.lr_factors) == 1
            else f"multiply the LR by {factors} on attempts 1..{len(rs.lr_factors)}"
            + (" (the last repeats)" if len(rs.lr_factors) < rs.max_attempts else "")
        )
        + f", compounding (x{rs.lr_scale(rs.max_attempts):.3g} after {rs.max_attempts})",
        (
            "reset the optimizer"
            + (
                f" and re-warm the LR over its first {rs.rewarm_steps} steps"
                if rs.rewarm_steps
                else " (the full LR at once)"
            )
        )
        if rs.reset_optimizer
        else "keep the optimizer state",
        (
            f"skip the batches of the {rs.skip_window} steps before the incident"
            + (" by their ids, wherever they come up again" if rs.skip_by == "batch_ids" else "")
        )
        if rs.skip_window
        else "skip no data",
        f"then {rs.probation_steps} steps of probation ({_in_probation(rs)})"
        if rs.probation_steps
        else "no probation",
        _recurrence(rs),
        f"once probation passes, give the LR cut back over {rs.lr_restore_steps} steps"
        if rs.lr_restore_steps
        else "an LR cut is permanent",
        f"at most {rs.max_attempts} attempt{'s' if rs.max_attempts != 1 else ''} per incident and "
        f"{rs.max_incidents} incident{'s' if rs.max_incidents != 1 else ''} per run, then "
        + ("stop the job and page" if rs.on_exhausted == "stop" else "hold the job for a human"),
    ]
    return "Recovery: " + "; ".join(parts) + "."


def explain(policy: Policy) -> str:
    """The whole policy in plain words."""
    out = [f"Policy {policy.name!r} (version {policy.version}), {len(policy.rules)} rules."]
    if policy.description:
        out += ["", *("  " + line for line in policy.description.strip().splitlines())]
    out += [
        "",
        f"Warm-in: rules on per-layer signals stay quiet before step {int(policy.warm_in.value)}.",
        "",
    ]
    for i, rule in enumerate(policy.rules, 1):
        out += explain_rule(rule, policy, i)
    out += ["", explain_recovery(policy.recovery)]
    n = policy.notify
    routes = "; ".join(
        f"{sev} → {', '.join(n.destinations(sev)) or 'nowhere'}" for sev in ("info", "warn", "page")
    )
    slack = n.slack
    where = slack.channel or "$SPIKEGUARD_SLACK_CHANNEL"
    out.append(
        f"Notifications: {routes}. Slack channel {where}"
        + (f", pages mention {slack.mention}" if slack.mention else "")
        + (
            f", repeated every {n.repeat_interval} while firing"
            if n.repeat_interval
            else ", never repeated"
        )
        + (", resolved messages sent." if n.send_resolved else ", no resolved messages.")
    )
    return "\n".join(out)
