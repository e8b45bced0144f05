"""A rank's configuration: the environment the launcher set, read once, over ``attach()``'s
arguments.

Under the supervisor every setting comes from an environment variable
(:mod:`spikeguard.workers.contract.env`); without one the same script runs on ``attach()``'s
arguments. :meth:`RankConfig.from_env` is the only place the SDK reads that environment (the
resume plan's file is read by :mod:`.resume`), so every other part is handed the values it
needs and never looks at ``os.environ`` itself. Torch-free.
"""

from __future__ import annotations

import dataclasses
import os

from .. import contract


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankConfig:
    """What a rank is and where it reports: fixed for the life of the process."""

    rank: int = 0
    """This rank's global index (``RANK``, as torchrun sets it)."""
    world_size: int = 1
    """How many ranks the job has (``WORLD_SIZE``)."""
    generation: int = 0
    """The launch generation (``SPIKEGUARD_GENERATION``): every message carries it, and a rank
    of an older generation than the FENCE file's may write no checkpoint."""
    run_id: str = "local"
    """The run's name, echoed in every message (``SPIKEGUARD_RUN_ID``, else ``run_id=``)."""
    sample_every: int = 200
    """Probe activations every N steps (``SPIKEGUARD_SAMPLE_EVERY``, else ``sample_every=``);
    at least 1."""
    checkpoint_every: int | None = None
    """The job's checkpoint interval (``SPIKEGUARD_CKPT_EVERY``, the job's ``checkpoint_every``),
    in steps: it overrides the script's own (``should_checkpoint(every=...)``, the Lightning
    callback's ``checkpoint_every``, the Trainer's ``save_steps``). None: the script's."""
    ckpt_dir: str | None = None
    """Where checkpoints are written (``SPIKEGUARD_CKPT_DIR``, else ``ckpt_dir=``); None: no
    checkpoints can be saved."""
    report: str | None = None
    """Where messages go (``SPIKEGUARD_REPORT``, else ``report=``): see
    :mod:`spikeguard.workers.channel`; None is ``off``."""
    fence_file: str | None = None
    """The FENCE file naming the current generation (``SPIKEGUARD_FENCE_FILE``); None: no
    fencing (a run without a supervisor)."""
    standby_agent: int | None = None
    """In a warm standby (``SPIKEGUARD_STANDBY``), the pid of the agent that started it: the
    process waits for that agent's release and exits once it is gone. None: not a standby."""
    batch_ids_window: int = 200
    """How many steps of ``batch_ids`` the ring buffer keeps for an incident's forensics."""
    queue_size: int = 1024
    """Bound of the report queue; beyond it messages are dropped and counted."""

    def __post_init__(self) -> None:
        if self.sample_every < 1:
            raise ValueError(f"sample_every must be >= 1, got {self.sample_every}")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise ValueError(f"{contract.ENV_CKPT_EVERY} must be >= 1, got {self.checkpoint_every}")

    @property
    def standby(self) -> bool:
        """Whether this process is a warm standby (it waits for its release)."""
        return self.standby_agent is not None

    @classmethod
    def from_env(
        cls,
        *,
        report: str | None = None,
        sample_every: int = 200,
        ckpt_dir: str | None = None,
        run_id: str | None = None,
        batch_ids_window: int = 200,
        queue_size: int = 1024,
    ) -> RankConfig:
        """The configuration of this process: each argument (``attach()``'s) unless the
        environment variable that overrides it is set. Raises ``ValueError`` for a variable
        that is not a number where one is expected, or a ``sample_every`` below 1."""
        agent = os.environ.get(contract.ENV_STANDBY, "")
        every = contract.env_int(contract.ENV_CKPT_EVERY, 0)
        return cls(
            rank=int(os.environ.get("RANK", "0")),
            world_size=int(os.environ.get("WORLD_SIZE", "1")),
            generation=contract.env_int(contract.ENV_GENERATION, 0),
            run_id=os.environ.get(contract.ENV_RUN_ID) or run_id or "local",
            sample_every=contract.env_int(contract.ENV_SAMPLE_EVERY, sample_every),
            checkpoint_every=every if os.environ.get(contract.ENV_CKPT_EVERY) else None,
            ckpt_dir=os.environ.get(contract.ENV_CKPT_DIR) or ckpt_dir,
            report=os.environ.get(contract.ENV_REPORT) or report,
            fence_file=os.environ.get(contract.ENV_FENCE_FILE),
            standby_agent=int(agent) if agent.isdigit() else None,
            batch_ids_window=batch_ids_window,
            queue_size=queue_size,
        )
