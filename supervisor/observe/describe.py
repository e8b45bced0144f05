"""One line per journal event, for people: the console, ``spikeguard events``, the demo, Slack.

Each event kind has one template (:data:`TEMPLATES`), written once and rendered in either of two
markups: ``plain`` text (the console, logs, Slack's notification fallback) or Slack ``mrkdwn``
(bold, code and ``&<>`` escaping). The words are the same in both. In mrkdwn, what a rank named
(a layer, a path) is a code span (:func:`code`), in the event's fields and where its reason
quotes it: Slack links no URL and reads no markup inside one.

A rollback's line counts the checkpoints it passed over by reason (:func:`passed_over`) rather
than listing their paths, so it stays one short line however many there were; Slack's reply adds
the first few paths (``slack/render.py``).

Events come from the journal, which may be hand-written or older than this code: a field may be
missing or of the wrong type. Nothing here raises on such an event; a missing value reads ``—``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any, Literal

from spikeguard.workers.contract.signals import grade_text

from ..decide.events import Kind
from ..intake.forensics import holds_no_ids

Markup = Literal["plain", "mrkdwn"]
MISSING = "—"
"""How a missing value reads."""


def esc(value: Any) -> str:
    """Escape a value for Slack mrkdwn (``&``, ``<``, ``>`` only, as Slack documents)."""
    return str(value).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


SPAN_BACKTICK = "\u02cb"
"""What a backtick inside a code span becomes (ˋ, a modifier letter grave accent): mrkdwn has no
escape for it, and a real one would end the span."""


def code(value: Any) -> str:
    """``value`` as one Slack mrkdwn code span: ``&<>`` escaped, a backtick shown as
    :data:`SPAN_BACKTICK` and a line break as a space (neither can be escaped inside a span).
    Inside it Slack links no URL and reads no ``*bold*``, ``_italics_`` or ``:emoji:``, so a
    name a rank supplied (a layer such as ``http://evil.example``) reads as it is."""
    text = str(value).replace("`", SPAN_BACKTICK).replace("\r", " ").replace("\n", " ")
    return f"`{esc(text)}`" if text.strip() else esc(text or MISSING)


def spans(escaped: str, layer: Any) -> str:
    """``escaped`` (mrkdwn-escaped prose, a reason) with each ``layer NAME`` it quotes for the
    event's ``layer`` as ``layer `NAME```: the policy engine writes a layer into its reasons
    that way (``rank 3 layer blocks.7.attn: ...``), and a rank chose the name."""
    if not isinstance(layer, str) or not layer:
        return escaped
    return escaped.replace(f"layer {esc(layer)}", f"layer {code(layer)}")


def num(value: Any, digits: int = 4) -> str:
    """``12,345`` for ints, ``digits`` significant digits for finite floats, ``—`` for None;
    anything else as it is (``nan``, a string)."""
    if value is None:
        return MISSING
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:.{digits}g}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


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


def ranks_text(ranks: Any) -> str:
    """``[0, 1, 2, 3, 5]`` -> ``0–3, 5``; anything that is not a list of ranks as it is."""
    try:
        values = sorted({int(r) for r in ranks})
    except (TypeError, ValueError):
        return MISSING if ranks is None else str(ranks)
    runs: list[list[int]] = []
    for r in values:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(f"{a}" if a == b else f"{a}–{b}" for a, b in runs) or MISSING


