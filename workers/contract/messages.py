"""The rank -> supervisor message format: one JSON object a line.

Every message has ``v`` (format version, :data:`FORMAT_VERSION`), ``type``, ``run``, ``gen``,
``rank``, ``step`` and ``t`` (the rank's wall clock, informational only; the supervisor times
everything with its own monotonic clock). Non-finite floats are written as JSON
``NaN``/``Infinity`` (Python's ``json`` reads them back).

``hello``       first message after attach: ``world_size``, ``pid``, ``host``, ``sample_every``.
``heartbeat``   every step: ``loss``, ``lr``, ``grad_norm`` (each may be null).
``report``      on sampled steps: the heartbeat fields plus ``layers`` {layer name: {signal:
                value}} with the per-layer signals of :mod:`.signals`, and ``summary`` {signal:
                value} aggregated over layers (:func:`.signals.summarize`) plus ``worst_layer``.
``checkpoint``  after a checkpoint is durable: ``path``, ``sha256``, ``grade`` (min over layers,
                null if never sampled), ``loss``, ``requests`` (the supervisor's requests it
                answers). A sharded checkpoint is reported once, by rank 0, when its commit
                marker is durable: ``path`` is its directory, ``sha256`` the marker's, ``grade``
                the worst rank's, plus ``kind`` (``"sharded"``) and ``world_size``.
``resumed``     after ``Session.resume`` applied a plan: ``from_step``, ``checkpoint``,
                ``lr_scale``, ``optimizer_reset``, ``skip_ranges``.
``skipped``     a batch was skipped because its step is in a skip range.
``dropped``     how many messages the channel dropped on back-pressure so far (sent with the next
                message that gets through).
``done``        the training loop finished normally (``Session.close``).

The supervisor adds two messages of its own for the policy engine (never sent by a rank):

``exit``        the rank's process ended: ``code``; ``first`` when it never sent a message
                (a launch failure, not a crash); ``teardown_code`` when it said ``done`` and
                then died in teardown (counted as finished).
``hang``        no message for longer than the timeout: ``age_s``; ``first`` when the rank never
                sent a message since its launch.
"""

from __future__ import annotations

from typing import Any

FORMAT_VERSION = 1

MESSAGE_TYPES = (
    "hello",
    "heartbeat",
    "report",
    "checkpoint",
    "resumed",
    "skipped",
    "dropped",
    "done",
)
"""What a rank sends."""

SUPERVISOR_MESSAGE_TYPES = ("exit", "hang")
"""What the supervisor synthesises for the policy engine."""

MAX_LINE_BYTES = 1 << 20
"""The longest line (newline excluded) a message may take; longer ones are dropped unread."""

MAX_DEPTH = 32
"""How deeply a message may nest lists and objects (the message itself is level 1; a report's
``layers`` go 3 deep). Deeper messages are refused by the channel and dropped by the collector."""

MAX_SAFE_INT = 2**53
"""The largest magnitude of an integer the supervisor reads (``step``, ``gen``, ``rank``, the
metrics, ``summary`` and ``layers`` values, ``count``...): beyond it a float cannot hold it
exactly, and far beyond it converting it to a float raises. Such a message is dropped."""


def too_deep(value: Any, limit: int) -> bool:
    """Whether decoded JSON ``value`` nests lists and dicts more than ``limit`` levels (``value``
    itself is level 1). Iterative: a value nested deeper than the interpreter's recursion limit
    is answered too. Report messages and checkpoint sidecars are checked with it."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return True
        for child in children:
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))
    return False
