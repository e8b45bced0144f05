"""The collector: turns raw report lines, exit codes and silence into messages.

Pure bookkeeping (no Ray, no I/O, time passed in): validates every line against the contract,
fences by generation, admits at most ``MAX_LAYERS_PER_RANK`` distinct layer names per rank
(:class:`~spikeguard.workers.contract.messages.LayerGate`: the others are stripped before the
message is recorded or evaluated, so nothing downstream keeps more), counts what it drops and
why, and synthesises ``exit`` and ``hang``
messages for the policy engine. It also classifies them: an exit or hang of a rank that never
sent a message is marked ``first`` (a launch failure, not a crash; its step is the step the
generation was to begin with), and a crash in teardown after ``done`` is counted as finished.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import statistics
from collections.abc import Iterable
from typing import Any, NamedTuple

from spikeguard.workers.contract.messages import FORMAT_VERSION, MAX_LAYERS_PER_RANK, LayerGate
from spikeguard.workers.contract.signals import AGENT_SIGNALS

from ..launch.interface import RankPoll
from . import validate

PROGRESS_SAMPLES = 256
"""At most this many (time, step, tokens) samples a rank view keeps for its rates (those of
the last :data:`RATE_WINDOW_S`, one per poll)."""
RATE_WINDOW_S = 30.0
"""Steps/s and tokens/s are measured over this many seconds of the latest progress."""
STEP_TIME_WINDOW = 20
"""A rank view's recent ``step_time`` median is over its last this many measured steps."""


class Accepted(dict):  # type: ignore[type-arg]
    """An accepted rank message (a plain ``dict`` to every reader) with the line it came from,
    so that ``reports.jsonl`` can keep the rank's own bytes instead of encoding it again."""

    __slots__ = ("line",)

    line: bytes | str | None
    """The line as received (``at`` is not in it); None when the message no longer says what
    the line does (validation replaced a lone surrogate, layers beyond the cap were stripped)."""

    def record(self) -> bytes:
        """The message as one ``reports.jsonl`` line (newline included): the rank's line with
        the supervisor's ``at`` appended (a later duplicate key wins for every JSON reader), or
        the message encoded again when the line is not plain ASCII JSON on one line, or was
        changed at ingest."""
        line = None if self.line is None else _verbatim(self.line)
        at = self.get("at")
        if line is not None and type(at) is float and math.isfinite(at):
            return b'%s,"at":%s}\n' % (line[:-1], repr(at).encode())  # json.dumps' own form
        return (json.dumps(self, separators=(",", ":")) + "\n").encode()


def _verbatim(line: bytes | str) -> bytes | None:
    """``line`` as bytes that can go into ``reports.jsonl`` unchanged: ASCII (no encoding
    question, no Unicode line separator), no line feed or carriage return inside (a line break
    to text-mode readers), ending in the object's closing brace. None otherwise (the message is
    encoded again)."""
    if isinstance(line, str):
        if not line.isascii():
            return None
        line = line.encode()
    line = line.strip(b" \t\n")
    if not line.isascii() or b"\r" in line or b"\n" in line or not line.endswith(b"}"):
        return None
    return line


HEALTH_REPEAT_S = 30.0
"""A rank's unchanged accelerator readings are handed to the policy engine again after this long
(a rule with a ``for:`` in seconds sees time pass)."""


