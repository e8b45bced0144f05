"""``spikeguard policy …``: check, schema, explain, replay and calibrate.

``register(subparsers)`` adds the group to the main CLI; every handler returns an exit code:
0 fine, 2 bad input (the one-line ``FILE:LINE:COL: path: message`` errors go to stderr).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import math
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from spikeguard.workers.contract.exitcodes import ExitCode
from spikeguard.workers.contract.messages import loads_text

from . import calibrate
from .engine import Decision, replay
from .explain import explain
from .loader import (
    BUILTINS,
    PolicyError,
    builtin_path,
    load_policy,
    load_policy_text,
    load_yaml_text,
)
from .schema import Policy
from .values import caller_choices


def register(subparsers: Any, *, destinations: Sequence[str] | None = None) -> None:
    """Add ``policy check|schema|explain|replay|calibrate`` to an argparse subparsers object.

    ``destinations``: the names the policies' ``notify.routes`` may use (the sinks of the
    supervisor whose command this is); None: those of the default routes."""
    p = subparsers.add_parser(
        "policy",
        help="check, explain and replay recovery policies",
        description="Work with policy files (or the built-in policies "
        + ", ".join(BUILTINS)
        + ").",
    )
    p.set_defaults(
        func=lambda args: (p.print_help(sys.stderr), ExitCode.BAD_INPUT)[1],
        destinations=None if destinations is None else tuple(destinations),
    )
    sub = p.add_subparsers(dest="policy_cmd", metavar="{check,schema,explain,replay,calibrate}")
    c = sub.add_parser("check", help="validate a policy file (exit 0 ok, 2 with the error)")
    c.add_argument("file", help="a policy YAML file or a built-in name")
    c.set_defaults(func=cmd_check)
    s = sub.add_parser("schema", help="print the JSON Schema of policy files (for editors)")
    s.set_defaults(func=cmd_schema)
    e = sub.add_parser("explain", help="say in plain words what a policy does")
    e.add_argument("file", help="a policy YAML file or a built-in name")
    e.set_defaults(func=cmd_explain)
    r = sub.add_parser(
        "replay", help="dry-run a policy over a recorded run: what would it have done?"
    )
    r.add_argument("file", help="a policy YAML file or a built-in name")
    r.add_argument(
        "source",
        nargs="+",
        help="a run directory (its reports.jsonl or reports.jsonl.gz) or .jsonl(.gz) report files",
    )
    r.add_argument("--json", action="store_true", help="one JSON object per decision")
    r.set_defaults(func=cmd_replay)
    _add_calibrate(sub)


def _add_calibrate(sub: Any) -> None:
    k = sub.add_parser(
        "calibrate",
        help="propose thresholds from recorded runs: silent on stable ones, early on divergences",
        description="For each rule with a numeric threshold, find by replaying the stable runs "
        "the tightest setting at which it stays silent, add a margin, report the lead on the "
        "diverging runs and what the whole proposed policy decides, and write it for review.",
    )
    k.add_argument(
        "file", nargs="?", default="default", help="the base policy (a file or a built-in name)"
    )
    k.add_argument(
        "--stable",
        nargs="+",
        required=True,
        metavar="RUN",
        help="stable runs: run directories (their reports.jsonl(.gz)) or report files",
    )
    k.add_argument(
        "--diverging",
        nargs="+",
        default=[],
        metavar="RUN@ONSET",
        help="diverging runs, each with the step its divergence began at (runs/lr-high@725)",
    )
    k.add_argument(
        "--margin",
        type=float,
        default=calibrate.Settings().margin,
        help="how far past the tightest silent setting to go, loosely (default %(default)s)",
    )
    k.add_argument(
        "--out", help="where to write the proposed policy (default: <base name>-calibrated.yaml)"
    )
    k.add_argument("--force", action="store_true", help="replace the --out file if it exists")
    k.set_defaults(func=cmd_calibrate)


def _load(args: argparse.Namespace) -> Policy | None:
    try:
        return load_policy(args.file, destinations=_destinations(args))
    except PolicyError as e:
        for issue in e.issues:
            print(issue, file=sys.stderr)
        return None


def _guard(fn: Any) -> Any:
    """Never a traceback for the user: unexpected errors become one line and exit 2."""

    def wrapper(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except BrokenPipeError:
            raise  # the CLI's entry ends a closed pipe once, for every command (exit 141)
        except Exception as e:
            print(
                f"spikeguard policy: internal error ({type(e).__name__}: {e}); please report it",
                file=sys.stderr,
            )
            return ExitCode.BAD_INPUT

    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper


@_guard
def cmd_check(args: argparse.Namespace) -> int:
    """Validate a policy: exit 0 and a one-line summary, or 2 and the errors on stderr."""
    policy = _load(args)
    if policy is None:
        return ExitCode.BAD_INPUT
    actions = collections.Counter(r.action for r in policy.rules)
    print(
        f"{args.file}: ok — policy {policy.name!r}, {len(policy.rules)} rules ("
        + ", ".join(f"{n} {a}" for a, n in sorted(actions.items()))
        + ")"
    )
    return ExitCode.OK


def _destinations(args: argparse.Namespace) -> tuple[str, ...] | None:
    """The route names :func:`register` was given (None on a parser it did not build)."""
    return getattr(args, "destinations", None)


def policy_schema(destinations: Sequence[str] | None = None) -> dict[str, Any]:
    """The JSON Schema of policy files, derived from the pydantic models; ``destinations`` (the
    names routes may use) replace the default routes' names."""
    schema = Policy.model_json_schema()
    if destinations is not None:
        schema = caller_choices(schema, "destination", tuple(destinations))
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://spikeguard.dev/schema/policy-v1.json",
        **schema,
    }


