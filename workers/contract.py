"""The launcher <-> rank contract, in one place.

Everything the supervisor tells a rank, and everything a rank tells the
supervisor, is named here. The worker SDK reads these variables; the
supervisor's launcher sets them. Neither side knows anything else about the
other (the workers know nothing of Ray).

Environment variables set by the launcher
-----------------------------------------
The usual torchrun variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) plus:

``SPIKEGUARD_REPORT``
    Where reports go. ``tcp://HOST:PORT`` or ``unix:///path/to.sock``: the
    rank's agent listens there (newline-delimited JSON, one message a line).
    ``jsonl:///path/file.jsonl``: append to a local file (what a script run
    without a supervisor uses). ``off``: report nothing. Unset: the
    ``report=`` argument of :func:`spikeguard.workers.attach` decides
    (default ``off``).
``SPIKEGUARD_RUN_ID``
    The run's name, echoed in every message.
``SPIKEGUARD_GENERATION``
    An integer that grows by one on every (re)launch. Every message carries
    it; the supervisor drops messages and checkpoint registrations of an
    older generation (fencing).
``SPIKEGUARD_CKPT_DIR``
    Directory where :meth:`Session.save_checkpoint` writes. Unset: the
    ``ckpt_dir=`` argument of ``attach``.
``SPIKEGUARD_RESUME``
    Path of a JSON file holding a :class:`ResumePlan` (see below): what the
    supervisor decided at this launch. Unset: a fresh start.
``SPIKEGUARD_SAMPLE_EVERY``
    Overrides the sampling interval (steps) of ``attach``.
``SPIKEGUARD_FENCE_FILE``
    Path of a small file holding the current generation. A rank whose own
    generation is older refuses to write checkpoints (a frozen node that
    wakes up after it was replaced must not overwrite anything).

Messages (rank -> supervisor), one JSON object a line
-----------------------------------------------------
Every message has ``v`` (format version, 1), ``type``, ``run``, ``gen``,
``rank``, ``step`` and ``t`` (the rank's wall clock, informational only;
the supervisor times everything with its own monotonic clock). Non-finite
floats are written as JSON ``NaN``/``Infinity`` (Python's ``json`` reads
them back).

``hello``       first message after attach: ``world_size``, ``pid``, ``host``,
                ``sample_every``.
``heartbeat``   every step: ``loss``, ``lr``, ``grad_norm`` (each may be null).
``report``      on sampled steps: the heartbeat fields plus
                ``layers`` {layer name: {signal: value}} with the signals
                ``erank_ratio``, ``grade`` (0..7), ``attn_entropy_mean``,
                ``attn_entropy_min``, ``attn_entropy_min_norm`` (min head
                entropy / log(keys)), ``max_logit``, ``logz_mean``,
                ``logz_max``; and ``summary`` {signal: value} aggregated over
                layers (``grade`` and ``erank_ratio`` and entropies: min,
                ``max_logit`` and ``logz_*``: max) plus ``worst_layer`` (the
                layer with the lowest grade).
``checkpoint``  after a checkpoint is durable: ``path``, ``sha256``, ``grade``
                (min over layers, null if never sampled), ``loss``.
``resumed``     after :meth:`Session.resume` applied a plan: ``from_step``,
                ``checkpoint``, ``lr_scale``, ``optimizer_reset``,
                ``skip_ranges``.
``skipped``     a batch was skipped because its step is in a skip range.
``dropped``     how many messages the channel dropped on back-pressure so far
                (sent with the next message that gets through).
``done``        the training loop finished normally (:meth:`Session.close`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

FORMAT_VERSION = 1

ENV_REPORT = "SPIKEGUARD_REPORT"
ENV_RUN_ID = "SPIKEGUARD_RUN_ID"
ENV_GENERATION = "SPIKEGUARD_GENERATION"
ENV_CKPT_DIR = "SPIKEGUARD_CKPT_DIR"
ENV_RESUME = "SPIKEGUARD_RESUME"
ENV_SAMPLE_EVERY = "SPIKEGUARD_SAMPLE_EVERY"
ENV_FENCE_FILE = "SPIKEGUARD_FENCE_FILE"

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

SIGNALS = (
    "erank_ratio",
    "grade",
    "attn_entropy_mean",
    "attn_entropy_min",
    "attn_entropy_min_norm",
    "max_logit",
    "logz_mean",
    "logz_max",
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResumePlan:
    """What the supervisor decided for a (re)launch; written as JSON to ``SPIKEGUARD_RESUME``."""

    checkpoint: str | None = None
    """Path of the checkpoint to load; None starts from scratch (with the other settings)."""
    checkpoint_step: int | None = None
    """The training step the checkpoint was taken at (training resumes at the next one)."""
    sha256: str | None = None
    """Expected checksum of that checkpoint; a mismatch refuses the load."""
    lr_scale: float = 1.0
    """Multiplier applied on top of whatever LR schedule the script uses (compounded by the supervisor)."""
    reset_optimizer: bool = False
    """Start the optimizer from fresh state instead of the checkpoint's (moments are often poisoned)."""
    skip_ranges: tuple[tuple[int, int], ...] = ()
    """Inclusive step ranges whose batches are skipped (the incident window's data)."""
    generation: int = 0
    """The launch generation this plan belongs to."""

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["skip_ranges"] = [list(r) for r in self.skip_ranges]
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ResumePlan:
        d: dict[str, Any] = json.loads(text)
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"resume plan has unknown fields {sorted(unknown)}")
        d["skip_ranges"] = tuple((int(a), int(b)) for a, b in d.get("skip_ranges", ()))
        return cls(**d)

    @classmethod
    def from_env(cls) -> ResumePlan | None:
        path = os.environ.get(ENV_RESUME)
        if not path:
            return None
        with open(path, encoding="utf-8") as f:
            return cls.from_json(f.read())


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None
