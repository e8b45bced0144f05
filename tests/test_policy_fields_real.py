"""Every field of the policy schema reaches the runtime: a non-default value changes what the
engine decides, what the recovery machine does or what the notifiers are configured with.

`test_every_schema_field_has_a_check` walks the pydantic models, so a field added to the schema
without being wired (and checked here) fails the suite.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable

import pytest
from pydantic import BaseModel
from spikeguard.policies import Engine, load_policy_text, replay
from spikeguard.policies.explain import explain
from spikeguard.policies.schema import Policy
from spikeguard.policies.testing import heartbeat, hello, report
from spikeguard.supervisor.decide import recovery as rc
from spikeguard.supervisor.job import JobSpec
from spikeguard.supervisor.runner import make_notifiers

NAN_RULE = "  - {name: nan, when: loss is nonfinite, action: recover%s}\n"


def policy(rules: str = NAN_RULE % "", extra: str = "") -> Policy:
    return load_policy_text(f"version: 1\nname: p\nrules:\n{rules}{extra}")


def _unwrap(tp: typing.Any) -> typing.Any:
    while True:
        origin = typing.get_origin(tp)
        if origin is typing.Annotated:
            tp = typing.get_args(tp)[0]
        elif origin in (typing.Union, types.UnionType):
            models = [
                a for a in typing.get_args(tp) if isinstance(a, type) and issubclass(a, BaseModel)
            ]
            return models[0] if len(models) == 1 else tp
        elif origin is list:
            tp = typing.get_args(tp)[0]
        else:
            return tp


def field_paths(model: type[BaseModel], prefix: str = "") -> set[str]:
    out = set()
    for name, f in model.model_fields.items():
        path = prefix + (f.alias or name)
        tp = _unwrap(f.annotation)
        if isinstance(tp, type) and issubclass(tp, BaseModel) and name not in ("when", "ranks"):
            out |= field_paths(tp, path + ".")
        else:
            out.add(path)
    return out


# ---- recovery settings: through the engine's decision into the machine -------------------------
def settings_of(pol: Policy) -> rc.Settings:
    """The machine's settings for the decision the policy takes on a NaN loss."""
    (d,) = replay(pol, [heartbeat(0, 500, loss=math.nan)])
    return rc.Settings.from_policy(d.recovery)


def drive(
    s: rc.Settings, *, incidents: int = 1, batch_ids: str | None = None
) -> list[rc.Transition]:
    """An incident (or several, each passing probation) through the machine; its transitions.
    ``batch_ids``: the file the kill stored the ranks' batch ids in."""
    out, state = [], rc.step(rc.State(), rc.Launched(1)).state
    for i in range(incidents):
        for obs in (
            rc.Recover("nan", "x", 1000 * (i + 1), s),
            rc.Killed((0,), 0.1, batch_ids=batch_ids),
            rc.CheckpointChosen("/c.pt", step=1000 * (i + 1) - 50, grade=6),
            rc.Launched(i + 2),
            rc.Progress(10**6),
        ):
            t = rc.step(state, obs)
            out.append(t)
            state = t.state
            if state.phase in rc.TERMINAL or state.phase is rc.Phase.HOLDING:
                return out
    return out


def recovery_yaml(field: str, value: str, *, per_rule: bool) -> Policy:
    if per_rule:
        return policy(NAN_RULE % f", recovery: {{{field}: {value}}}")
    return policy(extra=f"recovery: {{{field}: {value}}}\n")


def check_min_grade(per_rule: bool) -> None:
    s = settings_of(recovery_yaml("min_grade", "S6", per_rule=per_rule))
    assert drive(s)[1].effects[0].min_grade == 6


def check_min_steps_back(per_rule: bool) -> None:
    s = settings_of(recovery_yaml("min_steps_back", "300", per_rule=per_rule))
    assert drive(s)[1].effects[0].min_steps_back == 300


def check_fallback_on_corrupt(per_rule: bool) -> None:
    s = settings_of(recovery_yaml("fallback_on_corrupt", "false", per_rule=per_rule))
    assert drive(s)[1].effects[0].fallback_on_corrupt is False