@dataclasses.dataclass
class RankView:
    """What the supervisor knows of one rank in the current generation."""

    rank: int
    step: int | None = None
    loss: float | None = None
    lr: float | None = None
    grad_norm: float | None = None
    summary: dict[str, Any] = dataclasses.field(default_factory=dict)
    layers: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """The per-layer signals of the rank's latest ``report`` (the metrics' per-layer series)."""
    tokens_total: int = 0
    """Tokens the rank reported processing in this generation (the sum of ``tokens``)."""
    total_steps: int | None = None
    """How many steps the script says it trains (``total_steps``), for the ETA."""
    progress: collections.deque[tuple[float, int, int]] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=PROGRESS_SAMPLES)
    )
    """(time, step, tokens_total) at each poll that brought a step: for steps/s and tokens/s."""
    last_seen: float | None = None
    """Supervisor monotonic time of the last message (None: not yet)."""
    exit_code: int | None = None
    done: bool = False
    hang_reported_at: float | None = None
    health_sent: tuple[dict[str, float], float] | None = None
    """The accelerator readings of the latest ``health`` message made for this rank, and when."""
    """When the last ``hang`` message for this silence was made (None: the rank is not silent)."""
    step_time: float | None = None
    """The rank's latest measured ``step_time`` (seconds it computed in a step; None: none
    measured yet in this generation)."""
    step_times: collections.deque[float] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=STEP_TIME_WINDOW)
    )
    """The last :data:`STEP_TIME_WINDOW` measured ``step_time`` values, oldest first."""
    phases: dict[str, float] = dataclasses.field(default_factory=dict)
    """The ``phases`` of the rank's latest message that had any."""

    def step_time_median(self) -> float | None:
        """The median of :attr:`step_times` (None before the first): a rank's recent compute
        time per step, one slow step (a checkpoint, a probe) left out."""
        return statistics.median(self.step_times) if self.step_times else None


class CappedRank(NamedTuple):
    """A rank whose layer names passed the cap: the first message trimmed (for the journal)."""

    rank: int
    generation: int
    step: int
    stripped: int
    """Layer entries stripped from that message."""


