"""Wires a job: Ray (embedded or existing), the worker group, the policy engine,
the notifiers and the controller. The thin layer under ``spikeguard submit``."""

from __future__ import annotations

import math
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spikeguard.workers import contract
from spikeguard.workers.checkpoint.retention import RetentionSettings
from spikeguard.workers.contract.exitcodes import ExitCode

from . import rundir
from .controller import Controller
from .decide import recovery as rc
from .decide.events import Kind
from .job import JobSpec
from .journal import read_events
from .launch.group import GroupSpec, WorkerGroup, python_cmd
from .launch.ray_init import init_ray
from .observe.status import finished
from .sinks.console import ConsoleNotifier, LiveView
from .sinks.rank_output import RankOutput


def routed(notify: Any, destination: str) -> tuple[str, ...]:
    """The severities a policy's ``notify.routes`` send to ``destination``."""
    return tuple(s for s in ("info", "warn", "page") if destination in notify.destinations(s))


def make_notifiers(job: JobSpec, policy: Any, run_id: str, journal_fn: Any) -> list[Any]:
    """The console, and Slack when a channel or a webhook is configured (the job file's
    notify.slack first, then the policy's, then the environment; secrets only from the latter)."""
    from .sinks.slack import SlackNotifier, SlackSettings

    notify = policy.notify
    notifiers: list[Any] = [ConsoleNotifier(severities=routed(notify, "console"))]
    job_slack, pol_slack = job.notify.slack, notify.slack
    repeat = notify.repeat_interval
    settings = SlackSettings.from_env(
        channel=(job_slack.channel if job_slack else None) or pol_slack.channel,
        mention=(job_slack.mention if job_slack else None) or pol_slack.mention,
        runbook_url=pol_slack.runbook_url,
        dashboard_url=pol_slack.dashboard_url,
        severities=routed(notify, "slack"),
        repeat_interval_s=math.inf if repeat is None else repeat.value,
    )
    if not settings.channel and not settings.webhook_url:
        return notifiers  # Slack is not wanted
    if settings.problems():
        print(
            "spikeguard: Slack is configured but not usable ("
            + "; ".join(settings.problems())
            + "); notifying on the console only"
        )
        return notifiers
    notifiers.append(SlackNotifier(settings, run=run_id, journal=journal_fn))
    return notifiers


def start_metrics(job: JobSpec, run_dir: Path) -> Any:
    """The job's Prometheus exporter, serving; None (said in one line) when the job turns it off,
    ``prometheus_client`` is not installed or the address cannot be bound: metrics never stop a
    run. (A restarted run's journal is folded in with the other notifiers' ``restore``, so the
    counters count the whole run.)"""
    m = job.metrics
    if not m.enabled:
        return None
    from .observe.exporter import MetricsExporter, missing

    why = missing()
    if why is not None:
        print(f"spikeguard: no /metrics: {why}", flush=True)
        return None
    exporter = MetricsExporter(run=job.name, max_layers=m.max_layers)
    try:
        url = exporter.serve(m.address, m.port)
    except OSError as e:
        print(f"spikeguard: no /metrics: cannot listen on {m.address}:{m.port}: {e}", flush=True)
        return None
    rundir.write_atomic(run_dir / "metrics.url", url + "\n")
    print(f"spikeguard: Prometheus metrics at {url}", flush=True)
    return exporter


def also_into(exporter: Any, record: Callable[[dict[str, Any]], dict[str, Any]]) -> Any:
    """``record`` (the journal's), folding each event it journals into ``exporter`` as well:
    the Slack notifier journals from its own thread (``notify_undelivered``), past the
    controller's notifiers."""

    def journal(event: dict[str, Any]) -> dict[str, Any]:
        rec = record(event)
        exporter.handle(rec)
        return rec

    return journal


def finish_metrics(exporter: Any, ctl: Any, timeout_s: float, *, interrupted: bool) -> None:
    """Show the run's final state and stop serving. When the run ended, keep serving until
    Prometheus scraped that state once (at most ``timeout_s``; not at all when nothing ever
    scraped): the alert rules tell a finished run from a dead supervisor by it. Not after
    Ctrl-C (a person is at the terminal) nor a preemption (the platform's grace period is
    short, and a preempted run is not finished: its supervisor is meant to come back)."""
    if ctl is not None:
        exporter.tick(ctl)
        if not interrupted and ctl.state.phase in rc.TERMINAL:
            exporter.final_scrape(timeout_s)
    exporter.close()  # (again among the notifiers: a no-op)


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


def finished_outcome(events: list[dict[str, Any]]) -> rc.State | None:
    """The folded state if the journal ends the run (completed, failed, escalated, stopped)."""
    st = rc.fold(events)
    return st if st.phase in rc.TERMINAL else None