@_guard
def cmd_schema(args: argparse.Namespace) -> int:
    """Print the JSON Schema."""
    print(json.dumps(policy_schema(_destinations(args)), indent=2, ensure_ascii=False))
    return ExitCode.OK


@_guard
def cmd_explain(args: argparse.Namespace) -> int:
    """Print the policy in plain words."""
    policy = _load(args)
    if policy is None:
        return ExitCode.BAD_INPUT
    print(explain(policy))
    return ExitCode.OK


REPORTS = ("reports.jsonl", "reports.jsonl.gz")
"""What a run directory's rank reports are called (recorded runs keep only the .gz)."""


class NotReports(ValueError):
    """A file that holds something other than rank reports (a run's journal)."""


def _journal_line(msg: dict) -> bool:
    """True for a line of a spikeguard journal (``kind`` and ``seq``) rather than a rank
    message (which has a ``type``)."""
    return "kind" in msg and "seq" in msg and "type" not in msg


class _Source:
    def __init__(self) -> None:
        self.bad_lines: list[str] = []

    def read(self, path: Path) -> Iterator[dict]:
        opener = gzip.open if path.suffix == ".gz" else open
        first = True
        with opener(path, "rt", encoding="utf-8", errors="replace") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    msg = loads_text(line)
                except ValueError:
                    self.bad_lines.append(f"{path}:{n}")
                    continue
                if not isinstance(msg, dict):
                    self.bad_lines.append(f"{path}:{n}")
                    continue
                if first and _journal_line(msg):
                    raise NotReports(
                        f"{path} is a spikeguard journal (its lines have 'kind' and 'seq'), not "
                        "rank reports: replay reads what the ranks reported, in the run "
                        "directory's reports.jsonl or reports.jsonl.gz (pass the run directory)"
                    )
                first = False
                yield msg


def _reports_in(run_dir: Path) -> Path:
    """The rank reports of a run directory: ``reports.jsonl``, else ``reports.jsonl.gz``."""
    for name in REPORTS:
        if (run_dir / name).is_file():
            return run_dir / name
    found = sorted(
        x.name
        for x in run_dir.iterdir()
        if x.name.endswith((".jsonl", ".jsonl.gz")) and not x.name.startswith("journal.")
    )
    raise FileNotFoundError(
        f"{run_dir}: no reports.jsonl (or reports.jsonl.gz) in this directory"
        + (f" (found {', '.join(found)}: pass them as files)" if found else "")
        + (
            "; journal.jsonl is the run's event log, not rank reports"
            if (run_dir / "journal.jsonl").exists()
            else ""
        )
    )


