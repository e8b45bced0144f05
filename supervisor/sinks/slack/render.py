"""Pure rendering of journal events into Slack messages (Block Kit + plain-text fallback).

No I/O and no Slack client here: :class:`IncidentView` folds the journal events of one incident
into what the thread's root message shows, and the ``*_message`` functions turn views and events
into :class:`SlackMessage` objects. Every user-supplied string is escaped for mrkdwn and every
text is clipped to Block Kit's limits (header 150 chars, section text 3000, field 2000), so a very
long reason or run name degrades to an ellipsis instead of an ``invalid_blocks`` error at 3 a.m.
What a rank named (a layer, a checkpoint path) is a code span wherever it appears, a reason's
``layer NAME`` included (:func:`~...observe.describe.code`): a URL, a ``<!channel>`` or ``*bold*``
in a layer's name is shown as text, never as a link, a mention or markup.

With Socket Mode on (:attr:`~.settings.SlackSettings.buttons`) the root message also carries the
operator buttons (:data:`BUTTONS`): those the incident's state offers (:func:`offered`), each
naming its run and incident in its value (:func:`button_value`); :mod:`.buttons` answers them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from spikeguard.workers.contract.signals import grade_text, is_grade

from ...decide.events import Code, Kind
from ...decide.lifecycle import CONCLUDED, IncidentState, leads_to
from ...observe.describe import MISSING, code, describe, duration_text, esc, num, ranks_text, spans

HEADER_MAX, SECTION_MAX, FIELD_MAX, CONTEXT_MAX, TEXT_MAX = 150, 3000, 2000, 2000, 3900
EMOJI = {
    "incident": ":rotating_light:",
    "alert": ":warning:",
    "kill": ":octagonal_sign:",
    "rollback": ":rewind:",
    "lr_cut": ":chart_with_downwards_trend:",
    "optimizer_reset": ":arrows_counterclockwise:",
    "probation_start": ":hourglass_flowing_sand:",
    "probation_progress": ":hourglass_flowing_sand:",
    "probation_passed": ":white_check_mark:",
    "probation_failed": ":x:",
    "escalated": ":sos:",
    "failed": ":sos:",
    "completed": ":checkered_flag:",
    "launch": ":rocket:",
    "stopped": ":stop_button:",
    "forensics": ":mag:",
    "operator": ":raising_hand:",
}


@dataclass(frozen=True)
class Button:
    """One operator button of an incident's root message."""

    action: str
    """The operator request it writes (``ack``, ``hold``, ``resume``, ``stop``)."""
    action_id: str
    """Its Block Kit ``action_id``, by which a press names it."""
    label: str
    """What it says (plain text, <= 75 chars)."""
    style: str | None = None
    """``primary`` or ``danger``; None: the default look."""
    confirm: str | None = None
    """A confirm dialog's text, for a button that cannot be taken back."""


RESUME_LR_FACTOR = 0.5
"""The Resume button's LR factor: the run's LR scale times this."""
BUTTONS = (
    Button("ack", "spikeguard_ack", "Acknowledge", "primary"),
    Button("hold", "spikeguard_hold", "Hold"),
    Button("resume", "spikeguard_resume", f"Resume with LR ×{RESUME_LR_FACTOR:g}"),
    Button(
        "stop",
        "spikeguard_stop",
        "Stop",
        "danger",
        "Stop the run? Its ranks are killed and the supervisor exits; "
        "spikeguard resume RUN_DIR can supervise it again later.",
    ),
)
"""The operator buttons, in the order they show."""
BUTTONS_BLOCK_ID = "spikeguard_operator"
"""The ``block_id`` of the root message's buttons."""
VALUE_MAX = 2000
"""Block Kit's limit on a button's ``value``."""


@dataclass(frozen=True)
class SlackMessage:
    """One Slack message: ``text`` is the notification/accessibility fallback, always set."""

    text: str
    blocks: list[dict[str, Any]]


