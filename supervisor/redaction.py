"""The secrets the supervisor holds: which of its environment variables no rank may see, and
which values no text it writes may contain.

The supervisor runs with credentials in its environment: the on-call token
(``SLACK_BOT_TOKEN``), a webhook URL, a pager's routing key, and whatever else the shell that
started it holds (cloud keys, ``HF_TOKEN``). The ranks run the user's script and its libraries,
so they get none of them (:func:`withheld`, used by
:func:`~.launch.environment.rank_environment`), and every text the supervisor journals or prints
has their values blanked out (:func:`held_secrets`, given to
:func:`~spikeguard.workers.contract.secret_scan.redact` as ``known``).

What is a secret is the one scanner's call (:mod:`spikeguard.workers.contract.secret_scan`): by its
name (``secret_key``) or by its value (``secret_value``). The supervisor's own notification
settings are withheld too, secret or not (:func:`notify_variable`): a rank has no business with
the on-call channel.
"""

from __future__ import annotations

from collections.abc import Mapping

from spikeguard.workers.contract.secret_scan import secret_key, secret_value

NOTIFY_NAMES = frozenset({"SLACK_BOT_TOKEN"})
"""The supervisor's notification variables without a ``SPIKEGUARD_`` prefix."""
NOTIFY_PREFIXES = ("SPIKEGUARD_SLACK_", "SPIKEGUARD_PAGER")
"""Every ``SPIKEGUARD_SLACK_*`` (channel, mention, webhook, API URL) and ``SPIKEGUARD_PAGER*``
(a pager's service and keys) variable belongs to the supervisor."""
MIN_HELD_LEN = 8
"""Values shorter than this are not redacted by value (``true``, ``1``, ``none`` would blank out
ordinary words); real credentials are far longer, and the scanner's patterns still apply."""


def notify_variable(name: str) -> bool:
    """True for the supervisor's own notification settings (``SLACK_BOT_TOKEN``,
    ``SPIKEGUARD_SLACK_*``, ``SPIKEGUARD_PAGER*``)."""
    return name in NOTIFY_NAMES or name.startswith(NOTIFY_PREFIXES)


def withheld(name: str, value: str) -> str | None:
    """Why the variable ``name=value`` of the supervisor's environment is kept from the ranks
    (``"a secret by its name"``, …), or None when a rank may inherit it."""
    if notify_variable(name):
        return "a notification setting of the supervisor"
    if secret_key(name):
        return "a secret by its name"
    what = secret_value(value)
    if what:
        return f"a credential by its value ({what})"
    return None


def _names_a_file(value: str) -> bool:
    return value.startswith(("/", "~", "./", "../"))


def held_secrets(env: Mapping[str, str]) -> list[str]:
    """The secret values in ``env`` (a secret by name or by value), longest first: what
    :func:`~spikeguard.workers.contract.secret_scan.redact` must blank out as ``known``.

    Values shorter than :data:`MIN_HELD_LEN` and file paths (``GOOGLE_APPLICATION_CREDENTIALS=
    /home/me/key.json`` says where a secret is, and blanking it would garble every path under
    it) are left to the scanner's patterns. Non-secret notification settings (the channel) are
    not secrets.
    """
    held: set[str] = set()
    for name, value in env.items():
        if not isinstance(value, str) or len(value) < MIN_HELD_LEN or _names_a_file(value):
            continue
        if secret_key(name) or secret_value(value):
            held.add(value)
    return sorted(held, key=lambda v: (-len(v), v))