def _files(sources: list[str]) -> list[Path]:
    out = []
    for s in sources:
        p = Path(s)
        if p.is_dir():
            p = _reports_in(p)
        elif not p.is_file():
            raise FileNotFoundError(f"{p}: no such file or run directory")
        out.append(p)
    return out


def load_messages(sources: list[str]) -> tuple[list[dict], list[str]]:
    """Messages from run directories (``reports.jsonl`` or ``reports.jsonl.gz``) or .jsonl(.gz)
    files (several files are merged by time). Raises :class:`NotReports` for a journal."""
    src = _Source()
    paths = _files(sources)
    if len(paths) == 1:
        return list(src.read(paths[0])), src.bad_lines
    tagged = [(i, m) for path in paths for i, m in enumerate(src.read(path))]

    def when(item: tuple[int, dict]) -> float:
        m = item[1]
        t = m.get("at", m.get("t"))
        return t if isinstance(t, (int, float)) and not isinstance(t, bool) else float("inf")

    tagged.sort(key=when)  # stable: each file keeps its own order on ties
    return [m for _, m in tagged], src.bad_lines


def _line(d: Decision) -> str:
    rank = "-" if d.rank is None else str(d.rank)
    return (
        f"step {d.step:>6}  gen {d.generation}  rank {rank:>2}  {d.layer or '-':<16} {d.rule:<22} "
        f"{d.action + (' (resolved)' if d.resolved else ''):<10}  {d.reason}"
    )


def summarize(policy: Policy, messages: list[dict], decisions: list[Decision]) -> str:
    steps = [m["step"] for m in messages if isinstance(m.get("step"), int) and m["step"] >= 0]
    gens = sorted({m.get("gen", 0) for m in messages if isinstance(m.get("gen", 0), int)})
    ranks = sorted({m["rank"] for m in messages if isinstance(m.get("rank"), int)})
    head = (
        f"policy {policy.name!r} over {len(messages)} messages ({len(ranks)} rank"
        f"{'s' if len(ranks) != 1 else ''}, generation{'s' if len(gens) != 1 else ''} "
        f"{', '.join(map(str, gens)) or '-'}, steps "
        f"{min(steps) if steps else '-'}..{max(steps) if steps else '-'})"
    )
    if not decisions:
        return head + ": no decisions — the policy would have done nothing."
    counts = collections.Counter(d.action for d in decisions if not d.resolved)
    acted = next((d for d in decisions if d.action in ("recover", "stop")), None)
    text = (
        f"{head}: {len(decisions)} decision{'s' if len(decisions) != 1 else ''} ("
        + ", ".join(f"{a} ×{n}" for a, n in sorted(counts.items()))
        + ")"
    )
    if acted:
        text += f"; first {acted.action} at step {acted.step} by rule {acted.rule!r}"
    return text + "."