def _items(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else []


class _Fields:
    """An event's fields as text in one markup; a missing or malformed field never raises."""

    def __init__(self, event: Any, markup: Markup) -> None:
        self.e: Mapping[str, Any] = event if isinstance(event, Mapping) else {}
        self.mrkdwn = markup == "mrkdwn"

    def get(self, key: str) -> Any:
        """The field's raw value (None when missing)."""
        return self.e.get(key)

    def esc(self, text: str) -> str:
        """``text`` escaped for the markup."""
        return esc(text) if self.mrkdwn else text

    def text(self, key: str) -> str:
        """The field as text (``—`` when missing)."""
        value = self.e.get(key)
        return self.esc(MISSING if value is None else str(value))

    def num(self, key: str, digits: int = 4) -> str:
        """The field as a number (see :func:`num`)."""
        return self.esc(num(self.e.get(key), digits))

    def bold(self, rendered: str) -> str:
        """Already rendered text, in bold."""
        return f"*{rendered}*" if self.mrkdwn else rendered

    def code(self, rendered: str) -> str:
        """Already rendered text, as code."""
        return f"`{rendered}`" if self.mrkdwn else rendered

    def name(self, key: str) -> str:
        """The field as a name a rank supplied (a layer, a path): a code span in mrkdwn
        (:func:`code`), as it is in plain text; ``—`` when missing."""
        value = self.e.get(key)
        if value is None:
            return MISSING
        return code(value) if self.mrkdwn else str(value)

    @property
    def reason(self) -> str:
        """The event's prose reason, or ``""`` (in mrkdwn the layer it quotes as code)."""
        text = self.esc(str(self.e.get("reason") or ""))
        return spans(text, self.e.get("layer")) if self.mrkdwn else text

    def because(self, line: str, why: str | None = None) -> str:
        """``line: why`` (the event's reason by default); just ``line`` without one."""
        why = self.reason if why is None else why
        return f"{line}: {why}" if why else line

    def where(self) -> str:
        """``on rank 3, layer blocks.7.attn`` from the fields present (``""`` for neither)."""
        parts = [f"rank {self.text('rank')}"] if self.get("rank") is not None else []
        parts += [f"layer {self.name('layer')}"] if self.get("layer") is not None else []
        return "on " + ", ".join(parts) if parts else ""

    def measured(self) -> str:
        """What the event's fields say was measured: ``attn_entropy_min = 0.15 on rank 3``."""
        signal = self.get("signal")
        what = f"{self.code(self.text('signal'))} = {self.num('value')}" if signal else ""
        return " ".join(p for p in (what, self.where()) if p) or MISSING


def _launch(f: _Fields) -> str:
    ranks = f.get("ranks")
    warm = (
        isinstance(ranks, list)
        and bool(ranks)
        and all(isinstance(r, dict) and r.get("standby") is True for r in ranks)
    )
    how = " (released from standby)" if warm else ""
    line = f"{f.bold('Launched')} generation {f.text('generation')}{how}"
    return f"{line}, LR scale {f.num('lr_scale')}"


def _standby(f: _Fields) -> str:
    return f.because(f.bold(f"Standby of generation {f.text('generation')}"))


def _incident(f: _Fields) -> str:
    attempt = f.get("attempt")
    again = f" (attempt {attempt})" if isinstance(attempt, int) and attempt > 1 else ""
    head = f.bold(f"{f.text('rule')} fired{again}")
    line = f"{head} at step {f.num('step')} → {f.text('action')}"
    return f.because(line, f.reason or f.measured())


def _alert(f: _Fields) -> str:
    severity = f.esc(str(f.get("severity") or "warn").upper())
    rule = f" {f.text('rule')}" if f.get("rule") is not None else ""
    line = f"{f.bold(severity + rule)} at step {f.num('step')}"
    return f.because(line, f.reason or f.measured())


def _kill(f: _Fields) -> str:
    ranks = f.esc(ranks_text(f.get("ranks")))
    return f"{f.bold('Killed')} ranks {ranks} in {f.num('duration_s', 2)} s"


_STEPS_BACK_RE = re.compile(r"min_steps_back\D{0,3}(\d+)")
_GRADE_RE = re.compile(r"\bgraded?\s+S?(\d+)\s*<\s*(?:min_grade\s+)?S?(\d+)", re.IGNORECASE)
_VERIFY_WORDS = ("verif", "sha256", "checksum", "corrupt", "truncat", "pickle", "unreadable")


def _classify(reason: Any) -> tuple[str, str]:
    """(the count a skip reason falls in, its own words): the reasons come from
    ``workers/checkpoint/choose.py`` (and the machine's tests), recognised by their wording."""
    text = reason if isinstance(reason, str) else ""
    low = text.lower()
    if "min_steps_back" in low:
        m = _STEPS_BACK_RE.search(low)
        label = f"within min_steps_back {m.group(1)}" if m else "within min_steps_back"
        return label, label
    if "lineage" in low:
        return "off the current lineage", "off the current lineage"
    if "ungraded" in low:
        return "ungraded", "ungraded"
    m = _GRADE_RE.search(text)
    if m:
        grade, floor = grade_text(int(m.group(1))), grade_text(int(m.group(2)))
        return f"graded below {floor}", f"graded {grade} < {floor}"
    if any(w in low for w in _VERIFY_WORDS):
        return "failed verification", "failed verification"
    return "other", "other"


def skip_category(reason: Any) -> str:
    """Why a checkpoint was passed over, in a few words: ``within min_steps_back 200``,
    ``off the current lineage``, ``ungraded``, ``graded S3 < S4``, ``failed verification`` or
    ``other`` (anything else, a missing reason included)."""
    return _classify(reason)[1]


def passed_over(skipped: Any, *, newer: bool = True) -> str:
    """``passed over 4 newer checkpoints (2 within min_steps_back 200, 1 graded S3 < S4, 1 failed
    verification)``: a rollback's ``skipped`` list counted by :func:`skip_category`, in the order
    first met (checkpoints graded differently below one floor count as ``graded below S4``);
    ``""`` when nothing was passed over."""
    items = _items(skipped)
    if not items:
        return ""
    groups: dict[str, list[str]] = {}
    for s in items:
        key, label = _classify(s.get("reason") if isinstance(s, Mapping) else None)
        groups.setdefault(key, []).append(label)
    counts = [f"{len(v)} {v[0] if len(set(v)) == 1 else k}" for k, v in groups.items()]
    what = f"{len(items)} {'newer ' if newer else ''}checkpoint{'s' if len(items) != 1 else ''}"
    return f"passed over {what} ({', '.join(counts)})"


def _rollback(f: _Fields) -> str:
    chosen = f.get("checkpoint_step") is not None
    over = passed_over(f.get("skipped"), newer=chosen)
    tail = f"; {f.esc(over)}" if over else ""
    for r in _items(f.get("skip_ranges"))[:3]:
        if isinstance(r, (list, tuple)) and len(r) == 2:
            tail += f"; data of steps {f.esc(num(r[0]))}–{f.esc(num(r[1]))} will be skipped"
    window = _items(f.get("skip_batches_steps"))
    if len(window) == 2:
        a, b = f.esc(num(window[0])), f.esc(num(window[1]))
        tail += f"; the batches of steps {a}–{b} will be skipped by their ids"
    if not chosen:
        return f.because(f.bold("No checkpoint to roll back to")) + tail
    grade = f.esc(grade_text(f.get("grade")))
    if f.get("grade_rule") == "ungraded":  # no checkpoint of the run carries a grade
        grade += ", the run's checkpoints are ungraded"
    if f.get("grade_rule") == "run baseline":  # nothing reached min_grade: the run's own bar
        bar = f.esc(grade_text(f.get("grade_bar")))
        grade += f", healthy by this run's baseline {bar}, the median of {f.num('baseline_of')}"
    return f"{f.bold('Rolled back')} to step {f.num('checkpoint_step')} ({grade}){tail}"


def _preempted(f: _Fields) -> str:
    head = f.bold("Run preempted")
    if f.get("checkpoint_step") is None:
        line = f"{head} without an emergency checkpoint"
    else:
        line = f"{head} after an emergency checkpoint at step {f.num('checkpoint_step')}"
    resume = f"{f.code('spikeguard submit')} of the same job resumes it"
    if f.get("checkpoint_step") is None and f.get("resume_step") is not None:
        resume += f" from step {f.num('resume_step')}"  # the newest usable checkpoint
    return f"{line}; {resume}"


def _lr_cut(f: _Fields) -> str:
    return f"{f.bold('LR cut')} ×{f.num('factor')}: LR scale now {f.num('lr_scale')}"


def _optimizer_reset(f: _Fields) -> str:
    return f"{f.bold('Optimizer reset')}: optimizer state cleared, weights kept"


def _probation_start(f: _Fields) -> str:
    return f"{f.bold('Probation')} from step {f.num('from_step')} until step {f.num('until_step')}"


def _probation_progress(f: _Fields) -> str:
    return f"{f.bold('Probation')} at step {f.num('step')} until step {f.num('until_step')}"


def _probation_passed(f: _Fields) -> str:
    if f.get("step") is None:
        return f.because(f.bold("RESOLVED"))
    return f"{f.bold('RESOLVED')}: probation passed at step {f.num('step')}"


def _probation_failed(f: _Fields) -> str:
    return f.because(f"{f.bold('Probation failed')} at step {f.num('step')}")


def _probation_superseded(f: _Fields) -> str:
    return f.because(f"{f.bold('Superseded')} at step {f.num('step')}")


def _completed(f: _Fields) -> str:
    return f"{f.bold('Run completed')}, final loss {f.num('final_loss')}"


def _failed(f: _Fields) -> str:
    return f.because(f"{f.bold('Run FAILED')} (exit code {f.text('exit_code')})")


def _launch_failed(f: _Fields) -> str:
    return f.because(f.bold(f"Launch of generation {f.text('generation')} failed"))


def _forensics(f: _Fields) -> str:
    head = f.bold("Batch forensics")
    asked = len(_items(f.get("ranks_asked")))
    answered = _items(f.get("ranks_answered"))
    if not answered or f.get("path") is None:
        return f"{head}: no rank answered within {f.num('waited_s', 2)} s (of {asked} asked)"
    if holds_no_ids({"batches": f.get("batches"), "truncated": f.get("truncated")}):  # older
        return f"{head}: the script passes no batch ids to {f.code('sg.step()')}"
    steps = _items(f.get("steps"))
    window = f" of steps {f.esc(num(steps[0]))}–{f.esc(num(steps[1]))}" if len(steps) == 2 else ""
    ranks = f.esc(ranks_text(answered))
    return (
        f"{head}: {f.num('batches')} batch ids{window} from ranks {ranks} "
        f"({len(answered)} of {asked}) → {f.name('path')}"
    )


def _headline(words: str) -> Callable[[_Fields], str]:
    """A kind whose line is a headline and the event's reason (``Run stopped: by user``)."""
    return lambda f: f.because(f.bold(words))


def _notify_thread(f: _Fields) -> str:
    where = f"channel {f.text('channel')}, ts {f.text('ts')}"
    return f"{f.bold('Slack thread')} of {f.text('incident')}: {where}"


def _checkpoint_deleted(f: _Fields) -> str:
    what = f" of step {f.text('step')}, generation {f.text('generation')}"
    return f.because(f.bold("Deleted checkpoint") + what)


def _notify_undelivered(f: _Fields) -> str:
    sink = SINK_TITLES.get(str(f.get("sink") or "slack"), f.text("sink"))
    line = f"{f.bold(f'{sink} message undelivered')} ({f.text('what')})"
    return f.because(line, f.text("error"))


SINK_TITLES = {
    "slack": "Slack",
    "alertmanager": "Alertmanager",
    "pagerduty": "PagerDuty",
    "webhook": "Webhook",
}
"""How a sink's name reads in a story line (an undelivered message names its sink)."""

OPERATOR_HEADLINES = {
    "acknowledged": "Acknowledged",
    "hold_set": "Recovery on hold",
    "hold_released": "Hold lifted",
    "recovery_held": "HELD for a human",
    "resume_asked": "Resume asked",
    "operator_resumed": "Resumed by hand",
    "operator_refused": "Operator request refused",
    "operator_stop": "Stop asked",
    "button_refused": "Slack button press refused",
}
"""The headline of an ``operator`` event, by code."""


def _operator(f: _Fields) -> str:
    return f.because(f.bold(OPERATOR_HEADLINES.get(str(f.get("code")), "Operator")))


TEMPLATES: dict[Kind, Callable[[_Fields], str]] = {
    Kind.LAUNCH: _launch,
    Kind.INCIDENT: _incident,
    Kind.KILL: _kill,
    Kind.ROLLBACK: _rollback,
    Kind.LR_CUT: _lr_cut,
    Kind.OPTIMIZER_RESET: _optimizer_reset,
    Kind.PROBATION_START: _probation_start,
    Kind.PROBATION_PROGRESS: _probation_progress,
    Kind.PROBATION_PASSED: _probation_passed,
    Kind.PROBATION_FAILED: _probation_failed,
    Kind.PROBATION_SUPERSEDED: _probation_superseded,
    Kind.ESCALATED: _headline("ESCALATED"),
    Kind.COMPLETED: _completed,
    Kind.FAILED: _failed,
    Kind.STOPPED: _headline("Run stopped"),
    Kind.PREEMPTED: _preempted,
    Kind.LAUNCH_FAILED: _launch_failed,
    Kind.RESUME: _headline("Supervisor restarted"),
    Kind.ALERT: _alert,
    Kind.FORENSICS: _forensics,
    Kind.OPERATOR: _operator,
    Kind.NODE_EXCLUDED: _headline("Node excluded"),
    Kind.SUPERVISOR_START: _headline("Supervisor started"),
    Kind.REAPED: _headline("Killed leftover rank processes"),
    Kind.STANDBY: _standby,
    Kind.NOTIFY_THREAD: _notify_thread,
    Kind.NOTIFY_UNDELIVERED: _notify_undelivered,
    Kind.CHECKPOINT_DELETED: _checkpoint_deleted,
}
"""The template of each kind (every :class:`~..events.Kind` has one)."""


def describe(event: Mapping[str, Any], markup: Markup = "plain") -> str:
    """One line describing a journal event, as plain text or as Slack mrkdwn.

    An unknown kind reads ``kind: reason``; a malformed event still gets a line.
    """
    f = _Fields(event, markup)
    kind = f.get("kind")
    template = TEMPLATES.get(kind) if isinstance(kind, str) else None
    if template is None:
        return f.because(f.bold(f.esc(MISSING if kind is None else str(kind))))
    return template(f)