class Collector:
    """Validates and fences the current generation's messages; see the module docstring."""

    def __init__(
        self,
        *,
        world_size: int,
        hang_timeout_s: float,
        first_heartbeat_timeout_s: float,
        max_layers_per_rank: int = MAX_LAYERS_PER_RANK,
    ) -> None:
        self.world_size = world_size
        self.hang_timeout_s = hang_timeout_s
        self.first_heartbeat_timeout_s = first_heartbeat_timeout_s
        self.generation: int | None = None
        self.launched_at = 0.0
        self.start_step = 0
        """The step the current generation begins with (its resume plan's)."""
        self.ranks: dict[int, RankView] = {}
        self.dropped: collections.Counter[str] = collections.Counter()
        """Lines dropped, by reason (:mod:`.validate`'s, ``unknown_rank``, ...), and under
        ``too_many_layers`` the messages whose layers beyond the cap were stripped."""
        self.layer_gate = LayerGate(max_layers_per_rank)
        """The distinct layer names admitted per rank, for the run (every generation): the
        entries it stripped are counted per rank in its ``dropped``."""
        self._capped: list[CappedRank] = []
        self._capped_ranks: set[int] = set()
        self.rank_dropped = 0
        self.history: collections.deque[dict[str, Any]] = collections.deque(maxlen=400)
        self.now: float | None = None
        """The latest time the supervisor handed in (its monotonic clock): what ages and rates
        in the live view are measured against."""

    # -- generations --------------------------------------------------------------------------
    def new_generation(self, generation: int, now: float, start_step: int = 0) -> None:
        """Accept ``generation`` from now on; its ranks begin at ``start_step``."""
        self.generation = generation
        self.launched_at = now
        self.start_step = start_step
        self.ranks = {r: RankView(rank=r) for r in range(self.world_size)}

    def fence(self) -> None:
        """Stop accepting anything from the current generation (it is being killed)."""
        self.generation = None

    # -- input ----------------------------------------------------------------------------------
    def ingest(self, rank: int, line: bytes | str, now: float) -> dict[str, Any] | None:
        """Validate one line from ``rank``; returns the accepted message (with ``at``) or None.

        Never raises: a line that cannot be used (:mod:`.validate`), of an unknown rank or of a
        fenced generation is dropped and counted in ``dropped`` by reason. One bad line costs
        that line only. :meth:`read` then :meth:`accept`.
        """
        msg = self.read(rank, line)
        return None if msg is None else self.accept(msg, now)

    def read(self, rank: int, line: bytes | str) -> Accepted | None:
        """The message on one line from ``rank`` if it is valid, of that rank and of the
        current generation (else None, the drop counted); nothing else is updated until it is
        :meth:`accept`-ed."""
        try:
            parsed, repaired = validate.read(line)
            msg = Accepted(parsed)
            if msg["rank"] != rank or rank not in self.ranks:
                self._drop("unknown_rank")
                return None
            if self.generation is None or msg["gen"] != self.generation:
                self._drop("stale_generation")
                return None
            msg.line = None if repaired else line
            return msg
        except validate.Rejected as e:
            self._drop(e.reason)
        except Exception:  # a case validation missed must cost one line, not the supervisor
            self._drop("malformed")
        return None

    def accept(self, msg: Accepted, now: float) -> dict[str, Any] | None:
        """Take a message :meth:`read` returned into the rank's view, stamped with the time
        ``now`` (``at``); None when its generation was fenced since it was read."""
        if msg["gen"] != self.generation:
            self._drop("stale_generation")
            return None
        try:
            return self._accept(msg, now)
        except Exception:  # a case validation missed must cost one line, not the supervisor
            self._drop("malformed")
        return None

    def _accept(self, msg: Accepted, now: float) -> dict[str, Any]:
        rank = msg["rank"]
        layers = msg.get("layers")
        if layers:  # a dict of str -> dict (validated)
            kept = self.layer_gate.admit(rank, layers)
            if kept is not layers:
                self._trim(msg, kept, len(layers) - len(kept))
        msg["at"] = round(now, 3)
        self.now = now
        v = self.ranks[rank]
        v.last_seen = now
        v.hang_reported_at = None
        if msg["type"] == "dropped":
            self.rank_dropped = max(self.rank_dropped, int(msg.get("count") or 0))
        if msg["type"] in ("heartbeat", "report"):
            v.step = msg["step"]
            v.loss, v.lr, v.grad_norm = msg.get("loss"), msg.get("lr"), msg.get("grad_norm")
            v.tokens_total += msg.get("tokens") or 0
            if msg.get("total_steps") is not None:
                v.total_steps = msg["total_steps"]
            step_time = msg.get("step_time")
            if step_time is not None:  # a finite timing (validated)
                v.step_time = float(step_time)
                v.step_times.append(v.step_time)
            if msg.get("phases"):
                v.phases = {name: float(s) for name, s in msg["phases"].items()}
            _record_progress(v, now)
            if msg["type"] == "report":
                v.summary = dict(msg.get("summary") or {})
                v.layers = dict(msg.get("layers") or {})
                self.history.append(
                    {
                        "rank": rank,
                        "step": msg["step"],
                        "loss": msg.get("loss"),
                        **{
                            k: v.summary.get(k)
                            for k in (
                                "grade",
                                "attn_entropy_min",
                                "attn_entropy_min_norm",
                                "max_logit",
                            )
                        },
                    }
                )
        elif msg["type"] == "done":
            v.done = True
        return msg

    def ingest_poll(self, poll: RankPoll, now: float) -> list[dict[str, Any]]:
        """Everything one agent poll brings: the accepted report lines, then (once) the exit.
        :meth:`read_poll` then :meth:`accept_poll`."""
        return self.accept_poll(poll, self.read_poll(poll), now)

    def read_poll(self, poll: RankPoll) -> list[Accepted]:
        """The valid messages of one poll's lines (:meth:`read`), not accepted yet."""
        out = []
        for line in poll.lines:
            msg = self.read(poll.rank, line)
            if msg is not None:
                out.append(msg)
        return out

    def accept_poll(self, poll: RankPoll, msgs: list[Accepted], now: float) -> list[dict[str, Any]]:
        """Accept what :meth:`read_poll` read of ``poll`` (at ``now``), count what its agent
        dropped, and add (once) the rank's ``exit``."""
        out = []
        for msg in msgs:
            accepted = self.accept(msg, now)
            if accepted is not None:
                out.append(accepted)
        if poll.overflow:
            self.dropped["agent_overflow"] += poll.overflow
        if poll.oversize:
            self.dropped["oversize"] += poll.oversize
        if poll.exit_code is not None:
            exited = self.exit(poll.rank, poll.exit_code, poll.generation, now)
            if exited is not None:
                for key in ("lost", "log_tail", "host"):
                    value = getattr(poll, key)
                    if value:
                        exited[key] = value
                out.append(exited)
        return out

    def exit(
        self, rank: int, code: int, generation: int | None, now: float
    ) -> dict[str, Any] | None:
        """The rank's process ended: an ``exit`` message (once) for the current generation.

        ``first`` when it never sent a heartbeat (its ``step`` is then the generation's start);
        a rank that said ``done`` and then died in teardown (gloo's threads aborting at
        interpreter exit, say) has finished: code 0, with the real one as ``teardown_code``.
        """
        v = self.ranks.get(rank)
        if self.generation is None or generation != self.generation:
            return None
        if v is None or v.exit_code is not None:
            return None
        msg = {
            "v": FORMAT_VERSION,
            "type": "exit",
            "gen": self.generation,
            "rank": rank,
            "step": self.start_step if v.step is None else v.step,
            "code": int(code),
            "first": v.step is None,
            "at": round(now, 3),
        }
        if v.done and code != 0:
            msg.update(code=0, teardown_code=int(code))
            code = 0
        v.exit_code = code
        return msg

    def check_hangs(self, now: float) -> list[dict[str, Any]]:
        """``hang`` messages for ranks silent too long: when the silence passes the timeout, and
        again after every further timeout of silence, with the growing ``age_s`` (so a rule such
        as ``hang: 5m`` fires once the silence reaches 5 minutes). Before its first heartbeat a
        rank has the longer ``first_heartbeat_timeout_s``; any message ends the silence."""
        self.now = now
        if self.generation is None:
            return []
        out = []
        for v in self.ranks.values():
            if v.exit_code is not None or v.done:
                continue
            if v.step is None:
                age, limit = now - self.launched_at, self.first_heartbeat_timeout_s
            else:
                age, limit = now - (v.last_seen or now), self.hang_timeout_s
            due = v.hang_reported_at is None or now - v.hang_reported_at >= limit
            if age > limit and due:
                v.hang_reported_at = now
                out.append(
                    {
                        "v": FORMAT_VERSION,
                        "type": "hang",
                        "gen": self.generation,
                        "rank": v.rank,
                        "step": self.start_step if v.step is None else v.step,
                        "age_s": round(age, 3),
                        "first": v.step is None,
                        "timeout_s": limit,
                        "at": round(now, 3),
                    }
                )
        return out

    def health_messages(self, polls: Iterable[RankPoll], now: float) -> list[dict[str, Any]]:
        """``health`` messages for the policy engine: the accelerator readings a poll of the
        current generation carries (its agent's NVML signals, :data:`AGENT_SIGNALS`, as numbers:
        a flag is 0 or 1), at the rank's latest step, when they changed since the rank's last
        one or :data:`HEALTH_REPEAT_S` passed (a poll every 0.25 s repeats the agent's reading
        of every few seconds: one line, not twenty); none for a poll without readings (no NVML),
        of a standby or of another generation."""
        if self.generation is None:
            return []
        out = []
        for p in polls:
            signals, v = p.health, self.ranks.get(p.rank)
            if not isinstance(signals, dict) or v is None or p.generation != self.generation:
                continue
            values = {
                k: float(signals[k])
                for k in AGENT_SIGNALS
                if isinstance(signals.get(k), (int, float)) and math.isfinite(signals[k])
            }
            sent = v.health_sent
            fresh = sent is None or sent[0] != values or now - sent[1] >= HEALTH_REPEAT_S
            if values and fresh:
                v.health_sent = (values, now)
                out.append(
                    {
                        "v": FORMAT_VERSION,
                        "type": "health",
                        "gen": self.generation,
                        "rank": p.rank,
                        "step": self.start_step if v.step is None else v.step,
                        "at": round(now, 3),
                        **values,
                    }
                )
        return out

    # -- views ------------------------------------------------------------------------------------
    def min_step(self) -> int | None:
        """The slowest rank's latest step, once every rank has reported one."""
        steps = [v.step for v in self.ranks.values() if v.step is not None]
        return min(steps) if len(steps) == len(self.ranks) else None

    def all_finished(self) -> bool:
        """Every rank of the current generation exited 0."""
        return bool(self.ranks) and all(v.exit_code == 0 for v in self.ranks.values())

    def all_done(self) -> bool:
        """Every rank of the current generation said ``done`` (its script closed the session at
        the end of training) and exited 0: finished training, not merely exited (a rank's own
        SIGTERM handler that saves and exits 0 is not done)."""
        return self.all_finished() and all(v.done for v in self.ranks.values())

    def final_loss(self) -> float | None:
        """The mean of the ranks' last reported losses."""
        losses = [v.loss for v in self.ranks.values() if isinstance(v.loss, (int, float))]
        return sum(losses) / len(losses) if losses else None

    def heartbeat_age(self, v: RankView, now: float) -> float:
        """Seconds since rank view ``v`` last sent anything (since the launch, before its first
        message)."""
        return max(0.0, now - (self.launched_at if v.last_seen is None else v.last_seen))

    def _drop(self, why: str) -> None:
        self.dropped[why] += 1

    def _trim(self, msg: Accepted, kept: dict[str, Any], stripped: int) -> None:
        """``msg`` keeps only the admitted layers ``kept``: counted, its line no longer recorded
        as it came, and the rank noted for the journal the first time (:meth:`take_capped`)."""
        msg["layers"] = kept
        msg.line = None
        self._drop("too_many_layers")
        rank = msg["rank"]
        if rank not in self._capped_ranks:
            self._capped_ranks.add(rank)
            self._capped.append(CappedRank(rank, msg["gen"], msg["step"], stripped))

    def take_capped(self) -> list[CappedRank]:
        """The ranks whose layer names passed the cap since the last call, each once a run
        (the tick reader journals them)."""
        out, self._capped = self._capped, []
        return out