def replayable(events: list[dict[str, Any]]) -> bool:
    """False for the journal of an older spikeguard: launches recorded without the observations
    a restarted supervisor replays (it can be read, not continued)."""
    launched = any(e.get("kind") == Kind.LAUNCH for e in events)
    return not launched or any("obs" in e for e in events)


def run_job(job: JobSpec, *, live: bool = True) -> int:
    """Run ``job`` to its end; returns the process exit code (see the README's table).

    On a run directory whose journal is unfinished (a supervisor died), resume it: the state is
    folded from the journal, survivors are fenced and reaped, the Slack threads restored. On a
    finished one, say so and return its recorded exit code without starting anything.
    """
    import ray
    from spikeguard.policies import Engine, load_policy

    policy = load_policy(job.policy)
    run_dir = job.resolved_run_dir()
    try:
        rundir.refuse_links(run_dir)
    except rundir.UnsafePath as e:
        print(f"spikeguard: {e}", flush=True)
        return ExitCode.BAD_INPUT
    events = read_events(run_dir)
    if not replayable(events):
        print(
            f"spikeguard: {run_dir} holds the journal of an older spikeguard, which a restart "
            "cannot replay; it can be read (spikeguard events) but not continued. Use another "
            "--run-dir or --name for a new run.",
            flush=True,
        )
        return ExitCode.BAD_INPUT
    done = finished_outcome(events) if events else None
    if done is not None:
        print(
            f"spikeguard: run {job.name} in {run_dir} already finished: {finished(events)}. "
            "Nothing to do; its journal is final. Use another --run-dir or --name for a new run.",
            flush=True,
        )
        return done.exit_code if done.exit_code is not None else ExitCode.FAILED
    try:
        lock = rundir.acquire_lock(run_dir)
    except (rundir.LockHeld, rundir.UnsafePath) as e:
        print(f"spikeguard: {e}", flush=True)
        return ExitCode.BAD_INPUT
    try:  # private: 0700, the files 0600 (the controller appends to journal and reports)
        rundir.prepare(run_dir)
    except rundir.UnsafePath as e:
        lock.close()
        print(f"spikeguard: {e}", flush=True)
        return ExitCode.BAD_INPUT
    t = job.timeouts
    exporter = start_metrics(job, run_dir)
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
    env = {k: str(v) for k, v in job.env.items()}
    env[contract.ENV_BACKEND] = job.resolved_backend()
    if job.checkpoint_every:
        env[contract.ENV_CKPT_EVERY] = str(job.checkpoint_every)
    if job.sample_every:
        env[contract.ENV_SAMPLE_EVERY] = str(job.sample_every)
    ctl: Controller | None = None
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
        )
        if exporter is not None:
            exporter.clock = ctl.journal.mono  # heartbeat ages on the supervisor's clock
        ctl.on_tick = ticks(LiveView() if live else None, exporter.tick if exporter else None)
        journal_fn = ctl.journal.record
        if exporter is not None:  # what the Slack thread journals (undelivered) is counted too
            journal_fn = also_into(exporter, ctl.journal.record)
        notifiers = make_notifiers(job, policy, job.name, journal_fn)
        if exporter is not None:
            notifiers.append(exporter)
        for n in notifiers if events else ():
            # the Slack threads of open incidents continue where the dead supervisor left them
            restore = getattr(n, "restore", None)
            if restore:
                restore(events)
        ctl.sinks = notifiers
        # SIGTERM is a preemption (pod eviction, spot reclaim, `ray job stop`): an emergency
        # checkpoint, then exit 143; the next `spikeguard submit` resumes
        preempt = ctl.preempt
        signal.signal(signal.SIGTERM, lambda *_: preempt("SIGTERM: the supervisor must go"))
        what = "resuming" if events else "running"
        print(
            f"spikeguard: {what} run {job.name} in {run_dir} ({job.workers} ranks, "
            f"policy {job.policy})",
            flush=True,
        )
        return ctl.run(resume_events=events or None)
    except KeyboardInterrupt:
        interrupted = True
        if ctl is not None:
            rundir.write_atomic(ctl.stop_file, "interrupted (Ctrl-C)")
            ctl.step()
        return ExitCode.INTERRUPTED
    finally:
        signal.signal(signal.SIGTERM, old_term)
        if exporter is not None:
            finish_metrics(exporter, ctl, job.metrics.final_scrape_s, interrupted=interrupted)
        if ctl is not None:
            for n in ctl.sinks:
                close = getattr(n, "close", None)
                if close:
                    close(10.0)
            ctl.close()
        group.shutdown()
        if started:
            ray.shutdown()
        lock.close()
