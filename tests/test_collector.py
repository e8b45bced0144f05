"""The collector: validation, generation fencing, exits and hangs (no Ray; time is passed in)."""

from __future__ import annotations

import json

import pytest
from spikeguard.supervisor.intake.collector import Collector


def line(**kw) -> bytes:
    msg = {
        "v": 1,
        "type": "heartbeat",
        "run": "r",
        "gen": 2,
        "rank": 0,
        "step": 5,
        "t": 0.0,
        "loss": 2.0,
    }
    msg.update(kw)
    return json.dumps(msg).encode()


@pytest.fixture
def col() -> Collector:
    c = Collector(world_size=2, hang_timeout_s=10, first_heartbeat_timeout_s=60)
    c.new_generation(2, now=100.0)
    return c


def test_accepts_current_generation_and_stamps_arrival(col):
    msg = col.ingest(0, line(), now=101.5)
    assert msg is not None and msg["at"] == 101.5
    assert col.ranks[0].step == 5 and col.ranks[0].loss == 2.0


def test_stale_generation_report_is_dropped_and_counted(col):
    assert col.ingest(0, line(gen=1, type="report", summary={"grade": 1}), now=101) is None
    assert col.dropped["stale_generation"] == 1
    assert col.ranks[0].step is None  # nothing of it was taken in


@pytest.mark.parametrize(
    "raw,why",
    [
        (b"{not json", "malformed"),
        (b"[1, 2]", "malformed"),
        (b"\xff\xfe", "malformed"),
        (line(v=99), "bad_version"),
        (line(type="brag"), "unknown_type"),
        (line(step="5"), "wrong_type"),
        (line(loss="2.0"), "wrong_type"),
        (line(gen=True), "wrong_type"),
        (line(summary=[1]), "wrong_type"),
    ],
)
def test_bad_lines_are_dropped_with_a_reason_never_raise(col, raw, why):
    assert col.ingest(0, raw, now=101) is None
    assert col.dropped[why] == 1


def test_unknown_rank_and_rank_spoofing_are_dropped(col):
    assert col.ingest(7, line(rank=7), now=101) is None
    assert col.ingest(1, line(rank=0), now=101) is None  # rank 1's socket claiming to be rank 0
    assert col.dropped["unknown_rank"] == 2


def test_nonfinite_metrics_pass_through_as_data(col):
    msg = col.ingest(
        0, b'{"v":1,"type":"heartbeat","run":"r","gen":2,"rank":0,"step":6,"t":0,"loss":NaN}', 101
    )
    assert msg is not None and msg["loss"] != msg["loss"]


def test_fence_drops_everything_until_the_next_generation(col):
    col.fence()
    assert col.ingest(0, line(), now=101) is None
    col.new_generation(3, now=102)
    assert col.ingest(0, line(gen=3), now=103) is not None


def test_exit_message_once_and_only_for_current_generation(col):
    assert col.exit(1, 3, generation=1, now=101) is None
    msg = col.exit(1, 3, generation=2, now=101)
    assert msg["type"] == "exit" and msg["code"] == 3 and msg["rank"] == 1
    assert col.exit(1, 3, generation=2, now=102) is None


def test_hang_uses_first_heartbeat_timeout_then_the_regular_one(col):
    assert col.check_hangs(now=159.0) == []  # 59 s since launch < 60 s first-heartbeat allowance
    col.ingest(0, line(), now=159.5)
    hangs = col.check_hangs(now=160.5)
    assert [h["rank"] for h in hangs] == [1] and hangs[0]["first"] is True
    assert col.check_hangs(now=169.0) == []  # rank 0 silent 9.5 s < 10 s
    hangs = col.check_hangs(now=170.0)
    assert [h["rank"] for h in hangs] == [0] and hangs[0]["first"] is False
    # a silence is reported again only after another full timeout, with its growing age (so a
    # `hang: 5m` rule sees the silence reach 5 minutes); rank 1 (first at 160.5) is due at 220.5
    assert col.check_hangs(now=175.0) == []
    again = {h["rank"]: h for h in col.check_hangs(now=221.0)}
    assert sorted(again) == [0, 1] and again[1]["age_s"] == 121.0 and again[1]["first"] is True
    assert again[0]["age_s"] == 61.5 and again[0]["first"] is False
    col.ingest(0, line(step=2), now=222.0)  # any message ends rank 0's silence
    assert col.check_hangs(now=230.0) == []


def test_a_slow_but_progressing_rank_is_not_hung(col):
    for i in range(20):  # one step every 8 s, under the 10 s timeout
        col.ingest(0, line(step=i), now=100 + 8 * i)
        col.ingest(1, line(rank=1, step=i), now=100 + 8 * i)
        assert col.check_hangs(now=100 + 8 * i + 7.9) == []