@dataclass(frozen=True)
class Links:
    """Where a reader goes next; any of them may be missing."""

    run_dir_url: str | None = None
    dashboard_url: str | None = None
    runbook_url: str | None = None


def clip(text: str, limit: int) -> str:
    """Clip ``text`` to ``limit`` characters, ending with an ellipsis when shortened."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def parse_time(value: Any) -> float | None:
    """Seconds since the epoch of an ISO-8601 journal ``time``; None when absent or invalid."""
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


FIRED_FIELDS = (
    "rule",
    "action",
    "severity",
    "signal",
    "value",
    "rank",
    "layer",
    "step",
    "loss",
    "grad_norm",
    "grade",
    "reason",
)
"""What the root message shows of the event that opened the incident."""


def _rolled_back(e: Mapping[str, Any]) -> str | None:
    if e.get("checkpoint_step") is None:
        return None  # no checkpoint: the escalation that follows says why
    return f"rolled back to step {num(e.get('checkpoint_step'))} ({grade_text(e.get('grade'))})"


DONE: dict[Kind, Callable[[Mapping[str, Any]], str | None]] = {
    Kind.INCIDENT: lambda e: f"fired again at step {num(e.get('step'))}",
    Kind.KILL: lambda e: f"killed ranks {ranks_text(e.get('ranks'))}",
    Kind.ROLLBACK: _rolled_back,
    Kind.LR_CUT: lambda e: f"LR ×{num(e.get('factor'))} (scale {num(e.get('lr_scale'))})",
    Kind.OPTIMIZER_RESET: lambda e: "optimizer reset",
    Kind.LAUNCH: lambda e: f"relaunched gen {e.get('generation')}",
    Kind.PROBATION_START: lambda e: f"probation until step {num(e.get('until_step'))}",
    Kind.PROBATION_FAILED: lambda e: f"probation failed at step {num(e.get('step'))}",
}
"""How a recovery step reads in the root message's "Done so far" (a short form of its line)."""


