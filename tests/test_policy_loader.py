"""Malformed policies: one clear line each, at the right line; and the YAML pitfalls defused."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict, Field
from spikeguard.policies import PolicyError, load_policy, load_policy_text
from spikeguard.policies.loader import load_model_file, load_yaml_text

RULE = """\
rules:
  - name: r
    when: grade < S3
    action: notify
"""

# (id, YAML, what the message must contain). The line marked '#<' is where the error must point
# (no marker: line 1).
MALFORMED = [
    (
        "duplicate-key",
        "version: 1\nname: a\nname: b  #<\n" + RULE,
        "duplicate key 'name' (first at line 2)",
    ),
    (
        "unknown-field",
        "version: 1\nname: a\nrules:\n  - name: r\n    when: grade < S3\n    acton: notify  #<\n",
        "rules[0].acton: unknown field 'acton' (did you mean 'action'?)",
    ),
    (
        "prometheus-expr",
        "version: 1\nname: a\nrules:\n  - name: r\n    expr: grade < S3  #<\n    action: notify\n",
        "unknown field 'expr' (write it as 'when')",
    ),
    (
        "no-as-bool",
        "version: 1\nname: a\nnotify:\n  send_resolved: no  #<\n" + RULE,
        "notify.send_resolved: expected true or false, got 'no'",
    ),
    (
        "no-as-choice",
        "version: 1\nname: a\nrecovery:\n  on_exhausted: no  #<\n" + RULE,
        "recovery.on_exhausted: unknown value 'no'; expected 'stop' or 'hold'",
    ),
    (
        "exponent-float",
        "version: 1\nname: a\nrecovery:\n  lr_factors: [1e-3, 1e1]  #<\n" + RULE,
        "recovery.lr_factors[1]: each LR factor must be in (0, 1] (it multiplies the learning "
        "rate), got 10",
    ),
    (
        "python-tag",
        "version: 1\nname: !!python/object:os.system a  #<\n" + RULE,
        "name: tag '!!python/object:os.system' is not allowed",
    ),
    (
        "custom-tag",
        "version: 1\nname: a\nwarm_in: !steps 300  #<\n" + RULE,
        "tag '!steps' is not allowed",
    ),
    (
        "bad-grade",
        "version: 1\nname: a\nrules:\n  - name: r\n    when: {signal: grade, below: S9}  #<\n"
        "    action: notify\n",
        "rules[0].when.below: expected a grade S0…S7 (S7 is healthy), got 'S9'",
    ),
    (
        "grade-on-loss",
        "version: 1\nname: a\nrules:\n  - name: r\n    when: {signal: loss, above: S3}  #<\n"
        "    action: notify\n",
        "grades S0…S7 only apply to the grade signal",
    ),
    (
        "bare-duration",
        "version: 1\nname: a\nrules:\n  - name: r\n    when: grade < S3\n    for: 3  #<\n"
        "    action: notify\n",
        "rules[0].for: expected a duration like '5 samples' or '200 steps' or '30s' or "
        "'10m', got 3 (a bare number is ambiguous: add a unit)",
    ),
    (
        "wrong-duration-unit",
        "version: 1\nname: a\nwarm_in: 10m  #<\n" + RULE,
        "warm_in: '10m' is measured in seconds; here write '200 steps'",
    ),
    (
        "slack-token-key",
        "version: 1\nname: a\nnotify:\n  slack:\n    token: abc  #<\n" + RULE,
        "notify.slack.token: key 'token' looks like a secret: secrets never go in a policy file: "
        "set SLACK_BOT_TOKEN",
    ),
    (
        "slack-token-value",
        "version: 1\nname: a\ndescription: xoxb-12345-abcdef  #<\n" + RULE,
        "description: this value looks like a Slack token",
    ),
    (
        "webhook-url",
        "version: 1\nname: a\nnotify:\n  slack:\n"
        "    runbook_url: https://hooks.slack.com/services/T/B/X  #<\n" + RULE,
        "looks like a Slack webhook URL: secrets never go in a policy file: set SLACK_BOT_TOKEN "
        "(bot token) "
        "or SPIKEGUARD_SLACK_WEBHOOK_URL",
    ),
    (
        "webhook-key",
        "version: 1\nname: a\nnotify:\n  slack:\n    webhook_url: x  #<\n" + RULE,
        "key 'webhook_url' looks like a secret",
    ),
    (
        "wrong-type-list",
        "version: 1\nname: a\nrules:  #<\n  r: {when: grade < S3}\n",
        "rules: expected a list, got a mapping",
    ),
    (
        "wrong-type-int",
        "version: 1\nname: a\nrecovery:\n  max_attempts: many  #<\n" + RULE,
        "recovery.max_attempts: expected a whole number, got 'many'",
    ),
    (
        "negative-probation",
        "version: 1\nname: a\nrecovery:\n  probation_steps: -5  #<\n" + RULE,
        "recovery.probation_steps: must be 0 or more steps, got -5",
    ),
    (
        "lr-factor-above-1",
        "version: 1\nname: a\nrecovery:\n  lr_factors: [0.5, 1.5]  #<\n" + RULE,
        "recovery.lr_factors[1]: each LR factor must be in (0, 1]",
    ),
    (
        "empty-rules",
        "version: 1\nname: a\nrules: []  #<\n",
        "rules: a policy needs at least one rule",
    ),
    ("missing-rules", "version: 1\nname: a\n", "rules: missing required field"),
    (
        "unknown-signal",
        "version: 1\nname: a\nrules:\n  - name: r\n    when:\n      signal: grad_nrom  #<\n"
        "      above: 10\n    action: notify\n",
        "rules[0].when.signal: unknown signal 'grad_nrom' (did you mean 'grad_norm'?)",
    ),
    (
        "unknown-signal-compact",
        "version: 1\nname: a\nrules:\n  - name: r\n    when: grad_nrom > 10  #<\n"
        "    action: notify\n",
        "rules[0].when.signal: unknown signal 'grad_nrom' (did you mean 'grad_norm'?)",
    ),
    (
        "bad-scope",
        "version: 1\nname: a\nrules:\n  - name: r\n    when: grade < S3\n    ranks: most  #<\n"
        "    action: notify\n",
        "rules[0].ranks: unknown rank scope 'most'",
    ),
    (
        "bad-scope-key",
        "version: 1\nname: a\nrules:\n  - name: r\n    when: grade < S3\n"
        "    ranks: {fracton: 0.5}  #<\n"
        "    action: notify\n",
        "unknown rank scope 'fracton' (did you mean 'fraction'?)",
    ),
    (
        "fraction-above-1",
        "version: 1\nname: a\nrules:\n  - name: r\n    when: grade < S3\n"
        "    ranks: {fraction: 1.5}  #<\n"
        "    action: notify\n",
        "rules[0].ranks.fraction: must be less than or equal to 1, got 1.5",
    ),
    (
        "bad-action",
        "version: 1\nname: a\nrules:\n  - name: r\n    when: grade < S3\n    action: recovr  #<\n",
        "rules[0].action: unknown action 'recovr' (did you mean 'recover'?)",
    ),
    (
        "missing-action",
        "version: 1\nname: a\nrules:\n  - name: r  #<\n    when: grade < S3\n",
        "rules[0].action: missing required field",
    ),
    ("version-2", "version: 2  #<\nname: a\n" + RULE, "version: unsupported version 2"),
    (
        "condition-typo",
        "version: 1\nname: a\nrules:\n  - name: r\n    when: {signal: lr, belwo: 1e-3}  #<\n"
        "    action: notify\n",
        "rules[0].when.belwo: unknown field 'belwo' (did you mean 'below'?)",
    ),
    (
        "condition-two-kinds",
        "version: 1\nname: a\nrules:\n  - name: r\n"
        "    when: {signal: grade, below: S3, drops_by: 2}  #<\n"
        "    action: notify\n",
        "a condition tests one thing, found 'below' and 'drops_by'",
    ),
    (
        "compact-parse-error",
        "version: 1\nname: a\nrules:\n  - name: r\n    when: grade <= S3  #<\n    action: notify\n",
        "cannot parse condition 'grade <= S3' at column 7: comparisons are strict: use '<' or '>'",
    ),
    (
        "never-together",
        "version: 1\nname: a\nrules:\n  - name: r\n    when: crash and loss > 3  #<\n"
        "    action: notify\n",
        "these conditions never arrive together",
    ),
    (
        "recovery-on-notify",
        "version: 1\nname: a\nrules:\n  - name: r\n    when: grade < S3\n    action: notify\n"
        "    recovery: {lr_factors: [0.3]}  #<\n",
        "'recovery' overrides only apply to action: recover",
    ),
    (
        "layers-on-loss",
        "version: 1\nname: a\nrules:\n  - name: r\n    when: loss > 3\n    layers: '*'  #<\n"
        "    action: notify\n",
        "'layers' only applies to per-layer signals",
    ),
    (
        "for-on-crash",
        "version: 1\nname: a\nrules:\n  - name: r\n    when: crash\n    for: 2 samples  #<\n"
        "    action: recover\n",
        "'for' does not apply to crash and hang",
    ),
    (
        "duplicate-rule-name",
        "version: 1\nname: a\nrules:\n  - {name: r, when: crash, action: recover}\n"
        "  - {name: r, when: hang, action: recover}  #<\n",
        "rules[1].name: duplicate rule name 'r' (also rules[0])",
    ),
    (
        "merge-key",
        "version: 1\nname: a\nbase: &b {action: notify}\nrules:\n  - name: r\n    <<: *b  #<\n"
        "    when: grade < S3\n",
        "merge keys (<<) are not supported",
    ),
    (
        "yaml-syntax",
        "version: 1\nname: a\nrules:\n  - name: r\n    when: [grade  #<\n",
        "YAML syntax error",
    ),
    (
        "top-level-list",
        "- version: 1  #<\n",
        "expected a mapping (key: value) at the top level, got a list",
    ),
    ("empty-file", "# nothing here\n", "the file is empty"),
]


def _expected_line(text: str) -> int:
    for n, line in enumerate(text.splitlines(), 1):
        if "#<" in line:
            return n
    return 1


@pytest.mark.parametrize("case_id,text,expected", MALFORMED, ids=[c[0] for c in MALFORMED])
def test_malformed_policy_gives_one_clear_line(case_id, text, expected):
    with pytest.raises(PolicyError) as info:
        load_policy_text(text, filename="p.yaml")
    msg = str(info.value)
    assert "\n" not in msg
    assert expected in msg, msg
    line = _expected_line(text)
    if case_id not in ("empty-file",):
        assert msg.startswith(f"p.yaml:{line}:"), msg
        assert info.value.line == line and info.value.col >= 1


def test_table_is_large_enough():
    assert len(MALFORMED) >= 15


def test_columns_point_at_the_offending_token():
    text = (
        "version: 1\nname: a\nrules:\n  - name: r\n    when: 'grade < S3 andd loss > 2'\n"
        "    action: notify\n"
    )
    with pytest.raises(PolicyError) as info:
        load_policy_text(text, "p.yaml")
    # the quote is at column 11; 'andd' starts at offset 11 inside the string
    assert str(info.value).startswith("p.yaml:5:23: rules[0].when: cannot parse condition")


def test_all_errors_are_kept_in_file_order():
    text = "version: 1\nname: a\nrecovery:\n  max_attempts: 0\n  lr_factors: [2]\n" + RULE
    with pytest.raises(PolicyError) as info:
        load_policy_text(text, "p.yaml")
    assert [i.line for i in info.value.issues] == [4, 5]
    assert info.value.path == "recovery.max_attempts"


# --- pitfalls that must NOT be errors -----------------------------------------------------


def test_yaml_11_booleans_stay_strings_where_a_string_is_meant():
    pol = load_policy_text(
        "version: 1\nname: no\nnotify:\n  slack: {channel: off, mention: yes}\n" + RULE
    )
    assert pol.name == "no"
    assert pol.notify.slack.channel == "off" and pol.notify.slack.mention == "yes"


def test_numbers_dates_and_octal_lookalikes():
    pol = load_policy_text(
        "version: 1\nname: 2024-01-01\nrecovery: {max_attempts: 010, lr_factors: [5e-1, .25]}\n"
        "rules:\n  - {name: r, when: {signal: lr, below: 1e-3}, action: notify}\n"
    )
    assert pol.name == "2024-01-01"
    assert pol.recovery.max_attempts == 10 and pol.recovery.lr_factors == [0.5, 0.25]
    assert pol.rules[0].when.below == pytest.approx(0.001)


def test_severity_defaults_follow_the_action():
    pol = load_policy_text(
        "version: 1\nname: a\nrules:\n"
        + "".join(
            f"  - {{name: {a}, when: crash, action: {a}}}\n"
            for a in ("notify", "recover", "checkpoint", "stop")
        )
    )
    assert [r.severity for r in pol.rules] == ["warn", "warn", "info", "page"]


# --- sources ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["default", "conservative", "aggressive"])
def test_builtins_load_by_name_and_by_path(name):
    by_name = load_policy(name)
    by_path = load_policy(Path(__file__).resolve().parents[1] / "policies" / f"{name}.yaml")
    assert by_name == by_path and by_name.name == name


def test_unknown_builtin_name_suggests_one():
    with pytest.raises(PolicyError) as info:
        load_policy("defualt")
    assert str(info.value) == (
        "defualt: no such file; the built-in policies are default, conservative, "
        "aggressive (did you mean 'default'?)"
    )


def test_directory_is_a_clear_error(tmp_path):
    with pytest.raises(PolicyError, match="is a directory"):
        load_policy(tmp_path)


def test_load_model_file_for_other_models_with_overrides(tmp_path):
    class Job(BaseModel):
        model_config = ConfigDict(extra="forbid")
        name: str
        workers: int = Field(2, ge=1)

    path = tmp_path / "job.yaml"
    path.write_text(
        textwrap.dedent("""\
        name: x
        workres: 3
    """)
    )
    with pytest.raises(PolicyError) as info:
        load_model_file(Job, path)
    assert (
        str(info.value) == f"{path}:2:1: workres: unknown field 'workres' (did you mean 'workers'?)"
    )
    path.write_text("name: x\nworkers: 3\n")
    assert load_model_file(Job, path, overrides={"workers": 5}).workers == 5
    with pytest.raises(PolicyError) as info:
        load_model_file(Job, path, overrides={"workers": 0})
    assert "workers:" in str(info.value) and "(set on the command line)" in str(info.value)


def test_mutated_builtins_never_crash():
    """Random line-level damage to the built-ins: a Policy or a PolicyError, never anything else."""
    import random

    rng = random.Random(1234)
    tokens = [
        "no",
        "1e-3",
        "S9",
        "-1",
        "[",
        "{a: 1}",
        "!!python/name:os.system",
        "xoxb-1",
        "'",
        "~",
        "10m",
        "3 samples",
        "*",
        "&a",
        "*a",
        "<<: {}",
        "[1, [2]]",
        "grade < S3",
        ":",
        "\t",
    ]
    texts = [
        (Path(__file__).resolve().parents[1] / "policies" / f"{n}.yaml").read_text()
        for n in ("default", "conservative", "aggressive")
    ]
    outcomes = {"ok": 0, "error": 0}
    for i in range(300):
        lines = rng.choice(texts).splitlines()
        for _ in range(rng.randint(1, 3)):
            j = rng.randrange(len(lines))
            op = rng.randrange(4)
            if op == 0:
                del lines[j]
            elif op == 1:
                lines.insert(j, lines[rng.randrange(len(lines))])
            elif op == 2 and ":" in lines[j]:
                lines[j] = lines[j].split(":", 1)[0] + ": " + rng.choice(tokens)
            else:
                lines[j] = lines[j][: rng.randrange(len(lines[j]) + 1)] + rng.choice(tokens)
        try:
            load_policy_text("\n".join(lines) + "\n", f"m{i}.yaml")
            outcomes["ok"] += 1
        except PolicyError as e:
            assert "\n" not in str(e) and str(e).startswith(f"m{i}.yaml")
            outcomes["error"] += 1
    assert outcomes["error"] > 100


# --- hostile files: size, nesting and number caps, each a FILE:LINE:COL error -------------------
HEAD = "version: 1\nname: a\n"
HUGE = "9" * 5000  # beyond int()'s 4300-digit limit


def _hostile_error(text: str) -> PolicyError:
    with pytest.raises(PolicyError) as info:
        load_policy_text(text, "p.yaml")
    return info.value


@pytest.mark.parametrize(
    "text,where,message",
    [
        (HEAD + "rules: " + "[" * 20_000 + "]" * 20_000 + "\n", "p.yaml:3:", "nested more than 64"),
        (HEAD + "x: " + "{a: " * 20_000 + "1" + "}" * 20_000 + "\n", "p.yaml:3:", "nested more"),
        (
            HEAD + "rules:\n" + "".join("  " * i + "-\n" for i in range(1, 700)),
            "p.yaml:",
            "nested more than 64",
        ),
        (HEAD + "rules: &a [*a]\n", "p.yaml:3:", "nested more than 64"),
        (HEAD + f"warm_in: {HUGE}\n" + RULE, "p.yaml:3:10: warm_in: ", "too large"),
        (HEAD + f"warm_in: -{HUGE}\n" + RULE, "p.yaml:3:10: warm_in: ", "too large"),
        (HEAD + f"warm_in: 0x{HUGE}\n" + RULE, "p.yaml:3:10: warm_in: ", "too large"),
        (HEAD + "recovery:\n  max_attempts: 9007199254740993\n" + RULE, "p.yaml:4:17: ", "large"),
        (HEAD + f"warm_in: {HUGE} steps\n" + RULE, "p.yaml:3:10: warm_in: ", "too large"),
        (HEAD + f"warm_in: {'9' * 400} steps\n" + RULE, "p.yaml:3:10: warm_in: ", "too large"),
        (
            HEAD + f"rules:\n  - {{name: r, when: hang, action: notify, cooldown: {HUGE}h}}\n",
            "p.yaml:4:",
            "too large",
        ),
        (
            HEAD + f"rules:\n  - {{name: r, when: hang, action: notify, for: {'9' * 400} steps}}\n",
            "p.yaml:4:",
            "too large",
        ),
    ],
    ids=[
        "flow-list-20000-deep",
        "flow-map-20000-deep",
        "block-700-deep",
        "recursive-anchor",
        "5000-digit-int",
        "5000-digit-negative-int",
        "5000-digit-hex",
        "int-beyond-2^53",
        "5000-digit-steps",
        "400-digit-steps",
        "5000-digit-hours",
        "400-digit-for",
    ],
)
def test_hostile_policy_is_one_clear_line(text: str, where: str, message: str) -> None:
    error = _hostile_error(text)
    assert str(error).startswith(where), str(error)
    assert message in str(error) and "\n" not in str(error), str(error)
    assert len(str(error)) < 300  # a 5000-digit number is never echoed whole


def test_the_limits_themselves_are_fine() -> None:
    deep = "x: " + "[" * 63 + "1" + "]" * 63 + "\n"  # 64 levels with the top-level mapping
    data = load_yaml_text(deep)
    for _ in range(63):
        data = data["x"] if isinstance(data, dict) else data[0]
    assert data == [1]
    with pytest.raises(PolicyError, match="nested more than 64"):
        load_yaml_text("x: " + "[" * 64 + "]" * 64 + "\n")
    pol = load_policy_text(HEAD + "warm_in: 9007199254740992 steps\n" + RULE)
    assert pol.warm_in.value == 2**53


def test_a_50_mb_policy_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    path.write_text(HEAD + RULE + "# " + "x" * (50 << 20) + "\n")
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    assert str(info.value) == (
        f"{path}: the file is 50.0 MiB; policies and job files are at most 1 MiB"
    )
    with pytest.raises(PolicyError, match="at most 1 MiB"):
        load_policy_text(path.read_text(), str(path))
