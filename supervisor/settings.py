"""The controller's settings and the run directory's layout: typed, keyword-only, one place.

``runner.run_job`` fills :class:`ControllerSettings` from the job file (``timeouts``, ``standby``,
``checkpoints``) and the policy; tests build it with the defaults and a few overrides.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from spikeguard.workers.checkpoint.retention import RetentionSettings

from .decide import recovery as rc


@dataclasses.dataclass(frozen=True, kw_only=True)
class ControllerSettings:
    """How the controller watches a generation and carries out the machine's effects."""

    world_size: int
    """Ranks of every generation."""
    hang_timeout_s: float
    """A rank silent this long (after its first message) has hung."""
    first_heartbeat_timeout_s: float
    """A rank silent this long after its launch never started."""
    kill_grace_s: float = 0.0
    """Between SIGTERM and SIGKILL when a generation is killed."""
    poll_interval_s: float = 0.25
    """Between two ticks."""
    backoff_base_s: float = 0.0
    """The first relaunch's delay after a launch failure (doubling up to ``backoff_max_s``)."""
    backoff_max_s: float = 60.0
    """The longest relaunch delay."""
    launch_retries: int = 3
    """Launch failures in a row before the run fails."""
    reap_interval_s: float = 30.0
    """How often rank processes of replaced generations are looked for (and killed)."""
    default_settings: rc.Settings = dataclasses.field(default_factory=rc.Settings)
    """The policy's recovery settings, for what no rule decided (a restart, a launch)."""
    remote_reap: bool = True
    """Reap on every node of the cluster, not only this one."""
    preempt_grace_s: float = 30.0
    """How long a preemption waits for the emergency checkpoint it asked for."""
    standby: bool = False
    """Keep the next generation's processes warm (the job's ``standby``)."""
    batch_ids_wait_s: float = 10.0
    """How long an incident's kill waits for the ranks' batch ids (0: it does not ask)."""
    retention_settings: RetentionSettings | None = None
    """Which checkpoints to keep; None: never delete a checkpoint."""


@dataclasses.dataclass(frozen=True)
class RunPaths:
    """Where a run's files are, below its run directory."""

    root: Path

    @property
    def ckpt_dir(self) -> Path:
        return self.root / "checkpoints"

    @property
    def plans_dir(self) -> Path:
        return self.root / "plans"

    @property
    def fence_file(self) -> Path:
        return self.root / "FENCE"

    @property
    def stop_file(self) -> Path:
        return self.root / "STOP"

    @property
    def reports(self) -> Path:
        return self.root / "reports.jsonl"

    def make(self) -> RunPaths:
        """Create the directories a supervised run writes to."""
        for d in (self.root, self.ckpt_dir, self.plans_dir):
            d.mkdir(parents=True, exist_ok=True)
        return self

    def stop_reason(self) -> str:
        """What ``STOP`` says (written by ``spikeguard stop``, Ctrl-C), or a default."""
        try:
            text = self.stop_file.read_text(errors="replace").strip()
        except OSError:
            text = ""
        return text or "stop requested"