def check_lr_factors(per_rule: bool) -> None:
    s = settings_of(recovery_yaml("lr_factors", "[0.2]", per_rule=per_rule))
    assert drive(s)[2].effects[0].plan.lr_scale == pytest.approx(0.2)


def check_reset_optimizer(per_rule: bool) -> None:
    s = settings_of(recovery_yaml("reset_optimizer", "false", per_rule=per_rule))
    assert drive(s)[2].effects[0].plan.reset_optimizer is False


def check_skip_window(per_rule: bool) -> None:
    s = settings_of(recovery_yaml("skip_window", "20", per_rule=per_rule))
    assert drive(s)[2].effects[0].plan.skip_ranges == ((981, 1000),)


def check_skip_by(per_rule: bool) -> None:
    s = settings_of(recovery_yaml("skip_by", "batch_ids, skip_window: 20", per_rule=per_rule))
    plan = drive(s, batch_ids="/run/incidents/inc-001/batch_ids-1.json")[2].effects[0].plan
    assert plan.skip_ranges == () and plan.skip_batches_steps == (981, 1000)
    assert plan.skip_batches == "/run/incidents/inc-001/batch_ids-1.json"
    # no rank answered: the window's steps are skipped instead
    assert drive(s)[2].effects[0].plan.skip_ranges == ((981, 1000),)


def check_probation_steps(per_rule: bool) -> None:
    s = settings_of(recovery_yaml("probation_steps", "77", per_rule=per_rule))
    assert drive(s)[3].state.probation_until == 951 + 77


def check_max_attempts(per_rule: bool) -> None:
    s = settings_of(recovery_yaml("max_attempts", "1", per_rule=per_rule))
    t = drive(s)
    state = t[3].state  # in probation after the one attempt
    again = rc.step(state, rc.Recover("nan", "x", 1200, s))
    assert again.state.phase is rc.Phase.ESCALATED and "budget of 1" in again.events[-1]["reason"]


def check_max_incidents(per_rule: bool) -> None:
    s = settings_of(recovery_yaml("max_incidents", "1", per_rule=per_rule))
    t = drive(s, incidents=2)
    assert t[-1].state.phase is rc.Phase.ESCALATED
    assert "max_incidents 1" in t[-1].events[-1]["reason"]


def check_on_exhausted(per_rule: bool) -> None:
    s = settings_of(recovery_yaml("on_exhausted", "hold", per_rule=per_rule))
    s = rc.Settings(**{**s.to_dict(), "max_attempts": 1, "lr_factors": (0.5,)})
    state = drive(s)[3].state
    assert rc.step(state, rc.Recover("nan", "x", 1200, s)).state.phase is rc.Phase.HOLDING


def check_grade_baseline(per_rule: bool) -> None:
    s = settings_of(recovery_yaml("grade_baseline", "absolute", per_rule=per_rule))
    assert drive(s)[1].effects[0].grade_baseline == "absolute"


def check_recur_window_steps(per_rule: bool) -> None:
    s = settings_of(recovery_yaml("recur_window_steps", "5", per_rule=per_rule))
    state = drive(s)[3].state  # in probation after the incident at step 1000
    again = rc.step(state, rc.Recover("nan", "x", 1004, s))  # within 5 steps: a recurrence
    assert again.state.phase is rc.Phase.ESCALATED and again.events[-1]["fail_fast"]


def check_recur_tolerance(per_rule: bool) -> None:
    s = settings_of(recovery_yaml("recur_tolerance", "0.5", per_rule=per_rule))
    state = drive(s)[3].state
    state = dataclasses.replace(state, incident=dataclasses.replace(state.incident, value=1.0))
    again = rc.step(state, rc.Recover("nan", "x", 1000, s, details={"value": 1.2}))
    assert again.state.phase is rc.Phase.ESCALATED  # 1.2 is 1.0 within a relative 0.5


def check_rewarm_steps(per_rule: bool) -> None:
    s = settings_of(recovery_yaml("rewarm_steps", "7", per_rule=per_rule))
    assert drive(s)[2].effects[0].plan.rewarm_steps == 7


