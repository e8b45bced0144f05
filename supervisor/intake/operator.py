"""A human's hand on a run: the operator's requests (acknowledge, hold, resume, stop).

``spikeguard ack|hold|resume`` and the Slack buttons write a request as one small JSON file in
``RUN_DIR/operator/`` (:func:`write_request`: a temp file renamed into place, so a reader never
sees half of one). The controller takes them at its next tick, oldest first
(:func:`take_requests`), removes each file, and hands each to the recovery machine as an
:class:`~spikeguard.supervisor.decide.recovery.Operator` observation: the journal then records
the action with who asked and why, and a restarted supervisor replays it like every other
observation. A file that is not a valid request is removed too and answered as refused, with the
reason (a hostile or broken writer never stops the run).

Who asked comes from the environment (``SPIKEGUARD_OPERATOR``, else the login name) or, for a
button, the Slack user; the request's ``id`` lets its writer find the journal's answer
(:func:`answer_in`).
"""

from __future__ import annotations

import dataclasses
import getpass
import json
import math
import os
import secrets
import socket
import stat
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .. import rundir
from ..decide import recovery as rc

INBOX = "operator"
"""The directory of ``RUN_DIR`` that holds requests not yet taken."""
MAX_REQUEST_BYTES = 16 * 1024
"""A request file larger than this is refused unread."""
MAX_NOTE_CHARS = 500
"""A note (the why) is cut to this many characters."""
MAX_PENDING = 64
"""At most this many requests are taken in one tick (the rest wait for the next)."""
ACTIONS = ("ack", "hold", "resume", "stop")
"""What an operator can ask for."""
VIAS = ("cli", "slack")
"""Where a request can come from."""
OPERATOR_ENV = "SPIKEGUARD_OPERATOR"
"""Who the CLI's requests are from (default: the login name and host)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResumeChoice:
    """What ``spikeguard resume`` (or the Slack button) asks the relaunch to do differently."""

    checkpoint: str | None = None
    """The checkpoint to resume from (a path the supervisor lists); None: the newest healthy
    one on the run's lineage."""
    lr_scale: float | None = None
    """The run's LR scale from now on (relative to the script's own LR); None: keep the run's."""
    lr_factor: float | None = None
    """Multiply the run's LR scale by this (the Slack button's ×0.5); ignored with ``lr_scale``."""
    reset_optimizer: bool = False
    """Start the relaunch with fresh optimizer state."""
    skip_steps: tuple[int, int] | None = None
    """Skip the batches of steps A..B (inclusive) after the resume."""

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if self.skip_steps is not None:
            d["skip_steps"] = list(self.skip_steps)
        return {k: v for k, v in d.items() if v not in (None, False)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class OperatorRequest:
    """One request of a human."""

    action: str
    """One of :data:`ACTIONS`."""
    who: str
    """Who asked (``alice@host``, a Slack user ``U123 (alice)``)."""
    via: str
    """Where from: ``cli`` or ``slack``."""
    note: str = ""
    """Why, in the operator's words (shown in the journal, Slack and the report)."""
    incident: str | None = None
    """The incident it is about (a button names its thread's); None: the run's current one."""
    resume: ResumeChoice | None = None
    """For ``resume``: what to resume with."""
    id: str = ""
    """A unique id (the file's name), so the writer can find the journal's answer."""
    at: float = 0.0
    """When it was written (wall clock, seconds)."""

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "action": self.action,
            "who": self.who,
            "via": self.via,
            "note": self.note,
            "id": self.id,
            "at": self.at,
        }
        if self.incident is not None:
            d["incident"] = self.incident
        if self.resume is not None:
            d["resume"] = self.resume.to_dict()
        return d


@dataclasses.dataclass(frozen=True)
class Refused:
    """A file in the inbox that is not a valid request, and why."""

    id: str
    reason: str


