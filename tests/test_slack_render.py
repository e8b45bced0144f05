"""Slack rendering of a rollback: the reply keeps the describer's line and lists up to five of
the checkpoints passed over, with their reasons (no Slack server needed)."""

from __future__ import annotations

import json

from spikeguard.supervisor.observe.describe import describe
from spikeguard.supervisor.sinks.slack.render import IncidentView, Links, step_message


def rollback(n: int) -> dict:
    skipped = [
        {
            "path": f"/run/ckpt-{s}.pt",
            "reason": f"step {s} > 575 = before_step - min_steps_back 200",
        }
        for s in range(600 + 50 * (n - 1), 599, -50)
    ]
    return {
        "kind": "rollback",
        "incident": "inc-001",
        "reason": "newest checkpoint graded S6 >= S4 before step 775",
        "checkpoint_step": 550,
        "checkpoint_path": "/run/ckpt-550.pt",
        "grade": 6,
        "skipped": skipped,
    }


def test_a_rollback_reply_lists_five_passed_over_checkpoints_with_reasons():
    ev = rollback(7)
    msg = step_message(ev, IncidentView(run="r", incident="inc-001"), Links(), None)
    texts = [json.dumps(b) for b in msg.blocks]
    assert describe(ev, "mrkdwn") in texts[0]
    detail = msg.blocks[1]["elements"][0]["text"]
    assert detail.startswith("checkpoint `/run/ckpt-550.pt`; passed over: ")
    assert detail.count("`/run/ckpt-") == 6  # the chosen one and five passed over
    assert "`/run/ckpt-900.pt` (`step 900 &gt; 575 = before_step - min_steps_back 200`)" in detail
    assert detail.endswith("and 2 more")
    assert msg.text == f"[inc-001] {describe(ev)}"  # the fallback: the concise line


def test_a_rollback_that_passed_over_nothing_has_no_list():
    ev = rollback(0)
    msg = step_message(ev, IncidentView(run="r", incident="inc-001"), Links(), None)
    assert msg.blocks[1]["elements"][0]["text"] == "checkpoint `/run/ckpt-550.pt`"
