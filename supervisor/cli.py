"""The ``spikeguard`` command.

Exit codes: 0 completed · 1 failed · 2 bad input (or nothing to act on: ``stop`` without a live
supervisor) · 3 escalated (or held) · 5 stopped by ``spikeguard stop`` · 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from spikeguard.policies import commands as policy_commands
from spikeguard.workers.contract.exitcodes import ExitCode

from . import operate, rundir
from .decide.events import Kind
from .sinks import destinations
from .sinks.slack import command as slack_command


def _submit(args: argparse.Namespace) -> int:
    from spikeguard.policies import PolicyError

    from .job import load_job, load_job_policy
    from .runner import run_job

    overrides: dict[str, Any] = {}
    for field in ("workers", "policy", "run_dir", "name"):
        v = getattr(args, field, None)
        if v is not None:
            overrides[field] = v
    ray: dict[str, Any] = {}
    if args.address:
        ray["address"] = args.address
    if args.no_dashboard:
        ray["dashboard"] = False
    if ray:
        overrides["ray"] = ray
    try:
        job = load_job(args.job, overrides)
        load_job_policy(job)  # bad policy: say so before starting anything
    except (PolicyError, OSError) as e:
        print(f"spikeguard: {e}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    except Exception as e:  # a job or policy the loader did not foresee: one line, never a trace
        print(
            f"spikeguard: {args.job}: cannot load the job or its policy "
            f"({type(e).__name__}: {str(e)[:200]})",
            file=sys.stderr,
        )
        return ExitCode.BAD_INPUT
    return run_job(job, live=not args.quiet)


def _status(args: argparse.Namespace) -> int:
    run = Path(args.run_dir)
    if not (run / "journal.jsonl").exists():
        print(f"spikeguard: no run in {args.run_dir} (no journal.jsonl)", file=sys.stderr)
        return ExitCode.BAD_INPUT
    if args.watch is None:
        status = _run_status(run, say=_journal_problems("status", run))
        print(json.dumps(status) if args.json else _status_text(status))
        return ExitCode.OK
    if args.watch <= 0:
        print("spikeguard status: --watch takes a positive number of seconds", file=sys.stderr)
        return ExitCode.BAD_INPUT
    import time

    clear = sys.stdout.isatty() and not args.json
    said: set[str] = set()  # each odd line said once, not at every redraw
    try:
        while True:
            status = _run_status(run, say=_journal_problems("status", run, said))
            text = json.dumps(status) if args.json else _status_text(status)
            print(("\033[H\033[2J" if clear else "") + text, flush=True)
            if status.get("finished"):
                return ExitCode.OK  # the run ended: nothing more will change
            if not clear and not args.json:
                print(flush=True)  # a blank line between views in a log or a pipe
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return ExitCode.OK


def _run_status(run: Path, say: Callable[[list[str]], None] | None = None) -> dict[str, Any]:
    """The run as the journal says (true also when its supervisor is dead); the ranks and the
    throughput as the live supervisor last wrote them in ``status.json``. ``say``: told what
    is wrong with which journal line (also a line that cannot be replayed)."""
    from .journal import read_journal, redact_fields
    from .observe.status import finished, journal_view
    from .redaction import held_secrets

    read = read_journal(run)
    status = journal_view(read.events, read.lines)
    problems = [str(p) for p in read.problems]
    if status.get("replay_problem"):
        problems.append(f"{status['replay_problem']}: the state shown is the one before it")
    if say is not None and problems:
        say(problems)
    status["finished"] = finished(read.events)
    if status.get("phase") in ("HOLDING", "ESCALATED"):
        status["resumable"] = _resumable(run, read.events)
    if status["finished"] is None:
        try:
            holder = rundir.lock_holder(run)
        except (OSError, rundir.UnsafePath):
            holder = None
        status["supervisor"] = {"alive": holder is not None, "holder": holder}
    live: Any = {}
    try:
        live = json.loads((run / "status.json").read_text())
    except (OSError, ValueError):
        pass
    if not isinstance(live, dict):
        live = {}
    kinds: dict[str, type | tuple[type, ...]] = {"ranks": dict, "throughput": dict}
    kinds.update(dropped=dict, updated=(int, float), waiting=dict)
    gone = status.get("supervisor", {}).get("alive") is False
    for key in ("ranks", "throughput", "dropped", "rank_dropped", "updated", "waiting"):
        if gone and key in ("throughput", "waiting"):
            continue  # the pace, ETA and wait of a supervisor that is gone are not the run's now
        if key in live and isinstance(live[key], kinds.get(key, object)):
            status[key] = live[key]
    return dict(redact_fields(status, held_secrets(os.environ)))  # an older journal may hold one


RESUMABLE_SHOWN = 5
"""How many checkpoints ``status`` of a held or escalated run lists (the newest)."""


def _resumable(run: Path, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The newest checkpoints a resume could choose (listed, on the lineage; unverified: the
    resume verifies), for ``status`` of a run that waits for a human."""
    from . import operate
    from .decide import recovery as rc

    try:
        infos = operate.resumable(run, rc.fold(events), verify=False)
    except Exception:  # a view: a checkpoint directory it cannot read leaves the list out
        return []
    return [
        {"step": i.step, "generation": i.generation, "grade": i.grade, "path": str(i.path)}
        for i in infos[-RESUMABLE_SHOWN:]
    ]


