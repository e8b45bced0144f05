"""The policy engine: a pure, deterministic function from a message stream to decisions.

``Engine(policy).observe(msg)`` takes one message at a time (rank messages per
``workers/contract.py`` plus the supervisor's ``exit`` and ``hang``) and returns the decisions it
triggers. Nothing here reads a clock, a file or the environment: time comes from each
message's ``at`` (the supervisor's monotonic seconds), or ``t`` when ``at`` is absent, so the
same messages always give the same decisions, and :func:`replay` over ``reports.jsonl``
reproduces what the live supervisor saw.

Semantics, per rule:

* A rule is evaluated on the messages that carry its signals: per-layer signals on ``report``,
  loss/grad_norm/lr on ``heartbeat`` and ``report`` (once per step), ``crash`` on ``exit``,
  ``hang`` on ``hang``. With ``layers:`` each matching layer is its own instance, otherwise the
  rank's summary is used.
* ``for:`` counts consecutive true evaluations of an instance (samples), the steps they span
  (last − first + 1), or the time between the first and the current one.
* A rank holds the rule when one of its instances has held long enough and the step is past
  warm-in. Scope ``any`` fires per rank; ``all``/``fraction``/``at_least`` fire once for the
  group when enough ranks hold it (rank None in the decision).
* Firing is edge-triggered like a Prometheus alert: one decision when the rule starts to hold,
  none while it keeps holding, and (for notify rules with ``send_resolved``) a resolved decision
  when it stops. ``cooldown`` keeps the whole rule quiet for a while after it fired; step
  cooldowns count steps of training seen, so a rollback does not stretch them.
* Warm-in compares the absolute training step with the rule's warm-in.
* A message with a higher ``gen`` starts a new generation (a relaunch): persistence and firing
  state restart; the trailing series are rewound to the step the generation resumed at (its
  first heartbeat or report): points before that step stay (the history the checkpoint was
  trained through, a baseline a spike coming back right after the resume is measured against),
  points from it on are dropped (the abandoned timeline, spike included). Since a series holds
  only its window, the engine keeps a copy of every series as it stood at each of the last
  :data:`SNAPSHOTS` checkpoints (``checkpoint`` messages) to rewind to. A restart from step 0,
  or from further back than those checkpoints, keeps nothing. Warm-in is not re-applied (the
  resumed step is usually past it; if a rollback lands inside it, it applies as to any step);
  cooldowns and the step clock carry over. Messages of an older generation are ignored, and so
  are messages of a generation passed to :meth:`Engine.retire` (the supervisor killed it).
* A rank's layers are those of the first ``MAX_LAYERS_PER_RANK`` distinct names it reported
  (:class:`~spikeguard.workers.contract.messages.LayerGate`, the collector's gate, applied
  again here so that a replay of any ``reports.jsonl`` is bounded too): the others are left out
  of its reports (counted in :attr:`Engine.layers_dropped`). Series, instances and snapshots are
  kept per admitted layer only, so the engine's memory is bounded by ranks x that cap.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

from spikeguard.workers.contract.messages import MAX_LAYERS_PER_RANK, LayerGate
from spikeguard.workers.contract.signals import LAYER_SIGNALS

from .conditions import Change, PeerRelative, Trailing
from .evaluate import (
    Context,
    Hit,
    PeerKey,
    Peers,
    RankMessage,
    Series,
    evaluate,
    number,
    peer_key,
    screen,
)
from .schema import FractionOfRanks, Policy, RecoverySettings, Rule
from .values import Duration

SNAPSHOTS = 4
"""Checkpoints whose series the engine keeps to rewind to after a rollback (see above)."""
MAX_HOST_CHARS = 100
"""A rank's host name (its ``hello``) as a peer comparison's reason names it, at most."""

__all__ = ["Decision", "Engine", "replay"]


@dataclasses.dataclass(frozen=True)
class Decision:
    """What a rule decided on a message."""

    rule: str
    action: Literal["notify", "recover", "checkpoint", "stop"]
    severity: Literal["info", "warn", "page"]
    reason: str
    """One sentence with the numbers."""
    rank: int | None
    """The rank, or None when the rule's scope spans ranks."""
    layer: str | None
    step: int
    signal: str | None
    value: float | None
    generation: int
    recovery: RecoverySettings
    """The effective recovery settings (the rule's overrides applied)."""
    resolved: bool = False
    """True for the 'no longer holds' message of a notify rule (policy notify.send_resolved)."""
    repeated: bool = False
    """True for the reminder that a notify rule still holds (policy notify.repeat_interval)."""
    at: float | None = None
    """The message time (supervisor seconds) the decision was made at."""

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["recovery"] = self.recovery.model_dump(mode="json")
        if d["value"] is not None and not math.isfinite(d["value"]):
            d["value"] = str(d["value"])
        return d


