"""The environment variables the launcher sets for each rank.

The usual torchrun variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``) plus the ones below. The worker SDK reads them; the
supervisor's launcher sets them; neither side knows anything else about the other.
"""

from __future__ import annotations

import os

ENV_REPORT = "SPIKEGUARD_REPORT"
"""Where reports go. ``tcp://HOST:PORT`` or ``unix:///path/to.sock``: the rank's agent listens
there (newline-delimited JSON, one message a line). ``jsonl:///path/file.jsonl``: append to a
local file (what a script run without a supervisor uses). ``off``: report nothing. Unset: the
``report=`` argument of ``attach`` decides (default ``off``)."""

ENV_RUN_ID = "SPIKEGUARD_RUN_ID"
"""The run's name, echoed in every message."""

ENV_GENERATION = "SPIKEGUARD_GENERATION"
"""An integer that grows by one on every (re)launch. Every message carries it; the supervisor
drops messages and checkpoint registrations of an older generation (fencing)."""

ENV_CKPT_DIR = "SPIKEGUARD_CKPT_DIR"
"""Directory where ``Session.save_checkpoint`` writes. Unset: the ``ckpt_dir=`` argument of
``attach``."""

ENV_RESUME = "SPIKEGUARD_RESUME"
"""Path of a JSON file holding a :class:`~.plan.ResumePlan`: what the supervisor decided at this
launch. Unset: a fresh start."""

ENV_SAMPLE_EVERY = "SPIKEGUARD_SAMPLE_EVERY"
"""Overrides the sampling interval (steps) of ``attach``."""

ENV_BACKEND = "SPIKEGUARD_BACKEND"
"""The torch.distributed backend the job asks for: ``gloo`` or ``nccl`` (the job's ``backend``,
``auto`` resolved by whether it reserves GPUs)."""

ENV_CKPT_EVERY = "SPIKEGUARD_CKPT_EVERY"
"""The job's checkpoint interval hint (steps), for scripts that read it."""

ENV_FENCE_FILE = "SPIKEGUARD_FENCE_FILE"
"""Path of a small file holding the current generation. A rank whose own generation is older
refuses to write checkpoints (a frozen node that wakes up after it was replaced must not
overwrite anything)."""


def env_int(name: str, default: int) -> int:
    """The integer in environment variable ``name``; ``default`` when unset or empty."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None
