"""What a run directory holds, read for the post-mortem: any run, finished, running or crashed.

:func:`load_run` reads ``journal.jsonl`` (the story), ``reports.jsonl`` or, as recordings keep
it, ``reports.jsonl.gz`` (every accepted rank message, streamed and folded per generation and
step, so a long run never sits in memory whole), the checkpoints' sidecars (torch-free:
:func:`~spikeguard.workers.checkpoint.choose.list_checkpoints`) and the incidents' batch-ids
files. A part that is missing or cannot be read is left out and said in ``problems``; a torn or
malformed line costs that line only.

Per (generation, step), over ranks: the mean loss and grad norm (every heartbeat), and the worst
of each declared per-layer signal (every report's summary, by where its declaration says trouble
lies): the lowest grade, rank ratio and entropy, the highest logit and log Z. Per (generation,
step, layer): the lowest grade and normalised min-head entropy (:data:`HEATMAP_SIGNALS`).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
from pathlib import Path
from typing import IO, Any

from spikeguard.workers.checkpoint.choose import list_checkpoints
from spikeguard.workers.contract.signals import LAYER_SIGNALS, worse

from ..decide import recovery as rc
from ..intake import forensics
from ..journal import read_events

HEATMAP_SIGNALS = ("grade", "attn_entropy_min_norm")
"""The per-layer signals kept per layer: the ones the report's heatmaps show (every declared
per-layer signal is kept per step, the worst over ranks)."""


@dataclasses.dataclass
class Generation:
    """What the ranks of one generation reported, per step (over ranks)."""

    number: int
    loss: dict[int, float] = dataclasses.field(default_factory=dict)
    grad_norm: dict[int, float] = dataclasses.field(default_factory=dict)
    signals: dict[int, dict[str, float]] = dataclasses.field(default_factory=dict)
    layers: dict[int, dict[str, dict[str, float]]] = dataclasses.field(default_factory=dict)
    skipped: dict[int, str] = dataclasses.field(default_factory=dict)
    """Step -> how its batch was skipped (``steps`` or ``batch_ids``)."""
    _sums: dict[int, list[float]] = dataclasses.field(default_factory=dict, repr=False)

    @property
    def steps(self) -> tuple[int, int] | None:
        """The first and last step any rank of this generation reported."""
        known = list(self._sums) or list(self.loss) or list(self.signals)
        return (min(known), max(known)) if known else None


@dataclasses.dataclass
class Forensics:
    """One incident's batch-ids file, read back (``error`` when it could not be)."""

    path: Path
    incident: str
    attempt: int
    doc: dict[str, Any] | None = None
    error: str | None = None


@dataclasses.dataclass
class RunData:
    """Everything the report shows of one run directory."""

    run_dir: Path
    name: str
    events: list[dict[str, Any]]
    state: rc.State | None
    generations: dict[int, Generation]
    layer_names: list[str]
    checkpoints: list[Any]
    checkpoint_problems: list[tuple[str, str]]
    forensics: list[Forensics]
    reports_file: Path | None
    problems: list[str]


def reports_path(run_dir: Path) -> Path | None:
    """``reports.jsonl``, else ``reports.jsonl.gz``, else None."""
    for name in ("reports.jsonl", "reports.jsonl.gz"):
        if (run_dir / name).is_file():
            return run_dir / name
    return None


