"""The post-mortem: one self-contained HTML file for any run (``spikeguard report RUN_DIR``).

It opens with no network and runs no script: inline CSS and inline SVG (:mod:`.svg`) only. In
order:

* the run at a glance (outcome, generations, incidents, LR scale, final loss) and the incidents;
* four panels over the whole run, one color per generation, incidents and recovery steps as
  markers: effective-rank ratio, grade S0–S7, attention entropy mean/min, grad norm with loss;
* each rank's step time over the steps (the seconds it computed in a step, a mean per bin of
  steps), the slowest ranks of each generation drawn against the median of all its ranks, with
  a table of their ratios to their peers' (``SLOW`` from
  :data:`~.metrics.STRAGGLER_RATIO`): a straggler stands out before or without any rule;
* per-layer × step heatmaps of the grade and of the normalised min-head attention entropy, one
  band per generation, the layer each incident fired on marked: which layer fell first;
* the checkpoints with their grades, the best healthy one marked (what a rollback would pick);
* each incident's batch forensics (the ranks' recent batch ids);
* the journal, one line per event.

Every string from the run (its name, rule names, reasons, layer names, batch ids, paths) is user
text: it is redacted of secrets (:func:`~spikeguard.workers.contract.secret_scan.redact`) and
escaped before it reaches the page.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from spikeguard.workers.checkpoint.choose import on_lineage, select_checkpoint
from spikeguard.workers.contract.secret_scan import redact
from spikeguard.workers.contract.signals import grade_text

from ..decide.lifecycle import outcome_of
from ..intake import forensics as fx
from ..redaction import held_secrets
from .describe import describe, ranks_text
from .metrics import STRAGGLER_RATIO, badness, is_slow, peer_ratios
from .rundata import (
    STRETCH_BINS,
    Forensics,
    Generation,
    LayerSeries,
    RunData,
    StepTimes,
    Stretch,
    load_run,
)
from .status import ratio_text, seconds_text
from .svg import PALETTE, Axis, Chart, color_scale, esc, finite

WIDTH = 1100
LEFT, RIGHT = 190, 70
"""The margins of every chart: their step axes line up."""
MAX_POINTS = 1500
"""A generation's line is averaged down to at most this many points."""
MAX_COLUMNS = 400
"""A heatmap band is binned down to at most this many columns."""
MAX_LAYER_ROWS = 48
"""A heatmap band shows at most this many layers (the ones that fell lowest, of the
:data:`.rundata.MAX_LAYER_SERIES` the run data keeps); the rest are counted under the band."""
MAX_STEP_TIME_LINES = 6
"""Per generation, the step-time chart draws this many ranks (the slowest against their peers)
besides the median of all its ranks; the table lists the same ones."""
MEDIAN_COLOR = "#888888"
"""The step-time chart's line of the median over a generation's ranks."""
MAX_IDS_SHOWN = 12
"""Batch-id entries listed per rank of an incident (the file has them all)."""
HEATMAPS: dict[str, tuple[str, float, float]] = {
    "grade": ("Grade per layer (S0 red … S7 green)", 0.0, 7.0),
    "attn_entropy_min_norm": (
        "Lowest head's attention entropy / log(visible keys), per layer",
        0.0,
        1.0,
    ),
}
"""Per-layer signal -> the title and scale of its heatmap: the signals the run data keeps per
layer (:data:`.rundata.HEATMAP_SIGNALS`, checked against this by ``tests/test_signal_seam.py``)."""
MARKERS = {
    "incident": ("#d62728", "incident"),
    "rollback": ("#2ca02c", "rollback target"),
    "probation_passed": ("#1f77b4", "probation passed"),
    "probation_failed": ("#ff7f0e", "probation failed"),
    "escalated": ("#000000", "escalated"),
}
"""Journal kind -> (color, what the marker says)."""

