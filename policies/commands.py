"""``spikeguard policy …``: check, schema, explain and replay.

``register(subparsers)`` adds the group to the main CLI; every handler returns an exit code:
0 fine, 2 bad input (the one-line ``FILE:LINE:COL: path: message`` errors go to stderr).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from spikeguard.workers.contract.exitcodes import ExitCode

from .engine import Decision, replay
from .explain import explain
from .loader import BUILTINS, PolicyError, load_policy
from .schema import Policy
from .values import caller_choices


def register(subparsers: Any, *, destinations: Sequence[str] | None = None) -> None:
    """Add ``policy check|schema|explain|replay`` to an argparse subparsers object.

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
    sub = p.add_subparsers(dest="policy_cmd", metavar="{check,schema,explain,replay}")
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
            return ExitCode.OK
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
                    msg = json.loads(line)
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