def _open_reports(path: Path) -> IO[bytes]:
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def load_run(run_dir: str | Path) -> RunData:
    """Read ``run_dir`` (see the module docstring); ``FileNotFoundError`` when it holds no
    journal and no reports (it is not a run directory)."""
    run = Path(run_dir)
    problems: list[str] = []
    reports = reports_path(run)
    if not (run / "journal.jsonl").is_file() and reports is None:
        raise FileNotFoundError(f"{run} holds no journal.jsonl and no reports.jsonl(.gz)")
    events = read_events(run)
    state: rc.State | None = None
    try:
        state = rc.fold(events)
    except (ValueError, TypeError, KeyError) as e:
        problems.append(f"the journal does not fold into a recovery state: {e}")
    generations: dict[int, Generation] = {}
    layer_names: dict[str, None] = {}
    if reports is None:
        problems.append("no reports.jsonl(.gz): the panels are empty")
    else:
        try:
            _read_reports(reports, generations, layer_names)
        except (OSError, EOFError) as e:  # a truncated .gz: what was read so far counts
            problems.append(f"{reports.name} could not be read to its end: {e}")
    for g in generations.values():
        _finish(g)
    ckpts = list_checkpoints(run / "checkpoints")
    names = [e.get("run") for e in events if isinstance(e.get("run"), str)]
    return RunData(
        run_dir=run,
        name=names[0] if names else run.name,
        events=events,
        state=state,
        generations=dict(sorted(generations.items())),
        layer_names=list(layer_names),
        checkpoints=list(ckpts),
        checkpoint_problems=list(ckpts.problems),
        forensics=_read_forensics(run),
        reports_file=reports,
        problems=problems,
    )


def _read_reports(path: Path, gens: dict[int, Generation], layers: dict[str, None]) -> None:
    with _open_reports(path) as f:
        for line in f:
            try:
                msg = json.loads(line)
            except (ValueError, RecursionError):
                continue
            if isinstance(msg, dict):
                _fold(msg, gens, layers)


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _fold(msg: dict[str, Any], gens: dict[int, Generation], layers: dict[str, None]) -> None:
    kind, gen, step = msg.get("type"), msg.get("gen"), msg.get("step")
    if not (_int(gen) and _int(step)):
        return
    g = gens.get(gen)
    if g is None:
        g = gens[gen] = Generation(gen)
    if kind == "skipped":
        g.skipped[step] = str(msg.get("by") or "steps")
        return
    if kind not in ("heartbeat", "report"):
        return
    sums = g._sums.setdefault(step, [0.0, 0.0, 0.0, 0.0, 0.0])
    loss, gn = msg.get("loss"), msg.get("grad_norm")
    if _num(loss):
        if math.isfinite(loss):
            sums[0] += loss
            sums[1] += 1
        else:
            sums[4] += 1
    if _num(gn) and math.isfinite(gn):
        sums[2] += gn
        sums[3] += 1
    if kind != "report":
        return
    summary = msg.get("summary")
    if isinstance(summary, dict):
        worst = g.signals.setdefault(step, {})
        for name in LAYER_SIGNALS:
            _keep_worst(worst, name, summary.get(name))
    per_layer = msg.get("layers")
    if isinstance(per_layer, dict):
        at = g.layers.setdefault(step, {})
        for layer, signals in per_layer.items():
            if not isinstance(signals, dict):
                continue
            shown = {s: signals[s] for s in HEATMAP_SIGNALS if s in signals}
            if not shown:
                continue
            layers.setdefault(str(layer))
            cell = at.setdefault(str(layer), {})
            for name, value in shown.items():
                _keep_worst(cell, name, value)


def _keep_worst(into: dict[str, float], name: str, value: Any) -> None:
    """Keep the worse of ``into[name]`` and ``value`` (by where the signal's declaration says
    trouble lies; NaN is the worst of all)."""
    if not _num(value):
        return
    old = into.get(name)
    into[name] = float(value) if old is None else worse(name, old, float(value))


def _finish(g: Generation) -> None:
    """Means from the running sums (a step whose every loss was non-finite reads NaN)."""
    for step, (ls, ln, gs, gn, bad) in g._sums.items():
        if ln:
            g.loss[step] = ls / ln
        elif bad:
            g.loss[step] = math.nan
        if gn:
            g.grad_norm[step] = gs / gn


def _read_forensics(run: Path) -> list[Forensics]:
    out = []
    base = run / forensics.INCIDENTS_DIR
    for path in base.glob("inc-*/batch_ids-*.json") if base.is_dir() else ():
        try:
            attempt = int(path.stem.rpartition("-")[2])
        except ValueError:
            continue
        item = Forensics(path=path, incident=path.parent.name, attempt=attempt)
        try:
            item.doc = forensics.read_batch_ids(path)
        except ValueError as e:
            item.error = str(e)
        out.append(item)
    return sorted(out, key=lambda f: (f.incident, f.attempt))
