"""Pure rendering of journal events into Slack messages (Block Kit + plain-text fallback).

No I/O and no Slack client here: :class:`IncidentView` folds the journal events of one incident
into what the thread's root message shows, and the ``*_message`` functions turn views and events
into :class:`SlackMessage` objects. Every user-supplied string is escaped for mrkdwn and every
text is clipped to Block Kit's limits (header 150 chars, section text 3000, field 2000), so a very
long reason or run name degrades to an ellipsis instead of an ``invalid_blocks`` error at 3 a.m.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

HEADER_MAX, SECTION_MAX, FIELD_MAX, CONTEXT_MAX, TEXT_MAX = 150, 3000, 2000, 2000, 3900
STATES = ("RECOVERING", "PROBATION", "RESOLVED", "ESCALATED")
CONCLUSIONS = ("probation_passed", "escalated")
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
}


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


def esc(value: Any) -> str:
    """Escape a value for Slack mrkdwn (``&``, ``<``, ``>`` only, as Slack documents)."""
    return str(value).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def clip(text: str, limit: int) -> str:
    """Clip ``text`` to ``limit`` characters, ending with an ellipsis when shortened."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def num(value: Any, digits: int = 4) -> str:
    """``12,345`` for ints, ``digits`` significant digits for finite floats, ``—`` for None."""
    if value is None:
        return "—"
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:.{digits}g}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def grade_text(grade: Any) -> str:
    """Grades are written ``S0``..``S7`` across spikeguard (console, status, Slack)."""
    return f"S{grade}" if isinstance(grade, int) and not isinstance(grade, bool) else "S?"


def ranks_text(ranks: Any) -> str:
    """``[0, 1, 2, 3, 5]`` -> ``0–3, 5``."""
    try:
        values = sorted({int(r) for r in ranks})
    except (TypeError, ValueError):
        return "—" if ranks is None else str(ranks)
    runs: list[list[int]] = []
    for r in values:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(f"{a}" if a == b else f"{a}–{b}" for a, b in runs) or "—"


def parse_time(value: Any) -> float | None:
    """Seconds since the epoch of an ISO-8601 journal ``time``; None when absent or invalid."""
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def duration_text(seconds: float) -> str:
    """``252`` -> ``4 min 12 s``."""
    s = max(0, round(seconds))
    return (
        f"{s} s"
        if s < 60
        else f"{s // 60} min {s % 60} s"
        if s < 3600
        else f"{s // 3600} h {s % 3600 // 60} min"
    )


