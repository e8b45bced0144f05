"""The collector: turns raw report lines, exit codes and silence into messages.

Pure bookkeeping (no Ray, no I/O, time passed in): validates every line
against the contract, fences by generation, counts what it drops and why,
and synthesises ``exit`` and ``hang`` messages for the policy engine.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
from typing import Any

from spikeguard.workers.contract import FORMAT_VERSION, MESSAGE_TYPES

_NUMERIC = ("loss", "lr", "grad_norm")


@dataclasses.dataclass
class RankView:
    """What the supervisor knows of one rank in the current generation."""

    rank: int
    step: int | None = None
    loss: float | None = None
    lr: float | None = None
    grad_norm: float | None = None
    summary: dict[str, Any] = dataclasses.field(default_factory=dict)
    last_seen: float | None = None
    """Supervisor monotonic time of the last message (None: not yet)."""
    exit_code: int | None = None
    done: bool = False
    hang_reported: bool = False


class Collector:
    def __init__(
        self, *, world_size: int, hang_timeout_s: float, first_heartbeat_timeout_s: float
    ) -> None:
        self.world_size = world_size
        self.hang_timeout_s = hang_timeout_s
        self.first_heartbeat_timeout_s = first_heartbeat_timeout_s
        self.generation: int | None = None
        self.launched_at = 0.0
        self.ranks: dict[int, RankView] = {}
        self.dropped: collections.Counter[str] = collections.Counter()
        self.rank_dropped = 0
        self.history: collections.deque[dict[str, Any]] = collections.deque(maxlen=400)

    # -- generations --------------------------------------------------------------------------
    def new_generation(self, generation: int, now: float) -> None:
        self.generation = generation
        self.launched_at = now
        self.ranks = {r: RankView(rank=r) for r in range(self.world_size)}

    def fence(self) -> None:
        """Stop accepting anything from the current generation (it is being killed)."""
        self.generation = None

    # -- input ----------------------------------------------------------------------------------
    def ingest(self, rank: int, line: bytes | str, now: float) -> dict[str, Any] | None:
        """Validate one line from ``rank``; returns the accepted message (with ``at``) or None."""
        try:
            msg = json.loads(line)
        except (ValueError, UnicodeDecodeError):
            return self._drop("malformed")
        if not isinstance(msg, dict):
            return self._drop("malformed")
        why = _invalid(msg)
        if why:
            return self._drop(why)
        if msg["rank"] != rank or rank not in self.ranks:
            return self._drop("unknown_rank")
        if self.generation is None or msg["gen"] != self.generation:
            return self._drop("stale_generation")
        msg["at"] = round(now, 3)
        v = self.ranks[rank]
        v.last_seen = now
        if msg["type"] == "dropped":
            self.rank_dropped = max(self.rank_dropped, int(msg.get("count") or 0))
        if msg["type"] in ("heartbeat", "report"):
            v.step = msg["step"]
            for k in _NUMERIC:
                setattr(v, k, msg.get(k))
            if msg["type"] == "report":
                v.summary = dict(msg.get("summary") or {})
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

    def exit(
        self, rank: int, code: int, generation: int | None, now: float
    ) -> dict[str, Any] | None:
        """The rank's process ended; returns an ``exit`` message (once) for the current generation."""
        v = self.ranks.get(rank)
        if (
            v is None
            or generation != self.generation
            or self.generation is None
            or v.exit_code is not None
        ):
            return None
        msg = {
            "v": FORMAT_VERSION,
            "type": "exit",
            "gen": self.generation,
            "rank": rank,
            "step": v.step if v.step is not None else -1,
            "code": int(code),
            "at": round(now, 3),
        }
        if v.done and code != 0:
            # it said `done` (training finished) and then died in teardown (e.g. gloo's threads
            # aborting at interpreter exit): the training is complete, not a crash to recover
            msg.update(code=0, teardown_code=int(code))
            code = 0
        v.exit_code = code
        return msg

    def check_hangs(self, now: float) -> list[dict[str, Any]]:
        """``hang`` messages for ranks silent too long (first heartbeat has its own, longer timeout)."""
        if self.generation is None:
            return []
        out = []
        for v in self.ranks.values():
            if v.exit_code is not None or v.done or v.hang_reported:
                continue
            if v.step is None:
                age, limit = now - self.launched_at, self.first_heartbeat_timeout_s
            else:
                age, limit = now - (v.last_seen or now), self.hang_timeout_s
            if age > limit:
                v.hang_reported = True
                out.append(
                    {
                        "v": FORMAT_VERSION,
                        "type": "hang",
                        "gen": self.generation,
                        "rank": v.rank,
                        "step": v.step if v.step is not None else -1,
                        "age_s": round(age, 3),
                        "first": v.step is None,
                        "at": round(now, 3),
                    }
                )
        return out

    # -- views ------------------------------------------------------------------------------------
    def min_step(self) -> int | None:
        steps = [v.step for v in self.ranks.values() if v.step is not None]
        return min(steps) if len(steps) == len(self.ranks) else None

    def all_finished(self) -> bool:
        return bool(self.ranks) and all(v.exit_code == 0 for v in self.ranks.values())

    def final_loss(self) -> float | None:
        losses = [v.loss for v in self.ranks.values() if isinstance(v.loss, (int, float))]
        return sum(losses) / len(losses) if losses else None

    def _drop(self, why: str) -> None:
        self.dropped[why] += 1
        return None


def _invalid(msg: dict[str, Any]) -> str | None:
    if msg.get("v") != FORMAT_VERSION:
        return "bad_version"
    if msg.get("type") not in MESSAGE_TYPES:
        return "unknown_type"
    for k in ("rank", "gen", "step"):
        if not isinstance(msg.get(k), int) or isinstance(msg.get(k), bool):
            return "wrong_type"
    for k in _NUMERIC:
        x = msg.get(k)
        if x is not None and (not isinstance(x, (int, float)) or isinstance(x, bool)):
            return "wrong_type"
    for k in ("summary", "layers"):
        if k in msg and not isinstance(msg[k], dict):
            return "wrong_type"
    return None


def is_finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)
