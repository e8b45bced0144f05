"""spikeguard the way a Ray cluster user runs it: a real Ray head (``ray start --head`` on loopback,
its own ports, temp dir and token, stopped afterwards) and supervised runs submitted through the
Ray Jobs API with a working dir, the README's "Run on a cluster" commands.

The job's status maps to spikeguard's exit code (README table): a completed run SUCCEEDED with
driver exit 0; a crash no rule recovers FAILED with 1; an escalated run FAILED with 3; ``ray job
stop`` preempts (SIGTERM: an emergency checkpoint, exit 143, status STOPPED) and the same job
submitted again resumes from it. ``ray job logs`` shows the ranks' output, prefixed by generation
and rank.

The Jobs API calls run in a client process of their own (tests/scripts/ray_jobs_client.py): the
head's token must not leak into this process's own local Ray.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import IO

import pytest
from conftest import SCRIPTS, events, kinds

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
CLIENT = SCRIPTS / "ray_jobs_client.py"

JOB = """\
name: {name}
entrypoint: {script}
args: {args}
workers: 2
policy: policy.yaml
run_dir: {run_dir}
timeouts: {{heartbeat_s: 30, first_heartbeat_s: 120, preempt_grace_s: 30, reap_interval_s: 2,
  restart_backoff_s: 0.2}}
"""

POLICY = """\
version: 1
name: ray-jobs-test
warm_in: 0 steps
rules:
  - name: loss-spike
    when: {signal: loss, above_median: 1.5, window: 10 steps}
    for: 2 steps
    action: recover
