"""The sinks seam: a sink registered under a new name is a route destination policies may use,
and the runner builds, restores, ticks, feeds and closes it through the registry (no Ray: a
scripted group hands the controller its polls). A name nobody registered is a FILE:LINE:COL
error, with the closest registered name suggested."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import scripted_controller
from spikeguard.policies import Engine, PolicyError, load_policy
from spikeguard.policies.commands import policy_schema
from spikeguard.supervisor import runner
from spikeguard.supervisor.cli import main
from spikeguard.supervisor.job import JobSpec, load_job_policy
from spikeguard.supervisor.journal import read_events
from spikeguard.supervisor.sinks import SINKS, BaseSink, SinkContext, destinations
from spikeguard.supervisor.sinks.registry import register
from test_controller_reports import LockstepGroup  # three ranks; rank 2's loss high from step 1

POLICY = """\
version: 1
name: paged
warm_in: 0 steps
rules:
  - {name: loss-high, when: loss > 5, action: notify, severity: page}
notify:
  routes:
    info: [console]
    warn: [console]
    page: [console, %s]
"""


UNDELIVERED = {"kind": "notify_undelivered", "incident": None, "what": "page", "error": "down"}


class Recorder(BaseSink):
    """A throw-away pager: records each lifecycle call; journals each page it was routed as
    undelivered (what a pager whose service is down would journal)."""

    def __init__(self, ctx: SinkContext) -> None:
        self.ctx = ctx
        self.calls: list[tuple[Any, ...]] = []
        self.handled: list[dict[str, Any]] = []

    def restore(self, events: list[dict[str, Any]]) -> None:
        self.calls.append(("restore", [e["seq"] for e in events]))

    def tick(self, ctl: Any) -> None:
        self.calls.append(("tick", ctl.state.phase))

    def handle(self, event: dict[str, Any]) -> None:
        self.calls.append(("handle", event["kind"]))
        self.handled.append(event)
        if event["kind"] == "alert" and event.get("severity") in self.ctx.severities:
            self.ctx.record(UNDELIVERED)

    def close(self, timeout_s: float = 10.0, *, ended: bool = False) -> None:
        self.calls.append(("close", ended))


@pytest.fixture
def pager():
    """Registers ``pager`` (routable) and ``tap`` (not routable, hears the other sinks) for one
    test; every sink they build is listed under its name."""
    built: dict[str, list[Recorder]] = {"pager": [], "tap": []}

    def factory(name: str):
        def make(ctx: SinkContext) -> Recorder:
            built[name].append(Recorder(ctx))
            return built[name][-1]

        return make

    register("pager")(factory("pager"))
    register("tap", routable=False, hears_sinks=True)(factory("tap"))
    try:
        yield built
    finally:
        SINKS.pop("pager", None)
        SINKS.pop("tap", None)


def job_for(tmp_path: Path, route: str) -> JobSpec:
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY % route)
    return JobSpec(
        name="t", entrypoint="x.py", policy=str(path), metrics={"enabled": False}, run_dir="run"
    )


@pytest.fixture(autouse=True)
def no_slack(monkeypatch):
    for name in ("SLACK_BOT_TOKEN", "SPIKEGUARD_SLACK_WEBHOOK_URL", "SPIKEGUARD_SLACK_CHANNEL"):
        monkeypatch.delenv(name, raising=False)


def test_a_registered_sink_lives_the_whole_lifecycle_through_the_runner(tmp_path, pager):
    assert "pager" in destinations() and "tap" not in destinations()
    job = job_for(tmp_path, "pager")
    policy = load_job_policy(job)  # the registry's names: "pager" is a destination now
    run = tmp_path / "run"
    ctl = scripted_controller(run, LockstepGroup(), Engine(policy), world_size=3)
    before = len(read_events(run))  # the first launch, journaled before the sinks came
    sinks = runner.attach_sinks(ctl, job, policy, [], live=False)
    assert sorted(sinks.named) == ["console", "pager", "tap"]  # no Slack, no metrics configured
    (p,), (tap,) = pager["pager"], pager["tap"]
    assert p.ctx.severities == ("page",) and tap.ctx.severities == ()
    assert p.ctx.run_id == "t" and p.ctx.run_dir == run and p.ctx.job is job
    for _ in range(3):
        ctl.step()
    ctl.stop_file.write_text("stopped by the test")
    ctl.step()  # the run ends (stopped): no tick
    runner.release_sinks(sinks, ctl, interrupted=False)
    ctl.close()

    journal = read_events(run)[before:]
    kinds = [e["kind"] for e in journal]
    assert "alert" in kinds and "notify_undelivered" in kinds
    # the pager: no restore (a fresh run), every event the controller journaled, a tick per
    # controller tick and one last, then close (the run ended: the metrics' final scrape)
    assert [e["seq"] for e in p.handled] == [
        e["seq"] for e in journal if e["kind"] != "notify_undelivered"
    ]
    assert [c[0] for c in p.calls if c[0] != "handle"] == ["tick"] * 4 + ["close"]
    assert p.calls[-1] == ("close", True)
    # the tap hears what the pager journaled itself (here from within its handle, so ahead of
    # the alert); the pager is not handed it back
    assert sorted(e["seq"] for e in tap.handled) == [e["seq"] for e in journal]
    # a restarted supervisor: the sinks fold the journal the dead one left, before any event
    events = read_events(run)
    ctl2 = scripted_controller(tmp_path / "run2", LockstepGroup(), Engine(policy), world_size=3)
    sinks2 = runner.attach_sinks(ctl2, job, policy, events, live=False)
    restored = pager["pager"][-1]
    assert restored is not p and restored.calls[0] == ("restore", [e["seq"] for e in events])
    assert pager["tap"][-1].calls[0] == ("restore", [e["seq"] for e in events])
    ctl2.stop_file.write_text("interrupted (Ctrl-C)")
    ctl2.step()
    runner.release_sinks(sinks2, ctl2, interrupted=True)
    ctl2.close()
    assert restored.calls[-1] == ("close", False)  # Ctrl-C: the supervisor goes, not ended


def test_make_notifiers_builds_the_routable_registered_sinks(tmp_path, pager):
    job = job_for(tmp_path, "pager")
    journaled: list[dict[str, Any]] = []
    console, *rest = runner.make_notifiers(
        job, load_job_policy(job), "t", lambda ev: journaled.append(ev) or ev
    )
    assert rest == pager["pager"] and not pager["tap"]  # routable ones only
    assert console.severities == ("info", "warn", "page") and rest[0].ctx.severities == ("page",)
    rest[0].ctx.record(UNDELIVERED)
    assert journaled == [UNDELIVERED]


def test_an_unregistered_destination_is_refused_at_its_position(tmp_path, capsys):
    job = job_for(tmp_path, "pager")
    where = f"{job.policy}:10:21: notify.routes.page[1]"
    with pytest.raises(PolicyError) as e:
        load_job_policy(job)
    # the registered names are suggested (the pagers': 'pagerduty' is the nearest)
    assert str(e.value) == f"{where}: unknown destination 'pager' (did you mean 'pagerduty'?)"
    with pytest.raises(PolicyError, match="unknown destination 'pager'"):
        load_policy(job.policy)  # a library user's default: the default routes' names
    assert main(["policy", "check", job.policy]) == 2
    assert f"{where}: unknown destination 'pager'" in capsys.readouterr().err


def test_a_typo_suggests_the_closest_registered_name(tmp_path, pager, capsys):
    job = job_for(tmp_path, "pagr")
    with pytest.raises(PolicyError) as e:
        load_job_policy(job)
    assert str(e.value).endswith("unknown destination 'pagr' (did you mean 'pager'?)")
    ok = job_for(tmp_path, "pager")
    assert main(["policy", "check", ok.policy]) == 0  # the CLI knows the registry's names
    assert "ok" in capsys.readouterr().out
    schema = json.dumps(policy_schema(destinations()))  # what `spikeguard policy schema` prints
    assert '"enum": ["console", "slack", "alertmanager", "pagerduty", "webhook", "pager"]' in schema


def test_a_route_to_a_sink_that_is_not_routable_is_refused(tmp_path, pager):
    with pytest.raises(PolicyError, match="unknown destination 'tap'"):
        load_job_policy(job_for(tmp_path, "tap"))
