"""Shared fixtures: a real local Ray, fault injection, run helpers."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
sys.path.insert(0, str(Path(__file__).resolve().parent))  # so tests can import fakeslack


RAY_INIT = dict(
    # always a fresh instance of this test process's own: never a cluster another test (a
    # second xdist worker's Ray head, ray.cluster_utils.Cluster) registered on the machine
    address="local",
    num_cpus=4,
    object_store_memory=80 * 1024 * 1024,
    include_dashboard=False,
    log_to_driver=False,
    namespace="spikeguard-tests",
)


OWN_RAY_LAST = (
    "test_bench_recovery.py",
    "test_cluster_gpus.py",
    "test_faults_nodes.py",
    "test_node_workdir.py",
    "test_ray_jobs.py",
    "test_straggler_supervised.py",
)
"""Modules that shut the shared Ray down to run their own (a multi-node ``Cluster``, a ``ray start``
head, the bench's embedded Ray). They run last, so the session's Ray starts once instead of once
after each of them (~7 s a start on 2 cores)."""


TRAINING_MODULES = frozenset(
    {
        "test_bench_sharded.py",
        "test_bench_smoke.py",
        "test_checkpoint_sharded.py",
        "test_dcp_s3.py",
        "test_demo.py",
        "test_example.py",
        "test_example_fsdp.py",
        "test_hf_eval_pause.py",
        "test_hf_loss_truth.py",
        "test_hf_remote.py",
        "test_hf_trainer.py",
        "test_lightning.py",
        "test_lightning_remote.py",
        "test_observe_ray.py",
        "test_ray_init.py",
        "test_s3_supervised.py",
        "test_standby.py",
        "test_step_time.py",
        "test_supervisor_ray.py",
    }
)
"""Modules that train real models (the examples to a natural divergence, the integrations, sharded
checkpoints): CPU-bound. ``make test`` runs them one after the other on one xdist worker."""
FAULT_MODULES = frozenset(
    {
        "test_bench_recovery.py",
        "test_cluster_gpus.py",
        "test_faults_hostile.py",
        "test_faults_nodes.py",
        "test_faults_preemption.py",
        "test_faults_ranks.py",
        "test_faults_recovery.py",
        "test_faults_supervisor.py",
        "test_node_exclusion.py",
        "test_node_workdir.py",
        "test_operator_resume.py",
        "test_pagers_supervised.py",
        "test_preempt_semantics.py",
        "test_rank_env_ray.py",
        "test_ray_jobs.py",
        "test_sigterm_group.py",
        "test_slack_buttons.py",
        "test_slack_supervised.py",
        "test_standby_process.py",
        "test_straggler_supervised.py",
    }
)
"""Fault injection on real Ray: mostly waiting (for heartbeat timeouts, backoffs, grace periods),
one after the other on the other worker, so one group's waits are the other's CPU. The unit tests
fill in on whichever worker is free. Every ``slow`` test's module is in one of the two sets."""


def xdist_group(nodeid: str) -> str | None:
    """The xdist group of a test (None: any worker), from its module."""
    module = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    if module in TRAINING_MODULES:
        return "training"
    return "faults" if module in FAULT_MODULES else None


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` with the groups above (xdist's own reads ``xdist_group`` marks through
    ``item._nodeid``, which pytest 9.2 no longer uses)."""
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByModuleGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(nodeid) or nodeid

    return ByModuleGroup(config, log)


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.path.name in OWN_RAY_LAST)  # stable: order kept otherwise
    for item in items:
        if item.get_closest_marker("slow") and xdist_group(item.nodeid) is None:
            raise pytest.UsageError(
                f"{item.nodeid} is marked slow: add its module to TRAINING_MODULES or "
                "FAULT_MODULES in tests/conftest.py (the xdist groups of `make test`)"
            )


@pytest.fixture(scope="session")
def _ray_session():
    import ray

    yield ray
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture
def ray_local(_ray_session):
    """A real embedded Ray shared by the session (small object store, logical CPUs for 2-4 ranks).

    (Re)started on demand: the multi-node tests shut it down to run their own cluster.
    """
    ray = _ray_session
    if not ray.is_initialized():
        ray.init(**RAY_INIT)
    return ray


@contextlib.contextmanager
def ray_cluster(nodes: int, num_cpus: int) -> Iterator[Any]:
    """A real multi-node Ray on this machine (``ray.cluster_utils.Cluster``): a head without
    CPUs (nothing is placed on it) and ``nodes`` worker nodes of ``num_cpus`` logical CPUs each,
    this process connected to it; the session's local Ray is shut down first
    (:func:`ray_local` restarts it on demand)."""
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    mb80 = 80 * 1024 * 1024
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "object_store_memory": mb80})
    for _ in range(nodes):
        c.add_node(num_cpus=num_cpus, object_store_memory=mb80)
    ray.init(address=c.address, include_dashboard=False, log_to_driver=False)
    c.wait_for_nodes()
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


class Faults:
    """``fail_at(rank, step, mode, gen=1)``: inject a fault into ``tests/scripts/toy_rank.py``.

    Modes: exit, sigkill, hang, collapse, nan, stall_start, ignore_term, zombie, garbage,
    finish, slow (see the script's docstring). The fault fires only in that launch
    generation (``gen="*"``: in all), so a recovered run goes on; ``step`` may be
    ``"+N"``: N steps after the generation's first step. The
    faults travel to the ranks in the job's ``env`` (Ray workers do not see
    variables the test process sets after Ray started).
    """

    def __init__(self) -> None:
        self.specs: list[str] = []

    def __call__(self, rank: int, step: int | str, mode: str, gen: int | str = 1) -> None:
        self.specs.append(f"{rank}:{step}:{mode}:{gen}")

    @property
    def env(self) -> dict[str, str]:
        return {"SG_FAULT": ",".join(self.specs)} if self.specs else {}


@pytest.fixture
def restore_environ():
    """``os.environ`` put back whole after the test: an in-process Trainer (Lightning, HF) sets
    ``RANK``, ``WORLD_SIZE`` and the like itself, which ``monkeypatch.delenv`` of a name absent
    before does not undo (a later test then sees a rank's environment)."""
    before = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(before)


@pytest.fixture
def fail_at() -> Faults:
    return Faults()


TEST_TIMEOUTS = {
    "restart_backoff_s": 0.2,
    "restart_backoff_max_s": 2.0,
    "reap_interval_s": 2.0,
    "batch_ids_s": 2.0,
}


def toy_job(
    tmp_path: Path,
    *,
    policy: str | Path,
    steps: int = 120,
    workers: int = 2,
    heartbeat_s: float = 30.0,
    first_heartbeat_s: float = 120.0,
    extra_args: list[str] | None = None,
    faults: Faults | None = None,
    timeouts: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    **fields: Any,
):
    """A JobSpec for tests/scripts/toy_rank.py (short backoff and reap interval unless ``timeouts``
    says)."""
    from spikeguard.supervisor.job import JobSpec

    args = ["--steps", str(steps), *(extra_args or [])]
    t = {
        "heartbeat_s": heartbeat_s,
        "first_heartbeat_s": first_heartbeat_s,
        **TEST_TIMEOUTS,
        **(timeouts or {}),
    }
    fields.setdefault("metrics", {"port": 0})  # any free port: runs never collide on one
    return JobSpec(
        name="toy",
        entrypoint=str(SCRIPTS / "toy_rank.py"),
        args=args,
        workers=workers,
        policy=str(policy),
        run_dir=str(tmp_path / "run"),
        env={**(faults.env if faults else {}), **(env or {})},
        timeouts=t,
        **fields,
    )


def plan_file(tmp: Path, info: Any, generation: int) -> str:
    """A resume plan naming the checkpoint ``info`` (what the supervisor writes at a rollback),
    written to ``tmp/plan-GENERATION.json``; its path."""
    from spikeguard.workers import contract

    path = tmp / f"plan-{generation}.json"
    plan = contract.ResumePlan(
        checkpoint=info.path, checkpoint_step=info.step, sha256=info.sha256, generation=generation
    )
    path.write_text(plan.to_json())
    return str(path)


def free_port() -> int:
    """A TCP port nobody listens on now (for MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int, **extra: str) -> dict[str, str]:
    """This process's environment (no SPIKEGUARD_* variable) plus the torchrun variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPIKEGUARD_")}
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        **extra,
    )
    return env


def run_ranks(
    script: str | Path, argv: list[str], world: int, timeout: float = 120, **extra: str
) -> list[subprocess.CompletedProcess]:
    """Run ``script argv`` as ``world`` real processes of one torch.distributed job (no
    supervisor); return each rank's result (stdout and stderr together), killing leftovers."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), *argv],
            env=rank_env(r, world, port, **extra),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    out = []
    try:
        for p in procs:
            stdout, _ = p.communicate(timeout=timeout)
            out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, None))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    import json

    out = []
    for line in Path(path).read_bytes().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def events(run_dir: Path) -> list[dict[str, Any]]:
    return read_jsonl(Path(run_dir) / "journal.jsonl")


def kinds(run_dir: Path) -> list[str]:
    return [e["kind"] for e in events(run_dir)]


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] != b"Z"
    except OSError:
        return False


class When(threading.Thread):
    """Runs ``action(events)`` once, as soon as ``predicate(events)`` holds for the run's journal.

    Polls every 20 ms in a daemon thread (the supervisor runs in the test's main thread, as
    ``run_job`` installs signal handlers). ``done`` tells whether it fired; ``error`` keeps what
    the action raised.
    """

    def __init__(
        self,
        run_dir: Path,
        predicate: Callable[[list[dict[str, Any]]], Any],
        action: Callable[[list[dict[str, Any]]], None],
        timeout_s: float = 240.0,
    ) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.predicate, self.action, self.timeout_s = (
            Path(run_dir),
            predicate,
            action,
            timeout_s,
        )
        self.done = False
        self.error: BaseException | None = None
        self.start()

    def ok(self, timeout_s: float = 60.0) -> bool:
        """Wait for the action to finish; True if it ran without raising."""
        self.join(timeout_s)
        if self.error is not None:
            raise self.error
        return self.done

    def run(self) -> None:
        end = time.monotonic() + self.timeout_s
        while time.monotonic() < end:
            evs = events(self.run_dir) if (self.run_dir / "journal.jsonl").exists() else []
            try:
                if self.predicate(evs):
                    self.action(evs)
                    self.done = True
                    return
            except BaseException as e:
                self.error = e
                return
            time.sleep(0.02)


def launch_of(evs: list[dict[str, Any]], gen: int) -> dict[str, Any] | None:
    return next((e for e in evs if e["kind"] == "launch" and e.get("generation") == gen), None)


def reports(run_dir: Path) -> list[dict[str, Any]]:
    p = Path(run_dir) / "reports.jsonl"
    return read_jsonl(p) if p.exists() else []


def assert_journal_replays(path: Path) -> int:
    """Prove a journal rebuilds the live state: replaying the observations it records up to each
    transition (what a restarted supervisor does) gives the state digest the live supervisor
    journaled right there. Returns how many transitions were checked."""
    from spikeguard.supervisor.decide import recovery as rc

    evs = read_jsonl(path)
    checked = 0
    for i, ev in enumerate(evs):
        if "obs" not in ev:
            continue
        rebuilt = rc.fold(evs[: i + 1])
        assert rc.state_digest(rebuilt) == ev["state_digest"], (
            f"{path}: replaying up to event {ev.get('seq')} ({ev.get('kind')}) gives {rebuilt}"
        )
        checked += 1
    return checked


@pytest.fixture(autouse=True)
def _journals_replay(request):
    """After every test that had a tmp_path: each journal a supervisor wrote there replays to
    the live state at every transition (a simulated restart at each point)."""
    tmp = request.getfixturevalue("tmp_path") if "tmp_path" in request.fixturenames else None
    yield
    for path in Path(tmp).rglob("journal.jsonl") if tmp else ():
        assert_journal_replays(path)


os.environ.setdefault("OMP_NUM_THREADS", "1")


class SpyEngine:
    """The real policy engine on ``policy_text``, recording every message handed to it (for
    controller tests with a scripted group)."""

    def __init__(self, policy_text: str) -> None:
        from spikeguard.policies import Engine, load_policy_text

        self.engine = Engine(load_policy_text(policy_text))
        self.seen: list[dict[str, Any]] = []

    def observe(self, msg: dict[str, Any]) -> Any:
        self.seen.append(msg)
        return self.engine.observe(msg)

    def retire(self, generation: int) -> None:
        self.engine.retire(generation)

    def quiet(self, msgs: list[dict[str, Any]]) -> bool:
        return self.engine.quiet(msgs)

    def pending_ranks(self) -> set[int]:
        return self.engine.pending_ranks()


def scripted_controller(run_dir: Path, group: Any, engine: Any, **kw: Any) -> Any:
    """A supervisor ``Controller`` over a scripted group (no Ray), its first generation
    launched; ``kw`` overrides the defaults (2 ranks, 60 s timeouts, no reaping)."""
    from spikeguard.supervisor.controller import Controller
    from spikeguard.supervisor.decide import recovery as rc

    args: dict[str, Any] = dict(
        run_dir=str(run_dir),
        run_id="t",
        group=group,
        engine=engine,
        cmd=["true"],
        env={},
        world_size=2,
        hang_timeout_s=60.0,
        first_heartbeat_timeout_s=60.0,
        reap_interval_s=1e9,
    )
    ctl = Controller(**{**args, **kw})
    ctl._apply(rc.Start())
    return ctl
