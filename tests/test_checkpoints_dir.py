"""The job's ``checkpoints.dir`` on the supervisor's side, without Ray: the field and its
validation, where the run keeps its checkpoints (one value, carried by ``RunPaths``, recorded in
``RUN_DIR/job.json`` and read back by every command given a RUN_DIR), the object store's
environment that every launch sends the ranks, and a store that cannot be used refused before
any rank starts. Object-store cases run against the real S3-compatible server of
tests/s3server.py (moto in server mode, real s3fs/botocore clients)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import events, toy_job
from s3server import SECRET_KEY, Bucket, _free_port, s3, s3_server
from spikeguard.supervisor.job import CheckpointRetention, JobSpec, load_job
from spikeguard.supervisor.runner import (
    checkpoint_store_problem,
    launch_environment,
    record_job,
    with_checkpoints_resolved,
)
from spikeguard.supervisor.settings import RunPaths
from spikeguard.workers.checkpoint import location, storage
from spikeguard.workers.contract.exitcodes import ExitCode

__all__ = ["s3", "s3_server"]  # the fixtures, used by name

POLICY = Path(__file__).parent / "data" / "toy_policy.yaml"


def _job(tmp_path: Path, place: str | None, **fields) -> JobSpec:
    checkpoints = {} if place is None else {"dir": place}
    return toy_job(tmp_path, policy=POLICY, checkpoints=checkpoints, **fields)


# -- the rules (pure) ---------------------------------------------------------------------------
def test_which_places_hold_checkpoints() -> None:
    for ok in ("s3://bucket/runs/x", "gs://b/p", "/abs/path", "rel/path", "file:///abs"):
        assert location.problem(ok) is None, ok
    unknown = location.problem("ftp://host/ckpts")
    assert unknown is not None and "ftp://" in unknown and "s3://" in unknown
    nobucket = location.problem("s3:///prefix")
    assert nobucket is not None and "bucket" in nobucket
    assert [location.is_local(p) for p in ("/a", "a", "file:///a", "s3://b/a")] == [
        True,
        True,
        True,
        False,
    ]
    assert location.local_path("file:///a/b") == "/a/b" and location.local_path("a/b") == "a/b"
    # every object store has its backend's variables named, once
    assert set(location.STORE_VARIABLES) == set(storage.OBJECT_STORE_SCHEMES)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_CA_BUNDLE"):
        assert name in location.store_variables("s3://b/p")
    assert location.store_variables("/local") == ()


def test_the_store_environment_is_what_the_supervisor_sets_of_the_backends_variables() -> None:
    environ = {
        "AWS_SECRET_ACCESS_KEY": "s3cr3t-value",
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9000",
        "AWS_REGION": "",  # set to nothing: not sent
        "GITHUB_TOKEN": "ghp_notforranks0000000000000000000000",
        "HOME": "/home/me",
    }
    assert location.store_environment("s3://b/p", environ) == {
        "AWS_SECRET_ACCESS_KEY": "s3cr3t-value",
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9000",
    }
    assert location.store_environment("/local/ckpts", environ) == {}
    assert location.store_environment("gs://b/p", environ) == {}


# -- the job field -----------------------------------------------------------------------------
def test_every_job_field_has_its_own_docstring() -> None:
    fields = JobSpec.model_fields
    assert fields["env"].description.startswith("Extra environment variables for the ranks")
    assert fields["pass_env"].description.startswith("Names of variables")
    place = CheckpointRetention.model_fields["dir"].description
    assert "s3://" in place and "{name}" in place and "RUN_DIR/checkpoints" in place


def test_an_unknown_scheme_is_a_validation_error_naming_the_field(tmp_path: Path) -> None:
    from spikeguard.policies import PolicyError

    job = tmp_path / "job.yaml"
    job.write_text("name: t\nentrypoint: train.py\ncheckpoints:\n  dir: ftp://host/ckpts\n")
    with pytest.raises(PolicyError) as bad:
        load_job(job)
    text = str(bad.value)
    assert f"{job}:4:" in text and "checkpoints.dir" in text and "ftp://" in text
    job.write_text("name: t\nentrypoint: train.py\ncheckpoints:\n  dir: s3://b/runs/{name}\n")
    assert load_job(job).checkpoints.dir == "s3://b/runs/{name}"


def test_the_place_is_resolved_once_and_recorded(tmp_path: Path) -> None:
    assert _job(tmp_path, None).resolved_checkpoints_dir() is None
    job = _job(tmp_path, "s3://bucket/runs/{name}/")
    assert job.resolved_checkpoints_dir() == "s3://bucket/runs/toy"
    rel = _job(tmp_path, "ckpts/{name}")
    assert rel.resolved_checkpoints_dir(base=tmp_path) == str(tmp_path / "ckpts" / "toy")
    url = _job(tmp_path, f"file://{tmp_path}/c")
    assert url.resolved_checkpoints_dir() == str(tmp_path / "c")
    # what the runner runs and records: the resolved place, read back from job.json
    run = tmp_path / "run"
    run.mkdir()
    assert RunPaths.recorded(run).ckpt_dir == str(run / "checkpoints")  # nothing recorded
    record_job(with_checkpoints_resolved(job), run)
    assert json.loads((run / "job.json").read_text())["checkpoints"]["dir"] == (
        "s3://bucket/runs/toy"
    )
    assert RunPaths.recorded(run) == RunPaths(run, "s3://bucket/runs/toy")
    record_job(_job(tmp_path, None), run)  # a run that keeps them in RUN_DIR/checkpoints
    assert RunPaths.recorded(run).ckpt_dir == str(run / "checkpoints")
    (run / "job.json").write_text('{"checkpoints": {"dir": 7}')  # torn, or not ours
    assert RunPaths.recorded(run).ckpt_dir == str(run / "checkpoints")


def test_make_creates_a_local_checkpoint_directory_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # where a mkdir of "s3://..." would have made "s3:"
    paths = RunPaths(tmp_path / "a", "s3://bucket/runs/a").make()
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["plans"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]
    assert paths.ckpt_dir == "s3://bucket/runs/a"
    local = RunPaths(tmp_path / "b", str(tmp_path / "elsewhere" / "b")).make()
    assert (tmp_path / "elsewhere" / "b").is_dir() and local.ckpt_dir.endswith("elsewhere/b")
    assert not (tmp_path / "b" / "checkpoints").exists()
    assert RunPaths(tmp_path / "c").make().ckpt_dir == str(tmp_path / "c" / "checkpoints")
    assert (tmp_path / "c" / "checkpoints").is_dir()


def test_every_launch_sends_the_stores_variables_and_nothing_else(tmp_path: Path) -> None:
    environ = {
        "AWS_ACCESS_KEY_ID": "AKIAEXAMPLEEXAMPLE00",
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_ENDPOINT_URL": "http://store:9000",
        "HF_TOKEN": "hf_notforthisrankatall000000000000",
        "SLACK_BOT_TOKEN": "xoxb-1-2-notforranks",
    }
    job = _job(tmp_path, "s3://b/runs/{name}", env={"AWS_ENDPOINT_URL": "http://other:9000"})
    env = launch_environment(job, "s3://b/runs/toy", environ)
    assert env["AWS_SECRET_ACCESS_KEY"] == SECRET_KEY
    assert env["AWS_ACCESS_KEY_ID"] == "AKIAEXAMPLEEXAMPLE00"
    assert env["AWS_ENDPOINT_URL"] == "http://other:9000"  # the job's own env wins
    assert not {"HF_TOKEN", "SLACK_BOT_TOKEN"} & set(env)
    assert env["SPIKEGUARD_BACKEND"] == "gloo"
    local = launch_environment(_job(tmp_path, None), str(tmp_path / "ckpts"), environ)
    assert not [k for k in local if k.startswith("AWS_")]


# -- the store at start ------------------------------------------------------------------------
def test_a_store_that_can_be_listed_is_fine_even_empty(s3: Bucket, tmp_path: Path) -> None:
    assert checkpoint_store_problem(s3.url("runs/new"), os.environ) is None
    assert checkpoint_store_problem(str(tmp_path / "not" / "yet"), os.environ) is None
    (tmp_path / "a-file").write_text("x")
    problem = checkpoint_store_problem(str(tmp_path / "a-file"), os.environ)
    assert problem is not None and str(tmp_path / "a-file") in problem


def _refused_before_any_rank(
    tmp_path: Path, url: str, capsys: pytest.CaptureFixture[str]
) -> tuple[str, Path]:
    from spikeguard.supervisor.runner import run_job

    job = _job(tmp_path, url)
    assert run_job(job, live=False) == ExitCode.BAD_INPUT
    out = capsys.readouterr()
    run_dir = Path(job.run_dir)
    assert list((run_dir / "logs").iterdir()) == []  # no rank's log: none was started
    assert events(run_dir) == []  # nothing launched, nothing journaled
    lines = [line for line in (out.out + out.err).splitlines() if url in line]
    assert len(lines) == 1, out
    assert SECRET_KEY not in out.out + out.err
    return lines[0], run_dir


def test_an_unreachable_store_is_refused_before_any_rank_starts(
    s3: Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_free_port()}")  # nobody there
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    line, _ = _refused_before_any_rank(tmp_path, s3.url("runs/toy"), capsys)
    assert "cannot be used" in line and "no rank was started" in line


def test_a_missing_bucket_is_refused_before_any_rank_starts(
    s3: Bucket, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"s3://{s3.name}-missing/runs/toy"
    line, _ = _refused_before_any_rank(tmp_path, url, capsys)
    assert "the bucket does not exist" in line


def test_without_s3fs_the_error_says_what_to_install() -> None:
    from test_architecture import run_blocked

    code = """
        from spikeguard.supervisor.runner import checkpoint_store_problem
        print(checkpoint_store_problem("s3://bucket/runs/x", {}))
    """
    res = run_blocked({"s3fs"}, code)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "s3://bucket/runs/x" in res.stdout and "pip install 'spikeguard[s3]'" in res.stdout


# -- the commands given a RUN_DIR ----------------------------------------------------------------
def test_the_commands_find_the_checkpoints_where_the_run_recorded_them(
    s3: Bucket, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch
    from spikeguard.supervisor import operate
    from spikeguard.supervisor.cli import main
    from spikeguard.supervisor.decide import recovery as rc
    from spikeguard.workers import checkpoint as ckpt

    job = with_checkpoints_resolved(_job(tmp_path, s3.url("runs/{name}")))
    place = s3.url("runs/toy")
    written = [
        ckpt.write_checkpoint(
            place, {"w": torch.ones(3) * s}, step=s, generation=1, meta={"grade": 6}
        )
        for s in (20, 40)
    ]
    run = Path(job.run_dir)
    run.mkdir()
    record_job(job, run)
    assert main(["checkpoints", str(run), "--json"]) == 0
    listed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["path"] for r in listed] == [w.path for w in written]
    assert all(r["path"].startswith(place + "/") for r in listed)
    assert all(r["status"] == "verified" for r in listed), listed
    usable = operate.resumable(run, rc.State())  # what `resume` and `status` choose from
    assert [i.path for i in usable] == [w.path for w in written]
    assert not (run / "checkpoints").exists()