@dataclass
class IncidentView:
    """What the root message of one incident thread shows, folded from its journal events.

    The incident's state follows :data:`~...decide.lifecycle.LIFECYCLE`, the journal's own table of
    where each kind of event leaves an incident; this view only renders the steps.
    """

    run: str
    incident: str
    state: IncidentState = IncidentState.RECOVERING
    fired: dict[str, Any] = field(default_factory=dict)
    done: list[str] = field(default_factory=list)
    started: float | None = None
    ended: float | None = None
    outcome: str | None = None
    probation_until: int | None = None
    version: int = 0
    context: dict[str, Any] | None = None
    acknowledged_by: str | None = None
    """Who acknowledged it (``U123 (alice) via slack``); its reminders stop."""
    held_by: str | None = None
    """Who put automatic recovery on hold (until a resume or a lifted hold)."""
    waiting: bool = False
    """A human is needed and the supervisor waits for one (held, or escalated with ``hold``)."""
    over: bool = False
    """The run ended with it (stopped, failed, escalated for good): no one answers buttons."""

    def apply(self, event: Mapping[str, Any], *, buttons: bool = False) -> bool:
        """Fold one event in; True when the root message must be updated: its state changed, or
        who has it, or (``buttons``: the root shows them) the buttons it offers."""
        before = self._shown(buttons)
        self._fold(event)
        if self._shown(buttons) == before:
            return False
        self.version += 1
        return True

    def _shown(self, buttons: bool) -> tuple[Any, ...]:
        """What of the view the root shows beyond its steps (a change means an update)."""
        offer = offered(self) if buttons else ()
        return (self.state, self.acknowledged_by, self.held_by, offer)

    def _fold(self, event: Mapping[str, Any]) -> None:
        kind, code = event.get("kind"), event.get("code")
        if kind == Kind.INCIDENT and not self.fired:
            self.fired = {k: event.get(k) for k in FIRED_FIELDS}
            self.started, self.context = parse_time(event.get("time")), event.get("context") or None
        elif isinstance(kind, str) and kind in DONE:
            step = DONE[Kind(kind)](event)
            if step:
                self.done.append(step)
        if kind == Kind.PROBATION_START:
            self.probation_until = event.get("until_step")
        if kind == Kind.OPERATOR:
            self._hand(str(code), event)
        elif kind == Kind.ESCALATED:
            self.waiting = event.get("hold") is True
            self.over = not self.waiting
        elif kind in (Kind.FAILED, Kind.STOPPED):
            self.waiting, self.over = False, True
        self._move(leads_to(kind, code), event)

    def _hand(self, code: str, event: Mapping[str, Any]) -> None:
        """A human's hand (an ``operator`` event): who has the incident, and whether it waits."""
        who = f"{event.get('who') or MISSING} via {event.get('via') or MISSING}"
        if code == Code.ACKNOWLEDGED:
            self.acknowledged_by = self.acknowledged_by or who
        elif code == Code.HOLD_SET:
            self.held_by = who
        elif code == Code.HOLD_RELEASED:
            self.held_by = None
        elif code == Code.RECOVERY_HELD:
            self.waiting = True
        elif code == Code.OPERATOR_RESUMED:
            self.held_by, self.waiting, self.over = None, False, False

    def _move(self, state: IncidentState | None, event: Mapping[str, Any]) -> None:
        """Take the state ``event`` leads to; a conclusion records when and how it ended, a
        reopening (a human resumed it) forgets when it ended."""
        if state is None:
            return
        if state is IncidentState.RESOLVED:
            self.outcome = describe(event).removeprefix("RESOLVED: ")
        elif state is IncidentState.ESCALATED:
            self.outcome = str(event.get("reason") or "escalated")
        self.ended = parse_time(event.get("time")) if state in CONCLUDED else None
        self.state = state

    @property
    def concluded(self) -> bool:
        """True once the incident reached RESOLVED or ESCALATED."""
        return self.state in CONCLUDED

    @property
    def severity(self) -> str:
        """The incident's severity as journaled (``page`` mentions the on-call)."""
        return str(self.fired.get("severity") or "warn")

    def took(self) -> str | None:
        """How long the incident lasted, once it ended and both times are known."""
        return (
            None
            if self.started is None or self.ended is None
            else duration_text(self.ended - self.started)
        )


def _section(text: str) -> dict[str, Any]:
    return {"type": "section", "text": {"type": "mrkdwn", "text": clip(text, SECTION_MAX)}}


def _fields(pairs: list[tuple[str, str]]) -> dict[str, Any]:
    return {
        "type": "section",
        "fields": [
            {"type": "mrkdwn", "text": clip(f"*{k}*\n{v}", FIELD_MAX)} for k, v in pairs[:10]
        ],
    }


def _context(*texts: str) -> dict[str, Any]:
    return {
        "type": "context",
        "elements": [{"type": "mrkdwn", "text": clip(t, CONTEXT_MAX)} for t in texts[:10]],
    }


def _header(text: str) -> dict[str, Any]:
    return {"type": "header", "text": {"type": "plain_text", "text": clip(text, HEADER_MAX)}}


def _link(url: str | None, label: str) -> str | None:
    if not url:
        return None  # a local path cannot be linked from Slack: show it verbatim
    return (
        f"<{esc(url)}|{label}>"
        if url.startswith(("http://", "https://"))
        else f"{label}: {code(url)}"
    )


def _name(value: Any) -> str:
    """A name a rank supplied (a layer) as a code span; ``—`` when missing."""
    return MISSING if value is None or value == MISSING else code(value)


def _prose(text: Any, layer: Any) -> str:
    """Prose (a reason, an outcome, a plain line) escaped for mrkdwn, the ``layer NAME`` it
    quotes as code."""
    return spans(esc(text), layer)


def links_text(links: Links) -> str | None:
    """``Run directory · Dashboard · Runbook`` as mrkdwn links (the operator buttons, which need
    Socket Mode, are :func:`buttons_block`)."""
    parts = [
        p
        for p in (
            _link(links.run_dir_url, "Run directory"),
            _link(links.dashboard_url, "Dashboard"),
            _link(links.runbook_url, "Runbook"),
        )
        if p
    ]
    return " · ".join(parts) or None