def _journal_problems(
    command: str, run: Path, said: set[str] | None = None
) -> Callable[[list[str]], None]:
    """Says on stderr what is wrong with which line of ``run``'s journal (each once, with
    ``said``)."""
    from .journal import JOURNAL_NAME

    def say(problems: list[str]) -> None:
        for problem in problems:
            if said is not None:
                if problem in said:
                    continue
                said.add(problem)
            print(f"spikeguard {command}: {run / JOURNAL_NAME} {problem}", file=sys.stderr)

    return say


def _status_text(status: dict[str, Any]) -> str:
    """:func:`_render_status`; when what ``status.json`` added cannot be shown (it is input too:
    a hand edit, another version's), the status without it, said on stderr; never a traceback."""
    try:
        return _render_status(status)
    except Exception as e:  # the journal's part alone is what the run is; show that
        live = [k for k in ("ranks", "throughput", "dropped", "waiting") if k in status]
        print(
            f"spikeguard status: status.json's {', '.join(live) or 'fields'} cannot be shown "
            f"({type(e).__name__}: {e}); shown without them",
            file=sys.stderr,
        )
    shown = ("ranks", "throughput", "dropped", "waiting")
    bare = {k: v for k, v in status.items() if k not in shown}
    try:
        return _render_status(bare)
    except Exception:
        return " ".join(f"{k}={bare.get(k)!r}" for k in ("phase", "generation", "lr_scale"))


def _render_status(status: dict[str, Any]) -> str:
    from .sinks.console import is_terminal, render_status

    last = status["last_event"]
    lines = [
        render_status(status, color=is_terminal(sys.stdout)),  # a slow rank in red on a tty
        f"{status['events']} events, {status['incidents']} incident(s); last: "
        + (f"{last['kind']} — {last.get('reason') or ''}" if last else "none"),
    ]
    if status.get("dropped"):
        lines.append(f"dropped reports: {status['dropped']}")
    for e in status.get("excluded_nodes") or []:
        if isinstance(e, dict):
            lines.append(
                f"node {e.get('node_id')} excluded ({e.get('cause')}, rank {e.get('rank')}): "
                f"{e.get('reason')}"
            )
    lines += _next_steps(status)
    return "\n".join(lines)


