"""``spikeguard ack | hold | resume RUN_DIR``: a human's hand on a run, from the command line.

Each command is a request (:mod:`.intake.operator`) carried out by the recovery machine, so the
journal records who asked and why, and a restarted supervisor replays it:

1. With a live supervisor (it holds ``RUN_DIR/supervisor.lock``): the request goes into its
   inbox, and the command waits for the journal's answer (``--wait`` seconds) and prints it.
2. With none, ``resume`` of a held or escalated run starts supervising it again in the
   foreground, as re-submitting its job would (the job as the run recorded it in
   ``RUN_DIR/job.json``, or ``--job``); the new supervisor takes the request first.
3. With none, ``ack`` and ``hold`` are carried out here, under the run directory's lock: the
   machine's answer is journaled, and the next supervisor folds it.

A resume's checkpoint choice is checked first: one that is not listed, not on the run's lineage
or does not verify is refused with the table of those that can be chosen (exit 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

from spikeguard.workers.contract.exitcodes import ExitCode

from . import rundir
from .decide import recovery as rc
from .intake import operator
from .journal import Journal, read_journal
from .observe.status import fold_journal

WAIT_S = 30.0
"""How long a command waits for the live supervisor's answer by default."""


def add_commands(sub: Any) -> None:
    """The ``ack``, ``hold`` and ``resume`` subcommands."""
    for name, text in (
        ("ack", "acknowledge a run's incident: its reminders stop, pagers get acknowledge"),
        ("hold", "pause automatic recovery: the next recover decision waits for a human"),
    ):
        s = sub.add_parser(name, help=text, description=text)
        s.add_argument("run_dir")
        s.add_argument("--note", default="", help="why (journaled, shown in Slack)")
        if name == "ack":
            s.add_argument("--incident", help="the incident (default: the run's current one)")
        _wait_flag(s)
        s.set_defaults(func=lambda a, n=name: request(a, n))
    s = sub.add_parser(
        "resume",
        help="resume a held or escalated run from a healthy checkpoint (or lift a hold)",
        description="A held or escalated run goes on from the checkpoint chosen (default: the "
        "newest healthy one) with the settings chosen, supervised again. On a run that still "
        "trains with a hold set, lifts the hold.",
    )
    s.add_argument("run_dir")
    which = s.add_mutually_exclusive_group()
    which.add_argument("--from-step", type=int, help="the checkpoint of this step")
    which.add_argument("--checkpoint", help="this checkpoint (a path `checkpoints` lists)")
    s.add_argument("--lr-scale", type=float, help="the run's LR scale from now on (e.g. 0.25)")
    s.add_argument("--reset-optimizer", action="store_true", help="fresh optimizer state")
    s.add_argument("--skip-steps", help="skip the batches of steps A-B after the resume")
    s.add_argument("--note", default="", help="why (journaled, shown in Slack)")
    s.add_argument("--job", help="the job file, when the run did not record its own")
    s.add_argument("--address", help="an existing Ray cluster (default: an embedded local Ray)")
    s.add_argument("--quiet", action="store_true", help="no live view while supervising")
    _wait_flag(s)
    s.set_defaults(func=lambda a: request(a, "resume"))


def _wait_flag(s: argparse.ArgumentParser) -> None:
    s.add_argument(
        "--wait",
        type=float,
        default=WAIT_S,
        metavar="SECONDS",
        help=f"how long to wait for a live supervisor's answer ({WAIT_S:g})",
    )


def _say(text: str) -> None:
    print(f"spikeguard: {text}", file=sys.stderr)