_SUMMARY: tuple[None] = (None,)
"""The one instance of a rule without ``layers:`` (or of any rule on a heartbeat)."""


@dataclasses.dataclass
class _Instance:
    count: int = 0
    since_step: int = 0
    since_at: float = 0.0
    last_step: int | None = None
    hit: Hit | None = None
    ready: bool = False


@dataclasses.dataclass
class _Firing:
    """Whether a rule fires for one scope (a rank, or the ranks together), and on what."""

    firing: bool = False
    hit: Hit | None = None
    rank: int | None = None
    notified_at: float = 0.0
    """When a notify rule last told anyone that it holds (for notify.repeat_interval)."""


class _Compiled:
    def __init__(self, index: int, rule: Rule, policy: Policy) -> None:
        self.index, self.rule = index, rule
        self.cadence = rule.when.cadence()
        # evaluated on every message, not once a step: an exit, a hang, and the agent's health
        # readings (several a step, or none for many steps: an XID read once must be seen)
        self.events = self.cadence <= {"exit", "hang", "health"}
        self.when = rule.when
        self.scope = rule.ranks
        self.recovery = policy.recovery_for(rule)
        default = policy.warm_in.value if rule.uses_layer_signals else 0
        self.warm_in = int(rule.warm_in.value) if rule.warm_in is not None else int(default)

    def layers(self, msg: RankMessage) -> Iterable[str | None]:
        globs = self.rule.layers
        if globs is None or msg.type != "report":
            return _SUMMARY
        return [name for name in msg.layers if any(fnmatch.fnmatchcase(name, g) for g in globs)]

    def persisted(self, inst: _Instance, step: int, at: float) -> bool:
        d: Duration | None = self.rule.for_
        if d is None:
            return True
        if d.unit == "samples":
            return inst.count >= d.value
        if d.unit == "steps":
            return step - inst.since_step + 1 >= d.value
        return at - inst.since_at >= d.value