def _next_steps(status: dict[str, Any]) -> list[str]:
    """What a human reading ``status`` at 3 a.m. needs next: whether anyone supervises the run,
    who holds or acknowledged it, and the command that moves it on."""
    out = []
    if status.get("acknowledged_by"):
        out.append(f"incident {status.get('incident')} acknowledged by {status['acknowledged_by']}")
    if status.get("hold"):
        out.append(f"automatic recovery on hold (set by {status['hold']})")
    sup = status.get("supervisor") or {}
    waiting = status.get("phase") in ("HOLDING", "ESCALATED")
    if sup.get("alive") is False:
        updated = status.get("updated")
        seen = ""
        if isinstance(updated, (int, float)) and not isinstance(updated, bool):
            import time

            seen = f"; its ranks were last seen {max(0.0, time.time() - updated) / 60:.0f} min ago"
        out.append(
            "SUPERVISOR GONE: no process holds the run's lock, so nobody is watching it and the "
            f"phase above is where it stopped{seen}. `spikeguard submit JOB` on this run "
            "directory resumes it" + ("; `spikeguard resume RUN_DIR` does too" if waiting else "")
        )
    if waiting:
        out.append(
            "a human is needed: `spikeguard resume RUN_DIR` (the newest healthy checkpoint), or "
            "`spikeguard resume RUN_DIR --from-step N --lr-scale X` with a step `spikeguard "
            "checkpoints RUN_DIR` lists (resume verifies it first)"
        )
        rows = status.get("resumable")
        if isinstance(rows, list) and rows:
            out.append(f"the newest {len(rows)} it can resume from (--from-step STEP):")
            out.extend(
                f"  step {r.get('step'):>8}  generation {r.get('generation'):>3}  grade "
                f"{'-' if r.get('grade') is None else 'S' + str(r.get('grade'))}  {r.get('path')}"
                for r in rows
                if isinstance(r, dict)
            )
        elif isinstance(rows, list):
            out.append("no checkpoint on the run's lineage is listed: resume has none to use")
    return out