def _ping(text: str, mention: str | None, wanted: bool) -> str:
    return f"{mention} {text}" if (wanted and mention) else text


def root_header(view: IncidentView) -> str:
    """``[RECOVERING] S2 · run-name`` (the incident id when the grade is unknown)."""
    grade = view.fired.get("grade")
    tag = grade_text(grade) if is_grade(grade) else view.incident
    return f"[{view.state.value}] {tag} · {view.run}"


class _Dash(dict):  # type: ignore[type-arg]
    def get(self, key: str, default: Any = "—") -> Any:  # type: ignore[override]
        value = super().get(key)
        return default if value is None else value


def offered(view: IncidentView) -> tuple[Button, ...]:
    """The buttons the incident's state offers: none once it is resolved or the run is over;
    Acknowledge until someone did; Hold while it recovers by itself (and no hold is set);
    Resume only when it waits for a human; Stop while the run lives."""
    if view.over or view.state is IncidentState.RESOLVED:
        return ()
    wanted = {
        "ack": view.acknowledged_by is None,
        "hold": view.held_by is None and not view.waiting,
        "resume": view.waiting,
        "stop": True,
    }
    return tuple(b for b in BUTTONS if wanted[b.action])


def button_value(run: str, incident: str) -> str:
    """What a button carries: the run and incident it acts on, as compact JSON."""
    return json.dumps({"run": run, "incident": incident}, separators=(",", ":"))


def _plain(text: str) -> dict[str, Any]:
    return {"type": "plain_text", "text": text}


def buttons_block(view: IncidentView) -> dict[str, Any] | None:
    """The ``actions`` block of the buttons :func:`offered` (None: none, or a run name so long
    that a value would pass Block Kit's limit)."""
    value = button_value(view.run, view.incident)
    if not offered(view) or len(value) > VALUE_MAX:
        return None
    elements = []
    for b in offered(view):
        el: dict[str, Any] = {
            "type": "button",
            "text": _plain(b.label),
            "action_id": b.action_id,
            "value": value,
        }
        if b.style:
            el["style"] = b.style
        if b.confirm:
            el["confirm"] = {
                "title": _plain(f"{b.label}: are you sure?"),
                "text": _plain(b.confirm),
                "confirm": _plain(b.label),
                "deny": _plain("Cancel"),
            }
        elements.append(el)
    return {"type": "actions", "block_id": BUTTONS_BLOCK_ID, "elements": elements}


def hands_text(view: IncidentView) -> str | None:
    """Who has the incident (acknowledged, holding), as mrkdwn; None: nobody yet."""
    parts = []
    if view.acknowledged_by:
        parts.append(f":eyes: *Acknowledged* by {esc(view.acknowledged_by)}")
    if view.held_by:
        parts.append(f":pause_button: *On hold* (set by {esc(view.held_by)})")
    return " · ".join(parts) or None