CSS = """
body{font:14px/1.4 -apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px;color:#222}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:6px 0} td,th{padding:3px 8px;border-bottom:1px solid #eee;
text-align:left;vertical-align:top} th{background:#f6f6f6} tr.best td{background:#e7f5e7}
tr.off td{color:#999}
code,.mono{font-family:SFMono-Regular,Menlo,Consolas,monospace;font-size:12px}
.muted{color:#777} .bad{color:#b00} svg{display:block;margin:6px 0} svg text{font-size:11px}
svg text.title{font-size:13px;font-weight:600} .problems{background:#fff4e5;padding:6px 10px}
.kind{white-space:nowrap} .legend-note{font-size:12px;color:#555}
"""


def write_report(run_dir: str | Path, out: str | Path) -> Path:
    """Render ``run_dir``'s post-mortem and write it to ``out`` (0600, atomically; a symlink at
    ``out`` is replaced, its target untouched). Returns ``out``."""
    from .. import rundir

    page = render(load_run(run_dir))
    path = Path(out)
    rundir.write_atomic(path, page)
    return path


def render(run: RunData, *, secrets: Iterable[str] | None = None) -> str:
    """The whole page for ``run`` (see the module docstring). ``secrets``: the values to redact
    besides anything shaped like a credential (default: those this process's environment
    holds)."""
    page = _Page(run, tuple(held_secrets(os.environ) if secrets is None else secrets))
    return page.html()


