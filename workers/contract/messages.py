"""The rank -> supervisor message format: one JSON object a line.

Every message has ``v`` (format version, :data:`FORMAT_VERSION`), ``type``, ``run``, ``gen``,
``rank``, ``step`` and ``t`` (the rank's wall clock, informational only; the supervisor times
everything with its own monotonic clock). Non-finite floats are written as JSON
``NaN``/``Infinity`` (Python's ``json`` reads them back).

``hello``       first message after attach: ``world_size``, ``pid``, ``host``, ``sample_every``.
``heartbeat``   every step: ``loss``, ``lr``, ``grad_norm`` (each may be null); optionally
                ``tokens``, the tokens this rank processed in this step (an integer >= 0, for
                tokens/s), and ``total_steps``, the number of steps the script trains (the
                last step is ``total_steps - 1``; for the ETA); optionally ``step_time``, the
                seconds this rank spent computing in this step, not waiting on its peers (a
                finite float in [0, :data:`MAX_STEP_TIME_S`]; absent when the SDK could not
                measure it): the time of the model's forward passes in the step (CUDA events on
                a model on CUDA) plus the script's ``data`` phase (:data:`OWN_PHASES`); and
                ``phases`` {phase name: seconds}, the time of each phase the script marked in the
                step (``Session.phase``): at most :data:`MAX_PHASES` names, each matching
                :data:`PHASE_NAME`, each value as ``step_time``. In synchronous data parallelism
                the time between two steps is the slowest rank's on every rank; ``step_time``
                is what tells the ranks apart.
``report``      on sampled steps: the heartbeat fields plus ``layers`` {layer name: {signal:
                value}} with the per-layer signals of :mod:`.signals`, and ``summary`` {signal:
                value} aggregated over layers (:func:`.signals.summarize`) plus ``worst_layer``.
                The supervisor keeps at most :data:`MAX_LAYERS_PER_RANK` distinct layer names
                of a rank (the first it sees) and drops the others from its reports.
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
``batch_ids``   the answer to a ``batch_ids`` request: ``request`` (its id), ``window`` (how
                many steps the rank keeps), ``entries`` [[step, batch ids], ...] oldest first
                (the ``batch_ids`` the script passed to ``step()``, as JSON), and ``truncated``,
                how many older entries were left out to keep the line under
                :data:`MAX_LINE_BYTES`.

The supervisor adds two messages of its own for the policy engine (never sent by a rank):

``exit``        the rank's process ended: ``code``; ``first`` when it never sent a message
                (a launch failure, not a crash); ``teardown_code`` when it said ``done`` and
                then died in teardown (counted as finished).
``hang``        no message for longer than the timeout: ``age_s``; ``first`` when the rank never
                sent a message since its launch.

Requests travel the other way, supervisor -> rank, one JSON object a line on the rank's report
socket (:data:`REQUEST_TYPES`), each with ``type`` and an ``id`` unique per type for the rank's
process; the SDK reads them inside ``step()`` (never blocking):

``checkpoint``  save a checkpoint at the next step boundary (``reason``); the ``checkpoint``
                message that follows lists the id in ``requests``.
``batch_ids``   send the ring buffer of recent batch ids now: answered by a ``batch_ids``
                message at the end of the current (or next) ``step()``.
"""

from __future__ import annotations

import json
import re
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
    "batch_ids",
)
"""What a rank sends."""

REQUEST_TYPES = ("checkpoint", "batch_ids")
"""What the supervisor asks a rank for."""

SUPERVISOR_MESSAGE_TYPES = ("exit", "hang", "health")
"""What the supervisor synthesises for the policy engine (``health``: a rank agent's NVML
readings, the ``gpu_*`` signals)."""

REQUEST_TYPES = ("checkpoint", "release")
"""What the supervisor sends a rank (one JSON line each, on the report socket): ``checkpoint``
(``id``, ``reason``: save at the next step boundary, see ``Session.should_checkpoint``) and
``release`` (``generation``, ``plan``: a standby process becomes the generation and resumes
from the plan file, see ``ENV_STANDBY``)."""

MAX_LINE_BYTES = 1 << 20
"""The longest line (newline excluded) a message may take; longer ones are dropped unread."""

MAX_STEP_TIME_S = 1e6
"""The largest ``step_time`` (and phase time) in seconds the supervisor reads (11 days): beyond
it, or negative, or not finite, the value is no timing and the message is dropped
(``out_of_range``)."""

MAX_PHASES = 16
"""The most phase names one message's ``phases`` may hold (the SDK keeps the first this many a
step names and warns once about the others)."""

PHASE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}")
"""What a phase name is (whole string): a letter or underscore, then at most 31 letters, digits,
``_``, ``.`` or ``-``: a label that fits a metric, a table column and a Slack line as it is."""

OWN_PHASES = ("data",)
"""The phases whose time also counts into ``step_time``: loading this rank's batch is this
rank's own time (a rank slow at it makes the others wait as surely as a slow forward). Other
phases are reported in ``phases`` only: the SDK cannot know whether they hold a wait on the
peers (a marked backward holds the gradient all-reduce) or enclose the forward it times."""