def root_message(
    view: IncidentView, links: Links, mention: str | None, *, buttons: bool = False
) -> SlackMessage:
    """The thread's root: what broke, what spikeguard did so far, and whether a human is needed;
    who has it; with ``buttons`` (Socket Mode on), the operator buttons its state offers."""
    f = _Dash(view.fired)  # a missing field shows as "—" (e.g. the incident event was lost)
    layer = view.fired.get("layer")
    where = f"rank {esc(f.get('rank'))}, layer {_name(layer)}"
    what = (
        f"*{esc(f.get('signal'))}* = {esc(num(f.get('value')))} on {where} at step "
        f"{num(f.get('step'))}"
    )
    took = f" in {view.took()}" if view.took() else ""
    status, ping, tail = {
        IncidentState.RECOVERING: (
            f"{EMOJI['incident']} {what}. spikeguard is recovering automatically; "
            "no action needed yet.",
            view.severity == "page",
            "spikeguard is recovering, no action needed yet",
        ),
        IncidentState.PROBATION: (
            f"{EMOJI['probation_start']} Recovery steps done; on probation until step "
            f"{num(view.probation_until)}. No action needed yet.",
            False,
            f"on probation until step {num(view.probation_until)}",
        ),
        IncidentState.RESOLVED: (
            f"{EMOJI['probation_passed']} *Resolved by spikeguard*{took}: "
            f"{_prose(view.outcome, layer)}. No action needed.",
            False,
            f"resolved: {view.outcome}",
        ),
        IncidentState.ESCALATED: (
            f"{EMOJI['escalated']} *Human needed:* {_prose(view.outcome, layer)}. Automatic "
            "recovery has stopped.",
            True,
            f"HUMAN NEEDED: {view.outcome}",
        ),
    }[view.state]
    blocks: list[dict[str, Any]] = [
        _header(root_header(view)),
        _section(_ping(status, mention, ping)),
        _fields(
            [
                ("Grade", grade_text(f.get("grade"))),
                ("Signal", f"`{esc(f.get('signal'))}` = {esc(num(f.get('value')))}"),
                (
                    "Worst rank · layer",
                    f"rank {esc(f.get('rank'))} · layer {_name(layer)} (fell first)",
                ),
                ("Step", num(f.get("step"))),
                ("Loss", esc(num(f.get("loss")))),
                ("Grad norm", esc(num(f.get("grad_norm"), 3))),
                ("Rule", f"`{esc(f.get('rule'))}` → {esc(f.get('action'))}"),
                ("Severity", esc(view.severity)),
            ]
        ),
    ]
    if view.fired.get("reason"):
        blocks.append(_section(f"*Why:* {_prose(view.fired['reason'], layer)}"))
    if view.done:
        blocks.append(_section("*Done so far:* " + " → ".join(esc(d) for d in view.done)))
    if hands_text(view):
        blocks.append(_context(hands_text(view)))  # type: ignore[arg-type]
    actions = buttons_block(view) if buttons else None
    if actions:
        blocks.append(actions)
    blocks.append(
        _context(*[t for t in (links_text(links), f"incident {code(view.incident)}") if t])
    )
    fallback = (
        f"{esc(root_header(view))}: {esc(f.get('signal'))}={esc(num(f.get('value')))} on "
        f"{where} at step {num(f.get('step'))} — {_prose(tail, layer)}"
    )
    return SlackMessage(clip(_ping(fallback, mention, ping), TEXT_MAX), blocks)


def rollback_detail(event: Mapping[str, Any], limit: int = 5) -> str:
    """What a rollback reply adds under the describer's line (which counts the checkpoints passed
    over by reason): the chosen checkpoint's path and the first ``limit`` passed over, each with
    its reason (``"checkpoint `…`; passed over: `…` (…); … and 3 more"``); ``""`` for neither."""
    parts = []
    if event.get("checkpoint_path"):
        parts.append(f"checkpoint {code(event.get('checkpoint_path'))}")
    raw = event.get("skipped")
    skipped = [s for s in raw if isinstance(s, Mapping)] if isinstance(raw, list) else []
    if skipped:
        listed = "; ".join(
            f"{code(s.get('path'))} ({code(s.get('reason'))})" for s in skipped[:limit]
        )
        more = f" and {len(skipped) - limit} more" if len(skipped) > limit else ""
        parts.append(f"passed over: {listed}{more}")
    return "; ".join(parts)


