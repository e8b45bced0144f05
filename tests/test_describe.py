"""One describer of journal events: one template per kind, plain or mrkdwn, never raising."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from fakeslack import incident_events
from spikeguard.supervisor.decide.events import Kind
from spikeguard.supervisor.observe.describe import (
    TEMPLATES,
    describe,
    num,
    passed_over,
    ranks_text,
    skip_category,
)

DATA = Path(__file__).parent / "data"


def journal(name: str) -> list[dict]:
    """The events of a recorded run in ``tests/data``."""
    lines = (DATA / name / "journal.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def unmark(mrkdwn: str) -> str:
    """mrkdwn -> the words a reader sees: no ``*`` or backticks, entities unescaped."""
    text = mrkdwn.replace("*", "").replace("`", "")
    return text.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")


def test_text_helpers():
    assert ranks_text([0, 1, 2, 3, 5, 7, 8]) == "0–3, 5, 7–8"
    assert ranks_text(None) == "—"
    assert (num(12345), num(0.000123456), num(math.nan), num(None), num("inf")) == (
        "12,345",
        "0.0001235",
        "nan",
        "—",
        "inf",
    )
    assert describe({"kind": "lr_cut", "factor": 0.5, "lr_scale": 0.25}) == (
        "LR cut ×0.5: LR scale now 0.25"
    )


def test_every_kind_has_a_template():
    assert set(TEMPLATES) == set(Kind)


EVENTS = [
    *incident_events(),
    *incident_events(conclusion="escalated"),
    *journal("demo_run"),
    *journal("stable_run"),
    {"kind": "alert", "severity": "page", "rule": "max-logit", "step": 5000, "reason": "a < b & c"},
    {"kind": "alert", "severity": "info", "rule": None, "rank": 2, "step": 40},
    {"kind": "probation_progress", "step": 1200, "until_step": 1400},
    {"kind": "failed", "exit_code": 1, "reason": "rank 1 crashed"},
    {"kind": "stopped", "reason": "stopped by user"},
    {"kind": "launch_failed", "generation": 4, "reason": "rank 0 exited before its hello"},
    {"kind": "resume", "reason": "supervisor restart: resuming from step 500"},
    {"kind": "supervisor_start", "reason": "restarted on an unfinished journal"},
    {"kind": "reaped", "reason": "killed 2 leftover rank processes (generations [1]) by pid"},
    {"kind": "notify_thread", "incident": "inc-001", "channel": "C0ALERTS", "ts": "1.2"},
    {"kind": "notify_undelivered", "what": "inc-001 kill", "error": "HTTP 500"},
    {"kind": "rollback", "checkpoint_step": None, "reason": "no checkpoint graded >= S4"},
    {"kind": "checkpoint_deleted", "step": 500, "generation": 2, "reason": "beyond keep_last 3"},
    {"kind": "something_new", "reason": "from a newer supervisor"},
]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: str(e.get("kind")))
def test_plain_and_mrkdwn_say_the_same_words(event):
    plain, mrkdwn = describe(event), describe(event, "mrkdwn")
    assert plain and "\n" not in plain
    assert unmark(mrkdwn) == plain


def test_the_recovery_story_in_words():
    lines = [describe(e) for e in incident_events(conclusion="escalated")]
    assert lines == [
        "entropy-collapse fired at step 1,230 → recover: "
        "attention entropy of blocks.7.attn fell below 0.3",
        "Killed ranks 0–3 in 1.4 s",
        "Rolled back to step 1,100 (S6); passed over 1 newer checkpoint (1 graded S3 < S5)",
        "LR cut ×0.5: LR scale now 0.5",
        "Optimizer reset: optimizer state cleared, weights kept",
        "Launched generation 1, LR scale 0.5",
        "Probation from step 1,101 until step 1,400",
        "ESCALATED: recovery budget of 2 attempts spent",
    ]
    assert describe(incident_events()[-1]) == "RESOLVED: probation passed at step 1,400"
    first = describe(incident_events()[0], "mrkdwn")
    assert first.startswith("*entropy-collapse fired* at step 1,230 → recover: ")


def test_mrkdwn_escapes_values_but_not_its_own_markup():
    ev = {"kind": "alert", "severity": "warn", "rule": "r<1>", "step": 7, "reason": "a < b & c"}
    assert describe(ev, "mrkdwn") == "*WARN r&lt;1&gt;* at step 7: a &lt; b &amp; c"
    assert describe(ev) == "WARN r<1> at step 7: a < b & c"


def test_fields_stand_in_for_a_missing_reason():
    ev = {"kind": "incident", "rule": "hang", "action": "recover", "attempt": 2, "step": 40}
    ev |= {"signal": "heartbeat_age", "value": 61.0, "rank": 1}
    assert (
        describe(ev) == "hang fired (attempt 2) at step 40 → recover: heartbeat_age = 61 on rank 1"
    )
    assert describe({"kind": "alert", "severity": "info", "rank": 2, "step": 40}) == (
        "INFO at step 40: on rank 2"
    )
    assert describe({"kind": "incident"}) == "— fired at step — → —: —"


ODD_VALUES = [None, "", "x", 0, -3, 2.5, math.nan, True, [], [1, "a", None], {"a": 1}, [[1]]]
FIELDS = sorted(
    {k for e in EVENTS for k in e if k not in ("kind", "context", "plan", "settings")}
    | {"attempt", "skip_ranges", "world_size", "what", "error"}
)


@pytest.mark.parametrize("kind", [*Kind, "unknown", None, 7, ["launch"]], ids=str)
def test_a_malformed_event_never_raises(kind):
    for value in ODD_VALUES:
        event = {"kind": kind, **dict.fromkeys(FIELDS, value)}
        for markup in ("plain", "mrkdwn"):
            assert isinstance(describe(event, markup), str)
        assert isinstance(describe({"kind": kind}), str)
    assert describe("not an event") == "—"  # type: ignore[arg-type]


def skip(reason: object, path: str = "/run/checkpoints/ckpt.pt") -> dict:
    return {"path": path, "reason": reason}


ROLLBACK = {
    "kind": "rollback",
    "checkpoint_step": 550,
    "checkpoint_path": "/run/checkpoints/ckpt-step00000550-gen001-rank0.pt",
    "grade": 6,
    "skipped": [
        skip("step 750 > 575 = before_step - min_steps_back 200"),
        skip("step 700 > 575 = before_step - min_steps_back 200"),
        skip("grade 3 < min_grade 4"),
        skip("failed verification: sha256 mismatch: the file was altered"),
    ],
}


def test_the_rollback_line_counts_what_it_passed_over_and_why():
    assert describe(ROLLBACK) == (
        "Rolled back to step 550 (S6); passed over 4 newer checkpoints "
        "(2 within min_steps_back 200, 1 graded S3 < S4, 1 failed verification)"
    )
    assert describe(ROLLBACK, "mrkdwn").startswith("*Rolled back* to step 550 (S6); passed over")
    assert unmark(describe(ROLLBACK, "mrkdwn")) == describe(ROLLBACK)


@pytest.mark.parametrize(
    "reason, category",
    [
        ("step 750 > 575 = before_step - min_steps_back 200", "within min_steps_back 200"),
        ("generation 1 step 750 is off the current lineage", "off the current lineage"),
        ("ungraded (no integer 'grade' in meta)", "ungraded"),
        ("grade 2 < min_grade 4", "graded S2 < S4"),
        ("grade S2 < S4", "graded S2 < S4"),
        ("graded S3 < S5", "graded S3 < S5"),
        ("failed verification: size 10 != 20 in the sidecar (truncated?)", "failed verification"),
        ("sha256 mismatch", "failed verification"),
        ("the disk ate it", "other"),
        ("", "other"),
        (None, "other"),
        (42, "other"),
    ],
)
def test_each_skip_reason_falls_in_one_category(reason, category):
    assert skip_category(reason) == category


def test_checkpoints_graded_differently_share_one_count():
    skipped = [skip("grade 3 < min_grade 4"), skip("grade 1 < min_grade 4"), "junk", skip(None)]
    assert passed_over(skipped) == "passed over 4 newer checkpoints (2 graded below S4, 2 other)"
    assert passed_over([]) == "" and passed_over(None) == ""


def test_without_a_checkpoint_the_line_says_what_was_passed_over():
    ev = {
        "kind": "rollback",
        "checkpoint_step": None,
        "reason": "no checkpoint graded >= S4 before step 40",
        "skipped": [skip("grade 2 < min_grade 4"), skip("grade 2 < min_grade 4")],
    }
    assert describe(ev) == (
        "No checkpoint to roll back to: no checkpoint graded >= S4 before step 40; "
        "passed over 2 checkpoints (2 graded S2 < S4)"
    )


def test_the_rollback_line_stays_short_however_many_were_passed_over():
    ev = dict(
        ROLLBACK,
        skipped=[
            skip(
                f"step {s} > 575 = before_step - min_steps_back 200",
                f"/a/very/long/path/ckpt-step{s:08d}-gen001-rank0.pt",
            )
            for s in range(600, 600 + 50 * 40, 40)
        ],
    )
    line = describe(ev)
    assert len(line) < 120 and "50 newer checkpoints (50 within min_steps_back 200)" in line
    assert "/a/very/long/path" not in line


def test_the_demo_runs_rollbacks_in_words():
    lines = [describe(e) for e in journal("demo_run") if e["kind"] == "rollback"]
    assert lines == [
        "Rolled back to step 550 (S6); passed over 4 newer checkpoints "
        "(4 within min_steps_back 200)",
        "Rolled back to step 700 (S6); passed over 5 newer checkpoints "
        "(4 within min_steps_back 200, 1 off the current lineage)",
    ]
