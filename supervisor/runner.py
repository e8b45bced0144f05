"""Wires a job: Ray (embedded or existing), the worker group, the policy engine,
the sinks (from their registry) and the controller. The thin layer under ``spikeguard submit``."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

from spikeguard.workers import contract
from spikeguard.workers.checkpoint import location
from spikeguard.workers.checkpoint.retention import RetentionSettings
from spikeguard.workers.checkpoint.storage import UnknownScheme, storage_for
from spikeguard.workers.contract.exitcodes import ExitCode
from spikeguard.workers.contract.logs import logger
from spikeguard.workers.contract.secret_scan import redact

from . import rundir
from .controller import Controller
from .decide import recovery as rc
from .decide.events import Kind
from .intake import operator
from .job import JobSpec, load_job_policy
from .journal import JOURNAL_NAME, read_journal
from .launch.group import GroupSpec, WorkerGroup, python_cmd
from .launch.ray_init import init_ray
from .observe.status import finished, fold_journal
from .redaction import held_secrets
from .settings import RunPaths
from .sinks import SinkSet, build_sinks, destinations
from .sinks.console import LiveView
from .sinks.metrics import start_metrics
from .sinks.rank_output import RankOutput
from .sinks.registry import Record, Sink

log = logger(__name__)

__all__ = [
    "attach_sinks",
    "checkpoint_store_problem",
    "finished_outcome",
    "launch_environment",
    "make_notifiers",
    "release_sinks",
    "replayable",
    "retention_settings",
    "run_job",
    "start_metrics",
    "ticks",
    "with_checkpoints_resolved",
]


SINK_CLOSE_S = 10.0
"""How long each sink may take to finish at the end (Slack sends its queue)."""


def make_notifiers(job: JobSpec, policy: Any, run_id: str, journal_fn: Record) -> list[Sink]:
    """The sinks policies route to, built from the registry: the console, and Slack when a
    channel or a webhook is configured (the job file's notify.slack first, then the policy's,
    then the environment; secrets only from the latter)."""
    return build_sinks(
        job,
        policy,
        run_id=run_id,
        run_dir=job.resolved_run_dir(),
        record=journal_fn,
        names=destinations(),
    ).sinks


def attach_sinks(
    ctl: Controller, job: JobSpec, policy: Any, events: list[dict[str, Any]], *, live: bool
) -> SinkSet:
    """Every sink the registry builds for this run, continued from ``events`` (the journal a
    dead supervisor left, if any), handed each event ``ctl`` journals and ticked with it (after
    the live view, when ``live``)."""
    sinks = build_sinks(
        job,
        policy,
        run_id=job.name,
        run_dir=Path(ctl.run_dir),
        record=ctl.journal.record,
        clock=ctl.journal.mono,  # heartbeat ages on the supervisor's clock
    )
    if events:  # e.g. Slack threads of open incidents continue where the dead supervisor left them
        sinks.restore(events)
    ctl.sinks = list(sinks.sinks)
    ctl.on_tick = ticks(LiveView() if live else None, sinks.tick)
    return sinks


def release_sinks(sinks: SinkSet, ctl: Controller, *, interrupted: bool) -> None:
    """Show the sinks the run's final state (one last tick), then close them. ``ended`` (the
    metrics then wait for Prometheus to scrape that state) when the run reached its end, not
    after Ctrl-C nor a preemption."""
    sinks.tick(ctl)
    ended = not interrupted and ctl.state.phase in rc.TERMINAL
    sinks.close(SINK_CLOSE_S, ended=ended)


def ticks(*hooks: Callable[[Any], None] | None) -> Callable[[Any], None]:
    """One controller tick hook calling each of ``hooks`` (None ones skipped) in turn."""
    live = [h for h in hooks if h is not None]

    def tick(ctl: Any) -> None:
        for hook in live:
            hook(ctl)

    return tick


def retention_settings(job: JobSpec, policy: Any) -> RetentionSettings | None:
    """The job's ``checkpoints`` settings, completed from the policy: healthy means graded at
    least the policy's ``recovery.min_grade`` (unless the job says), and ``keep_healthy`` looks
    back as far as the largest ``min_steps_back`` of its recover rules. None when disabled."""
    spec = job.checkpoints
    if not spec.enabled:
        return None
    steps_back = [policy.recovery.min_steps_back]
    for rule in policy.rules:
        if rule.action == "recover":
            steps_back.append(policy.recovery_for(rule).min_steps_back)
    min_grade = spec.min_grade if spec.min_grade is not None else policy.recovery.min_grade
    return RetentionSettings(
        keep_last=spec.keep_last,
        keep_every=spec.keep_every,
        keep_healthy=spec.keep_healthy,
        min_grade=min_grade,
        min_steps_back=max(steps_back),
    )


def with_checkpoints_resolved(job: JobSpec) -> JobSpec:
    """``job`` with its ``checkpoints.dir`` resolved (:meth:`JobSpec.resolved_checkpoints_dir`):
    what the supervisor uses and ``RUN_DIR/job.json`` records, so that every command given the
    RUN_DIR later finds the checkpoints (:meth:`RunPaths.recorded`) without the job file or
    the directory it was submitted from."""
    place = job.resolved_checkpoints_dir()
    if place is None or place == job.checkpoints.dir:
        return job
    return job.model_copy(update={"checkpoints": job.checkpoints.model_copy(update={"dir": place})})


def checkpoint_store_problem(place: str, environ: Mapping[str, str]) -> str | None:
    """Why the run cannot use its checkpoint location ``place``, in one line naming it (never a
    credential: the values ``environ`` holds in confidence are blanked), or None when it can. It
    is listed through its storage: nothing there yet (``FileNotFoundError``) is fine; a store
    that cannot be reached, a missing bucket, refused credentials or a backend that is not
    installed (:class:`UnknownScheme`) is a problem."""
    try:
        storage_for(place).listdir(place)
    except FileNotFoundError:
        return None
    except UnknownScheme as e:
        why = str(e)
    except OSError as e:
        why = str(e.strerror or e)
    else:
        return None
    text = f"the checkpoint location {place} cannot be used ({why}); no rank was started"
    return redact(text, held_secrets(environ))


def launch_environment(job: JobSpec, ckpt_dir: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables every launch sends the ranks (the agents add them to the environment they
    filter, :func:`~.launch.environment.rank_environment`): the checkpoint store's standard
    variables that ``environ`` (the supervisor's) sets (:func:`.location.store_environment`:
    ``AWS_*`` for ``s3://``, credentials included, since on a remote cluster the ranks' nodes
    do not have the supervisor's environment), the job's ``env`` (which wins) and the
    ``SPIKEGUARD_*`` settings. Never journaled nor printed: it lives in memory, and in the
    ranks' environment."""
    env = location.store_environment(ckpt_dir, environ)
    env.update({k: str(v) for k, v in job.env.items()})
    env[contract.ENV_BACKEND] = job.resolved_backend()
    if job.checkpoint_every:
        env[contract.ENV_CKPT_EVERY] = str(job.checkpoint_every)
    if job.sample_every:
        env[contract.ENV_SAMPLE_EVERY] = str(job.sample_every)
    return env