def step_message(
    event: Mapping[str, Any], view: IncidentView, links: Links, mention: str | None
) -> SlackMessage:
    """A thread reply for one recovery step (or the broadcast conclusion)."""
    kind = str(event.get("kind"))
    emoji = EMOJI.get(kind, ":small_blue_diamond:")
    state = leads_to(kind, event.get("code"))
    escalated = state is IncidentState.ESCALATED
    ping = escalated or (kind == Kind.ALERT and event.get("severity") == "page")
    why = _prose(event.get("reason") or "", event.get("layer"))
    line = describe(event, "mrkdwn")
    if state is IncidentState.RESOLVED:
        took = f" in {view.took()}" if view.took() else ""
        body = f"{emoji} {line}. Recovered{took}; training continues, no action needed."
    elif escalated:
        body = f"{emoji} *ESCALATED*: {why}. Automatic recovery has stopped; a human is needed."
        body += f" {_link(links.runbook_url, 'Runbook')}" if links.runbook_url else ""
    else:
        body = f"{emoji} {line}"
    blocks = [_section(_ping(body, mention, ping))]
    if state in CONCLUDED:
        blocks.append(
            _context(
                f"{esc(root_header(view))}: "
                + (" → ".join(esc(d) for d in view.done) or "no steps recorded")
            )
        )
    elif why and why not in line and kind not in ("rollback", "lr_cut"):
        blocks.append(_context(why))  # unless the line says it, or the reason restates the line
    elif kind == Kind.ROLLBACK and rollback_detail(event):
        blocks.append(_context(rollback_detail(event)))
    fallback = _prose(f"[{view.incident}] {describe(event)}", event.get("layer"))
    return SlackMessage(clip(_ping(fallback, mention, ping), TEXT_MAX), blocks)


def alert_message(
    event: Mapping[str, Any], run: str, links: Links, mention: str | None, repeats: int = 0
) -> SlackMessage:
    """A standalone notification (``alert``), headed ``[WARN] rule · run``."""
    sev, layer = str(event.get("severity") or "warn"), event.get("layer")
    blocks: list[dict[str, Any]] = [
        _header(f"[{sev.upper()}] {event.get('rule')} · {run}"),
        _section(
            _ping(
                f"{EMOJI['alert']} {_prose(event.get('reason') or describe(event), layer)}",
                mention,
                sev == "page",
            )
        ),
        _fields(
            [
                ("Signal", f"`{esc(event.get('signal'))}` = {esc(num(event.get('value')))}"),
                (
                    "Rank · layer",
                    f"rank {esc(event.get('rank', '—'))} · layer {_name(layer)}",
                ),
                ("Step", num(event.get("step"))),
                ("Rule", f"`{esc(event.get('rule'))}`"),
            ]
        ),
    ]
    footer = [t for t in (links_text(links),) if t] + (
        [f"repeated {repeats}× since the last notification (deduplicated)"] if repeats else []
    )
    if footer:
        blocks.append(_context(*footer))
    text = _prose(f"[{sev.upper()}] {run}: {describe(event)}", layer)
    return SlackMessage(clip(_ping(text, mention, sev == "page"), TEXT_MAX), blocks)


def run_message(
    event: Mapping[str, Any], run: str, links: Links, mention: str | None
) -> SlackMessage:
    """A run-level message outside any incident: ``completed``, ``stopped`` or ``failed``."""
    kind, failed = str(event.get("kind")), event.get("kind") == "failed"
    body = f"{EMOJI.get(kind, '')} {describe(event, 'mrkdwn')}"
    body += ". A human is needed." if failed else ""
    blocks = [_header(f"[{kind.upper()}] {run}"), _section(_ping(body, mention, failed))]
    blocks += [_context(links_text(links) or "")] if links_text(links) else []
    text = f"[{kind.upper()}] {run}: {describe(event)}"
    return SlackMessage(clip(_ping(esc(text), mention, failed), TEXT_MAX), blocks)


def standalone_step_message(
    event: Mapping[str, Any], view: IncidentView, links: Links, mention: str | None
) -> SlackMessage:
    """Webhook mode (no threads): a step as a message naming its incident; a conclusion is
    the root message in its final state, so the last message in the channel tells it all."""
    if leads_to(event.get("kind"), event.get("code")) in CONCLUDED:
        return root_message(view, links, mention)
    reply = step_message(event, view, links, mention)
    prefix = _context(
        f"{EMOJI['incident']} *{esc(root_header(view))}* · incident {code(view.incident)}"
    )
    return SlackMessage(reply.text, [prefix, *reply.blocks])