def _report(args: argparse.Namespace) -> int:
    from .observe.report import write_report

    out = Path(args.output) if args.output else Path(args.run_dir) / "report.html"
    try:
        path = write_report(args.run_dir, out)
    except FileNotFoundError as e:
        print(f"spikeguard report: {e}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    except (OSError, rundir.UnsafePath) as e:
        print(f"spikeguard report: cannot write {out}: {e}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    print(f"spikeguard: wrote {path} (one self-contained HTML file: open it in any browser)")
    return ExitCode.OK


def _events(args: argparse.Namespace) -> int:
    from .journal import read_journal, redact_fields
    from .observe.describe import describe
    from .redaction import held_secrets

    valid = [k.value for k in Kind]
    unknown = [k for k in args.kind or () if k not in valid]
    if unknown:
        print(
            f"spikeguard events: unknown kind {', '.join(map(repr, unknown))}; the kinds are: "
            + ", ".join(valid),
            file=sys.stderr,
        )
        return ExitCode.BAD_INPUT
    if not (Path(args.run_dir) / "journal.jsonl").exists():
        print(f"spikeguard: no journal in {args.run_dir}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    held = held_secrets(os.environ)
    read = read_journal(args.run_dir)
    _journal_problems("events", Path(args.run_dir))([str(p) for p in read.problems])
    for raw in read.events:
        if args.kind and raw["kind"] not in args.kind:
            continue
        ev = redact_fields(raw, held)  # a journal written before redaction may hold a secret
        if args.json:
            print(json.dumps(ev))
        else:
            print(_event_line(ev, describe(ev)))
    return ExitCode.OK


def _event_line(ev: dict[str, Any], described: str) -> str:
    """``seq time kind incident  description``; a field the line lacks reads ``-``."""
    seq = ev.get("seq")
    if isinstance(seq, int) and not isinstance(seq, bool):
        seq_text = f"{seq:4d}"
    elif isinstance(seq, str):
        seq_text = f"{seq:>4}"
    else:
        seq_text = "   -"
    when = ev.get("time") if isinstance(ev.get("time"), str) else "-"
    inc = f" {ev['incident']}" if ev.get("incident") else ""
    return f"{seq_text} {when} {ev.get('kind')!s:<17}{inc}  {described}"


def _checkpoints(args: argparse.Namespace) -> int:
    """Every checkpoint of a run: where it keeps them (verified unless --no-verify) and deleted
    (journal)."""
    from spikeguard.workers.checkpoint import choose, location

    from .journal import read_journal
    from .observe.checkpoint_table import render, rows
    from .settings import RunPaths

    run = Path(args.run_dir)
    ckpt_dir = RunPaths.recorded(run).ckpt_dir
    local = location.is_local(ckpt_dir) and Path(location.local_path(ckpt_dir)).is_dir()
    recorded = (run / "journal.jsonl").exists() or (run / rundir.JOB_RECORD).exists()
    if not recorded and not local:
        print(
            f"spikeguard: no run in {args.run_dir} (no checkpoints/, no journal.jsonl, no "
            f"{rundir.JOB_RECORD})",
            file=sys.stderr,
        )
        return ExitCode.BAD_INPUT
    listed = choose.list_checkpoints(ckpt_dir)
    verified: dict[str, str | None] | None = None
    if not args.no_verify:
        verified = {}
        for info in listed:
            try:
                choose.verify(info)
                verified[info.path] = None
            except choose.CheckpointError as e:
                verified[info.path] = str(e)
    events: list[dict[str, Any]] = []
    if (run / "journal.jsonl").exists():
        read = read_journal(run)
        _journal_problems("checkpoints", run)([str(p) for p in read.problems])
        events = read.events
    table = rows(listed, listed.problems, listed.incomplete, verified, events)
    if args.json:
        for row in table:
            print(json.dumps(row.to_dict()))
    else:
        print(render(table))
    return ExitCode.OK


def _stop(args: argparse.Namespace) -> int:
    """Write STOP only for a live supervisor; a finished run or a dead supervisor is said so."""
    from .journal import read_journal
    from .observe.status import finished

    run = Path(args.run_dir)
    if not (run / "journal.jsonl").exists():
        print(f"spikeguard: no run in {args.run_dir}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    read = read_journal(run)
    _journal_problems("stop", run)([str(p) for p in read.problems])
    ended = finished(read.events)
    if ended is not None:
        print(f"spikeguard: the run in {run} already finished: {ended}. There is nothing to stop.")
        return ExitCode.OK
    try:
        holder = rundir.lock_holder(run)
    except (OSError, rundir.UnsafePath) as e:
        print(f"spikeguard: cannot tell whether a supervisor runs {run}: {e}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    if holder is None:
        print(
            f"spikeguard: no supervisor is running {run} (no process holds "
            f"{run / rundir.LOCK_NAME}): the run did not finish, its supervisor died. Nothing "
            "was asked to stop. `spikeguard submit` of its job on this run directory resumes it "
            "where the journal ends.",
            file=sys.stderr,
        )
        return ExitCode.BAD_INPUT
    from .intake.operator import who_from_env

    why = f"{args.reason} (asked by {who_from_env()} via cli)"  # the journal says who
    rundir.write_atomic(run / "STOP", why)
    print(f"spikeguard: asked the supervisor of {run} ({holder}) to stop ({why})")
    return ExitCode.OK


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(
        run_dir=args.run_dir,
        steps=args.steps,
        workers=args.workers,
        policy=args.policy,
        seed=args.seed,
        dashboard=not args.no_dashboard,
    )


def _version() -> str:
    """The installed spikeguard's version (``unknown`` when run from an uninstalled tree)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("spikeguard")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    """The ``spikeguard`` argument parser, every command's handler as ``args.func``."""
    p = argparse.ArgumentParser(
        prog="spikeguard",
        description="Supervise distributed PyTorch training and recover loss spikes by itself.",
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("submit", help="run a job under supervision")
    s.add_argument("job", help="job YAML")
    s.add_argument("--address", help="an existing Ray cluster (default: an embedded local Ray)")
    s.add_argument("--no-dashboard", action="store_true", help="no dashboard for the embedded Ray")
    s.add_argument("--workers", type=int)
    s.add_argument("--policy", help="policy file or built-in name")
    s.add_argument("--run-dir", dest="run_dir")
    s.add_argument("--name")
    s.add_argument("--quiet", action="store_true", help="no live view")
    s.set_defaults(func=_submit)
    s = sub.add_parser("status", help="the state of a run")
    s.add_argument("run_dir")
    s.add_argument("--json", action="store_true")
    s.add_argument(
        "--watch",
        nargs="?",
        const=2.0,
        type=float,
        metavar="SECONDS",
        help="redraw every SECONDS (2) until the run ends (Ctrl-C stops watching)",
    )
    s.set_defaults(func=_status)
    s = sub.add_parser(
        "report",
        help="the post-mortem of a run as one self-contained HTML file",
        description="Renders RUN_DIR (finished, running or crashed) into one HTML file that "
        "opens without a network: the signals by generation, a per-layer heatmap, incidents, "
        "checkpoints, batch forensics and the journal.",
    )
    s.add_argument("run_dir")
    s.add_argument("-o", "--output", help="where to write it (default: RUN_DIR/report.html)")
    s.set_defaults(func=_report)
    s = sub.add_parser("events", help="the run's journal")
    s.add_argument("run_dir")
    s.add_argument("--json", action="store_true", help="JSON lines")
    s.add_argument(
        "--kind",
        action="append",
        metavar="KIND",
        help="only events of this kind (repeatable): " + ", ".join(k.value for k in Kind),
    )
    s.set_defaults(func=_events)
    s = sub.add_parser(
        "checkpoints",
        help="every checkpoint of a run: kind, ranks, grade, size, verified or not, retention",
        description="Lists the run's checkpoints (RUN_DIR/checkpoints, or the job's "
        "checkpoints.dir as RUN_DIR/job.json recorded it: a path or s3://...), each one "
        "verified (sizes, sha256, pickle scan), and the checkpoints retention deleted, with "
        "the reason (from the journal).",
    )
    s.add_argument("run_dir")
    s.add_argument("--json", action="store_true", help="one JSON object per checkpoint")
    s.add_argument("--no-verify", action="store_true", help="list only (no hashing)")
    s.set_defaults(func=_checkpoints)
    s = sub.add_parser(
        "stop",
        help="ask a running supervisor to stop its job",
        description="Writes RUN_DIR/STOP for the live supervisor. On a finished run it says how "
        "the run ended (exit 0); when no supervisor runs the directory (it died) it says so "
        "and writes nothing, since a later submit would read the STOP (exit 2).",
    )
    s.add_argument("run_dir")
    s.add_argument("--reason", default="stopped by user")
    s.set_defaults(func=_stop)
    operate.add_commands(sub)
    s = sub.add_parser(
        "demo", help="the diverging example, 2 ranks on local Ray, recovered by spikeguard"
    )
    s.add_argument("--run-dir", dest="run_dir", default=None)
    s.add_argument("--steps", type=int, default=None)
    s.add_argument("--workers", type=int, default=2)
    s.add_argument("--policy", default="default")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--no-dashboard", action="store_true", help="no Ray dashboard")
    s.set_defaults(func=_demo)
    policy_commands.register(sub, destinations=destinations())
    slack_command.register(sub)
    return p


PIPE_CLOSED = 141
"""The exit code when the reader of stdout went away (``spikeguard events RUN | head``): 128 +
SIGPIPE, what a shell reports for any command cut short that way."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run a ``spikeguard`` command; its exit code. Output to a pipe whose reader has gone
    (``| head``) ends the command quietly, exit :data:`PIPE_CLOSED`, never a traceback: stdout
    is pointed at ``/dev/null`` so that nothing written later (the interpreter's last flush)
    fails again."""
    try:
        args = build_parser().parse_args(argv)  # --help, --version print too
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # inside: a closed pipe shows here, not at the interpreter's exit
    except BrokenPipeError:
        from .sinks.console import silence

        silence(sys.stdout)
        return PIPE_CLOSED
    return code


if __name__ == "__main__":
    sys.exit(main())
