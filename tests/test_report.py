"""``spikeguard report``: the post-mortem of any run as one self-contained HTML file."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from spikeguard.supervisor.cli import main
from spikeguard.supervisor.decide import recovery as rc
from spikeguard.supervisor.intake import forensics
from spikeguard.supervisor.journal import Journal
from spikeguard.supervisor.observe.report import render, write_report
from spikeguard.supervisor.observe.rundata import load_run
from spikeguard.workers.checkpoint import write_checkpoint

DEMO = Path(__file__).parent / "data" / "demo_run"
TOKEN = "xoxb-123456789012-123456789012-abcdefghijklmnopqrstuvwx"


def count(page: str, pattern: str) -> int:
    return len(re.findall(pattern, page))


def test_the_recorded_demo_s_report_tells_its_story():
    data = load_run(DEMO)
    page = render(data)
    assert page.startswith("<!DOCTYPE html>") and "<script" not in page.lower()
    assert "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")  # no CDN
    assert "https://" not in page
    # four panels, one line per generation (entropy and loss have a second one each)
    assert count(page, r'<svg class="panel"') == 4
    assert count(page, r'<path class="series"') == 3 + 3 + 2 * 3 + 2 * 3
    # the two incidents (steps 775 and 900) and their rollback targets (550, 700) on each panel
    assert count(page, r'class="marker incident"') == 2 * 4
    assert count(page, r'class="marker rollback"') == 2 * 4
    assert "incident at step 775" in page and "rollback target at step 550" in page
    # the per-layer heatmaps: grade and entropy, one band per generation; the layer each
    # incident fired on is boxed: blocks.2.attn in generation 1, blocks.1.attn in generation 2
    assert count(page, r'<svg class="heatmap"') == 2
    cells = sum(
        len(g.layers) * len({n for s in g.layers.values() for n, v in s.items() if signal in v})
        for g in data.generations.values()
        for signal in ("grade", "attn_entropy_min_norm")
    )
    assert count(page, r'<rect class="cell"') == cells > 400  # one per layer and sample
    boxes = re.findall(r'class="fell-first"[^>]*><title>([^<]*)</title>', page)
    assert len(boxes) == 2
    assert "layer blocks.2.attn" in boxes[0] and "step 775" in boxes[0]
    assert "layer blocks.1.attn" in boxes[1] and "step 900" in boxes[1]
    assert ">g1 blocks.2.attn<" in page and ">g3 blocks.0<" in page
    # the journal, one row per event
    assert count(page, r'<td class="kind">') == len(
        DEMO.joinpath("journal.jsonl").read_text().splitlines()
    )
    assert "entropy-collapse" in page and "final loss</th><td>1.432" in page
    assert "No checkpoints in this run directory" in page  # the recording keeps none


def hostile_run(tmp_path: Path) -> Path:
    """A run whose every name is an attack: the run, a rule, a reason, a layer, batch ids.
    Its journal comes from the real machine."""
    run = tmp_path / "run"
    journal = Journal(run, run='<script>window.__pwned="run"</script>')
    state = rc.State()
    for obs in (
        rc.Launched(1),
        rc.Recover(
            'r"><img src=x onerror="window.__pwned=1">',
            f"loss <b>9</b> & {TOKEN}",
            5,
            rc.Settings(),
            details={"layer": "</svg><script>window.__pwned=2</script>", "rank": 0},
        ),
        rc.Killed((0,), 0.1),
        rc.CheckpointChosen(None),
    ):
        t = rc.step(state, obs)
        state = t.state
        for ev in t.events:
            journal.record(ev)
    journal.close()
    evil = f'<script>window.__pwned=3</script>"><img src=x onerror="window.__pwned=4"> {TOKEN}'
    lines = []
    for step in range(6):
        msg = {"v": 1, "type": "report", "run": "x", "gen": 1, "rank": 0, "step": step, "t": 0}
        msg.update(loss=2.0 - step / 10, grad_norm=1.0, lr=1e-3)
        msg.update(layers={evil: {"grade": 7 - step, "attn_entropy_min_norm": 0.5}})
        msg.update(summary={"grade": 7 - step, "erank_ratio": 0.8, "attn_entropy_min": 1.0})
        lines.append(json.dumps(msg))
    (run / "reports.jsonl").write_text("\n".join(lines) + "\n{torn")  # a crash mid-line
    answers = forensics.Answers(incident="inc-001", attempt=1, generation=1, asked=[0])
    ids = [[4, f"</code><script>window.__pwned=5</script> {TOKEN}"], [5, [1, 2]]]
    answers.add({"rank": 0, "step": 5, "window": 200, "entries": ids})
    path = forensics.batch_ids_path(run, "inc-001", 1)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(answers.document(incident_step=5, waited_s=0.1)))
    return run


def test_every_string_from_the_run_is_escaped_and_redacted(tmp_path):
    page = render(load_run(hostile_run(tmp_path)))
    assert "<script" not in page.lower() and "<img" not in page.lower()
    assert "onerror=" not in page.replace("onerror=&quot;", "")  # only as escaped text
    assert "&lt;script&gt;window.__pwned=&quot;run&quot;&lt;/script&gt;" in page
    assert "&lt;/svg&gt;&lt;script&gt;window.__pwned=2" in page  # the incident's layer
    assert "window.__pwned=5" in page and TOKEN not in page and "[redacted]" in page
    assert "ESCALATED (exit 3)" in page  # a run that ended badly renders too


def test_a_crashed_run_with_little_on_disk_still_renders(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(DEMO / "journal.jsonl", run / "journal.jsonl")
    with (run / "journal.jsonl").open("r+") as f:  # the supervisor died after event 8
        f.truncate(sum(len(x) for x in f.read().splitlines(keepends=True)[:8]))
    data = load_run(run)
    assert data.state is not None and data.state.phase is rc.Phase.PROBATION
    page = render(data)
    assert "PROBATION" in page and "no reports.jsonl(.gz): the panels are empty" in page
    assert page.count('<td class="kind">') == 8
    with pytest.raises(FileNotFoundError, match=r"holds no journal\.jsonl"):
        load_run(tmp_path / "nothing")


def test_checkpoints_are_listed_with_grades_and_the_best_healthy_one_marked(tmp_path):
    shutil.copytree(DEMO, tmp_path / "run")
    ckpts = tmp_path / "run" / "checkpoints"
    ckpts.mkdir()
    state = {"w": torch.zeros(2)}
    for step, gen, grade in ((500, 1, 6), (800, 1, 7), (750, 2, 6), (690, 2, 6), (695, 2, 2)):
        write_checkpoint(ckpts, state, step=step, generation=gen, meta={"grade": grade})
    write_checkpoint(ckpts, state, step=900, generation=3, meta={"grade": 2, "loss": 1.5})
    page = render(load_run(tmp_path / "run"))
    rows = re.findall(r'<tr class="(best|off|)"><td>(★?)</td><td>(\d+)</td><td>(\d)</td>', page)
    # the demo's lineage: generation 2 from step 550, generation 3 from step 700
    assert [(int(s), int(g), star, row) for row, star, s, g in rows] == [
        (900, 3, "", ""),  # S2
        (800, 1, "", "off"),  # after generation 2 branched off at 550: abandoned
        (750, 2, "", "off"),  # after generation 3 branched off at 700: abandoned
        (695, 2, "", ""),  # S2
        (690, 2, "★", "best"),  # the newest checkpoint graded >= S4 on the lineage
        (500, 1, "", ""),
    ]
    assert "<td>1.5</td>" in page  # the sidecar's loss


def test_the_command_writes_one_file_and_refuses_a_directory_without_a_run(tmp_path, capsys):
    out = tmp_path / "out.html"
    assert main(["report", str(DEMO), "-o", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    assert out.stat().st_mode & 0o777 == 0o600 and out.read_text().endswith("</html>\n")
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "holds no journal.jsonl" in capsys.readouterr().err
    run = tmp_path / "copy"
    shutil.copytree(DEMO, run)
    assert main(["report", str(run)]) == 0 and (run / "report.html").is_file()
    assert write_report(run, run / "again.html").read_text() != ""
