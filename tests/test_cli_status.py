"""`spikeguard status`: the run as the journal folds it, the ranks as status.json last had them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from spikeguard.supervisor.cli import main

DEMO = Path(__file__).parent / "data" / "demo_run"


def test_status_of_a_finished_run_comes_from_its_journal(tmp_path, capsys):
    shutil.copy(DEMO / "journal.jsonl", tmp_path / "journal.jsonl")  # no status.json at all
    assert main(["status", str(tmp_path), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["phase"] == "COMPLETED" and st["exit_code"] == 0 and st["generation"] == 3
    assert st["lr_scale"] == 0.25
    # one incident with two attempts is one incident, not two
    kinds = [json.loads(line)["kind"] for line in (DEMO / "journal.jsonl").open()]
    assert kinds.count("incident") == 2 and st["incidents"] == 1
    assert st["last_event"]["kind"] == "completed" and "ranks" not in st


def test_status_adds_the_ranks_the_live_supervisor_last_wrote(tmp_path, capsys):
    shutil.copy(DEMO / "journal.jsonl", tmp_path / "journal.jsonl")
    ranks = {"0": {"step": 1599, "grade": 7, "attn_entropy_min_norm": 0.4, "loss": 1.5}}
    (tmp_path / "status.json").write_text(json.dumps({"phase": "RUNNING", "ranks": ranks}))
    assert main(["status", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    # the phase is the journal's (a stale status.json of a dead supervisor says RUNNING)
    assert out.startswith("COMPLETED") and "r0    step 1599  S7  H_min/max 0.400  loss 1.500" in out
    assert "1 incident(s); last: completed" in out


def test_status_without_a_run_is_bad_input(tmp_path, capsys):
    assert main(["status", str(tmp_path)]) == 2
    assert "no journal.jsonl" in capsys.readouterr().err