recovery: {min_grade: S4, lr_factors: [0.5], probation_steps: 20, max_attempts: 1}
"""


def free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Head:
    """A Ray head of its own (``ray start --head --block`` in a session of its own), with
    ``num_cpus`` CPUs; :meth:`add_node` joins worker nodes to it, each with its own temp dir."""

    def __init__(self, root: Path, num_cpus: int = 4) -> None:
        self.root = root
        self.nodes: list[tuple[subprocess.Popen[bytes], str, IO[bytes]]] = []
        token = root / "token"
        token.write_text(uuid.uuid4().hex)
        token.chmod(0o600)
        self.env = {
            **os.environ,
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(token),
            "RAY_JOB_STOP_WAIT_TIME_S": "45",  # the supervisor's grace to save (README)
        }
        self.env.pop("RAY_ADDRESS", None)
        gcs, dash, client, agent, agent_grpc, rt_env, metrics = free_ports(7)
        self.temp = tempfile.mkdtemp(prefix="sgray-", dir="/tmp")  # unix socket paths stay short
        self.address = f"http://127.0.0.1:{dash}"
        self.gcs = f"127.0.0.1:{gcs}"
        argv = [
            str(BIN / "ray"),
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={gcs}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dash}",
            f"--ray-client-server-port={client}",
            f"--dashboard-agent-listen-port={agent}",
            f"--dashboard-agent-grpc-port={agent_grpc}",
            f"--runtime-env-agent-port={rt_env}",
            f"--metrics-export-port={metrics}",
            f"--temp-dir={self.temp}",
            f"--num-cpus={num_cpus}",
            "--object-store-memory=80000000",
            "--include-dashboard=true",
            "--disable-usage-stats",
        ]
        self.log = open(root / "head.log", "wb")
        self.proc = subprocess.Popen(
            argv, env=self.env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        end = time.monotonic() + 120
        while not self._up():
            assert self.proc.poll() is None, (root / "head.log").read_text()[-3000:]
            assert time.monotonic() < end, "the Ray head's Jobs API never came up"
            time.sleep(0.5)

    def _up(self) -> bool:
        try:
            urllib.request.urlopen(f"{self.address}/api/version", timeout=2)
        except urllib.error.HTTPError:
            return True  # answering (auth or not): up
        except OSError:
            return False
        return True

    def add_node(self, num_cpus: int = 1) -> str:
        """Join a worker node (``ray start --address --block``) with a temp dir of its own;
        returns that temp dir. The node registers in the background (a job's placement waits)."""
        agent, agent_grpc, rt_env, metrics = free_ports(4)
        temp = tempfile.mkdtemp(prefix="sgnode-", dir="/tmp")
        argv = [
            str(BIN / "ray"),
            "start",
            f"--address={self.gcs}",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--dashboard-agent-listen-port={agent}",
            f"--dashboard-agent-grpc-port={agent_grpc}",
            f"--runtime-env-agent-port={rt_env}",
            f"--metrics-export-port={metrics}",
            f"--temp-dir={temp}",
            f"--num-cpus={num_cpus}",
            "--object-store-memory=80000000",
            "--disable-usage-stats",
        ]
        log = open(self.root / f"node-{len(self.nodes) + 1}.log", "wb")
        proc = subprocess.Popen(
            argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.nodes.append((proc, temp, log))
        return temp

    def node_log_tail(self, chars: int = 2000) -> str:
        """The end of each worker node's ``ray start`` output (why a node never registered)."""
        tails = []
        for i, (proc, _, log) in enumerate(self.nodes, 1):
            log.flush()
            text = (self.root / f"node-{i}.log").read_text(errors="replace")
            tails.append(f"node {i} (exit {proc.poll()}): {text[-chars:]}")
        return "\n".join(tails)

    def client(self, *args: str, timeout: float = 60) -> dict:
        out = subprocess.run(
            [sys.executable, str(CLIENT), self.address, *args],
            env=self.env,
            capture_output=True,
            timeout=timeout,
        )
        assert out.returncode == 0, out.stderr.decode()[-3000:]
        return json.loads(out.stdout.decode().strip().splitlines()[-1])

    def submit(self, job_id: str, wd: Path, entrypoint: str) -> None:
        """Submit through the Jobs API; a head whose job agent is not up yet ("No available
        agent to submit job", on a loaded machine seconds after the API answers) is asked
        again until it is."""
        end = time.monotonic() + 120
        while True:
            out = subprocess.run(
                [sys.executable, str(CLIENT), self.address, "submit", job_id, str(wd), entrypoint],
                env=self.env,
                capture_output=True,
                timeout=60,
            )
            err = out.stderr.decode()
            if out.returncode == 0:
                return
            assert "No available agent" in err and time.monotonic() < end, err[-3000:]
            time.sleep(1.0)

    def close(self) -> None:
        for proc, temp, log in self.nodes:  # the worker nodes first, as `ray stop` would
            _stop(proc)
            log.close()
            shutil.rmtree(temp, ignore_errors=True)
        _stop(self.proc)
        self.log.close()
        shutil.rmtree(self.temp, ignore_errors=True)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop one ``ray start --block`` we started, by its own process group: it stops its node's
    processes when signalled; what is still there after a few seconds is killed. (Never ``ray
    stop``: it stops every Ray on the machine, other runs' too.)"""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(8)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    import ray

    if ray.is_initialized():
        ray.shutdown()  # the session's local Ray; conftest.ray_local restarts it on demand
    h = Head(tmp_path_factory.mktemp("ray-head"))
    yield h
    h.close()


def job_dir(tmp_path: Path, name: str, args: list[str], env: dict[str, str] | None = None) -> Path:
    """A working dir as a user would ship it: the job file and its policy."""
    d = tmp_path / f"wd-{name}"
    d.mkdir()
    text = JOB.format(
        name=name,
        script=SCRIPTS / "toy_rank.py",
        args=json.dumps(args),
        run_dir=tmp_path / f"run-{name}",
    )
    if env:
        text += f"env: {json.dumps(env)}\n"
    (d / "job.yaml").write_text(text)
    (d / "policy.yaml").write_text(POLICY)
    return d


ENTRYPOINT = "spikeguard submit job.yaml --address auto"


def submit(head: Head, job_id: str, wd: Path, entrypoint: str = ENTRYPOINT) -> None:
    head.submit(job_id, wd, entrypoint)


def test_a_completed_run_succeeds_with_exit_0_and_its_ranks_output_in_the_job_logs(head, tmp_path):
    wd = job_dir(tmp_path, "ok", ["--steps", "40", "--print-every", "10"])
    submit(head, "sg-ok", wd)
    info = head.client("wait", "sg-ok", "240", timeout=300)
    assert (info["status"], info["driver_exit_code"]) == ("SUCCEEDED", 0), info["logs"][-3000:]
    assert kinds(tmp_path / "run-ok")[-1] == "completed"
    logs = info["logs"]
    for rank in (0, 1):  # `ray job logs`: the ranks' lines, prefixed, beside the supervisor's
        for step in (0, 10, 20, 30):
            assert f"[gen 1 rank {rank}] step {step} loss " in logs, logs[-3000:]
    assert "completed" in logs


def test_a_crash_no_rule_recovers_fails_the_job_with_exit_1(head, tmp_path):
    wd = job_dir(tmp_path, "crash", ["--steps", "40"], env={"SG_FAULT": "1:5:exit"})
    submit(head, "sg-crash", wd)
    info = head.client("wait", "sg-crash", "240", timeout=300)
    assert (info["status"], info["driver_exit_code"]) == ("FAILED", 1), info["logs"][-3000:]
    assert kinds(tmp_path / "run-crash")[-1] == "failed"


def test_an_escalated_run_fails_the_job_with_exit_3(head, tmp_path):
    # the spike comes back in every generation: one attempt, then escalation
    wd = job_dir(tmp_path, "esc", ["--steps", "50"], env={"SG_FAULT": "0:25:collapse:*"})
    submit(head, "sg-esc", wd)
    info = head.client("wait", "sg-esc", "300", timeout=360)
    assert (info["status"], info["driver_exit_code"]) == ("FAILED", 3), info["logs"][-3000:]
    assert kinds(tmp_path / "run-esc")[-1] == "escalated"


def test_ray_job_stop_preempts_with_a_checkpoint_and_the_same_job_submitted_again_resumes(
    head, tmp_path
):
    # the ranks wait before step 70 (past the regular checkpoint at 50) until the test lets them
    # go, after the stop: the preemption finds them training however fast the machine is, and
    # they answer it at their next step boundary (the run has 170 steps left to do so)
    go = tmp_path / "go"
    args = ["--steps", "240", "--step-sleep", "0.05", "--ckpt-every", "50"]
    wd = job_dir(tmp_path, "pre", [*args, "--hold-at", "70", "--hold-file", str(go)])
    run_dir = tmp_path / "run-pre"
    submit(head, "sg-pre-1", wd)
    wait_until(lambda: _heartbeat_steps(run_dir) >= {(0, 69), (1, 69)}, 240, "the hold at 70")
    head.client("stop", "sg-pre-1")
    wait_until(lambda: _asked(run_dir), 120, "the emergency checkpoint request")
    go.touch()
    info = head.client("wait", "sg-pre-1", "120", timeout=180)
    assert info["status"] == "STOPPED", info
    evs = events(run_dir)
    pre = evs[-1]
    assert pre["kind"] == "preempted" and pre["exit_code"] == 143, pre
    assert pre["code"] == "preempted_after_checkpoint", pre
    saved = pre["checkpoint_step"]
    assert saved >= 70 and saved % 50 != 0  # the emergency checkpoint, past the regular one
    assert (pre["resume_checkpoint"], pre["resume_step"]) == (pre["checkpoint_path"], saved)

    submit(head, "sg-pre-2", wd)  # a RayJob retry or a user resubmitting: same job, same run dir
    info = head.client("wait", "sg-pre-2", "240", timeout=300)
    assert (info["status"], info["driver_exit_code"]) == ("SUCCEEDED", 0), info["logs"][-3000:]
    evs = events(run_dir)
    resumed = [e for e in evs if e["kind"] == "launch"][-1]
    assert resumed["plan"]["checkpoint_step"] == saved, resumed
    assert evs[-1]["kind"] == "completed"


def wait_until(predicate, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.2)


def _heartbeat_steps(run_dir: Path) -> set[tuple[int, int]]:
    """(rank, step) of every step a rank reported (a sampled step is a ``report``)."""
    from conftest import reports

    return {
        (m["rank"], m["step"]) for m in reports(run_dir) if m["type"] in ("heartbeat", "report")
    }


def _asked(run_dir: Path) -> bool:
    path = run_dir / "journal.jsonl"
    return path.exists() and any(e.get("code") == "preemption" for e in events(run_dir))
