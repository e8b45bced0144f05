"""The environment variables the launcher sets for each rank.

Every variable ``torchrun`` exports (:data:`TORCHRUN_VARIABLES`, with the same meaning for the
same layout) plus the ``SPIKEGUARD_*`` ones below. The worker SDK reads them; the supervisor's
launcher sets them; neither side knows anything else about the other.
"""

from __future__ import annotations

import os

TORCHRUN_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_NAME",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_SIGNALS_TO_HANDLE",
    "TORCHELASTIC_ERROR_FILE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "OMP_NUM_THREADS",
)
"""What torchrun (torch 2.13) exports to each worker; spikeguard's launcher exports the same
names. Differences in value, by design: ``TORCHELASTIC_RUN_ID`` is the run's name,
``TORCHELASTIC_RESTART_COUNT`` is the generation minus one, ``TORCHELASTIC_MAX_RESTARTS`` is
:data:`UNBOUNDED_RESTARTS` (the policy's budget decides, not a count), and
``TORCHELASTIC_USE_AGENT_STORE`` is ``False``: rank 0 hosts the rendezvous store on
``MASTER_PORT`` (there is no torchrun agent). ``TORCHELASTIC_ERROR_FILE`` is
``RUN_DIR/logs/genNNN-rankR.error.json``, where ``torch.distributed.elastic``'s ``@record``
writes a crashing rank's traceback. ``OMP_NUM_THREADS`` is the job's own value, else the CPUs
reserved per rank. GPU ranks also get ``CUDA_VISIBLE_DEVICES`` from Ray's assignment."""

UNBOUNDED_RESTARTS = "-1"
"""``TORCHELASTIC_MAX_RESTARTS``: no fixed number (the policy's recovery budget decides)."""

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

ENV_STAGE_DIR = "SPIKEGUARD_STAGE_DIR"
"""A local directory (on each node) where a framework that writes its own checkpoint directories
(the Hugging Face ``Trainer``) writes them while :data:`ENV_CKPT_DIR` is a remote URL
(``s3://...``): spikeguard commits each there, publishes it to the store and removes it; a resume
pulls the plan's checkpoint into it. The launcher never sets it (a job's ``env`` may). Unset: the
callback's ``stage_dir=``, else ``spikeguard-stage`` in the temp directory (``$TMPDIR``). It needs
room for one checkpoint, more with the callback's ``keep_staged``."""

ENV_RESUME = "SPIKEGUARD_RESUME"
"""Path of a JSON file holding a :class:`~.plan.ResumePlan`: what the supervisor decided at this
launch. Unset: a fresh start."""

ENV_SAMPLE_EVERY = "SPIKEGUARD_SAMPLE_EVERY"
"""Overrides the sampling interval (steps) of ``attach``."""

ENV_BACKEND = "SPIKEGUARD_BACKEND"
"""The torch.distributed backend the job asks for: ``gloo`` or ``nccl`` (the job's ``backend``,
``auto`` resolved by whether it reserves GPUs)."""

ENV_CKPT_EVERY = "SPIKEGUARD_CKPT_EVERY"
"""The job's ``checkpoint_every`` (steps), set only when the job sets it. It overrides the
script's own interval, as the other variables override ``attach()``'s arguments:
``Session.should_checkpoint(step, every=...)`` uses it instead of ``every``, the Lightning
callback instead of its ``checkpoint_every``, and the Hugging Face callback makes it the
Trainer's ``save_steps`` (with a warning, each, when the script's interval differs)."""

ENV_FENCE_FILE = "SPIKEGUARD_FENCE_FILE"
"""Path of a small file holding the current generation. A rank whose own generation is older
refuses to write checkpoints (a frozen node that wakes up after it was replaced must not
overwrite anything)."""

ENV_STANDBY = "SPIKEGUARD_STANDBY"
"""Set in a standby process (the job's ``standby: true``) to the pid of the agent that started
it (its parent). Started while the generation before it trains, a standby runs the script up
to ``resume()`` (or its first ``step()``) and waits there for the supervisor's ``release``
request, which names the generation and the resume plan. It exits by itself once the FENCE
file names a later generation or its parent is no longer that agent."""


def env_int(name: str, default: int) -> int:
    """The integer in environment variable ``name``; ``default`` when unset or empty."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None
