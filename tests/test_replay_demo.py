"""`policy replay` of the default policy over a recorded supervised demo run names the steps the
live supervisor acted on (tests/data/demo_run: reports.jsonl and journal.jsonl of
`spikeguard demo`, 2 ranks, recorded as tests/data/README.md says) under the policy it was
recorded with (``policy.yaml`` beside them: the default policy of the time)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from spikeguard.policies import load_policy, replay

DATA = Path(__file__).parent / "data" / "demo_run"


def test_replay_reproduces_the_live_recoveries():
    with gzip.open(DATA / "reports.jsonl.gz", "rt") as f:
        messages = [json.loads(line) for line in f]
    journal = [json.loads(line) for line in (DATA / "journal.jsonl").read_text().splitlines()]
    live = [(e["step"], e["rule"], e["rank"]) for e in journal if e["kind"] == "incident"]
    replayed = [
        (d.step, d.rule, d.rank)
        for d in replay(load_policy(str(DATA / "policy.yaml")), messages)
        if d.action == "recover"
    ]
    assert live and replayed == live


def test_replay_over_a_recorded_stable_supervised_run_fires_nothing():
    """tests/data/stable_run: the same example with --stable (LR x0.1) under `spikeguard submit`."""
    stable = Path(__file__).parent / "data" / "stable_run"
    with gzip.open(stable / "reports.jsonl.gz", "rt") as f:
        messages = [json.loads(line) for line in f]
    assert {m["rank"] for m in messages} == {0, 1} and max(m["step"] for m in messages) >= 1599
    journal = [json.loads(line) for line in (stable / "journal.jsonl").read_text().splitlines()]
    assert [e["kind"] for e in journal] == ["launch", "completed"]
    assert replay(load_policy("default"), messages) == []