def _record_progress(v: RankView, now: float) -> None:
    """One (time, step, tokens) sample per poll (the messages of one poll share its time);
    samples older than the rate window are let go, so a rate costs a few samples."""
    sample = (now, v.step if v.step is not None else 0, v.tokens_total)
    p = v.progress
    if p and p[-1][0] == now:
        p[-1] = sample
    else:
        p.append(sample)
    while now - p[0][0] > RATE_WINDOW_S:
        p.popleft()


def rates(v: RankView, now: float, window_s: float = RATE_WINDOW_S) -> tuple[float | None, ...]:
    """(steps/s, tokens/s) of rank view ``v`` over the last ``window_s`` seconds before ``now``:
    0 for a rank silent that long, None before a second of progress was seen (tokens/s is None
    for a rank that reports no tokens)."""
    p = v.progress
    has_tokens = v.tokens_total > 0
    if not p:
        return None, None
    if now - p[-1][0] > window_s:
        return 0.0, (0.0 if has_tokens else None)
    i = 0
    while now - p[i][0] > window_s:  # ends: the last sample is inside the window
        i += 1
    t0, s0, k0 = p[i]
    _, s1, k1 = p[-1]
    span = now - t0
    if span < 1.0:
        return None, None
    return (s1 - s0) / span, ((k1 - k0) / span if has_tokens else None)


def is_finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)