def is_phase_name(name: object) -> bool:
    """Whether ``name`` is a valid phase name (:data:`PHASE_NAME`)."""
    return isinstance(name, str) and PHASE_NAME.fullmatch(name) is not None


def is_timing(value: Any) -> bool:
    """Whether ``value`` is a valid ``step_time`` or phase time: an int or float (not a bool),
    finite, in [0, :data:`MAX_STEP_TIME_S`]."""
    t = type(value)
    return (t is float or t is int) and 0 <= value <= MAX_STEP_TIME_S  # NaN fails both


MAX_LAYERS_PER_RANK = 1024
"""The most distinct layer names the supervisor keeps of one rank over a run (:class:`LayerGate`).
A probe names a module (``blocks.3``, ``blocks.3.attn``, ``lm_head``): a 100-block model has a
few hundred. Every name kept costs a policy series and rule instance per signal, a live view
entry and a report column, so a rank that names a new layer on every report would otherwise
grow the supervisor without bound."""

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


_SURROGATE = re.compile("[\ud800-\udfff]")
"""A surrogate code point: in a decoded string, always a lone one (json.loads joins a pair)."""
_MAY_HOLD_SURROGATE = re.compile(r"\\u[dD][89abcdefABCDEF]|[\ud800-\udfff]")
"""What a JSON text that decodes to a surrogate holds: an escape of one, or one itself (a text
handed in as ``str``). It also matches what decodes to none (a pair, an escaped backslash)."""


def may_hold_surrogate(text: str) -> bool:
    """Whether JSON ``text`` may decode to a lone surrogate (cheap: most lines are ASCII without
    a ``\\u`` escape); True means :func:`replace_surrogates` should look."""
    return ("\\u" in text or not text.isascii()) and _MAY_HOLD_SURROGATE.search(text) is not None


def replace_surrogates(value: Any, found: list[bool] | None = None) -> Any:
    """``value`` (decoded JSON, at most ``MAX_DEPTH`` deep) with every surrogate in its strings,
    keys included, replaced by U+FFFD (a lone surrogate cannot be encoded: a metrics page, a
    report or a printed line holding one raises); appends to ``found`` when one was."""
    t = type(value)
    if t is str:
        if _SURROGATE.search(value) is None:
            return value
        if found is not None:
            found.append(True)
        return _SURROGATE.sub("\ufffd", value)
    if t is dict:
        return {
            replace_surrogates(k, found): replace_surrogates(v, found) for k, v in value.items()
        }
    if t is list:
        return [replace_surrogates(v, found) for v in value]
    return value


def loads_text(text: str | bytes) -> Any:
    """``json.loads(text)`` with lone surrogates replaced: how the readers of recorded files
    (``reports.jsonl``, the journal) decode a line, since files written before ingest repaired
    them may hold ``"\\ud800"``. Raises what ``json.loads`` raises."""
    value = json.loads(text)
    raw = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
    return replace_surrogates(value) if may_hold_surrogate(raw) else value


class LayerGate:
    """Admits the first ``limit`` distinct layer names of each rank and strips the others from
    its messages, counting them (``dropped``).

    One gate, applied where messages come in (the collector, before a message is recorded in
    ``reports.jsonl`` or seen by anything else) and again by the policy engine on its own (a
    ``policy replay`` of a hostile ``reports.jsonl``), so that every layer name the supervisor
    keeps is one of at most ``limit`` per rank, whatever a rank sends. A name once admitted stays
    admitted for the gate's life (the run): a rank whose module names do not change is never
    trimmed, and a rank that sends too many keeps the names it sent first. Pure, no I/O.
    """

    __slots__ = ("_admitted", "dropped", "limit")

    def __init__(self, limit: int = MAX_LAYERS_PER_RANK) -> None:
        self.limit = limit
        self._admitted: dict[int, set[str]] = {}
        self.dropped: dict[int, int] = {}
        """Rank -> how many layer entries were stripped from its messages so far."""

    def admit(self, rank: int, layers: dict[str, Any]) -> dict[str, Any]:
        """``layers`` (a message's {layer name: signals}) with the admitted names only, in their
        order: ``layers`` itself when none is stripped (the usual case: one set lookup a name),
        else a new dict, the stripped entries counted in :attr:`dropped`."""
        seen = self._admitted.get(rank)
        if seen is None:
            seen = self._admitted[rank] = set()
        if seen.issuperset(layers):
            return layers
        new = [name for name in layers if name not in seen]
        room = self.limit - len(seen)
        if len(new) <= room:
            seen.update(new)
            return layers
        seen.update(new[: max(room, 0)])
        kept = {name: signals for name, signals in layers.items() if name in seen}
        self.dropped[rank] = self.dropped.get(rank, 0) + len(layers) - len(kept)
        return kept

    def admitted(self, rank: int) -> int:
        """How many distinct layer names of ``rank`` are admitted (at most ``limit``)."""
        return len(self._admitted.get(rank, ()))
