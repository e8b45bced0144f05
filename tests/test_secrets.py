"""The one secret scanner (``workers/contract/secret_scan.py``): names, values, redaction."""

from __future__ import annotations

import pytest
from spikeguard.workers.contract.secret_scan import redact, secret_key, secret_value


@pytest.mark.parametrize(
    "value, what",
    [
        ("xoxb-1234-5678-abcdef", "a Slack token"),
        ("xoxp-1-2-3-abc", "a Slack token"),
        ("xapp-1-A0123456789-1234567890123-abcdef", "a Slack token"),
        ("xoxe.xoxp-1-Mi0yLTEyMzQ1Njc4OQ", "a Slack token"),
        ("xoxe-1-My0xLTEyMzQ1Njc4OTA", "a Slack token"),
        ("https://hooks.slack.com/services/T0/B0/x", "a Slack webhook URL"),
        ("https://hooks.slack-gov.com/services/T0/B0/x", "a Slack webhook URL"),
        ("-----BEGIN RSA PRIVATE KEY-----", "a private key"),
        ("AKIAIOSFODNN7EXAMPLE", "an AWS access key"),
        ("ghp_abcdefghijklmnopqrstuvwxyz0123456789", "a GitHub token"),
        ("hf_abcdefghijklmnopqrstuvwxyz012345", "a Hugging Face token"),
    ],
)
def test_credential_shapes_are_recognised_and_redacted(value, what):
    assert secret_value(value) == what
    text = f"error: {value} refused"
    assert value not in redact(text) and "[redacted]" in redact(text)


@pytest.mark.parametrize(
    "value", ["xoxo", "hooks.example.com/x", "/data/hf_home", "gpt2", "max_tokens=2048", ""]
)
def test_ordinary_values_are_no_credentials(value):
    assert secret_value(value) is None and redact(value) == value


def test_names_split_into_words():
    assert secret_key("SLACK_BOT_TOKEN") and secret_key("apiKey") and secret_key("routing_key")
    assert not secret_key("TOKENIZERS_PARALLELISM") and not secret_key("max_tokens")


def test_known_values_are_redacted_longest_first():
    assert redact("a s3cret-long and s3cret", known=["s3cret", "s3cret-long", "abc"]) == (
        "a [redacted] and [redacted]"
    )