def describe(e: Mapping[str, Any]) -> str:
    """One mrkdwn line for any journal event (thread replies; :func:`summary_line` for plain)."""
    kind, why = e.get("kind", "?"), esc(e.get("reason") or "")
    step = num(e.get("step"))
    if kind == "launch":
        ranks = f" with {esc(e.get('world_size'))} ranks" if e.get("world_size") else ""
        return (
            f"*Launched* generation {esc(e.get('generation'))}{ranks}, LR scale "
            f"{num(e.get('lr_scale'))}"
        )
    if kind == "incident":
        again = f" (attempt {e['attempt']})" if (e.get("attempt") or 1) > 1 else ""
        return (
            f"*{esc(e.get('rule'))} fired{again}:* `{esc(e.get('signal'))}` = "
            f"{esc(num(e.get('value')))} on rank {esc(e.get('rank'))}, layer "
            f"{esc(e.get('layer'))} at step {step} → {esc(e.get('action'))}"
        )
    if kind == "alert":
        return (
            f"*{esc(str(e.get('severity') or 'warn').upper())} {esc(e.get('rule'))}:* "
            f"`{esc(e.get('signal'))}` = {esc(num(e.get('value')))} on rank {esc(e.get('rank'))}"
            f" at step {step}: {why}"
        )
    if kind == "kill":
        return f"*Killed* ranks {ranks_text(e.get('ranks'))} in {num(e.get('duration_s'), 2)} s"
    if kind == "rollback":
        skipped = [
            f"`{esc(s.get('path'))}` ({esc(s.get('reason'))})"
            for s in (e.get("skipped") or [])
            if isinstance(s, Mapping)
        ]
        tail = f"; skipped: {'; '.join(skipped[:5])}" if skipped else ""
        tail += f" and {len(skipped) - 5} more" if len(skipped) > 5 else ""
        for a, b in (e.get("skip_ranges") or [])[:3]:
            tail += f"; data of steps {num(a)}–{num(b)} will be skipped"
        if e.get("checkpoint_step") is None:
            return f"*No checkpoint to roll back to*: {why}{tail}"
        path = f" `{esc(e.get('checkpoint_path'))}`" if e.get("checkpoint_path") else ""
        return (
            f"*Rolled back* to step {num(e.get('checkpoint_step'))}{path} "
            f"(checkpoint {grade_text(e.get('grade'))}){tail}"
        )
    if kind == "lr_cut":
        return f"*LR cut* ×{num(e.get('factor'))}: LR scale now {num(e.get('lr_scale'))}"
    if kind == "optimizer_reset":
        return "*Optimizer reset*: optimizer state cleared, weights kept"
    if kind in ("probation_start", "probation_progress"):
        at = (
            f"from step {num(e.get('from_step'))}"
            if kind == "probation_start"
            else f"at step {step}"
        )
        return f"*Probation* {at} until step {num(e.get('until_step'))}"
    if kind == "probation_passed":
        return (
            f"*RESOLVED*: probation passed at step {step}"
            if e.get("step") is not None
            else f"*RESOLVED*: {why}"
        )
    if kind == "probation_failed":
        return f"*Probation failed* at step {step}: {why}"
    if kind in ("escalated", "stopped", "completed", "failed", "notify_undelivered"):
        return {
            "escalated": f"*ESCALATED*: {why}",
            "stopped": f"*Run stopped*: {why}",
            "completed": f"*Run completed*, final loss {num(e.get('final_loss'))}",
            "failed": f"*Run FAILED* (exit code {esc(e.get('exit_code'))}): {why}",
            "notify_undelivered": f"*Slack message undelivered* ({esc(e.get('what'))}): "
            f"{esc(e.get('error'))}",
        }[kind]
    return f"*{esc(kind)}* {why}".rstrip()


def plain(mrkdwn: str) -> str:
    """mrkdwn -> plain text: drop ``*`` and backticks, ``<url|label>`` -> label, unescape."""
    out = re.sub(r"<([^|<>]*)\|([^<>]*)>", r"\2", mrkdwn).replace("*", "").replace("`", "")
    return out.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")


def summary_line(event: Mapping[str, Any]) -> str:
    """One plain line describing any journal event (Slack ``text`` fallbacks, logs)."""
    return plain(describe(event))