def check_probation_kinds(per_rule: bool) -> None:
    s = settings_of(recovery_yaml("probation_kinds", "incident", per_rule=per_rule))
    state = drive(s)[3].state
    crash = rc.step(state, rc.Recover("crash", "x", 1100, s, fault=True))
    assert [e["kind"] for e in crash.events] == ["probation_failed", "incident"]
    assert crash.state.incident.id == "inc-001"  # not superseded: the same incident's attempt 2


def check_lr_restore_steps(per_rule: bool) -> None:
    s = settings_of(recovery_yaml("lr_restore_steps", "20", per_rule=per_rule))
    plan = drive(s)[2].effects[0].plan
    assert (plan.lr_restore_steps, plan.lr_restore_to) == (20, 1.0)


RECOVERY = {
    "min_grade": check_min_grade,
    "min_steps_back": check_min_steps_back,
    "fallback_on_corrupt": check_fallback_on_corrupt,
    "lr_factors": check_lr_factors,
    "reset_optimizer": check_reset_optimizer,
    "skip_window": check_skip_window,
    "skip_by": check_skip_by,
    "probation_steps": check_probation_steps,
    "max_attempts": check_max_attempts,
    "max_incidents": check_max_incidents,
    "on_exhausted": check_on_exhausted,
    "grade_baseline": check_grade_baseline,
    "recur_window_steps": check_recur_window_steps,
    "recur_tolerance": check_recur_tolerance,
    "rewarm_steps": check_rewarm_steps,
    "probation_kinds": check_probation_kinds,
    "lr_restore_steps": check_lr_restore_steps,
}


# ---- rules: the engine's decisions -------------------------------------------------------------
def grade_stream(grades: list[int], rank: int = 0, start: int = 400) -> list[dict]:
    return [
        report(rank, start + 25 * i, grade=g, erank_ratio=0.1 * g) for i, g in enumerate(grades)
    ]


def check_rule_name() -> None:
    pol = policy("  - {name: my-rule, when: loss is nonfinite, action: notify}\n")
    assert replay(pol, [heartbeat(0, 1, loss=math.nan)])[0].rule == "my-rule"


def check_rule_description() -> None:
    pol = policy("  - {name: r, description: Watch the NaNs, when: loss > 9, action: notify}\n")
    assert "Watch the NaNs" in explain(pol)


def check_rule_when() -> None:
    pol = policy("  - {name: r, when: loss > 9, action: notify}\n")
    assert replay(pol, [heartbeat(0, 1, loss=8.0)]) == []
    assert len(replay(pol, [heartbeat(0, 1, loss=10.0)])) == 1


def check_rule_layers() -> None:
    pol = policy("  - {name: r, when: grade < S3, layers: 'blocks.1', action: notify}\n")
    layers = {"blocks.0": {"grade": 1}, "blocks.1": {"grade": 2}}
    (d,) = replay(pol, [report(0, 500, layers)])
    assert d.layer == "blocks.1"


def check_rule_ranks() -> None:
    pol = policy("  - {name: r, when: loss > 9, ranks: all, action: notify}\n")
    msgs = [hello(0, world_size=2), hello(1, world_size=2), heartbeat(0, 5, loss=10.0)]
    assert replay(pol, msgs) == []
    assert len(replay(pol, [*msgs, heartbeat(1, 5, loss=10.0)])) == 1


def check_rule_for() -> None:
    pol = policy("  - {name: r, when: loss > 9, for: 3 steps, action: notify}\n")
    two = [heartbeat(0, s, loss=10.0) for s in (1, 2)]
    assert replay(pol, two) == [] and len(replay(pol, [*two, heartbeat(0, 3, loss=10.0)])) == 1


def check_rule_cooldown() -> None:
    rules = "  - {name: r, when: loss > 9, action: notify%s}\n"
    flap = [heartbeat(0, s, loss=10.0 if s % 2 else 1.0) for s in range(1, 8)]

    def fired(pol: Policy) -> int:
        return sum(1 for d in replay(pol, flap) if not d.resolved)

    assert fired(policy(rules % "")) == 4
    assert fired(policy(rules % ", cooldown: 100 steps")) == 1