class Engine:
    """Evaluates a policy over a message stream; see the module docstring for the semantics."""

    def __init__(self, policy: Policy, *, max_layers_per_rank: int = MAX_LAYERS_PER_RANK) -> None:
        self.policy = policy
        self.rules = [_Compiled(i, r, policy) for i, r in enumerate(policy.rules)]
        self.generation: int | None = None
        self.retired = -1
        self.ignored = 0
        """Messages ignored so far (older or retired generation, or malformed)."""
        self._layer_gate = LayerGate(max_layers_per_rank)
        """The layer names admitted per rank, for the engine's life (every generation)."""
        self._by_type: dict[str, list[_Compiled]] = {}
        """Message type -> the rules evaluated on it, in policy order (their cadence)."""
        for c in self.rules:
            for t in c.cadence:
                self._by_type.setdefault(t, []).append(c)
        self._peers: dict[PeerKey, Peers] = {}
        """The per-rank medians each peer comparison reads (cleared for a new generation)."""
        for c in self.rules:
            for leaf in c.rule.when.leaves():
                if isinstance(leaf, PeerRelative) and peer_key(leaf) not in self._peers:
                    span, within = int(leaf.median_of.value), int(leaf.peers_within.value)
                    self._peers[peer_key(leaf)] = Peers(span, leaf.need, within)
        self._hosts: dict[int, str] = {}
        """Rank -> its host, from its ``hello`` of the current generation."""
        self._screens = [
            (
                c.warm_in if c.warm_in > 0 else -math.inf,
                c.index,
                c.scope != "any",
                screen(c.when, self._peers),
            )
            for c in self._by_type.get("heartbeat", ())
        ]
        """(warm-in, rule index, scoped over ranks, :func:`~.evaluate.screen`) of the rules a
        heartbeat is evaluated on, for :meth:`quiet`."""
        self._history: dict[str, int] = {}  # signal -> series length it needs
        for c in self.rules:
            for leaf in c.rule.when.leaves():
                if isinstance(leaf, Trailing):
                    size = leaf.window
                    if leaf.median_of is not None:
                        need = int(size.value) + int(leaf.median_of.value) + 2
                        self._history[leaf.signal] = max(self._history.get(leaf.signal, 0), need)
                        continue
                elif isinstance(leaf, Change):
                    size = leaf.within
                else:
                    continue
                need = int(size.value) + 2
                self._history[leaf.signal] = max(self._history.get(leaf.signal, 0), need)
        self._earlier = tuple(dict.fromkeys([*self._history, *(k[0] for k in self._peers)]))
        """The signals :meth:`quiet` collects from a poll's earlier messages for the screens."""
        self._fired: dict[
            int, tuple[int, float]
        ] = {}  # rule -> (step clock, at) of the last firing
        self._progress = 0
        self._last_at = 0.0
        self._series: dict[tuple, Series] = {}  # (rank, layer, signal) -> recent points
        self._snapshots: dict[int, dict[tuple, Series]] = {}  # checkpoint step -> series
        self._rewind_from: dict[tuple, Series] | None = None  # set for a new generation
        self._reset_generation()
        self._rewind_from = None  # the first generation has nothing to rewind

    def _reset_generation(self) -> None:
        self._rewind_from = self._series
        self._series = {}
        self._instances: dict[tuple[int, int], dict[str | None, _Instance]] = {}
        self._groups: dict[tuple[int, int | None], _Firing] = {}
        self._holding: dict[int, dict[int, Hit]] = {}
        """Rule index -> the ranks that hold it now (rules scoped over ranks)."""
        self._active: dict[tuple[int, int], None] = {}
        """(rule index, rank) whose condition held on the rank's latest message (part-way
        through its ``for:``, or holding): the rank's next message may decide (:meth:`quiet`)."""
        self._building: dict[tuple[int, int], None] = {}
        """The part of ``_active`` not holding yet: part-way through ``for:``
        (:meth:`pending_ranks`)."""
        self._ranks: set[int] = set()
        self._world_size = 0
        self._max_step: int | None = None
        self._last_step: dict[int, int] = {}
        for table in self._peers.values():
            table.clear()
        self._hosts.clear()

    def _snapshot(self, step: int) -> None:
        """Keep the series as they stand at a checkpoint of ``step`` (once per step)."""
        if step in self._snapshots:
            return
        self._snapshots[step] = {
            key: kept for key, s in self._series.items() if (kept := s.rewound(step + 1))
        }
        for old in sorted(self._snapshots)[:-SNAPSHOTS]:
            del self._snapshots[old]

    def _rewind(self, step: int) -> None:
        """The generation resumed at ``step``: keep each series' points before it, from the live
        series and the newest checkpoint snapshot before it."""
        live: dict[tuple, Series] = self._rewind_from or {}
        base = max((c for c in self._snapshots if c < step), default=None)
        older = self._snapshots[base] if base is not None else {}
        self._series = {
            key: kept
            for key in {*live, *older}
            if (kept := Series.rewind(step, live.get(key), older.get(key))) is not None
        }
        for c in [c for c in self._snapshots if c >= step]:
            del self._snapshots[c]  # checkpoints of the abandoned timeline
        self._rewind_from = None

    def pending_ranks(self) -> set[int]:
        """The ranks a rule is part-way to firing on: its condition held on their latest
        message, not yet for as long as its ``for:`` asks. Their next message may fire it,
        whatever its values, so the supervisor reads them first in a tick, before it validates
        anything else. (A rank on which a rule already holds is not pending: its next message
        can only resolve it, or fire it again after a cooldown; :meth:`quiet` still counts it
        as one that may decide.)"""
        return {rank for _, rank in self._building}

    def quiet(self, msgs: Sequence[dict]) -> bool:
        """Whether observing ``msgs`` (one rank's messages, in order, next in the stream) is
        certain to decide nothing: they are heartbeats of the current generation, no rule holds
        on the rank or is part-way through its ``for:`` there, and no rule's condition can hold
        on their values (:func:`~.evaluate.screen`: thresholds, non-finite tests and the
        trailing-median tests are answered from the values and the window's minimum or
        maximum; anything else counts as possible).

        The supervisor reads the ranks whose messages are not quiet first in a tick, so that a
        decision does not wait for every other rank's evaluation. Sound, not exact: ``False``
        only means a decision is possible. It never changes what is decided.
        """
        if self._rewind_from is not None:
            return False  # a relaunch's first step: the series are about to be rewound
        extra: dict[str, list[float]] = {}  # this poll's earlier values, per signal
        active, holding, series = self._active, self._holding, self._series
        last = len(msgs) - 1
        for i, msg in enumerate(msgs):
            if msg.get("type") != "heartbeat" or msg.get("gen") != self.generation:
                return False
            rank, step = msg.get("rank"), number(msg.get("step"))
            if step is None:
                return False
            for warm_in, index, scoped, cannot in self._screens:
                if step < warm_in:
                    continue
                # a rule firing on the rank holds there; over ranks, some rank holds it
                if (active and (index, rank) in active) or (scoped and holding.get(index)):
                    return False
                if not cannot(msg, series, rank, extra):
                    return False
            if i < last:
                for signal in self._earlier:
                    v = number(msg.get(signal))
                    if v is not None:
                        extra.setdefault(signal, []).append(v)
        return True

    def retire(self, generation: int) -> None:
        """Ignore every later message of ``generation`` and older (the supervisor killed it)."""
        self.retired = max(self.retired, generation)

    # --- the message loop -----------------------------------------------------------------

    def observe(self, msg: dict) -> list[Decision]:
        """Feed one message; returns the decisions it triggers (usually none)."""
        parsed = self._accept(msg)
        if parsed is None:
            return []
        self._record(parsed)
        out: list[Decision] = []
        for c in self._by_type.get(msg["type"], ()):  # a str (see _accept)
            decided = self._evaluate(c, parsed)
            if decided:
                out.extend(decided)
        return out

    def _accept(self, msg: Any) -> RankMessage | None:
        if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
            self.ignored += 1
            return None
        gen, rank = msg.get("gen", 0), msg.get("rank")
        if (
            not isinstance(gen, int)
            or isinstance(gen, bool)
            or not isinstance(rank, int)
            or isinstance(rank, bool)
        ):
            self.ignored += 1
            return None
        if gen <= self.retired or (self.generation is not None and gen < self.generation):
            self.ignored += 1
            return None
        if self.generation is None or gen > self.generation:
            if self.generation is not None:
                self._reset_generation()
            self.generation = gen
        step = number(msg.get("step"))
        if (
            step is None
            or not math.isfinite(step)
            or (step < 0 and msg["type"] in ("exit", "hang"))
        ):
            if msg["type"] not in ("exit", "hang"):
                self.ignored += 1
                return None
            step = self._last_step.get(rank, max(self._max_step or 0, 0))  # -1: before any step
        at = number(msg.get("at"))
        if at is None:
            at = number(msg.get("t"))
        if at is not None and math.isfinite(at):
            self._last_at = at
        m = RankMessage(msg, int(step), self._last_at)
        if m.layers:
            m.layers = self._layer_gate.admit(m.rank, m.layers)
        return m

    @property
    def layers_dropped(self) -> int:
        """Layer entries left out of the messages so far: their rank had reported
        ``MAX_LAYERS_PER_RANK`` other names already."""
        return sum(self._layer_gate.dropped.values())

    def _record(self, m: RankMessage) -> None:
        self._ranks.add(m.rank)
        if m.type == "hello" and isinstance(m.raw.get("world_size"), int):
            self._world_size = m.raw["world_size"]
        if m.type == "hello" and isinstance(m.raw.get("host"), str) and self._peers:
            self._hosts[m.rank] = m.raw["host"][:MAX_HOST_CHARS]
        if m.type == "checkpoint" and self._rewind_from is None:
            self._snapshot(m.step)
        if m.type not in ("heartbeat", "report"):
            return  # only these carry a training step (a relaunch says hello at step 0)
        if self._rewind_from is not None:  # the generation's first step: where it resumed
            self._rewind(m.step)
        self._last_step[m.rank] = max(m.step, self._last_step.get(m.rank, m.step))
        if self._max_step is None:
            self._max_step = m.step
        elif m.step > self._max_step:
            self._progress += m.step - self._max_step
            self._max_step = m.step
        for signal, need in self._history.items():
            keys: list[str | None] = [None]
            if signal in LAYER_SIGNALS:
                if m.type != "report":
                    continue
                keys += list(m.layers)
            for layer in keys:
                v = m.value(signal, layer)
                if v is not None:
                    s = self._series.get((m.rank, layer, signal))
                    if s is None:
                        s = self._series[(m.rank, layer, signal)] = Series(need)
                    s.add(m.step, v)
        for (signal, _, _), table in self._peers.items():
            v = m.value(signal, None)
            if v is not None:
                table.add(m.rank, m.step, v, number(m.raw.get("t")))
            table.expire(self._max_step)

    def _evaluate(self, c: _Compiled, m: RankMessage) -> list[Decision]:
        key = (c.index, m.rank)
        per_layer = self._instances.get(key)
        if per_layer is None:
            per_layer = self._instances[key] = {}
        for layer in c.layers(m):
            inst = per_layer.get(layer)
            if inst is None:
                inst = per_layer[layer] = _Instance()
            if not c.events:
                if inst.last_step is not None and m.step <= inst.last_step:
                    continue  # this step was already evaluated (heartbeat, then the report)
                inst.last_step = m.step
            hit = (
                None
                if c.warm_in > 0 and m.step < c.warm_in
                else evaluate(c.when, Context(m, layer, self._series, self._peers, self._hosts))
            )
            if hit is None:
                if inst.count:
                    inst.count, inst.hit, inst.ready = 0, None, False
                continue
            if inst.count == 0:
                inst.since_step, inst.since_at = m.step, m.at
            inst.count += 1
            inst.hit = hit
            inst.ready = c.persisted(inst, m.step, m.at)
        hit, active = None, False
        for inst in per_layer.values():  # the rank holds the rule on its first ready instance
            if inst.count:
                active = True
                if inst.ready:
                    hit = inst.hit
                    break
        if active:
            self._active[key] = None
        elif key in self._active:
            del self._active[key]
        if active and hit is None:  # held, not yet for long enough
            self._building[key] = None
        elif key in self._building:
            del self._building[key]
        scope = c.scope
        if scope == "any":
            return self._update(c, m, key, hit, m.rank, str)
        holding = self._holding.get(c.index)
        if holding is None:
            holding = self._holding[c.index] = {}
        if hit is None:
            holding.pop(m.rank, None)
        else:
            holding[m.rank] = hit
        world = max(self._world_size, len(self._ranks))
        if scope == "all":
            need = world
        elif isinstance(scope, FractionOfRanks):
            need = max(1, math.ceil(scope.fraction * world - 1e-9))
        else:
            need = scope.at_least
        hit, lead = None, None
        if len(holding) >= need:
            lead = m.rank if m.rank in holding else min(holding)
            hit = holding[lead]

        def who() -> str:
            ranks = ", ".join(map(str, sorted(holding)))
            return f"{len(holding)} of {world} ranks ({ranks}) hold it; "

        return self._update(c, m, (c.index, None), hit, lead, who)

    def _update(
        self,
        c: _Compiled,
        m: RankMessage,
        key: tuple,
        hit: Hit | None,
        rank: int | None,
        who: Callable[[], str],
    ) -> list[Decision]:
        """The decision (if any) of rule ``c`` for one scope (``key``) now that it holds on
        ``hit`` (None: it does not); ``who`` says which ranks hold it, for the reason."""
        group = self._groups.get(key)
        if group is None:
            if hit is None:
                return []  # never fired here: nothing to resolve or repeat
            group = self._groups[key] = _Firing()
        elif hit is None and not group.firing:
            return []
        rule = c.rule
        if hit is not None and not group.firing:
            if self._cooling(c, m):
                return []
            group.firing, group.hit, group.rank = True, hit, rank
            group.notified_at = m.at
            self._fired[c.index] = (self._progress, m.at)
            where = f"rank {rank}" + (f" layer {hit.layer}" if hit.layer else "")
            held = f" (held for {rule.for_})" if rule.for_ is not None else ""
            reason = f"{who()}{where}: {hit.text}{held}"
            return [self._decision(c, m, reason, key[1], hit.layer, hit.signal, hit.value)]
        repeat = self.policy.notify.repeat_interval
        reminder_due = repeat is not None and m.at - group.notified_at >= repeat.value
        if hit is not None and rule.action == "notify" and reminder_due:  # still holding
            group.notified_at = m.at
            where = f"rank {group.rank}" + (f" layer {hit.layer}" if hit.layer else "")
            reason = f"still holding ({repeat} after the last notification): {where}: {hit.text}"
            return [
                self._decision(
                    c, m, reason, key[1], hit.layer, hit.signal, hit.value, repeated=True
                )
            ]
        if hit is None and group.firing:
            group.firing = False
            if rule.action == "notify" and self.policy.notify.send_resolved:
                prev = group.hit
                where = "the ranks" if key[1] is None else f"rank {key[1]}"
                reason = f"resolved: {rule.name} no longer holds on {where}"
                return [
                    self._decision(
                        c,
                        m,
                        reason,
                        key[1],
                        prev.layer if prev else None,
                        prev.signal if prev else None,
                        None,
                        resolved=True,
                    )
                ]
        return []

    def _cooling(self, c: _Compiled, m: RankMessage) -> bool:
        d, last = c.rule.cooldown, self._fired.get(c.index)
        if d is None or last is None:
            return False
        if d.unit == "steps":
            return self._progress - last[0] < d.value
        return m.at - last[1] < d.value

    def _decision(
        self,
        c: _Compiled,
        m: RankMessage,
        reason: str,
        rank: int | None,
        layer: str | None,
        signal: str | None,
        value: float | None,
        resolved: bool = False,
        repeated: bool = False,
    ) -> Decision:
        rule = c.rule
        return Decision(
            rule=rule.name,
            action=rule.action,
            severity=rule.severity,
            reason=reason,
            rank=rank,
            layer=layer,
            step=m.step,
            signal=signal,
            value=value,
            generation=self.generation or 0,
            recovery=c.recovery,
            resolved=resolved,
            repeated=repeated,
            at=m.at,
        )


def replay(policy: Policy, messages: Iterable[dict]) -> list[Decision]:
    """The decisions a live supervisor would have taken on these messages, in order.

    Like the supervisor, a ``recover`` or ``stop`` decision for generation g ends g at once: the
    rest of that message's decisions and g's later messages (the ranks it kills) are ignored.
    A live supervisor that calls :meth:`Engine.retire` when it kills a generation sees exactly
    these decisions.
    """
    engine = Engine(policy)
    out: list[Decision] = []
    for msg in messages:
        for d in engine.observe(msg):
            out.append(d)
            if d.action in ("recover", "stop"):
                engine.retire(d.generation)
                break
    return out