@dataclass
class IncidentView:
    """What the root message of one incident thread shows, folded from its journal events."""

    run: str
    incident: str
    state: str = "RECOVERING"
    fired: dict[str, Any] = field(default_factory=dict)
    done: list[str] = field(default_factory=list)
    started: float | None = None
    ended: float | None = None
    outcome: str | None = None
    probation_until: int | None = None
    version: int = 0
    context: dict[str, Any] | None = None

    def apply(self, event: Mapping[str, Any]) -> bool:
        """Fold one event in; True when the root message must be updated (its state changed)."""
        e, kind, before = event, event.get("kind"), self.state
        t = parse_time(e.get("time"))
        if kind == "incident":
            if not self.fired:
                self.fired = {
                    k: e.get(k)
                    for k in (
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
                }
                self.started, self.context = t, e.get("context") or None
            else:
                self.done.append(f"fired again at step {num(e.get('step'))}")
            self.state = "RECOVERING"
        elif kind == "kill":
            self.done.append(f"killed ranks {ranks_text(e.get('ranks'))}")
        elif kind == "rollback" and e.get("checkpoint_step") is not None:
            self.done.append(
                f"rolled back to step {num(e.get('checkpoint_step'))} "
                f"({grade_text(e.get('grade'))})"
            )
        elif kind == "lr_cut":
            self.done.append(f"LR ×{num(e.get('factor'))} (scale {num(e.get('lr_scale'))})")
        elif kind == "optimizer_reset":
            self.done.append("optimizer reset")
        elif kind == "launch":
            self.done.append(f"relaunched gen {e.get('generation')}")
        elif kind == "probation_start":
            self.probation_until = e.get("until_step")
            self.done.append(f"probation until step {num(self.probation_until)}")
            self.state = "PROBATION"
        elif kind == "probation_failed":
            self.done.append(f"probation failed at step {num(e.get('step'))}")
            self.state = "RECOVERING"
        elif kind == "probation_passed":
            self.state, self.ended = "RESOLVED", t
            self.outcome = plain(describe(e)).removeprefix("RESOLVED: ")
        elif kind in ("escalated", "failed"):
            self.state, self.ended = "ESCALATED", t
            self.outcome = str(e.get("reason") or "escalated")
        if self.state == before:
            return False
        self.version += 1
        return True

    @property
    def concluded(self) -> bool:
        """True once the incident reached RESOLVED or ESCALATED."""
        return self.state in ("RESOLVED", "ESCALATED")

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
        else f"{label}: `{esc(url)}`"
    )


def links_text(links: Links) -> str | None:
    """``Run directory · Dashboard · Runbook`` as mrkdwn links (no buttons: those need an app)."""
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
    tag = grade_text(grade) if isinstance(grade, int) else view.incident
    return f"[{view.state}] {tag} · {view.run}"


class _Dash(dict):  # type: ignore[type-arg]
    def get(self, key: str, default: Any = "—") -> Any:  # type: ignore[override]
        value = super().get(key)
        return default if value is None else value


