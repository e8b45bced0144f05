"""Text that no UTF-8 writer can write never gets past intake (issue #24, item 2).

A lone surrogate (``"\\ud800"``) is valid JSON but not a string UTF-8 can encode: before, it
passed validation, and then every ``/metrics`` scrape failed (HTTP 500) and ``spikeguard
report`` exited 1. Now intake replaces it with U+FFFD wherever it is in the message, and refuses
a line whose bytes are not UTF-8. Real collector, real exporter, real report, real files.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from spikeguard.supervisor.decide import recovery as rc
from spikeguard.supervisor.intake import validate
from spikeguard.supervisor.intake.collector import Collector
from spikeguard.supervisor.intake.tick import ReportLog
from spikeguard.supervisor.journal import Journal
from spikeguard.supervisor.observe.exporter import MetricsExporter
from spikeguard.supervisor.observe.report import write_report

LONE = "\ud800"
"""A lone (high) surrogate: what a JSON ``"\\ud800"`` escape decodes to."""


def report(step: int, layer: str, **extra: object) -> dict:
    return {
        "v": 1,
        "type": "report",
        "run": "r",
        "gen": 1,
        "rank": 0,
        "step": step,
        "t": 0.0,
        "loss": 2.0,
        "grad_norm": 1.0,
        "lr": 1e-3,
        "layers": {layer: {"grade": 5, "attn_entropy_min_norm": 0.8}, "blocks.0": {"grade": 6}},
        "summary": {"grade": 5, "worst_layer": layer},
        **extra,
    }


def ascii_line(msg: dict) -> bytes:
    """``msg`` as Python's json writes it (ASCII, the surrogate as a ``\\ud800`` escape)."""
    return json.dumps(msg).encode()