def test_min_step_and_all_finished(col):
    col.ingest(0, line(step=9), now=101)
    assert col.min_step() is None  # rank 1 not heard from yet
    col.ingest(1, line(rank=1, step=7), now=101)
    assert col.min_step() == 7
    col.exit(0, 0, 2, now=102)
    assert not col.all_finished()
    col.exit(1, 0, 2, now=102)
    assert col.all_finished()


def test_a_teardown_crash_after_done_counts_as_finished_but_is_kept(col):
    col.ingest(0, line(type="done", step=9), now=101)
    msg = col.exit(0, -6, generation=2, now=102)
    assert msg["code"] == 0 and msg["teardown_code"] == -6
    assert col.exit(1, -6, generation=2, now=102)["code"] == -6  # no `done`: a real crash
    assert not col.all_finished()


# -- hostile lines: each one is dropped and counted, none raises -------------------------------
BIG = 10**400  # parses as a Python int; float(BIG) raises OverflowError
DEEP = (
    b'{"v":1,"type":"heartbeat","run":"r","gen":2,"rank":0,"step":5,"t":0,"x":'
    + b"[" * 5000
    + b"]" * 5000
    + b"}"
)


def _nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    "raw,why",
    [
        (DEEP, "malformed"),  # json.loads raises RecursionError
        (line(extra=_nested(40)), "malformed"),  # parses, but deeper than any message nests
        (b'{"v":1,"type":"heartbeat","gen":2,"rank":0,"step":Infinity,"t":0}', "wrong_type"),
        (b'{"v":1,"type":"heartbeat","gen":2,"rank":0,"step":NaN,"t":0}', "wrong_type"),
        (line(step=BIG), "out_of_range"),
        (line(step=2**53 + 1), "out_of_range"),
        (line(gen=BIG), "out_of_range"),
        (line(rank=-BIG), "out_of_range"),
        (line(loss=BIG), "out_of_range"),
        (line(lr=-BIG), "out_of_range"),
        (line(grad_norm=BIG), "out_of_range"),
        (line(t=BIG), "out_of_range"),
        (line(type="report", summary={"grade": BIG}), "out_of_range"),
        (line(type="report", summary={"grade": "S3"}), "wrong_type"),
        (line(type="report", summary={"worst_layer": 3}), "wrong_type"),
        (line(type="report", layers={"blocks.0": {"max_logit": BIG}}), "out_of_range"),
        (line(type="report", layers={"blocks.0": {"grade": "x"}}), "wrong_type"),
        (line(type="report", layers={"blocks.0": {"grade": [3]}}), "wrong_type"),
        (line(type="report", layers={"blocks.0": {"grade": True}}), "wrong_type"),
        (line(type="report", layers={"blocks.0": [1, 2]}), "wrong_type"),
        (line(type="dropped", count="x"), "wrong_type"),
        (line(type="dropped", count=1.5), "wrong_type"),
        (line(type="dropped", count=BIG), "out_of_range"),
        (line(type="hello", world_size=BIG), "out_of_range"),
        (line(type="checkpoint", grade=BIG), "out_of_range"),
    ],
)
def test_hostile_lines_are_dropped_with_a_reason_never_raise(col, raw, why):
    assert col.ingest(0, raw, now=101) is None
    assert col.dropped == {why: 1}
    assert col.ranks[0].step is None and col.ranks[0].last_seen is None  # nothing taken in
    assert col.ingest(0, line(step=6), now=102) is not None  # and the next good line is


def test_an_oversize_line_is_dropped_without_parsing_it(col):
    assert col.ingest(0, line(run="r" * (1 << 20)), now=101) is None
    assert col.dropped == {"oversize": 1}


def test_values_at_the_limits_and_nonfinite_data_are_accepted(col):
    msg = col.ingest(
        0,
        line(
            type="report",
            step=2**53,
            loss=float("inf"),
            grad_norm=-(2**53),
            summary={"grade": 3, "max_logit": float("nan"), "worst_layer": "blocks.0"},
            layers={"blocks.0": {"grade": 3, "max_logit": 1e300, "logz_max": None}},
            extra={"tokens": BIG},  # the supervisor never reads extra: passed through as data
        ),
        now=101,
    )
    assert msg is not None and col.dropped == {}
    assert col.ranks[0].step == 2**53 and col.ranks[0].summary["grade"] == 3


def test_a_layer_name_that_is_not_a_string_is_refused():
    from spikeguard.supervisor.intake.validate import problem

    msg = json.loads(line(type="report"))
    msg["layers"] = {1: {"grade": 3}}
    assert problem(msg) == "wrong_type"
    msg["layers"] = {"blocks.0": {2: 3}}
    assert problem(msg) == "wrong_type"


