"""A supervised run whose checkpoints live on S3 (``checkpoints: {dir: s3://BUCKET/runs/{name}}``),
end to end on real Ray + gloo with 2 ranks against the real S3-compatible server of
tests/s3server.py (moto in server mode; real s3fs/botocore in the ranks and the supervisor): the
toy job collapses, spikeguard rolls it back to a checkpoint read from S3, retention deletes
objects there, nothing is written to ``RUN_DIR/checkpoints``, and the commands given the RUN_DIR
find the checkpoints on S3. The store's credentials reach the ranks (sent with each launch: the
Ray agents started before the test set them) and nothing else the supervisor writes or sends."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import read_jsonl, toy_job
from fakeslack import TOKEN, FakeSlack
from s3server import SECRET_KEY, Bucket, s3, s3_server

pytestmark = pytest.mark.slow
__all__ = ["s3", "s3_server"]  # the fixtures, used by name
POLICY = Path(__file__).parent / "data" / "toy_policy.yaml"


def test_a_run_on_s3_rolls_back_from_s3_and_keeps_its_credentials_to_the_ranks(
    ray_local, tmp_path, fail_at, s3: Bucket, monkeypatch, capsys
):
    from spikeguard.supervisor.cli import main
    from spikeguard.supervisor.redaction import withheld
    from spikeguard.supervisor.runner import run_job
    from spikeguard.workers import checkpoint as ckpt

    # the secret is one the ranks never inherit: only the launch can have given it to them
    assert withheld("AWS_SECRET_ACCESS_KEY", SECRET_KEY) is not None
    env_out = tmp_path / "env"
    env_out.mkdir()
    fail_at(0, 60, "collapse")  # generation 1 only
    place = s3.url("runs/toy")
    with FakeSlack() as fake:
        monkeypatch.setenv("SLACK_BOT_TOKEN", TOKEN)
        monkeypatch.setenv("SPIKEGUARD_SLACK_API_URL", fake.api_url)
        job = toy_job(
            tmp_path,
            policy=POLICY,
            faults=fail_at,
            steps=120,
            extra_args=["--env-out", str(env_out)],
            checkpoints={"dir": s3.url("runs/{name}"), "keep_last": 2, "keep_healthy": 1},
            notify={"slack": {"channel": "#ml-alerts"}},
        )
        assert run_job(job, live=False) == 0
        slack = json.dumps([(c.method, c.params) for c in fake.calls], default=repr)
        slack += json.dumps(fake.files, default=repr)
        assert fake.ok_calls("chat.postMessage")
    console = capsys.readouterr()
    run_dir = Path(job.run_dir)
    evs = read_jsonl(run_dir / "journal.jsonl")
    kinds = [e["kind"] for e in evs]
    assert kinds[-1] == "completed" and kinds.count("rollback") == 1

    # the rollback chose a checkpoint on S3, and the ranks loaded it from there
    rb = next(e for e in evs if e["kind"] == "rollback")
    assert rb["checkpoint_path"].startswith(place + "/"), rb
    resumed = [m for m in read_jsonl(run_dir / "reports.jsonl") if m["type"] == "resumed"]
    assert {m["rank"] for m in resumed} == {0, 1}
    for m in resumed:
        assert m["checkpoint"] == rb["checkpoint_path"]
        assert m["from_step"] == rb["checkpoint_step"] + 1
    gen2 = json.loads((env_out / "gen2-rank1.json").read_text())
    assert gen2["SPIKEGUARD_CKPT_DIR"] == place

    # nothing in the run directory; retention deleted objects on S3
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())
    deleted = [e["path"] for e in evs if e["kind"] == "checkpoint_deleted"]
    assert deleted and all(p.startswith(place + "/") for p in deleted)
    objects = {s3.url(k) for k in s3.objects("runs/toy/")}
    assert not [p for p in deleted if p in objects or p + ".json" in objects]
    listed = ckpt.list_checkpoints(place)
    assert listed and {i.path + ".json" for i in listed} <= objects

    # the commands given the RUN_DIR find them on S3
    assert main(["checkpoints", str(run_dir), "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    on_s3 = [r for r in rows if r["status"] != "deleted"]
    assert sorted(r["path"] for r in on_s3) == sorted(i.path for i in listed)
    assert all(r["status"] == "verified" for r in on_s3), on_s3
    assert {r["path"] for r in rows if r["status"] == "deleted"} == set(deleted)
    assert main(["checkpoints", str(run_dir)]) == 0
    table = capsys.readouterr().out
    assert main(["status", str(run_dir)]) == 0
    status = capsys.readouterr().out
    assert main(["report", str(run_dir)]) == 0
    capsys.readouterr()
    report = (run_dir / "report.html").read_text()
    assert "No checkpoints in this run directory" not in report
    assert all(os.path.basename(i.path) in report for i in listed)  # its checkpoint table

    # the credentials reached the ranks, and nothing else
    for rank in (0, 1):
        got = json.loads((env_out / f"rank{rank}.json").read_text())
        assert got["AWS_SECRET_ACCESS_KEY"] == SECRET_KEY
        assert got["AWS_ENDPOINT_URL"] == os.environ["AWS_ENDPOINT_URL"]
        assert TOKEN not in json.dumps(got)  # the supervisor's own secrets stay with it
    assert json.loads((run_dir / "job.json").read_text())["checkpoints"]["dir"] == place
    for path in run_dir.rglob("*"):  # journal, status.json, job.json, reports, logs, report
        if path.is_file():
            assert SECRET_KEY.encode() not in path.read_bytes(), path
    shown = {"slack": slack, "console": console.out + console.err, "table": table}
    shown["status"] = status
    for where, text in shown.items():
        assert SECRET_KEY not in text, where
