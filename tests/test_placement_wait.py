"""A launch that waits for the cluster to place its gang says what it waits for and for how
long: in ``status.json`` (hence ``spikeguard status``) and the live view, while it waits, and
no longer once it is over. Against real Ray (a gang that cannot be placed) and through the
controller (a scripted group that waits)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import scripted_controller
from spikeguard.supervisor.cli import main
from spikeguard.supervisor.sinks.console import render_status, waiting_text
from test_controller_reports import LockstepGroup

WAIT = {
    "for": "placement",
    "what": "2 workers with {'CPU': 64.0} each (PACK)",
    "waited_s": 42.0,
    "timeout_s": 120.0,
}


def test_the_words_of_a_wait():
    assert waiting_text(WAIT) == (
        "waiting for placement of 2 workers with {'CPU': 64.0} each (PACK): 42 s of 2 min 0 s, "
        "then the launch fails and is retried"
    )
    assert waiting_text(None) == "" and waiting_text("junk") == ""
    assert waiting_text({"waited_s": float("nan")}) == "waiting for resources of ?"


class WaitingGroup(LockstepGroup):
    """Waits for its placement at each launch, saying so through ``on_wait`` (as the real
    group does), and records what ``status.json`` held while it waited."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__()
        self.on_wait: Any = None
        self.run_dir = run_dir
        self.seen: list[Any] = []

    def launch(self, **kw: Any):
        for waited in (1.0, 2.0, 3.0):
            self.on_wait({**WAIT, "waited_s": waited})
            self.seen.append(json.loads((self.run_dir / "status.json").read_text())["waiting"])
        self.on_wait(None)
        return super().launch(**kw)


def test_the_controller_shows_the_wait_while_it_lasts(tmp_path, capsys):
    from spikeguard.policies import Engine, load_policy_text

    policy = load_policy_text(
        "version: 1\nname: t\nrules:\n  - {name: crash, when: crash, action: recover}\n"
    )
    group = WaitingGroup(tmp_path)
    ticks: list[str] = []
    ctl = scripted_controller(
        tmp_path,
        group,
        Engine(policy),
        world_size=3,
        on_tick=lambda c: ticks.append(render_status(c.status())),
    )
    try:
        assert [w["waited_s"] for w in group.seen] == [1.0, 2.0, 3.0]
        assert all("waiting for placement of 2 workers" in t for t in ticks[:3])
        assert "waiting for" not in ticks[-1]  # the wait is over: said once more, without it
        ctl.step()
        assert json.loads((tmp_path / "status.json").read_text())["waiting"] is None
    finally:
        ctl.close()


def test_status_shows_a_live_supervisor_s_wait(tmp_path, capsys):
    from spikeguard.supervisor import rundir
    from spikeguard.supervisor.journal import Journal

    j = Journal(str(tmp_path), run="t")
    j.record({"kind": "launch", "generation": 1, "code": "launching"})
    j.close()
    (tmp_path / "status.json").write_text(json.dumps({"waiting": WAIT}))
    lock = rundir.acquire_lock(tmp_path)  # this test stands in for the live supervisor
    try:
        assert main(["status", str(tmp_path)]) == 0
    finally:
        lock.close()
    assert "waiting for placement of 2 workers" in capsys.readouterr().out


def test_a_gang_the_cluster_cannot_place_reports_its_wait_then_fails(ray_local):
    from spikeguard.supervisor.launch.group import GroupSpec, LaunchError, WorkerGroup

    group = WorkerGroup(
        GroupSpec(world_size=2, cpus_per_worker=10_000.0, placement_timeout_s=3.0),
        run_id="unplaceable",
        run_dir="/nonexistent",
    )
    told: list[Any] = []
    group.on_wait = told.append
    with pytest.raises(LaunchError, match="could not place 2 workers"):
        group.start()
    waits, last = told[:-1], told[-1]
    assert waits and last is None  # said while it waited, then that it is over
    assert all(w["for"] == "placement" and w["timeout_s"] == 3.0 for w in waits)
    assert "10000.0" in waits[0]["what"]
    steps = [w["waited_s"] for w in waits]
    assert steps == sorted(steps) and steps[-1] <= 3.0 + 1.0