def root_message(view: IncidentView, links: Links, mention: str | None) -> SlackMessage:
    """The thread's root: what broke, what spikeguard did so far, and whether a human is needed."""
    f = _Dash(view.fired)  # a missing field shows as "—" (e.g. the incident event was lost)
    where = f"rank {f.get('rank')}, layer {f.get('layer')}"
    what = (
        f"*{esc(f.get('signal'))}* = {esc(num(f.get('value')))} on {esc(where)} at step "
        f"{num(f.get('step'))}"
    )
    took = f" in {view.took()}" if view.took() else ""
    status, ping, tail = {
        "RECOVERING": (
            f"{EMOJI['incident']} {what}. spikeguard is recovering automatically; "
            "no action needed yet.",
            view.severity == "page",
            "spikeguard is recovering, no action needed yet",
        ),
        "PROBATION": (
            f"{EMOJI['probation_start']} Recovery steps done; on probation until step "
            f"{num(view.probation_until)}. No action needed yet.",
            False,
            f"on probation until step {num(view.probation_until)}",
        ),
        "RESOLVED": (
            f"{EMOJI['probation_passed']} *Resolved by spikeguard*{took}: "
            f"{esc(view.outcome)}. No action needed.",
            False,
            f"resolved: {view.outcome}",
        ),
        "ESCALATED": (
            f"{EMOJI['escalated']} *Human needed:* {esc(view.outcome)}. Automatic "
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
                    f"rank {esc(f.get('rank'))} · layer {esc(f.get('layer'))} (fell first)",
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
        blocks.append(_section(f"*Why:* {esc(view.fired['reason'])}"))
    if view.done:
        blocks.append(_section("*Done so far:* " + " → ".join(esc(d) for d in view.done)))
    blocks.append(
        _context(*[t for t in (links_text(links), f"incident `{esc(view.incident)}`") if t])
    )
    fallback = (
        f"{root_header(view)}: {f.get('signal')}={num(f.get('value'))} on {where} at step "
        f"{num(f.get('step'))} — {tail}"
    )
    return SlackMessage(clip(_ping(esc(fallback), mention, ping), TEXT_MAX), blocks)


def step_message(
    event: Mapping[str, Any], view: IncidentView, links: Links, mention: str | None
) -> SlackMessage:
    """A thread reply for one recovery step (or the broadcast conclusion)."""
    kind = str(event.get("kind"))
    emoji = EMOJI.get(kind, ":small_blue_diamond:")
    ping = kind in ("escalated", "failed") or (kind == "alert" and event.get("severity") == "page")
    why = esc(event.get("reason") or "")
    if kind == "probation_passed":
        took = f" in {view.took()}" if view.took() else ""
        body = f"{emoji} {describe(event)}. Recovered{took}; training continues, no action needed."
    elif kind in ("escalated", "failed"):
        body = f"{emoji} *ESCALATED*: {why}. Automatic recovery has stopped; a human is needed."
        body += f" {_link(links.runbook_url, 'Runbook')}" if links.runbook_url else ""
    else:
        body = f"{emoji} {describe(event)}"
    blocks = [_section(_ping(body, mention, ping))]
    if kind in CONCLUSIONS or kind == "failed":
        blocks.append(
            _context(
                f"{esc(root_header(view))}: "
                + (" → ".join(esc(d) for d in view.done) or "no steps recorded")
            )
        )
    elif why and kind not in ("alert", "probation_failed", "stopped", "rollback", "lr_cut"):
        blocks.append(_context(why))
    return SlackMessage(
        clip(_ping(esc(f"[{view.incident}] {summary_line(event)}"), mention, ping), TEXT_MAX),
        blocks,
    )


def alert_message(
    event: Mapping[str, Any], run: str, links: Links, mention: str | None, repeats: int = 0
) -> SlackMessage:
    """A standalone notification (``alert``), headed ``[WARN] rule · run``."""
    sev = str(event.get("severity") or "warn")
    blocks: list[dict[str, Any]] = [
        _header(f"[{sev.upper()}] {event.get('rule')} · {run}"),
        _section(
            _ping(
                f"{EMOJI['alert']} {esc(event.get('reason') or summary_line(event))}",
                mention,
                sev == "page",
            )
        ),
        _fields(
            [
                ("Signal", f"`{esc(event.get('signal'))}` = {esc(num(event.get('value')))}"),
                (
                    "Rank · layer",
                    f"rank {esc(event.get('rank', '—'))} · layer {esc(event.get('layer', '—'))}",
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
    text = f"[{sev.upper()}] {run}: {summary_line(event)}"
    return SlackMessage(clip(_ping(esc(text), mention, sev == "page"), TEXT_MAX), blocks)


def run_message(
    event: Mapping[str, Any], run: str, links: Links, mention: str | None
) -> SlackMessage:
    """A run-level message outside any incident: ``completed``, ``stopped`` or ``failed``."""
    kind, failed = str(event.get("kind")), event.get("kind") == "failed"
    body = f"{EMOJI.get(kind, '')} {describe(event)}" + (". A human is needed." if failed else "")
    blocks = [_header(f"[{kind.upper()}] {run}"), _section(_ping(body, mention, failed))]
    blocks += [_context(links_text(links) or "")] if links_text(links) else []
    text = f"[{kind.upper()}] {run}: {summary_line(event)}"
    return SlackMessage(clip(_ping(esc(text), mention, failed), TEXT_MAX), blocks)


def standalone_step_message(
    event: Mapping[str, Any], view: IncidentView, links: Links, mention: str | None
) -> SlackMessage:
    """Webhook mode (no threads): a step as a message naming its incident; a conclusion is
    the root message in its final state, so the last message in the channel tells it all."""
    if event.get("kind") in CONCLUSIONS or (view.concluded and event.get("kind") == "failed"):
        return root_message(view, links, mention)
    reply = step_message(event, view, links, mention)
    prefix = _context(
        f"{EMOJI['incident']} *{esc(root_header(view))}* · incident `{esc(view.incident)}`"
    )
    return SlackMessage(reply.text, [prefix, *reply.blocks])