def strings(value: object) -> list[str]:
    """Every string in decoded JSON ``value``, keys included."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (*strings(k), *strings(v))]
    if isinstance(value, list):
        return [s for v in value for s in strings(v)]
    return []


def encodable(value: object) -> bool:
    return all(_utf8(s) for s in strings(value))


def _utf8(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@pytest.mark.parametrize("as_str", [False, True])
def test_a_lone_surrogate_anywhere_is_replaced_at_ingest(as_str):
    col = Collector(world_size=1, hang_timeout_s=60, first_heartbeat_timeout_s=300)
    col.new_generation(1, 0.0)
    msg = report(5, f"blocks.1{LONE}", extra={f"k{LONE}": [f"v{LONE}", {"x": "\udfff\ud800"}]})
    line = ascii_line(msg)
    assert b"\\ud800" in line
    got = col.ingest(0, line.decode() if as_str else line, 1.0)
    assert got is not None  # the message is kept (its loss and healthy layers count)
    assert encodable(got)
    assert "blocks.1\ufffd" in got["layers"] and got["summary"]["worst_layer"] == "blocks.1\ufffd"
    assert got["extra"] == {"k\ufffd": ["v\ufffd", {"x": "\ufffd\ufffd"}]}
    assert encodable(col.ranks[0].layers)
    record = got.record()  # reports.jsonl holds the repaired message, not the rank's line
    assert b"\\ud800" not in record and b"\\udfff" not in record
    assert "blocks.1\ufffd" in json.loads(record)["layers"]


def test_a_valid_pair_and_plain_text_are_read_as_they_are():
    emoji = "\U0001f600"  # json writes it as the pair "\ud83d\ude00"
    msg = report(5, f"blocks.{emoji}", loss=float("nan"))  # NaN: the json path, not orjson's
    parsed, repaired = validate.read(ascii_line(msg))
    assert f"blocks.{emoji}" in parsed["layers"] and not repaired
    escaped = report(5, "blocks.\\ud800")  # an escaped backslash, then "ud800": no surrogate
    parsed, repaired = validate.read(ascii_line(escaped))
    assert "blocks.\\ud800" in parsed["layers"] and not repaired


@pytest.mark.parametrize(
    "raw",
    [
        b"\xed\xa0\x80",  # a surrogate encoded in UTF-8's form: not UTF-8
        b"\xff",
        b"\xc3",  # a cut sequence
    ],
)
def test_a_line_whose_bytes_are_not_utf8_is_refused(raw):
    col = Collector(world_size=1, hang_timeout_s=60, first_heartbeat_timeout_s=300)
    col.new_generation(1, 0.0)
    line = ascii_line(report(5, "blocks.1@")).replace(b"@", raw)
    assert col.ingest(0, line, 1.0) is None
    assert col.dropped["malformed"] == 1 and col.ranks[0].step is None


def test_metrics_and_the_report_survive_a_lone_surrogate_in_a_layer_name(tmp_path: Path):
    """The reported failure: every scrape raised, and ``spikeguard report`` exited 1."""
    run = tmp_path / "run"
    journal = Journal(run, run="r")
    state = rc.State()
    for obs in (rc.Start(0), rc.Launched(1)):
        t = rc.step(state, obs)
        state = t.state
        for ev in t.events:
            journal.record(ev)
    journal.close()
    col = Collector(world_size=1, hang_timeout_s=60, first_heartbeat_timeout_s=300)
    col.new_generation(1, 0.0)
    log = ReportLog(run / "reports.jsonl")
    for step in range(0, 30, 5):
        msg = col.ingest(0, ascii_line(report(step, f"blocks.1{LONE}")), 1.0 + step)
        assert msg is not None
        log.write(msg)
    log.close()
    ex = MetricsExporter(run="r", clock=lambda: 40.0)
    ex.tick(SimpleNamespace(state=state, collector=col))
    text = ex.exposition()  # bytes, as served
    assert "blocks.1\ufffd".encode() in text
    out = write_report(run, tmp_path / "report.html")
    assert "blocks.1\ufffd" in out.read_text(encoding="utf-8")


def test_files_recorded_before_the_repair_are_read_with_it(tmp_path: Path, capsys):
    """A run recorded before ingest repaired lone surrogates holds them in ``reports.jsonl`` and
    the journal as escapes: the report, ``events``, ``status`` and ``policy replay`` read them
    repaired instead of failing to encode them."""
    import gzip
    import shutil

    from spikeguard.supervisor.cli import main

    demo = Path(__file__).parent / "data" / "demo_run"
    run = tmp_path / "old"
    shutil.copytree(demo, run)
    reports = run / "reports.jsonl"
    packed = run / "reports.jsonl.gz"
    lines = gzip.decompress(packed.read_bytes()).decode().splitlines()
    packed.unlink()
    for i, line in enumerate(lines):
        msg = json.loads(line)
        if msg.get("type") == "report" and msg.get("layers"):
            name = next(iter(msg["layers"]))
            msg["layers"]["evil\ud800" + name] = msg["layers"][name]
            lines[i] = json.dumps(msg)  # ensure_ascii: written as the escape "\ud800"
            break
    else:
        raise AssertionError("the demo run has no report with layers")
    reports.write_text("\n".join(lines) + "\n")
    journal = run / "journal.jsonl"
    events = journal.read_text().splitlines()
    ev = json.loads(events[-1])
    ev["reason"] = "stopped \ud800 here"
    events[-1] = json.dumps(ev)
    journal.write_text("\n".join(events) + "\n")
    assert "\\ud800" in reports.read_text() and "\\ud800" in journal.read_text()

    out = write_report(run, tmp_path / "report.html")
    out.read_text(encoding="utf-8")  # written: encodable
    for argv in (["events", str(run)], ["status", str(run)]):
        assert main(argv) == 0, argv
    printed = capsys.readouterr()
    assert "\ud800" not in printed.out and "Traceback" not in printed.err
    policy = demo / "policy.yaml"
    assert main(["policy", "replay", str(policy), str(reports)]) in (0, 1)
    assert "Traceback" not in capsys.readouterr().err