def request(args: argparse.Namespace, action: str) -> int:
    """Carry out ``action`` on ``args.run_dir`` (see the module's docstring)."""
    run = Path(args.run_dir)
    if not (run / "journal.jsonl").exists():
        _say(f"no run in {run} (no journal.jsonl)")
        return ExitCode.BAD_INPUT
    read = read_journal(run)
    state, broken = fold_journal(read.events, read.lines)
    if broken is not None:
        _say(f"{run / 'journal.jsonl'} {broken}: the run cannot be acted on")
        return ExitCode.BAD_INPUT
    try:
        choice = _choice(args, run, state) if action == "resume" else None
    except ValueError as e:
        _say(str(e))
        return ExitCode.BAD_INPUT
    req = operator.OperatorRequest(
        action=action,
        who=operator.who_from_env(),
        via="cli",
        note=str(getattr(args, "note", "") or ""),
        incident=getattr(args, "incident", None),
        resume=choice,
    )
    try:
        holder = rundir.lock_holder(run)
    except (OSError, rundir.UnsafePath) as e:
        _say(f"cannot tell whether a supervisor runs {run}: {e}")
        return ExitCode.BAD_INPUT
    if holder is not None:
        return _ask_live(run, req, args.wait, holder)
    if action == "resume" and state.phase in (*rc.TERMINAL, rc.Phase.HOLDING):
        if state.phase not in (rc.Phase.HOLDING, rc.Phase.ESCALATED):
            _say(f"the run in {run} has ended ({state.phase.value}): there is nothing to resume")
            return ExitCode.BAD_INPUT
        return _supervise_again(args, run, req)
    return _act_here(run, req, read.events)


def _choice(args: argparse.Namespace, run: Path, state: rc.State) -> operator.ResumeChoice:
    """The resume's settings, its checkpoint checked against what the run can resume from."""
    skip = None
    if args.skip_steps:
        a, sep, b = str(args.skip_steps).partition("-")
        if not (sep and a.strip().isdigit() and b.strip().isdigit() and int(a) <= int(b)):
            raise ValueError(f"--skip-steps {args.skip_steps!r}: expected A-B with A <= B")
        skip = (int(a), int(b))
    if args.lr_scale is not None and not (0 < args.lr_scale <= 10):
        raise ValueError(f"--lr-scale {args.lr_scale}: expected a number in (0, 10]")
    path = None
    if args.checkpoint is not None or args.from_step is not None:
        path = _checkpoint(run, state, args.checkpoint, args.from_step)
    return operator.ResumeChoice(
        checkpoint=path,
        lr_scale=args.lr_scale,
        reset_optimizer=bool(args.reset_optimizer),
        skip_steps=skip,
    )


def resumable(run: Path, state: rc.State, *, verify: bool = True) -> list[Any]:
    """The checkpoints a resume of ``run`` can choose, oldest first: listed, on the run's
    lineage (``state``'s) and, with ``verify``, verified (``status`` lists them unverified:
    verifying reads every file; the resume verifies its choice)."""
    from spikeguard.workers.checkpoint import choose

    from .settings import RunPaths

    listed = choose.list_checkpoints(RunPaths.recorded(run).ckpt_dir)
    usable: list[Any] = []
    for info in sorted(listed, key=lambda i: (i.step, i.generation)):
        if state.lineage and not choose.on_lineage(state.lineage, info.generation, info.step):
            continue
        if verify:
            try:
                choose.verify(info)
            except choose.CheckpointError:
                continue
        usable.append(info)
    return usable


def checkpoint_rows(infos: list[Any]) -> str:
    """One line per checkpoint: step, generation, grade, path."""
    return "\n".join(
        f"  step {i.step:>8}  generation {i.generation:>3}  "
        f"grade {'-' if i.grade is None else f'S{i.grade}'}  {i.path}"
        for i in infos
    )


def _checkpoint(run: Path, state: rc.State, path: str | None, step: int | None) -> str:
    """The listed checkpoint named by ``path`` or ``step`` that lies on the run's lineage and
    verifies; else ``ValueError`` with the table of those that do."""
    usable = resumable(run, state)
    wanted = [
        i
        for i in usable
        if (path is not None and (i.path == path or Path(i.path) == Path(path).resolve()))
        or (step is not None and i.step == step)
    ]
    if wanted:
        return str(wanted[-1].path)
    asked = f"checkpoint {path}" if path is not None else f"a checkpoint of step {step}"
    if not usable:
        raise ValueError(f"cannot resume from {asked}: no checkpoint of this run verifies")
    raise ValueError(
        f"cannot resume from {asked}: it is not one this run can resume from (listed, on its "
        "lineage, verified). These can be chosen (--from-step STEP or --checkpoint PATH):\n"
        + checkpoint_rows(usable)
    )