def check_rule_warm_in() -> None:
    pol = policy("  - {name: r, when: loss > 9, warm_in: 10 steps, action: notify}\n")
    assert replay(pol, [heartbeat(0, 5, loss=10.0)]) == []
    assert len(replay(pol, [heartbeat(0, 12, loss=10.0)])) == 1


def check_rule_action() -> None:
    pol = policy("  - {name: r, when: loss > 9, action: checkpoint}\n")
    assert replay(pol, [heartbeat(0, 1, loss=10.0)])[0].action == "checkpoint"


def check_rule_severity() -> None:
    pol = policy("  - {name: r, when: loss > 9, action: notify, severity: page}\n")
    assert replay(pol, [heartbeat(0, 1, loss=10.0)])[0].severity == "page"


# ---- the policy itself -------------------------------------------------------------------------
def check_version() -> None:
    with pytest.raises(Exception, match="version"):
        load_policy_text("version: 2\nname: p\nrules:\n" + NAN_RULE % "")


def check_name() -> None:
    assert explain(policy()).startswith("Policy 'p'")


def check_description() -> None:
    pol = load_policy_text(
        "version: 1\nname: p\ndescription: For the 3am run.\nrules:\n" + NAN_RULE % ""
    )
    assert "For the 3am run." in explain(pol)


def check_warm_in() -> None:
    rule = "  - {name: r, when: grade < S3, action: notify}\n"
    assert replay(policy(rule, "warm_in: 1000 steps\n"), grade_stream([1])) == []
    assert len(replay(policy(rule, "warm_in: 0 steps\n"), grade_stream([1]))) == 1


# ---- notifications: the console and Slack notifiers --------------------------------------------
@pytest.fixture
def slack_env(monkeypatch):
    monkeypatch.setenv("SLACK_BOT_TOKEN", "xoxb-test-not-real")
    monkeypatch.setenv("SPIKEGUARD_SLACK_API_URL", "http://127.0.0.1:9/api/")
    monkeypatch.delenv("SPIKEGUARD_SLACK_WEBHOOK_URL", raising=False)
    monkeypatch.delenv("SPIKEGUARD_SLACK_CHANNEL", raising=False)


def notifiers(notify_yaml: str):
    pol = policy(extra=notify_yaml)
    job = JobSpec(name="j", entrypoint="x.py")
    console, *rest = make_notifiers(job, pol, "j", lambda ev: None)
    for n in rest:
        n.close(0.1)
    return console, (rest[0].settings if rest else None)


SLACK = "notify:\n  slack: {channel: '#c', %s}\n"


def check_slack_channel() -> None:
    assert notifiers("notify:\n  slack: {channel: '#ml-oncall'}\n")[1].channel == "#ml-oncall"


def check_slack_mention() -> None:
    assert notifiers(SLACK % "mention: U0123ABC")[1].mention == "<@U0123ABC>"


def check_slack_runbook_url() -> None:
    assert notifiers(SLACK % "runbook_url: 'https://wiki/rb'")[1].runbook_url == "https://wiki/rb"


def check_slack_dashboard_url() -> None:
    url = "https://grafana/d/x"
    assert notifiers(SLACK % f"dashboard_url: '{url}'")[1].dashboard_url == url


def check_route(severity: str) -> Callable[[], None]:
    def check() -> None:
        routes = {"info": "[console]", "warn": "[console, slack]", "page": "[console, slack]"}
        routes[severity] = "[]"
        text = ", ".join(f"{k}: {v}" for k, v in routes.items())
        console, slack = notifiers(f"notify:\n  slack: {{channel: '#c'}}\n  routes: {{{text}}}\n")
        assert severity not in console.severities and severity not in slack.severities
        others = {"info", "warn", "page"} - {severity}
        assert others <= set(console.severities)

    return check


def check_repeat_interval() -> None:
    _, slack = notifiers("notify:\n  slack: {channel: '#c'}\n  repeat_interval: 20m\n")
    assert slack.repeat_interval_s == 1200
    _, never = notifiers("notify:\n  slack: {channel: '#c'}\n  repeat_interval: null\n")
    assert never.repeat_interval_s == math.inf
    # the engine reminds that a notify rule still holds, every interval
    pol = policy(
        "  - {name: r, when: loss > 9, action: notify}\n", "notify: {repeat_interval: 10s}\n"
    )
    out = replay(pol, [heartbeat(0, s, loss=10.0, at=float(s)) for s in range(0, 25)])
    assert [(d.step, d.repeated) for d in out] == [(0, False), (10, True), (20, True)]


