"""``spikeguard policy check|schema|explain|replay``, in-process and as a real subprocess."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import typing
from pathlib import Path

import jsonschema
import pytest
from pydantic import BaseModel
from spikeguard.policies import Policy, load_policy
from spikeguard.policies.commands import policy_schema, register
from spikeguard.policies.loader import BUILTINS, load_yaml_text
from spikeguard.policies.testing import exit_, heartbeat, hello, report

ROOT = Path(__file__).resolve().parents[1]
CLI = (
    "import argparse, sys; from spikeguard.policies.commands import register; "
    "p = argparse.ArgumentParser(prog='spikeguard'); s = p.add_subparsers(dest='cmd'); "
    "register(s); "
    "a = p.parse_args(sys.argv[1:]); raise SystemExit(a.func(a))"
)


def cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", CLI, "policy", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def run_in_process(capsys, *args: str) -> tuple[int, str, str]:
    p = argparse.ArgumentParser()
    register(p.add_subparsers(dest="cmd"))
    ns = p.parse_args(["policy", *args])
    code = ns.func(ns)
    out = capsys.readouterr()
    return code, out.out, out.err


# --- check --------------------------------------------------------------------------------


def test_the_documented_one_liner_works():
    snippet = (
        "import argparse; from spikeguard.policies.commands import register; "
        "p=argparse.ArgumentParser(); "
        's=p.add_subparsers(dest="cmd"); register(s); '
        'a=p.parse_args(["policy","check","policies/default.yaml"]); '
        "raise SystemExit(a.func(a))"
    )
    res = subprocess.run(
        [sys.executable, "-c", snippet], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    assert "policies/default.yaml: ok" in res.stdout


BROKEN = {
    "dup.yaml": (
        "version: 1\nname: a\nrules:\n  - {name: r, when: crash, action: recover}\nname: b\n",
        "dup.yaml:5:1: duplicate key 'name'",
    ),
    "tag.yaml": (
        "version: 1\nname: !!python/object/apply:os.system ['echo hi']\nrules: []\n",
        "tag.yaml:2:7: name: tag '!!python/object/apply:os.system' is not allowed",
    ),
    "token.yaml": (
        "version: 1\nname: a\nnotify:\n  slack:\n    channel: xoxb-123-456\n"
        "rules:\n  - {name: r, when: crash, action: recover}\n",
        "token.yaml:5:14: notify.slack.channel: this value looks like a Slack token",
    ),
    "signal.yaml": (
        "version: 1\nname: a\nrules:\n  - name: r\n    when: {signal: grad_nrom, above: 1}\n"
        "    action: recover\n",
        "did you mean 'grad_norm'?",
    ),
    "syntax.yaml": ("version: 1\nname: [a\n", "syntax.yaml:2:7: YAML syntax error"),
    "binary.yaml": (b"\xff\xfe\x00garbage", "binary.yaml"),
    "deep.yaml": (
        "version: 1\nname: a\nrules: " + "[" * 20_000 + "]" * 20_000 + "\n",
        "deep.yaml:3:",
    ),
    "bigint.yaml": (
        "version: 1\nname: a\nwarm_in: " + "9" * 5000 + "\nrules: []\n",
        "bigint.yaml:3:10: warm_in: ",
    ),
    "anchor.yaml": ("version: 1\nname: a\nrules: &r [*r]\n", "anchor.yaml:3:"),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_check_exits_2_with_one_line_and_no_traceback(tmp_path, name):
    text, expected = BROKEN[name]
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    res = cli("check", name, cwd=tmp_path)
    assert res.returncode == 2
    assert "Traceback" not in res.stderr and res.stdout == ""
    assert expected in res.stderr.splitlines()[0], res.stderr


@pytest.mark.parametrize("name", ["deep.yaml", "bigint.yaml", "anchor.yaml"])
def test_check_never_reports_an_internal_error_on_a_hostile_file(tmp_path, capsys, name):
    path = tmp_path / name
    path.write_text(BROKEN[name][0])
    code, out, err = run_in_process(capsys, "check", str(path))
    assert code == 2 and out == ""
    assert err.startswith(f"{path}:3:") and "internal error" not in err, err


def test_check_refuses_a_50_mb_policy(tmp_path, capsys):
    path = tmp_path / "big.yaml"
    path.write_text("version: 1\nname: a\nrules: []\n# " + "x" * (50 << 20) + "\n")
    code, _, err = run_in_process(capsys, "check", str(path))
    assert code == 2
    assert err.strip() == f"{path}: the file is 50.0 MiB; policies and job files are at most 1 MiB"


def test_check_missing_file_and_builtins(tmp_path):
    res = cli("check", "nope.yaml", cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.strip() == "nope.yaml: no such file"
    for name in BUILTINS:
        res = cli("check", name, cwd=tmp_path)
        assert res.returncode == 0 and f"policy {name!r}" in res.stdout


def test_check_usage_errors_do_not_trace(tmp_path):
    res = cli(cwd=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr and "check" in res.stderr


# --- schema -------------------------------------------------------------------------------


def test_schema_command_prints_the_model_schema(capsys):
    code, out, _ = run_in_process(capsys, "schema")
    assert code == 0
    schema = json.loads(out)
    assert schema == json.loads(json.dumps(policy_schema()))
    assert schema["additionalProperties"] is False and "rules" in schema["required"]


@pytest.mark.parametrize("name", BUILTINS)
def test_schema_validates_each_builtin(name):
    data = load_yaml_text((ROOT / "policies" / f"{name}.yaml").read_text())
    jsonschema.validate(data, policy_schema())


@pytest.mark.parametrize(
    "bad",
    [
        {
            "version": 1,
            "name": "a",
            "rules": [{"name": "r", "when": "crash", "action": "recover", "acton": 1}],
        },
        {
            "version": 1,
            "name": "a",
            "rules": [
                {"name": "r", "when": {"signal": "grad_nrom", "above": 1}, "action": "recover"}
            ],
        },
        {"version": 1, "name": "a", "rules": [{"name": "r", "when": "crash", "action": "reboot"}]},
        {
            "version": 1,
            "name": "a",
            "warm_in": 300,
            "rules": [{"name": "r", "when": "crash", "action": "stop"}],
        },
        {
            "version": 1,
            "name": "a",
            "recovery": {"min_grade": "S9"},
            "rules": [{"name": "r", "when": "crash", "action": "stop"}],
        },
    ],
)
def test_schema_rejects_what_the_models_reject(bad):
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, policy_schema())


def _models(root: type[BaseModel]) -> set[type[BaseModel]]:
    seen: set[type[BaseModel]] = set()
    todo = [root]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        for f in m.model_fields.values():
            stack = [f.annotation]
            while stack:
                tp = stack.pop()
                if isinstance(tp, type) and issubclass(tp, BaseModel):
                    todo.append(tp)
                stack.extend(typing.get_args(tp))
    return seen


def test_schema_is_derived_from_the_models():
    schema = policy_schema()
    defs = schema["$defs"]
    models = _models(Policy)
    assert len(models) >= 14  # Policy, Rule, 8 conditions, scopes, recovery, notify...
    for model in models:
        node = schema if model is Policy else defs[model.__name__]
        assert node["additionalProperties"] is False, model
        for name, field in model.model_fields.items():
            key = field.alias or name
            assert key in node["properties"], (model.__name__, key)
            assert field.description, f"{model.__name__}.{name} has no docstring"
            assert node["properties"][key]["description"] == field.description


# --- explain ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", BUILTINS)
def test_explain_each_builtin(capsys, name):
    code, out, _ = run_in_process(capsys, "explain", name)
    assert code == 0
    pol = load_policy(name)
    assert f"Policy {name!r}" in out
    for rule in pol.rules:
        assert f". {rule.name}: " in out
    assert "Recovery: " in out and "Notifications: " in out


# --- replay -------------------------------------------------------------------------------


def _stream() -> list[dict]:
    msgs = [hello(r, world_size=2) for r in range(2)]
    for s in range(0, 120):
        for r in range(2):
            msgs.append(heartbeat(r, s, loss=2.0 + 0.01 * ((s * 7 + r) % 5)))
    msgs.append(heartbeat(1, 120, loss=math.nan))
    msgs.append(exit_(0, -9))
    return msgs


def test_replay_run_dir_prints_decisions_and_summary(tmp_path, capsys):
    (tmp_path / "reports.jsonl").write_text(
        "".join(json.dumps(m) + "\n" for m in _stream()) + '{"trunc'
    )
    code, out, err = run_in_process(capsys, "replay", "default", str(tmp_path))
    assert code == 0
    lines = out.strip().splitlines()
    assert len(lines) == 2
    assert "step    120" in lines[0] and "rank  1" in lines[0] and "non-finite-loss" in lines[0]
    assert "recover" in lines[0] and "loss is nan" in lines[0]
    assert (
        "1 decision (recover ×1); first recover at step 120 by rule 'non-finite-loss'" in lines[1]
    )
    assert "skipped 1 line(s)" in err


def test_replay_json_lines(tmp_path, capsys):
    path = tmp_path / "rank.jsonl"
    path.write_text("".join(json.dumps(m) + "\n" for m in _stream()))
    code, out, err = run_in_process(capsys, "replay", "default", str(path), "--json")
    assert code == 0
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(r["rule"], r["step"], r["rank"], r["value"]) for r in rows] == [
        ("non-finite-loss", 120, 1, "nan")
    ]
    assert rows[0]["recovery"]["lr_factors"] == [
        0.5,
        0.3,
    ]  # the default policy: x0.5, then x0.3 per failed attempt
    assert "policy 'default'" in err


def test_replay_bad_source_is_exit_2(tmp_path, capsys):
    (tmp_path / "a.jsonl").write_text("")
    code, _, err = run_in_process(capsys, "replay", "default", str(tmp_path))
    assert code == 2 and "no reports.jsonl" in err and "a.jsonl" in err
    code, _, err = run_in_process(capsys, "replay", "default", str(tmp_path / "missing"))
    assert code == 2 and "no such file or run directory" in err


def test_replay_merges_several_rank_files_by_time(tmp_path, capsys):
    for r in range(2):
        (tmp_path / f"r{r}.jsonl").write_text(
            "".join(
                json.dumps(report(r, s * 25, grade=7 if s < 20 else 2)) + "\n" for s in range(22)
            )
        )
    code, out, _ = run_in_process(
        capsys, "replay", "aggressive", str(tmp_path / "r0.jsonl"), str(tmp_path / "r1.jsonl")
    )
    assert code == 0
    assert "grade-drop" in out and "step    500" in out and "rank  0" in out


DEMO_RUN = ROOT / "tests" / "data" / "demo_run"
DEMO_POLICY = str(DEMO_RUN / "policy.yaml")
"""The policy the demo run was recorded under (the default policy of the time)."""


def test_replay_reads_a_run_directory_with_only_a_gzipped_reports_file(capsys):
    assert not (DEMO_RUN / "reports.jsonl").exists()  # the recording keeps only the .gz
    code, out, err = run_in_process(capsys, "replay", DEMO_POLICY, str(DEMO_RUN))
    assert code == 0, err
    same, gz, _ = run_in_process(capsys, "replay", DEMO_POLICY, str(DEMO_RUN / "reports.jsonl.gz"))
    assert same == 0 and out == gz
    assert "entropy-collapse" in out and "step    775" in out and "step    900" in out


def test_replay_refuses_a_journal_passed_as_reports(tmp_path, capsys):
    code, out, err = run_in_process(capsys, "replay", "default", str(DEMO_RUN / "journal.jsonl"))
    assert code == 2 and not out
    assert "journal" in err and "not rank reports" in err and "reports.jsonl" in err
    # a run directory holding only a journal: no hint to pass the journal as reports
    (tmp_path / "journal.jsonl").write_text((DEMO_RUN / "journal.jsonl").read_text())
    code, _, err = run_in_process(capsys, "replay", "default", str(tmp_path))
    assert code == 2 and "no reports.jsonl" in err and "pass them as files" not in err
