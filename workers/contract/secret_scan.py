"""The one secret scanner: policy files, job files, rank environments and error texts use it.

Two questions, answered without false alarms on ordinary ML names:

* :func:`secret_key`: does a *name* say it holds a secret (``SLACK_BOT_TOKEN``, ``api_key``,
  ``webhook_url``, ``AWS_SECRET_ACCESS_KEY``)? Names are split into words, so
  ``TOKENIZERS_PARALLELISM`` and ``max_tokens`` are not secrets.
* :func:`secret_value`: does a *value* look like a credential (a Slack token or webhook URL, a
  private key, a cloud or hub access token)? The patterns are the providers' documented prefixes.

:func:`find_secret` walks plain data (what a YAML file parses to); :func:`redact` blanks secrets
out of a text before it reaches a journal, a log or a console.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Iterable
from typing import Any

_SECRET_WORDS = frozenset(
    {
        "token",
        "secret",
        "password",
        "passwd",
        "passphrase",
        "webhook",
        "credential",
        "credentials",
        "apikey",
        "privatekey",
    }
)
_SECRET_PAIRS = frozenset(
    {
        ("api", "key"),
        ("private", "key"),
        ("access", "key"),
        ("routing", "key"),
        ("integration", "key"),
        ("auth", "key"),
    }
)
_WORD_RE = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")

VALUE_PATTERNS: dict[str, re.Pattern[str]] = {
    "a Slack token": re.compile(r"\b(?:xox[a-z]|xapp)[-.][A-Za-z0-9][A-Za-z0-9.-]*"),
    "a Slack webhook URL": re.compile(r"\bhooks\.slack(?:-gov)?\.com/\S*", re.IGNORECASE),
    "a private key": re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    "an AWS access key": re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"),
    "a GitHub token": re.compile(r"\bgh[pousr]_[A-Za-z0-9]{20,}\b"),
    "a Hugging Face token": re.compile(r"\bhf_[A-Za-z0-9]{20,}\b"),
}
"""What a credential looks like, by kind."""

ADVICE = (
    "secrets never go in a {where}: set SLACK_BOT_TOKEN (bot token) or "
    "SPIKEGUARD_SLACK_WEBHOOK_URL (incoming webhook) in the supervisor's environment instead"
)
REDACTED = "[redacted]"


def _words(name: str) -> list[str]:
    return [w.lower() for w in _WORD_RE.findall(name)]


def secret_key(name: Any) -> bool:
    """True when ``name`` (a key or variable name) says it holds a secret."""
    if not isinstance(name, str):
        return False
    words = _words(name)
    if any(w in _SECRET_WORDS for w in words):
        return True
    return any(pair in _SECRET_PAIRS for pair in itertools.pairwise(words))


def secret_value(value: Any) -> str | None:
    """What kind of credential ``value`` looks like (``"a Slack token"``), or None."""
    if not isinstance(value, str):
        return None
    for what, pattern in VALUE_PATTERNS.items():
        if pattern.search(value):
            return what
    return None


@dataclasses.dataclass(frozen=True)
class Finding:
    """A secret found in plain data: where, and why."""

    path: tuple[Any, ...]
    """Keys and list indices from the top (``("notify", "slack", "token")``)."""
    in_key: bool
    """True when the key's name gave it away, False when the value did."""
    what: str
    """``"a secret"`` for a key, the kind of credential for a value."""

    def message(self, where: str = "policy file") -> str:
        """One sentence, never echoing the secret."""
        advice = ADVICE.format(where=where)
        if self.in_key:
            return f"key {self.path[-1]!r} looks like a secret: {advice}"
        return f"this value looks like {self.what}: {advice}"


def _empty(value: Any) -> bool:
    return value is None or value == ""


def find_secret(data: Any, path: tuple[Any, ...] = ()) -> Finding | None:
    """The first secret in plain data (mappings, lists, strings), depth first; None if clean.

    A secret-named key with an empty value (``token: null``) is no secret.
    """
    if isinstance(data, dict):
        items: Iterable[tuple[Any, Any]] = data.items()
    elif isinstance(data, (list, tuple)):
        items = enumerate(data)
    else:
        what = secret_value(data)
        return Finding(path, False, what) if what else None
    for k, v in items:
        if isinstance(data, dict) and secret_key(k) and not _empty(v):
            return Finding((*path, k), True, "a secret")
        found = find_secret(v, (*path, k))
        if found:
            return found
    return None


def redact(text: str, known: Iterable[str] = ()) -> str:
    """``text`` with every credential-looking substring, and each of the ``known`` secret values
    (at least 4 characters long), replaced by ``[redacted]``."""
    for value in sorted((k for k in known if k and len(k) >= 4), key=len, reverse=True):
        text = text.replace(value, REDACTED)
    for pattern in VALUE_PATTERNS.values():
        text = pattern.sub(REDACTED, text)
    return text