class _Page:
    def __init__(self, run: RunData, secrets: tuple[str, ...]) -> None:
        self.run, self.secrets = run, secrets
        steps = [s for g in run.generations.values() if g.steps for s in g.steps]
        steps += [e["step"] for e in run.events if _int(e.get("step"))]
        lo, hi = (min(steps), max(steps)) if steps else (0, 1)
        self.x = Axis(lo, hi if hi > lo else lo + 1)
        self.gen_of_event = _generation_of_events(run.events)

    def t(self, value: Any) -> str:
        """User text, redacted and escaped."""
        return esc(redact(str(value), self.secrets))

    # -- the page -----------------------------------------------------------------------------
    def html(self) -> str:
        run = self.run
        body = [
            f"<h1>spikeguard run {self.t(run.name)}</h1>",
            f'<p class="muted">{self.t(run.run_dir)} · rendered '
            f"{esc(_dt.datetime.now(_dt.timezone.utc).isoformat(timespec='seconds'))}</p>",
            self.summary(),
            self.problems(),
            "<h2>Incidents</h2>",
            self.incidents(),
            "<h2>The run by generation</h2>",
            self.legend_note(),
            *self.panels(),
            "<h2>Step time per rank: which rank is slow</h2>",
            *self.step_times(),
            "<h2>Per layer: which layer fell first</h2>",
            '<p class="legend-note">One band per generation, one row per layer, the worst '
            "over ranks at each sampled step (red: low, green: healthy, grey: not sampled). "
            "A black box marks the layer and step each incident fired on.</p>",
            *self.heatmaps(),
            "<h2>Checkpoints</h2>",
            self.checkpoints(),
            "<h2>Batch forensics</h2>",
            self.forensics(),
            "<h2>Journal</h2>",
            self.journal(),
        ]
        title = f"spikeguard · {self.t(run.name)}"
        return (
            '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f"<title>{title}</title><style>{CSS}</style></head><body>\n"
            + "\n".join(b for b in body if b)
            + "\n</body></html>\n"
        )

    def summary(self) -> str:
        run, st = self.run, self.run.state
        finals = [e for e in run.events if e.get("kind") == "completed"]
        rows: list[tuple[str, str]] = []
        if st is not None:
            outcome = st.phase.value + ("" if st.exit_code is None else f" (exit {st.exit_code})")
            rows += [
                ("outcome", esc(outcome)),
                ("generations", esc(st.max_generation or len(run.generations))),
                ("incidents", esc(st.incidents_seen)),
                ("LR scale", esc(f"{st.lr_scale:.4g}")),
            ]
        if finals:
            rows.append(("final loss", esc(_fmt(finals[-1].get("final_loss")))))
        times = [e.get("time") for e in run.events if isinstance(e.get("time"), str)]
        if times:
            rows.append(("journal", f"{self.t(times[0])} → {self.t(times[-1])}"))
        rows.append(("events", esc(len(run.events))))
        if run.reports_file is not None:
            rows.append(("reports", self.t(run.reports_file.name)))
        cells = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in rows)
        return f'<table class="summary">{cells}</table>'

    def problems(self) -> str:
        if not self.run.problems:
            return ""
        items = "".join(f"<li>{self.t(p)}</li>" for p in self.run.problems)
        return f'<div class="problems"><b>Not everything could be read:</b><ul>{items}</ul></div>'

    def legend_note(self) -> str:
        marks = " · ".join(
            f'<span style="color:{c}">┆ {esc(what)}</span>' for c, what in MARKERS.values()
        )
        return f'<p class="legend-note">Markers: {marks}. Hover a line or marker for details.</p>'

    # -- incidents -----------------------------------------------------------------------------
    def incidents(self) -> str:
        opened: dict[str, dict[str, Any]] = {}
        for e in self.run.events:
            inc = e.get("incident")
            if not isinstance(inc, str):
                continue
            row = opened.setdefault(inc, {"attempts": 0, "rollbacks": [], "end": "open"})
            kind = e.get("kind")
            if kind == "incident":
                row.setdefault("first", e)
                row["attempts"] = max(row["attempts"], e.get("attempt") or 1)
            elif kind == "rollback" and _int(e.get("checkpoint_step")):
                row["rollbacks"].append(e["checkpoint_step"])
            elif (ended := outcome_of(kind)) is not None:  # the one lifecycle
                row["end"] = ended.value
        if not opened:
            return '<p class="muted">No incident.</p>'
        out = [
            "<table><tr><th>incident</th><th>rule</th><th>step</th><th>rank · layer</th>"
            "<th>signal</th><th>attempts</th><th>rolled back to</th><th>outcome</th></tr>"
        ]
        for inc, row in opened.items():
            first = row.get("first", {})
            where = f"{first.get('rank', '—')} · {first.get('layer') or '—'}"
            signal = f"{first.get('signal') or '—'} = {_fmt(first.get('value'))}"
            back = ", ".join(f"step {s}" for s in row["rollbacks"]) or "—"
            out.append(
                f"<tr><td>{self.t(inc)}</td><td>{self.t(first.get('rule', '—'))}</td>"
                f"<td>{self.t(first.get('step', '—'))}</td><td>{self.t(where)}</td>"
                f"<td>{self.t(signal)}</td><td>{row['attempts']}</td><td>{esc(back)}</td>"
                f"<td>{self.t(row['end'])}</td></tr>"
            )
        out.append("</table>")
        return "".join(out)

    # -- the four panels -----------------------------------------------------------------------
    def panels(self) -> list[str]:
        gens = list(self.run.generations.values())
        sig = [g.signals for g in gens]
        loss = [v for g in gens for v in g.loss.values()]
        gn = [v for g in gens for v in g.grad_norm.values()]
        ent = [
            s.get(k)
            for d in sig
            for s in d.values()
            for k in ("attn_entropy_mean", "attn_entropy_min")
        ]
        charts = [
            self._panel(
                "Effective-rank ratio (worst layer, worst rank)",
                Axis(0.0, 1.0),
                lambda g: [(s, v.get("erank_ratio")) for s, v in sorted(g.signals.items())],
                y_label="erank ratio",
            ),
            self._panel(
                "Grade S0–S7 (worst layer, worst rank)",
                Axis(-0.5, 7.5),
                lambda g: [(s, v.get("grade")) for s, v in sorted(g.signals.items())],
                y_label="grade",
                y_ticks=[(float(i), f"S{i}") for i in range(8)],
                step=True,
            ),
            self._panel(
                "Attention entropy: mean over heads (dashed) and lowest head (worst layer, rank)",
                Axis.fit(ent),
                lambda g: [(s, v.get("attn_entropy_min")) for s, v in sorted(g.signals.items())],
                y_label="nats",
                extra=lambda g: [
                    (s, v.get("attn_entropy_mean")) for s, v in sorted(g.signals.items())
                ],
            ),
            self._panel(
                "Loss (solid, left) with grad norm (dashed, right), mean over ranks",
                Axis.fit(loss, log=True),
                lambda g: _thin(sorted(g.loss.items())),
                y_label="loss",
                y2=Axis.fit(gn, log=True),
                y2_label="grad norm",
                extra=lambda g: _thin(sorted(g.grad_norm.items())),
            ),
        ]
        return charts

    def _panel(
        self,
        title: str,
        y: Axis,
        points: Any,
        *,
        y_label: str,
        y_ticks: list[tuple[float, str]] | None = None,
        step: bool = False,
        y2: Axis | None = None,
        y2_label: str = "",
        extra: Any = None,
    ) -> str:
        chart = Chart(
            title=title,
            x=self.x,
            y=y,
            y2=y2,
            width=WIDTH,
            height=230,
            y_label=y_label,
            y2_label=y2_label,
            y_ticks=y_ticks,
            left=LEFT,
            right=RIGHT,
        )
        legend = []
        for i, g in enumerate(self.run.generations.values()):
            color = PALETTE[i % len(PALETTE)]
            label = f"generation {g.number}"
            chart.line(points(g), color=color, step=step, label=label)
            if extra is not None:
                chart.line(extra(g), color=color, dashed=True, axis=2 if y2 else 1, label=label)
            legend.append((color, label))
        self._markers(chart)
        return chart.render(legend=legend)

    def _markers(self, chart: Chart) -> None:
        for e in self.run.events:
            kind = e.get("kind")
            if kind not in MARKERS:
                continue
            step = e.get("checkpoint_step") if kind == "rollback" else e.get("step")
            if not _int(step):
                continue
            color, what = MARKERS[str(kind)]
            label = f"{what} at step {step}: {redact(describe(e), self.secrets)}"
            chart.vline(step, color=color, css_class=str(kind), label=label)

    # -- step time per rank -------------------------------------------------------------------
    def step_times(self) -> list[str]:
        """The step-time chart and its table (:meth:`_slowest` of each generation), or a line
        saying the run's loop measured no step time."""
        gens = [g for g in self.run.generations.values() if g.step_times.rows]
        if not gens:
            return [
                '<p class="muted">No step time in the reports (the training loop does not '
                "measure it: <code>step_timing=False</code>, or a forward that communicates).</p>"
            ]
        picked = [(g, self._slowest(g.step_times)) for g in gens]
        values = [v for g, rows in picked for r, *_ in rows for _, v in g.step_times.series(r)]
        values += [v for g in gens for _, v in g.step_times.median_series()]
        chart = Chart(
            title="Step time per rank: seconds computing per step (grey dashed: median of ranks)",
            x=self.x,
            y=Axis.fit([0.0, *values]),
            width=WIDTH,
            height=230,
            y_label="seconds",
            css_class="step-time",
            left=LEFT,
            right=RIGHT,
        )
        colors: dict[int, str] = {}
        for g, rows in picked:
            st = g.step_times
            chart.line(
                st.median_series(),
                color=MEDIAN_COLOR,
                dashed=True,
                css_class="step-median",
                label=f"generation {g.number}: median of its {len(st.rows)} ranks",
            )
            for rank, median, ratio, stretch in rows:
                color = colors.setdefault(rank, PALETTE[len(colors) % len(PALETTE)])
                label = f"generation {g.number} rank {rank}: {seconds_text(median)}"
                if ratio is not None:
                    label += f", {ratio_text(ratio)} its peers' median"
                slow = stretch is not None and is_slow(stretch.ratio)
                if stretch is not None and slow:
                    label += (
                        f"; {ratio_text(stretch.ratio)} over steps {stretch.first}–{stretch.last}"
                    )
                chart.line(
                    st.series(rank),
                    color=color,
                    css_class="rank-step slow" if slow else "rank-step",
                    label=label + (" (SLOW)" if slow else ""),
                    stroke_width=2.6 if slow else 1.3,
                )
        self._markers(chart)
        legend = [(c, f"r{r}") for r, c in list(colors.items())[: len(PALETTE)]]
        legend.append((MEDIAN_COLOR, "median of ranks"))
        return [chart.render(legend=legend), self._step_table(picked)]

    def _slowest(self, st: StepTimes) -> list[tuple[int, float, float | None, Stretch | None]]:
        """(rank, median step time, its ratio to its peers' median over the generation, its
        slowest stretch) of the :data:`MAX_STEP_TIME_LINES` ranks of a generation slowest
        against their peers at their slowest (:meth:`~.rundata.StepTimes.stretches`: a rank
        that became slow late in the generation too), the slowest first. A rank is slow (SLOW)
        when its slowest stretch is (:func:`~.metrics.is_slow`)."""
        medians = st.medians()
        ratios = peer_ratios(medians)
        stretches = st.stretches()

        def key(r: int) -> tuple[float, float, float, int]:
            worst = stretches[r].ratio if r in stretches else 0.0
            return (-worst, -ratios.get(r, 0.0), -medians[r], r)

        order = sorted(medians, key=key)[:MAX_STEP_TIME_LINES]
        return [(r, medians[r], ratios.get(r), stretches.get(r)) for r in order]

    def _step_table(self, picked: list[tuple[Generation, list[Any]]]) -> str:
        out = [
            f'<p class="legend-note">Each line is one rank\'s mean step time per bin of steps; '
            f"at its slowest, a rank's ratio to its peers' median over {STRETCH_BINS} "
            f"consecutive bins; at or above x{STRAGGLER_RATIO:g} (the built-in "
            "<code>straggler</code> rule's threshold) it is marked SLOW.</p>",
            "<table><tr><th>generation</th><th>rank</th><th>step time (median)</th>"
            "<th>at its slowest / peers' median</th><th>over steps</th>"
            "<th>over the generation</th><th>steps per bin</th></tr>",
        ]
        for g, rows in picked:
            st = g.step_times
            for rank, median, ratio, stretch in rows:
                slow = stretch is not None and is_slow(stretch.ratio)
                worst = "—" if stretch is None else ratio_text(stretch.ratio)
                worst += " SLOW" if slow else ""
                where = "—" if stretch is None else f"{stretch.first}–{stretch.last}"
                klass = ' class="bad slow"' if slow else ""
                overall = "—" if ratio is None else ratio_text(ratio)
                out.append(
                    f"<tr><td>{esc(g.number)}</td><td>{esc(rank)}</td>"
                    f"<td>{esc(seconds_text(median))}</td><td{klass}>{esc(worst)}</td>"
                    f"<td>{esc(where)}</td><td>{esc(overall)}</td><td>{esc(st.width)}</td></tr>"
                )
            hidden = len(st.rows) - len(rows)
            if hidden > 0 or st.left_out:
                note = f"+{hidden} faster ranks not shown" if hidden > 0 else ""
                if st.left_out:
                    note += f"{'; ' if note else ''}{st.left_out} values of ranks beyond "
                    note += f"the first {len(st.rows)} not kept"
                out.append(f'<tr><td></td><td colspan="6" class="muted">{esc(note)}</td></tr>')
        out.append("</table>")
        return "".join(out)

    # -- heatmaps -----------------------------------------------------------------------------
    def heatmaps(self) -> list[str]:
        out = []
        for signal, (title, lo, hi) in HEATMAPS.items():
            svg = self._heatmap(signal, title, lo, hi)
            if svg:
                out.append(svg)
        return out or ['<p class="muted">No per-layer reports.</p>']

    def _heatmap(self, signal: str, title: str, lo: float, hi: float) -> str | None:
        bands: list[tuple[Generation, list[LayerSeries], str]] = []
        for g in self.run.generations.values():
            kept = list(g.series.get(signal, {}).values())
            if not kept:
                continue
            worst_first = sorted(kept, key=lambda s: (-badness(signal, s.worst), s.order, s.name))
            shown = worst_first[:MAX_LAYER_ROWS]
            shown.sort(key=lambda s: (s.order, s.name))  # then in the model's order
            count, more = g.layer_count(signal)
            hidden = max(0, count - len(shown))
            note = f"+{'at least ' if more else ''}{hidden} layers not shown" if hidden else ""
            bands.append((g, shown, note))
        if not bands:
            return None
        row_h, gap = 14, 10
        rows = sum(len(shown) for _, shown, _ in bands)
        height = 26 + rows * row_h + gap * len(bands) + 30
        chart = Chart(
            title=title,
            x=self.x,
            y=Axis(0.0, 1.0),
            width=WIDTH,
            height=height,
            y_ticks=[],
            css_class="heatmap",
            left=LEFT,
            right=RIGHT,
        )
        y = float(chart.top)
        for g, shown, note in bands:
            samples = sorted(g.layer_steps)
            cols = _columns(samples)
            for series in shown:
                label = redact(f"g{g.number} {series.name}", self.secrets)
                chart.text(LEFT - 6, y + row_h - 3, _clip(label, 30), anchor="end", cls="row")
                for first, last, steps in cols:
                    value = _worst([series.values.get(s) for s in steps], signal)
                    x0, x1 = chart.px(first), chart.px(last)
                    if x0 is None or x1 is None:
                        continue
                    frac = None if value is None else (value - lo) / (hi - lo)
                    tip = f"{label} step {steps[0]}: {signal} {_fmt(value)}"
                    chart.rect(x0, x1, y, y + row_h - 1, fill=color_scale(frac), label=tip)
                self._incident_box(chart, g, series.name, y, row_h)
                y += row_h
            if note:
                chart.text(LEFT - 6, y + 9, note, anchor="end")
            y += gap
        return chart.render()

    def _incident_box(self, chart: Chart, g: Generation, layer: str, y: float, h: int) -> None:
        for e in self.run.events:
            if e.get("kind") != "incident" or e.get("layer") != layer:
                continue
            if self.gen_of_event.get(id(e)) != g.number or not _int(e.get("step")):
                continue
            px = chart.px(e["step"])
            if px is None:
                continue
            label = redact(describe(e), self.secrets)
            chart.outline(px - 4, y - 1, 8, h + 1, css_class="fell-first", label=label)

    # -- checkpoints ---------------------------------------------------------------------------
    def checkpoints(self) -> str:
        run = self.run
        if not run.checkpoints and not run.checkpoint_problems:
            return '<p class="muted">No checkpoints in this run directory.</p>'
        st = run.state
        min_grade = _min_grade(run.events)
        best = None
        if run.checkpoints:
            best, _ = select_checkpoint(
                run.checkpoints,
                min_grade=min_grade,
                before_step=None,
                lineage=st.lineage if st is not None and st.lineage else None,
                verify_fn=lambda info: None,  # sidecars only: hashing every file is not needed
            )
        out = [
            f'<p class="legend-note">★ best healthy: the newest checkpoint graded ≥ '
            f"{esc(grade_text(min_grade))} on the run's lineage (what a rollback would choose; "
            "checksums not verified here).</p>",
            "<table><tr><th></th><th>step</th><th>gen</th><th>rank</th><th>grade</th>"
            "<th>loss</th><th>LR scale</th><th>on the lineage</th><th>created (UTC)</th>"
            "<th>file</th>"
            "<th>sha256</th></tr>",
        ]
        lineage = st.lineage if st is not None else ()
        for c in reversed(run.checkpoints):
            mark = "★" if best is not None and c.path == best.path else ""
            meta = c.meta if isinstance(c.meta, dict) else {}
            kept = not lineage or on_lineage(lineage, c.generation, c.step)
            row = "best" if mark else ("" if kept else "off")
            out.append(
                f'<tr class="{row}"><td>{mark}</td><td>{esc(c.step)}</td>'
                f"<td>{esc(c.generation)}</td><td>{esc(c.rank)}</td>"
                f"<td>{esc(grade_text(c.grade))}</td><td>{esc(_fmt(meta.get('loss')))}</td>"
                f"<td>{esc(_fmt(meta.get('lr_scale')))}</td>"
                f"<td>{'✓' if kept else 'abandoned'}</td>"
                f"<td>{self.t(str(c.created)[:19].replace('T', ' '))}</td>"
                f'<td class="mono">{self.t(os.path.basename(c.path))}</td>'
                f'<td class="mono">{esc(c.sha256[:12])}</td></tr>'
            )
        out.append("</table>")
        for path, why in run.checkpoint_problems:
            out.append(f'<p class="bad">skipped {self.t(path)}: {self.t(why)}</p>')
        return "".join(out)

    # -- batch forensics -------------------------------------------------------------------------
    def forensics(self) -> str:
        run = self.run
        skipped = {g.number: g.skipped for g in run.generations.values() if g.skipped}
        files = [item for item in run.forensics if not _no_ids(item)]
        if not files and not skipped:
            return (
                '<p class="muted">No batch ids on file (no incident, or the script passes no '
                "<code>batch_ids</code> to <code>sg.step()</code>).</p>"
            )
        out = []
        for item in files:
            head = f"{self.t(item.incident)}, attempt {item.attempt}"
            if item.doc is None:
                out.append(f'<p class="bad">{head}: {self.t(item.error)}</p>')
                continue
            s = fx.summary(item.doc)
            steps = s["steps"]
            window = f" of steps {steps[0]}–{steps[1]}" if steps else ""
            answered = item.doc.get("answered") or []
            asked = item.doc.get("asked") or []
            out.append(
                f"<h3>{head}</h3><p>{esc(s['batches'])} batch ids{esc(window)} from "
                f"{esc(len(answered))} of {esc(len(asked))} ranks"
                + (f", {esc(s['truncated'])} older ones left out" if s["truncated"] else "")
                + f" · <code>{self.t(item.path)}</code></p>"
            )
            out.append(self._ids_table(item.doc))
        for gen, steps in sorted(skipped.items()):
            by_ids = sorted(s for s, how in steps.items() if how == "batch_ids")
            by_steps = sorted(s for s, how in steps.items() if how != "batch_ids")
            parts = []
            if by_ids:
                parts.append(f"{len(by_ids)} batches by id (at steps {ranks_text(by_ids)})")
            if by_steps:
                parts.append(f"the batches of steps {ranks_text(by_steps)}")
            out.append(f"<p>Generation {esc(gen)} skipped {esc('; '.join(parts))}.</p>")
        return "".join(out)

    def _ids_table(self, doc: Mapping[str, Any]) -> str:
        ranks = doc.get("ranks")
        if not isinstance(ranks, dict) or not ranks:
            return ""
        out = ["<table><tr><th>rank</th><th>latest steps and their batch ids</th></tr>"]
        for rank, answer in ranks.items():
            entries = answer.get("entries") if isinstance(answer, dict) else None
            entries = entries if isinstance(entries, list) else []
            shown = entries[-MAX_IDS_SHOWN:]
            lines = "<br>".join(
                f"step {self.t(e[0])}: <code>{self.t(_clip(json.dumps(e[1]), 160))}</code>"
                for e in shown
                if isinstance(e, list) and len(e) == 2
            )
            more = len(entries) - len(shown)
            tail = f'<br><span class="muted">… {more} earlier in the file</span>' if more else ""
            out.append(f"<tr><td>{self.t(rank)}</td><td>{lines}{tail}</td></tr>")
        out.append("</table>")
        return "".join(out)

    # -- the journal ---------------------------------------------------------------------------
    def journal(self) -> str:
        out = [
            "<table><tr><th>seq</th><th>time</th><th>kind</th><th>incident</th>"
            "<th>what happened</th></tr>"
        ]
        for e in self.run.events:
            out.append(
                f"<tr><td>{self.t(e.get('seq', ''))}</td>"
                f'<td class="mono">{self.t(e.get("time", ""))}</td>'
                f'<td class="kind">{self.t(e.get("kind", ""))}</td>'
                f"<td>{self.t(e.get('incident') or '')}</td><td>{self.t(describe(e))}</td></tr>"
            )
        out.append("</table>")
        return "".join(out)