def who_from_env(environ: Mapping[str, str] | None = None) -> str:
    """Who a CLI request is from: ``$SPIKEGUARD_OPERATOR``, else ``login@host``."""
    env = os.environ if environ is None else environ
    given = (env.get(OPERATOR_ENV) or "").strip()
    if given:
        return given[:200]
    try:
        user = getpass.getuser()
    except Exception:  # no login name (a container without passwd entry)
        user = f"uid {os.getuid()}"
    return f"{user}@{socket.gethostname()}"


def new_id() -> str:
    """A request id that sorts by time: ``<ns>-<random>``."""
    return f"{time.time_ns():020d}-{secrets.token_hex(4)}"


def write_request(run_dir: Path, request: OperatorRequest) -> OperatorRequest:
    """Put ``request`` in the inbox of ``run_dir`` (given an id and a time if it has none);
    returns it as written. Raises ``OSError`` (or :class:`~..rundir.UnsafePath`) when the run
    directory cannot take it."""
    if not request.id:
        request = dataclasses.replace(request, id=new_id())
    if not request.at:
        request = dataclasses.replace(request, at=time.time())
    problem = request_problem(request.to_dict())
    if problem is not None:
        raise ValueError(problem)
    inbox = rundir.private_dir(Path(run_dir) / INBOX)
    rundir.write_atomic(inbox / f"{request.id}.json", json.dumps(request.to_dict()), fsync=True)
    return request


def take_requests(run_dir: Path, *, limit: int = MAX_PENDING) -> list[OperatorRequest | Refused]:
    """The requests waiting in ``run_dir``'s inbox, oldest first, each removed as it is read (at
    most ``limit``). Files that are not requests come back as :class:`Refused`; a temp file
    still being written is left for the next tick."""
    inbox = Path(run_dir) / INBOX
    try:
        names = sorted(n for n in os.listdir(inbox) if n.endswith(".json"))
    except (FileNotFoundError, NotADirectoryError):
        return []
    taken: list[OperatorRequest | Refused] = []
    for name in names[:limit]:
        path = inbox / name
        rid = name[: -len(".json")]
        try:
            data = _read_small(path)
        except OSError as e:
            taken.append(Refused(rid, f"unreadable: {e.strerror or e}"))
            data = None
        except ValueError as e:
            taken.append(Refused(rid, str(e)))
            data = None
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue  # another reader took it
        except OSError:
            pass
        if data is None:
            continue
        taken.append(parse_request(data, rid))
    return taken


def pending_actions(run_dir: Path) -> list[str]:
    """The actions of the requests waiting in ``run_dir``'s inbox, oldest first, without taking
    them (a file that is not a request is left out)."""
    inbox = Path(run_dir) / INBOX
    try:
        names = sorted(n for n in os.listdir(inbox) if n.endswith(".json"))
    except OSError:
        return []
    actions = []
    for name in names[:MAX_PENDING]:
        try:
            req = parse_request(_read_small(inbox / name), name[: -len(".json")])
        except (OSError, ValueError):
            continue
        if isinstance(req, OperatorRequest):
            actions.append(req.action)
    return actions


def _read_small(path: Path) -> Any:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        if st.st_uid != os.getuid():
            raise ValueError(f"written by another user (uid {st.st_uid})")
        if st.st_size > MAX_REQUEST_BYTES:
            raise ValueError(f"{st.st_size} bytes, more than {MAX_REQUEST_BYTES}")
        raw = os.read(fd, MAX_REQUEST_BYTES + 1)
    finally:
        os.close(fd)
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"not JSON: {e}") from None