@_guard
def cmd_replay(args: argparse.Namespace) -> int:
    """Evaluate a policy over recorded messages and print what it would have decided."""
    policy = _load(args)
    if policy is None:
        return ExitCode.BAD_INPUT
    try:
        messages, bad = load_messages(args.source)
    except (OSError, UnicodeDecodeError, NotReports) as e:
        print(f"spikeguard policy replay: {e}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    if bad:
        print(
            f"spikeguard policy replay: skipped {len(bad)} line(s) that are not JSON objects "
            f"(first {bad[0]})",
            file=sys.stderr,
        )
    decisions = replay(policy, messages)
    for d in decisions:
        print(json.dumps(d.to_dict(), sort_keys=True) if args.json else _line(d))
    print(summarize(policy, messages, decisions), file=sys.stderr if args.json else sys.stdout)
    return ExitCode.OK


def _onset(spec: str) -> tuple[str, int]:
    """``RUN@ONSET`` -> (RUN, ONSET); ValueError with the sentence to print."""
    run, at, onset = spec.rpartition("@")
    if not at or not run or not onset.isdigit():
        raise ValueError(
            f"--diverging {spec!r}: expected RUN@ONSET, a run and the step its divergence "
            "began at (e.g. runs/lr-high@725)"
        )
    return run, int(onset)


def _runs(sources: Sequence[str], onsets: Sequence[int | None]) -> list[calibrate.Run]:
    """One :class:`~.calibrate.Run` per source, read as ``policy replay`` reads them."""
    runs = []
    for source, onset in zip(sources, onsets):
        messages, bad = load_messages([source])
        if bad:
            print(
                f"spikeguard policy calibrate: {source}: skipped {len(bad)} line(s) that are not "
                f"JSON objects (first {bad[0]})",
                file=sys.stderr,
            )
        runs.append(calibrate.Run(source, messages, onset))
    return runs


def _base_text(source: str) -> dict[str, Any] | None:
    """The base policy's plain data as written (rules keep their compact conditions), or None
    when it cannot be read back."""
    try:
        if source in BUILTINS and not Path(source).exists():
            return load_yaml_text(builtin_path(source).read_text(encoding="utf-8"))
        return load_yaml_text(Path(source).read_text(encoding="utf-8"), source)
    except (OSError, UnicodeDecodeError, PolicyError):
        return None


def _header(args: argparse.Namespace, cal: calibrate.Calibration) -> list[str]:
    """The comment block on top of the written policy: what it was calibrated from."""
    return [
        f"spikeguard policy {cal.proposed.name!r}: {args.file!r} calibrated by "
        "`spikeguard policy calibrate` on",
        *(f"  stable:    {run.label}" for run in cal.stable),
        *(f"  diverging: {run.label} (onset step {run.onset})" for run in cal.diverging),
        f"with margin {cal.settings.margin:g}. A comment above each rule whose thresholds changed",
        "says how they were found. Review it before use: it is fitted to these runs only.",
        "Check it with `spikeguard policy check FILE`; see what it decides on a run with",
        "`spikeguard policy replay FILE RUN`.",
        "",
    ]


def _problem(text: str) -> int:
    print(f"spikeguard policy calibrate: {text}", file=sys.stderr)
    return ExitCode.BAD_INPUT


@_guard
def cmd_calibrate(args: argparse.Namespace) -> int:
    """Propose per-rule thresholds from recorded runs, show what they decide, write the policy."""
    if not math.isfinite(args.margin) or args.margin < 1:
        return _problem(f"--margin {args.margin:g}: expected a number >= 1 (1: no margin)")
    try:
        diverging = [_onset(spec) for spec in args.diverging]
    except ValueError as e:
        return _problem(str(e))
    base = _load(args)
    if base is None:
        return ExitCode.BAD_INPUT
    out = Path(args.out or f"{base.name}-calibrated.yaml")
    if out.exists() and not args.force:
        return _problem(f"{out} exists: pass --force to replace it, or another --out")
    try:
        stable = _runs(args.stable, [None] * len(args.stable))
        diverged = _runs([run for run, _ in diverging], [onset for _, onset in diverging])
    except (OSError, UnicodeDecodeError, NotReports) as e:
        return _problem(str(e))
    settings = calibrate.Settings(margin=args.margin)

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    cal = calibrate.calibrate(base, stable, diverged, settings=settings, progress=progress)
    print(calibrate.render_report(cal))
    text = calibrate.render_policy(cal, _base_text(args.file), _header(args, cal))
    try:
        load_policy_text(text, str(out), destinations=_destinations(args))
    except PolicyError as e:  # a bug here, not the user's input: say what, write nothing
        return _problem("the proposed policy does not validate:\n" + "\n".join(map(str, e.issues)))
    try:
        out.write_text(text, encoding="utf-8")
    except OSError as e:
        return _problem(f"cannot write {out}: {e.strerror or e}")
    print(
        f"\nwrote {out} (policy {cal.proposed.name!r}); check it with "
        f"`spikeguard policy check {out}` and see it decide with "
        f"`spikeguard policy replay {out} RUN`"
    )
    return ExitCode.OK