def finished_outcome(events: list[dict[str, Any]]) -> rc.State | None:
    """The folded state if the journal ends the run (completed, failed, escalated, stopped)."""
    st = rc.fold(events)
    return st if st.phase in rc.TERMINAL else None


def replayable(events: list[dict[str, Any]]) -> bool:
    """False for the journal of an older spikeguard: launches recorded without the observations
    a restarted supervisor replays (it can be read, not continued)."""
    launched = any(e.get("kind") == Kind.LAUNCH for e in events)
    return not launched or any("obs" in e for e in events)


def _journal_to_continue(job: JobSpec, run_dir: Path) -> tuple[list[dict[str, Any]], int | None]:
    """The journal of ``run_dir`` to continue (empty for a new run) and None; or, when there is
    nothing to continue, why said and the exit code: a finished run (its own exit code), a
    journal an older spikeguard wrote or one with a line the recovery machine cannot replay
    (bad input). What is odd about other lines is said (a warning each) and does not stop it."""
    read = read_journal(run_dir)
    for problem in read.problems:
        log.warning(f"{run_dir / JOURNAL_NAME} {problem}")
    events = read.events
    if not replayable(events):
        log.warning(
            f"{run_dir} holds the journal of an older spikeguard, which a restart "
            "cannot replay; it can be read (spikeguard events) but not continued. Use another "
            "--run-dir or --name for a new run."
        )
        return events, ExitCode.BAD_INPUT
    _, broken = fold_journal(events, read.lines)
    if broken is not None:
        log.warning(
            f"{run_dir / JOURNAL_NAME} {broken}: the run cannot be continued from it (it can be "
            "read: spikeguard events). Use another --run-dir or --name for a new run."
        )
        return events, ExitCode.BAD_INPUT
    done = finished_outcome(events) if events else None
    if done is not None and done.phase is rc.Phase.ESCALATED and resume_waits(run_dir):
        log.info(f"run {job.name} in {run_dir} escalated; a human asked to resume it")
        return events, None
    if done is not None:
        log.info(
            f"run {job.name} in {run_dir} already finished: {finished(events)}. "
            "Nothing to do; its journal is final. Use another --run-dir or --name for a new run."
        )
        return events, done.exit_code if done.exit_code is not None else ExitCode.FAILED
    return events, None


def resume_waits(run_dir: Path) -> bool:
    """A human's ``resume`` waits in the run directory's inbox (``spikeguard resume``)."""
    return "resume" in operator.pending_actions(run_dir)


def record_job(job: JobSpec, run_dir: Path) -> None:
    """``RUN_DIR/job.json``: the job as this supervisor runs it (its ``checkpoints.dir``
    resolved), so ``spikeguard resume`` can supervise the run again without its job file and
    every command given the RUN_DIR finds its checkpoints (best effort: the journal is the
    record)."""
    try:
        rundir.write_atomic(run_dir / rundir.JOB_RECORD, job.model_dump_json(indent=1))
    except OSError as e:
        where = run_dir / rundir.JOB_RECORD
        log.warning(f"cannot record the job in {where} ({e}); the run goes on")


