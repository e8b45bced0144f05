"""One incident lifecycle (``decide/lifecycle.py``): every reader that says how an incident
ended reads the same table, so the metrics, the report and the Slack thread agree."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import read_jsonl
from spikeguard.supervisor.decide import lifecycle
from spikeguard.supervisor.decide.events import Kind
from spikeguard.supervisor.observe.metrics import MetricsFold

DATA = Path(__file__).parent / "data"
JOURNALS = sorted(DATA.rglob("journal.jsonl"))


def _incident(kind: str, mono: float, **kw) -> dict:
    return {"kind": kind, "incident": "inc-001", "mono": mono, "rule": "loss-spike", **kw}


ENDINGS = [k for k, step in lifecycle.LIFECYCLE.items() if step.outcome is not None]


def test_every_kind_that_ends_an_incident_has_one_outcome():
    assert {lifecycle.outcome_of(k) for k in ENDINGS} == set(lifecycle.Outcome)
    assert lifecycle.outcome_of("launch") is None
    assert lifecycle.outcome_of("no such kind") is None


@pytest.mark.parametrize("kind", ENDINGS, ids=str)
def test_the_metrics_count_the_outcome_the_lifecycle_gives(kind: Kind):
    fold = MetricsFold(run="r")
    for ev in (_incident("incident", 1.0), _incident(kind.value, 5.0)):
        fold.handle(ev)
    assert fold.recoveries == {("loss-spike", lifecycle.outcome_of(kind).value): 1}


@pytest.mark.parametrize("kind", ENDINGS, ids=str)
def test_the_fold_ends_an_incident_once_and_a_new_incident_starts_over(kind: Kind):
    evs = [_incident("incident", 1.0), _incident(kind.value, 2.0), _incident("kill", 3.0)]
    life = lifecycle.fold(evs)["inc-001"]
    assert life.outcome is lifecycle.outcome_of(kind)
    assert life.state is (lifecycle.leads_to(kind) or lifecycle.IncidentState.RECOVERING)
    again = lifecycle.fold([*evs, _incident("incident", 4.0)])["inc-001"]
    assert again.outcome is None and again.state is lifecycle.IncidentState.RECOVERING


@pytest.mark.parametrize("path", JOURNALS, ids=lambda p: str(p.relative_to(DATA)))
def test_recorded_runs_read_the_same_in_the_metrics_and_the_fold(path: Path):
    evs = read_jsonl(path)
    fold = MetricsFold(run="r")
    for ev in evs:
        fold.handle(ev)
    lives = lifecycle.fold(evs)
    ended = sorted(life.outcome.value for life in lives.values() if life.outcome is not None)
    counted = sorted(o for (_, o), n in fold.recoveries.items() for _ in range(n))
    assert counted == ended