def request_problem(data: Any) -> str | None:
    """What is wrong with a request document, or None."""
    if not isinstance(data, dict):
        return "not a JSON object"
    allowed = {"action", "who", "via", "note", "incident", "resume", "id", "at"}
    extra = sorted(set(data) - allowed)
    if extra:
        return f"unknown field(s) {extra}"
    if data.get("action") not in ACTIONS:
        return f"action must be one of {list(ACTIONS)}, got {data.get('action')!r}"
    if data.get("via") not in VIAS:
        return f"via must be one of {list(VIAS)}, got {data.get('via')!r}"
    for key in ("who", "note", "id"):
        if not isinstance(data.get(key, ""), str):
            return f"{key} must be a string"
    if not str(data.get("who") or "").strip():
        return "who is missing"
    if data.get("incident") is not None and not isinstance(data["incident"], str):
        return "incident must be a string"
    at = data.get("at", 0)
    if isinstance(at, bool) or not isinstance(at, (int, float)) or not math.isfinite(at):
        return "at must be a number"
    resume = data.get("resume")
    if resume is not None:
        if data["action"] != "resume":
            return "resume settings come only with action resume"
        return _resume_problem(resume)
    return None


def _resume_problem(r: Any) -> str | None:
    if not isinstance(r, dict):
        return "resume must be an object"
    extra = sorted(set(r) - {f.name for f in dataclasses.fields(ResumeChoice)})
    if extra:
        return f"unknown resume field(s) {extra}"
    if r.get("checkpoint") is not None and not isinstance(r["checkpoint"], str):
        return "resume.checkpoint must be a string"
    for key in ("lr_scale", "lr_factor"):
        v = r.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return f"resume.{key} must be a number"
        if not (math.isfinite(v) and 0 < v <= 10):
            return f"resume.{key} must be in (0, 10], got {v}"
    if not isinstance(r.get("reset_optimizer", False), bool):
        return "resume.reset_optimizer must be true or false"
    skip = r.get("skip_steps")
    if skip is not None:
        ok = (
            isinstance(skip, list)
            and len(skip) == 2
            and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in skip)
            and skip[0] <= skip[1]
        )
        if not ok:
            return f"resume.skip_steps must be [A, B] with 0 <= A <= B, got {skip!r}"
    return None


def parse_request(data: Any, rid: str) -> OperatorRequest | Refused:
    """A request document as an :class:`OperatorRequest`, or :class:`Refused` saying why."""
    problem = request_problem(data)
    if problem is not None:
        return Refused(rid, problem)
    r = data.get("resume")
    choice = None
    if r is not None:
        skip = r.get("skip_steps")
        choice = ResumeChoice(
            checkpoint=r.get("checkpoint"),
            lr_scale=None if r.get("lr_scale") is None else float(r["lr_scale"]),
            lr_factor=None if r.get("lr_factor") is None else float(r["lr_factor"]),
            reset_optimizer=bool(r.get("reset_optimizer", False)),
            skip_steps=None if skip is None else (int(skip[0]), int(skip[1])),
        )
    return OperatorRequest(
        action=data["action"],
        who=data["who"].strip()[:200],
        via=data["via"],
        note=str(data.get("note") or "")[:MAX_NOTE_CHARS],
        incident=data.get("incident"),
        resume=choice,
        id=rid,
        at=float(data.get("at") or 0.0),
    )


PENDING_CODES = frozenset({"resume_asked"})
"""Answers that are not the last word: a resume whose checkpoint is still being verified."""


def answer_in(events: Iterable[Mapping[str, Any]], request_id: str) -> Mapping[str, Any] | None:
    """The journal's latest ``operator`` event answering request ``request_id`` (None: none
    yet). Its ``code`` in :data:`PENDING_CODES`: the answer is not final yet."""
    found = None
    for ev in events:
        if ev.get("kind") == "operator" and ev.get("request") == request_id:
            found = ev
    return found


def observation(req: OperatorRequest) -> rc.Operator:
    """The recovery machine's observation of a request."""
    choice = req.resume or ResumeChoice()
    return rc.Operator(
        req.action,
        req.who,
        req.via,
        note=req.note,
        request=req.id,
        incident=req.incident,
        checkpoint=choice.checkpoint,
        lr_scale=choice.lr_scale,
        lr_factor=choice.lr_factor,
        reset_optimizer=choice.reset_optimizer,
        skip_steps=choice.skip_steps,
    )