@pytest.mark.parametrize(
    "raw, verbatim",
    [
        (line(), True),
        (b"  " + line(loss=float("nan")) + b" \t", True),  # NaN tokens, padding: still one line
        (line(at=5.0), True),  # the rank's own "at" is overridden by the later, appended one
        (line(loss=1.0)[:-1] + b', "loss": 3.5}', True),  # a duplicate key: the last one counts
        (line(run="é").replace(b"\\u00e9", "é".encode()), False),  # UTF-8: encoded again
        (line(run="r\u2028"), True),  # escaped in the line: ASCII
        (line().replace(b", ", b",\r "), False),  # a carriage return is a line break to some
        (line() + b"\n", True),
        (line().decode(), True),
        (
            json.dumps({"v": 1, "type": "heartbeat", "gen": 2, "rank": 0, "step": 5}, indent=1),
            False,
        ),
    ],
)
def test_reports_jsonl_keeps_the_ranks_line_and_reads_back_as_the_message(col, raw, verbatim):
    """``reports.jsonl`` gets the rank's own bytes plus ``at`` when they are plain ASCII JSON on
    one line, the message encoded again otherwise; either way the record is one line that reads
    back as exactly the message the engine saw."""
    msg = col.ingest(0, raw, now=101.25)
    assert msg is not None
    record = msg.record()
    assert record.endswith(b"\n") and record.count(b"\n") == 1 and b"\r" not in record
    back = json.loads(record)
    assert json.dumps(back, sort_keys=True) == json.dumps(msg, sort_keys=True)  # NaN-safe
    assert back["at"] == 101.25
    raw_bytes = raw.encode() if isinstance(raw, str) else raw
    assert record.startswith(raw_bytes.strip()[:-1]) is verbatim


def _random_json(rng, depth: int = 0) -> str:
    """A random JSON text, hostile corners included (integers around 2**53, 2**63 and 2**64
    and far beyond, floats that overflow or underflow, NaN tokens, escapes, lone surrogates,
    duplicate keys, deep nesting)."""
    pick = rng.randrange(12 if depth < 4 else 8)
    if pick == 0:
        base = rng.choice([0, 2**53, 2**63, 2**64, 10**30, 10**400])
        return str(rng.choice([1, -1]) * (base + rng.randint(-2, 2)))
    if pick == 1:
        return repr(rng.uniform(-1e6, 1e6))
    if pick == 2:
        return rng.choice(["1e400", "-1e400", "1e-400", "2.5E+3", "-0.0", "0.1e-5", "1.0"])
    if pick == 3:
        return rng.choice(["NaN", "Infinity", "-Infinity", "true", "false", "null"])
    if pick == 4:
        return json.dumps(rng.choice(["", "a\u00e9", "\\", '"', "\x00", "\u2028", "€"]))
    if pick == 5:
        return rng.choice(['"\\ud800"', '"\\udfff\\ud800"', '"\\u0041"', '"x\\ny"'])
    if pick in (6, 7):
        return repr(rng.random() * 10 ** rng.randint(-30, 30))
    if pick in (8, 9):
        items = [_random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))]
        return "[" + ",".join(items) + "]"
    keys = [rng.choice(["a", "b", "loss", "step", "\\u00e9"]) for _ in range(rng.randint(0, 4))]
    return "{" + ",".join(f'"{k}":{_random_json(rng, depth + 1)}' for k in keys) + "}"


def test_the_fast_json_reader_reads_every_line_as_json_does(monkeypatch):
    """``validate.parse`` reads lines with orjson where it can; on random and hostile lines,
    messages and refusals alike, it gives exactly what it gives with ``json.loads`` alone."""
    import random

    from spikeguard.supervisor.intake import validate

    rng = random.Random(17)
    lines = [line(), line(loss=float("nan")), line(step=2**64), line(t=-(2**63) - 1)]
    lines += [b"\xef\xbb\xbf" + line(), line().replace(b"2.0", b"2.0" * 30), b'{"v":1'] * 1
    for _ in range(3000):
        body = _random_json(rng)
        if rng.random() < 0.5:
            body = line()[:-1].decode() + ',"extra":' + body + "}"
        raw = body.encode("utf-8", "surrogatepass")
        if rng.random() < 0.05:
            raw = raw[: rng.randrange(len(raw) + 1)]
        lines.append(raw)

    def outcome(raw: bytes) -> str:
        try:
            return repr(validate.parse(raw))
        except validate.Rejected as e:
            return "rejected: " + e.reason

    fast = [outcome(raw) for raw in lines]
    monkeypatch.setattr(validate, "_fast_loads", lambda raw: None)  # json.loads alone
    slow = [outcome(raw) for raw in lines]
    assert fast == slow
    assert sum(o.startswith("{") for o in fast) > 500  # many messages are accepted
    assert len({o for o in fast if o.startswith("rejected")}) >= 3  # and refused several ways