def _ask_live(run: Path, req: operator.OperatorRequest, wait_s: float, holder: str) -> int:
    """Put the request in the live supervisor's inbox and print its answer."""
    try:
        req = operator.write_request(run, req)
    except (OSError, rundir.UnsafePath, ValueError) as e:
        _say(f"cannot write the request into {run / operator.INBOX}: {e}")
        return ExitCode.BAD_INPUT
    deadline = time.monotonic() + max(0.0, wait_s)
    answer = None
    while True:
        answer = operator.answer_in(read_journal(run).events, req.id)
        final = answer is not None and answer.get("code") not in operator.PENDING_CODES
        if final or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    if answer is None:
        _say(
            f"asked the supervisor of {run} ({holder}) to {req.action}; no answer within "
            f"{wait_s:g} s (it acts at its next tick: `spikeguard events {run}` shows it)"
        )
        return ExitCode.OK
    return _report(answer)


def _report(answer: Any) -> int:
    refused = answer.get("code") == "operator_refused"
    print(f"spikeguard: {answer.get('reason')}", file=sys.stderr if refused else sys.stdout)
    return ExitCode.BAD_INPUT if refused else ExitCode.OK


def _act_here(run: Path, req: operator.OperatorRequest, events: list[dict[str, Any]]) -> int:
    """No supervisor: the machine's answer journaled here, under the run directory's lock."""
    try:
        lock = rundir.acquire_lock(run)
    except (rundir.LockHeld, rundir.UnsafePath, OSError) as e:
        _say(f"cannot act on {run}: {e}")
        return ExitCode.BAD_INPUT
    try:
        read = read_journal(run)  # again, under the lock: what this answer continues
        state, broken = fold_journal(read.events, read.lines)
        if broken is not None:
            _say(f"{run / 'journal.jsonl'} {broken}: the run cannot be acted on")
            return ExitCode.BAD_INPUT
        req = dataclasses.replace(req, id=operator.new_id())
        obs = operator.observation(req)
        t = rc.step(state, obs)
        if t.effects:  # only a live supervisor carries effects out
            _say(f"{req.action} needs a running supervisor for {run}")
            return ExitCode.BAD_INPUT
        run_id = next((e["run"] for e in read.events if isinstance(e.get("run"), str)), run.name)
        journal = Journal(run, run=run_id)
        try:
            answer = None
            for ev in t.events:
                answer = journal.record(ev)
        finally:
            journal.close()
        if answer is None:
            _say(f"{req.action}: nothing to do")
            return ExitCode.OK
        return _report(answer)
    finally:
        lock.close()


def _supervise_again(args: argparse.Namespace, run: Path, req: operator.OperatorRequest) -> int:
    """Resume with no supervisor alive: supervise the run again with its recorded job, the
    request first in its inbox."""
    from spikeguard.policies import PolicyError

    from .job import JobSpec, load_job
    from .runner import run_job

    overrides: dict[str, Any] = {"run_dir": str(run.resolve())}
    if args.address:
        overrides["ray"] = {"address": args.address}
    try:
        if args.job:
            job = load_job(args.job, overrides)
        else:
            recorded = run / rundir.JOB_RECORD
            try:
                text = recorded.read_text(encoding="utf-8")
            except OSError as e:
                raise ValueError(
                    f"the run did not record its job ({recorded}: {e.strerror}): give it with "
                    "--job JOB.yaml"
                ) from None
            job = JobSpec.model_validate_json(text)
            job = job.model_copy(update={"run_dir": str(run.resolve())})
            if args.address:
                job = job.model_copy(
                    update={"ray": job.ray.model_copy(update={"address": args.address})}
                )
    except (PolicyError, ValueError, OSError) as e:
        _say(str(e))
        return ExitCode.BAD_INPUT
    try:
        operator.write_request(run, req)
    except (OSError, rundir.UnsafePath, ValueError) as e:
        _say(f"cannot write the request into {run / operator.INBOX}: {e}")
        return ExitCode.BAD_INPUT
    print(f"spikeguard: no supervisor runs {run}: supervising it again to {req.action} it")
    return run_job(job, live=not args.quiet)