# -- helpers ------------------------------------------------------------------------------------
def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _fmt(x: Any) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def _thin(points: list[tuple[int, float]]) -> list[tuple[float, float]]:
    """At most :data:`MAX_POINTS` points: means of consecutive runs (a NaN breaks the line)."""
    if len(points) <= MAX_POINTS:
        return [(float(s), v) for s, v in points]
    size = math.ceil(len(points) / MAX_POINTS)
    out = []
    for i in range(0, len(points), size):
        chunk = points[i : i + size]
        vals = [v for _, v in chunk]
        mean = math.nan if any(not finite(v) for v in vals) else sum(vals) / len(vals)
        out.append((sum(s for s, _ in chunk) / len(chunk), mean))
    return out


def _worst(values: list[Any], signal: str) -> float | None:
    nums = [float(v) for v in values if isinstance(v, (int, float))]
    if not nums:
        return None
    if any(math.isnan(v) for v in nums):
        return math.nan
    return min(nums)


def _no_ids(item: Forensics) -> bool:
    """A batch-ids file whose ranks answered with no batch id at all (the script passes none to
    ``sg.step()``, as the HF and Lightning callbacks do): nothing to show."""
    if item.doc is None:
        return False
    return fx.holds_no_ids(fx.summary(item.doc)) and bool(item.doc.get("answered"))