def run_job(job: JobSpec, *, live: bool = True) -> int:
    """Run ``job`` to its end; returns the process exit code (see the README's table).

    On a run directory whose journal is unfinished (a supervisor died), resume it: the state is
    folded from the journal, survivors are fenced and reaped, the Slack threads restored. On a
    finished one, say so and return its recorded exit code without starting anything.
    """
    import ray
    from spikeguard.policies import Engine

    policy = load_job_policy(job)
    job = with_checkpoints_resolved(job)
    run_dir = job.resolved_run_dir()
    paths = RunPaths(run_dir, job.checkpoints.dir)
    lock: IO[str] | None = None
    locked: Exception | None = None
    try:  # the lock first: the journal read next is the one this supervisor continues
        rundir.refuse_links(run_dir)
        lock = rundir.acquire_lock(run_dir)
    except (rundir.LockHeld, rundir.UnsafePath) as e:
        log.warning("%s", e)
        return ExitCode.BAD_INPUT
    except OSError as e:  # a read-only or foreign directory: a finished run can still say so
        locked = e
    events, code = _journal_to_continue(job, run_dir)
    if code is None and lock is None:
        log.warning(f"cannot use {run_dir} as the run directory: {locked}")
        code = ExitCode.BAD_INPUT
    if code is None and lock is not None:
        try:  # private: 0700, the files 0600 (the controller appends to journal and reports)
            rundir.prepare(run_dir)
        except (rundir.UnsafePath, OSError) as e:
            log.warning("%s", e)
            code = ExitCode.BAD_INPUT
    if code is None:  # a store that cannot be reached: said now, before any rank starts
        problem = checkpoint_store_problem(paths.ckpt_dir, os.environ)
        if problem is not None:
            log.error("%s", problem)
            code = ExitCode.BAD_INPUT
    if code is not None:
        if lock is not None:
            lock.close()
        return code
    assert lock is not None
    record_job(job, run_dir)
    t = job.timeouts
    started = init_ray(job)
    group = WorkerGroup(
        GroupSpec(
            world_size=job.workers,
            cpus_per_worker=job.cpus_per_worker,
            gpus_per_worker=job.gpus_per_worker,
            agent_timeout_s=t.agent_timeout_s,
            pass_env=tuple(job.pass_env),
            strategy=job.placement.strategy,
            placement_timeout_s=job.placement.timeout_s,
        ),
        run_id=job.name,
        run_dir=str(run_dir),
    )
    env = launch_environment(job, paths.ckpt_dir, os.environ)
    ctl: Controller | None = None
    sinks: SinkSet | None = None
    interrupted = False
    old_term = signal.getsignal(signal.SIGTERM)
    try:  # the first launch places the gang (a placement failure is a launch failure, retried)
        ctl = Controller(
            run_dir=str(run_dir),
            run_id=job.name,
            group=group,
            engine=Engine(policy),
            cmd=python_cmd(job.entrypoint, list(job.args)),
            env=env,
            world_size=job.workers,
            hang_timeout_s=t.heartbeat_s,
            first_heartbeat_timeout_s=t.first_heartbeat_s,
            kill_grace_s=t.kill_grace_s,
            backoff_base_s=t.restart_backoff_s,
            backoff_max_s=t.restart_backoff_max_s,
            launch_retries=t.launch_retries,
            reap_interval_s=t.reap_interval_s,
            default_settings=rc.Settings.from_policy(policy.recovery),
            preempt_grace_s=t.preempt_grace_s,
            on_output=(
                RankOutput(max_bytes_per_s=job.logs.max_bytes_per_s) if job.logs.to_driver else None
            ),
            standby=job.standby,
            batch_ids_wait_s=t.batch_ids_s,
            retention_settings=retention_settings(job, policy),
            checkpoints=job.checkpoints.dir,
        )
        sinks = attach_sinks(ctl, job, policy, events, live=live)
        # SIGTERM is a preemption (pod eviction, spot reclaim, `ray job stop`): an emergency
        # checkpoint, then exit 143; the next `spikeguard submit` resumes
        preempt = ctl.preempt
        signal.signal(signal.SIGTERM, lambda *_: preempt("SIGTERM: the supervisor must go"))
        what = "resuming" if events else "running"
        log.info(f"{what} run {job.name} in {run_dir} ({job.workers} ranks, policy {job.policy})")
        return ctl.run(resume_events=events or None)
    except KeyboardInterrupt:
        interrupted = True
        if ctl is not None:
            rundir.write_atomic(ctl.stop_file, "interrupted (Ctrl-C)")
            ctl.step()
        return ExitCode.INTERRUPTED
    finally:
        signal.signal(signal.SIGTERM, old_term)
        if ctl is not None:
            if sinks is not None:
                release_sinks(sinks, ctl, interrupted=interrupted)
            ctl.close()
        group.shutdown()
        if started:
            ray.shutdown()
        lock.close()