def check_repeat_intervals() -> None:
    every = "notify:\n  slack: {channel: '#c'}\n  repeat_interval: 20m\n"
    _, slack = notifiers(every + "  repeat_intervals: {slack: 5m}\n")
    assert slack.repeat_interval_s == 300  # its own entry, over repeat_interval
    _, never = notifiers(every + "  repeat_intervals: {slack: null, pagerduty: 1m}\n")
    assert never.repeat_interval_s == math.inf


def check_rule_notify() -> None:
    rules = (
        "  - {name: r, when: loss > 9, action: notify, severity: page, notify: [pagerduty]}\n"
        "  - {name: q, when: loss > 5, action: notify, severity: page}\n"
    )
    pol = load_policy_text(
        f"version: 1\nname: p\nrules:\n{rules}notify:\n  slack: {{channel: '#c'}}\n"
    )
    job = JobSpec(name="j", entrypoint="x.py")
    console, slack = make_notifiers(job, pol, "j", lambda ev: None)
    slack.close(0.1)
    # r names its destinations: not the console's nor Slack's, whatever the page route says
    assert console.rules == {"r": False} and slack.settings.rules == {"r": False}
    from spikeguard.supervisor.sinks.registry import routes_to

    fired = {"kind": "alert", "severity": "page"}
    assert not routes_to(slack.settings.severities, slack.settings.rules, {**fired, "rule": "r"})
    assert routes_to(slack.settings.severities, slack.settings.rules, {**fired, "rule": "q"})


def check_send_resolved() -> None:
    rule = "  - {name: r, when: loss > 9, action: notify}\n"
    msgs = [heartbeat(0, 1, loss=10.0), heartbeat(0, 2, loss=1.0)]
    assert [d.resolved for d in replay(policy(rule), msgs)] == [False, True]
    quiet = policy(rule, "notify: {send_resolved: false}\n")
    assert [d.resolved for d in replay(quiet, msgs)] == [False]


CHECKS: dict[str, Callable[[], None]] = {
    "version": check_version,
    "name": check_name,
    "description": check_description,
    "warm_in": check_warm_in,
    "rules.name": check_rule_name,
    "rules.description": check_rule_description,
    "rules.when": check_rule_when,
    "rules.layers": check_rule_layers,
    "rules.ranks": check_rule_ranks,
    "rules.for": check_rule_for,
    "rules.cooldown": check_rule_cooldown,
    "rules.warm_in": check_rule_warm_in,
    "rules.action": check_rule_action,
    "rules.severity": check_rule_severity,
    "rules.notify": check_rule_notify,
    **{f"recovery.{k}": (lambda f=f: f(False)) for k, f in RECOVERY.items()},
    **{f"rules.recovery.{k}": (lambda f=f: f(True)) for k, f in RECOVERY.items()},
    "notify.slack.channel": check_slack_channel,
    "notify.slack.mention": check_slack_mention,
    "notify.slack.runbook_url": check_slack_runbook_url,
    "notify.slack.dashboard_url": check_slack_dashboard_url,
    "notify.routes.info": check_route("info"),
    "notify.routes.warn": check_route("warn"),
    "notify.routes.page": check_route("page"),
    "notify.repeat_interval": check_repeat_interval,
    "notify.repeat_intervals": check_repeat_intervals,
    "notify.send_resolved": check_send_resolved,
}


def test_every_schema_field_has_a_check():
    assert field_paths(Policy) == set(CHECKS)


@pytest.mark.parametrize("path", sorted(CHECKS))
def test_the_field_reaches_the_runtime(path, slack_env):
    CHECKS[path]()


def test_the_engine_is_what_replay_runs():
    # the checks above use replay(); the live supervisor feeds the same Engine message by message
    pol = policy("  - {name: r, when: loss > 9, action: notify}\n")
    engine = Engine(pol)
    assert [d.rule for d in engine.observe(heartbeat(0, 1, loss=10.0))] == ["r"]