def _columns(samples: list[int]) -> list[tuple[float, float, list[int]]]:
    """The heatmap columns of a band: (first step, end step, the sampled steps in it), at most
    :data:`MAX_COLUMNS`; a column reaches the next one (the last one a typical spacing)."""
    if not samples:
        return []
    size = math.ceil(len(samples) / MAX_COLUMNS)
    groups = [samples[i : i + size] for i in range(0, len(samples), size)]
    spacing = (samples[-1] - samples[0]) / max(len(samples) - 1, 1) if len(samples) > 1 else 1
    out = []
    for i, grp in enumerate(groups):
        end = groups[i + 1][0] if i + 1 < len(groups) else grp[-1] + spacing
        out.append((float(grp[0]), float(end), grp))
    return out


def _min_grade(events: list[dict[str, Any]]) -> int:
    """The ``min_grade`` the run's incidents used (the latest one), else the default S4."""
    for e in reversed(events):
        settings = e.get("settings")
        if e.get("kind") == "incident" and isinstance(settings, dict):
            g = settings.get("min_grade")
            if _int(g) and 0 <= g <= 7:
                return int(g)
    return 4


def _generation_of_events(events: list[dict[str, Any]]) -> dict[int, int]:
    """id(event) -> the generation running when it was journaled (the last one launched)."""
    out, gen = {}, 0
    for e in events:
        if e.get("kind") == "launch" and _int(e.get("generation")):
            gen = e["generation"]
        out[id(e)] = gen
    return out
