"""`spikeguard status` at 3 a.m.: a run whose supervisor is gone says so (and shows no ETA of a
pace nobody measures any more); a live one names its holder; a held run says who holds it and
what a human can run next."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from spikeguard.supervisor.cli import main
from spikeguard.supervisor.decide import recovery as rc
from test_faults_fold import Run, launched, recover


def write_journal(run_dir: Path, r: Run) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "journal.jsonl", "w") as f:
        for i, ev in enumerate(r.journal, 1):
            f.write(json.dumps({"seq": i, "run": "toy", "time": "t", "mono": i, **ev}) + "\n")


def training(run_dir: Path) -> Run:
    r = Run()
    r.feed(rc.Start())
    r.feed(launched(1))
    write_journal(run_dir, r)
    live = {
        "ranks": {"0": {"step": 120, "loss": 2.0}},
        "throughput": {"min_step": 120, "steps_per_s": 2.0, "eta_s": 600.0, "last_step": 1319},
        "updated": time.time() - 600,
    }
    (run_dir / "status.json").write_text(json.dumps(live))
    return r


def status(run_dir: Path, capsys, *extra: str) -> str:
    assert main(["status", str(run_dir), *extra]) == 0
    return capsys.readouterr().out


def test_a_run_whose_supervisor_is_gone_says_so_without_an_eta(tmp_path, capsys):
    training(tmp_path)
    out = status(tmp_path, capsys)
    assert "SUPERVISOR GONE" in out and "10 min ago" in out
    assert "ETA" not in out and "spikeguard submit JOB" in out
    st = json.loads(status(tmp_path, capsys, "--json"))
    assert st["supervisor"] == {"alive": False, "holder": None} and "throughput" not in st


def test_a_live_supervisor_is_named_and_its_eta_shown(tmp_path, capsys):
    training(tmp_path)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; "
            "from spikeguard.supervisor import rundir; "
            "lock = rundir.acquire_lock(Path(sys.argv[1])); print('held', flush=True); "
            "time.sleep(120)",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        st = json.loads(status(tmp_path, capsys, "--json"))
        assert st["supervisor"]["alive"] is True and st["supervisor"]["holder"]
        assert st["throughput"]["eta_s"] == 600.0
        assert "SUPERVISOR GONE" not in status(tmp_path, capsys)
    finally:
        holder.kill()
        holder.wait(30)


def test_a_held_run_says_who_holds_it_and_the_command_that_moves_it_on(tmp_path, capsys):
    r = Run()
    r.feed(rc.Start())
    r.feed(launched(1))
    r.feed(rc.Operator("hold", "alice@host", "cli"))
    r.feed(recover(250))
    r.feed(rc.Operator("ack", "bob@host", "cli"))
    write_journal(tmp_path, r)
    out = status(tmp_path, capsys)
    assert out.startswith("HOLDING")
    assert "on hold (set by alice@host)" in out and "acknowledged by bob@host" in out
    assert "spikeguard resume RUN_DIR" in out and "SUPERVISOR GONE" in out


def test_a_held_run_lists_the_checkpoints_it_can_resume_from(tmp_path, capsys):
    import torch
    from spikeguard.workers import checkpoint as ckpt

    r = Run()
    r.feed(rc.Start())
    r.feed(launched(1))
    r.feed(rc.Operator("hold", "alice@host", "cli"))
    r.feed(recover(250))
    write_journal(tmp_path, r)
    ck = tmp_path / "checkpoints"
    ck.mkdir()
    for step in (50, 100, 150, 200, 250, 300, 350):
        ckpt.write_checkpoint(ck, {"w": torch.ones(2)}, step=step, generation=1, meta={"grade": 5})
    out = status(tmp_path, capsys)
    assert "the newest 5 it can resume from" in out
    listed = [int(line.split()[1]) for line in out.splitlines() if line.startswith("  step ")]
    assert listed == [150, 200, 250, 300, 350]
    st = json.loads(status(tmp_path, capsys, "--json"))
    assert [c["step"] for c in st["resumable"]] == listed and st["resumable"][0]["grade"] == 5
