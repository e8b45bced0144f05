"""The compact condition grammar: the same meaning as the mapping form, and nothing else."""

from __future__ import annotations

import pytest
from pydantic_core import PydanticCustomError
from spikeguard.policies import PolicyError, load_policy_text
from spikeguard.policies.expr import parse


@pytest.mark.parametrize(
    "text,expected",
    [
        ("grade < S3", {"signal": "grade", "below": "S3"}),
        ("max_logit > 40", {"signal": "max_logit", "above": 40}),
        ("lr < 1e-5", {"signal": "lr", "below": 1e-5}),
        (
            "attn_entropy_min < 0.5 * median(20)",
            {"signal": "attn_entropy_min", "below_median": 0.5, "window": "20 samples"},
        ),
        ("loss > 1.5 * median(50)", {"signal": "loss", "above_median": 1.5, "window": "50 steps"}),
        (
            "loss > 1.5 * median(5 samples)",
            {"signal": "loss", "above_median": 1.5, "window": "5 samples"},
        ),
        ("zscore(loss, 50 steps) > 4", {"signal": "loss", "z_above": 4, "window": "50 steps"}),
        (
            "zscore(attn_entropy_min, 8) < -3",
            {"signal": "attn_entropy_min", "z_below": 3, "window": "8 samples"},
        ),
        (
            "loss > 1.3 * median(50 steps) and zscore(loss, 50 steps) > 6",
            {"signal": "loss", "above_median": 1.3, "z_above": 6, "window": "50 steps"},
        ),
        (
            "grade drops by 3 within 2 samples",
            {"signal": "grade", "drops_by": 3, "within": "2 samples"},
        ),
        (
            "max_logit rises by 10 within 100 steps",
            {"signal": "max_logit", "rises_by": 10, "within": "100 steps"},
        ),
        ("loss is nonfinite", {"signal": "loss", "nonfinite": True}),
        ("crash", {"crash": True}),
        ("hang", {"hang": True}),
        ("hang > 5m", {"hang": "5m"}),
        ("crash or hang > 1h30m", {"any": [{"crash": True}, {"hang": "1h30m"}]}),
        (
            "grade < S3 and loss > 4 or crash",
            {
                "any": [
                    {"all": [{"signal": "grade", "below": "S3"}, {"signal": "loss", "above": 4}]},
                    {"crash": True},
                ]
            },
        ),
        (
            "grade < S3 and (loss > 4 or crash)",
            {
                "all": [
                    {"signal": "grade", "below": "S3"},
                    {"any": [{"signal": "loss", "above": 4}, {"crash": True}]},
                ]
            },
        ),
    ],
)
def test_parse(text, expected):
    assert parse(text) == expected


@pytest.mark.parametrize(
    "compact,mapping",
    [
        ("grade drops by 3 within 2 samples", "{signal: grade, drops_by: 3, within: 2 samples}"),
        (
            "loss > 1.5 * median(50 steps) and zscore(loss, 50 steps) > 4",
            "{signal: loss, above_median: 1.5, z_above: 4, window: 50 steps}",
        ),
        (
            "loss is nonfinite or grad_norm is nonfinite",
            "{any: [{signal: loss, nonfinite: true}, {signal: grad_norm, nonfinite: true}]}",
        ),
    ],
)
def test_compact_and_mapping_forms_validate_to_the_same_model(compact, mapping):
    def load(when: str):
        return load_policy_text(
            f"version: 1\nname: t\nrules:\n  - name: r\n    when: {when}\n    action: recover\n"
        )

    assert load(repr(compact)).rules[0].when == load(mapping).rules[0].when


@pytest.mark.parametrize(
    "text,message",
    [
        ("grade <= S3", "comparisons are strict"),
        ("grade == S3", "comparisons are strict"),
        ("grade", "expected '<', '>', 'is nonfinite', 'drops by' or 'rises by', got the end"),
        ("grade < ", "expected a number, got the end"),
        ("loss > 1.5 * mean(20)", "expected 'median', got 'mean'"),
        ("loss > 2 * median(2.5)", "expected a whole number of samples or steps"),
        ("zscore(loss, 10) > -3", "write 'zscore(...) > N' (rise) or 'zscore(...) < -N' (fall)"),
        ("(grade < S3", "expected ')'"),
        ("grade < S3 loss > 2", "expected 'and', 'or' or the end"),
        ("__import__('os').system('x')", "unexpected character"),
        ("loss > 1; crash", "unexpected character ';'"),
        ("hang > 5", "expected a time like 30s or 5m"),
        ("(" * 40 + "crash" + ")" * 40, "nested too deeply"),
        ("crash or " * 100 + "crash", "longer than 500 characters"),
    ],
)
def test_parse_errors(text, message):
    with pytest.raises(PydanticCustomError) as info:
        parse(text)
    assert message in str(info.value)


def test_parse_errors_in_a_file_point_into_the_string():
    text = (
        "version: 1\nname: t\nrules:\n  - name: r\n    when: grade < S3 or lossy > 2 )\n"
        "    action: recover\n"
    )
    with pytest.raises(PolicyError) as info:
        load_policy_text(text, "p.yaml")
    # the scalar starts at column 11; ')' is at offset 24 of the string
    assert str(info.value) == (
        "p.yaml:5:35: rules[0].when: cannot parse condition 'grade < S3 or lossy > 2 )' "
        "at column 25: expected 'and', 'or' or the end of the condition, got ')'"
    )


def test_signals_in_compact_form_are_validated_like_any_other():
    text = (
        "version: 1\nname: t\nrules:\n  - name: r\n    when: gradnorm is nonfinite\n"
        "    action: recover\n"
    )
    with pytest.raises(
        PolicyError,
        match=r"p.yaml:5:11: rules\[0\].when.signal: unknown signal 'gradnorm' "
        r"\(did you mean 'grad_norm'\?\)",
    ):
        load_policy_text(text, "p.yaml")
