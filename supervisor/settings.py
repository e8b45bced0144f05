"""The controller's settings and the run directory's layout: typed, keyword-only, one place.

``runner.run_job`` fills :class:`ControllerSettings` from the job file (``timeouts``, ``standby``,
``checkpoints``) and the policy; tests build it with the defaults and a few overrides.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from spikeguard.workers.checkpoint import location
from spikeguard.workers.checkpoint.retention import RetentionSettings

from .decide import recovery as rc
from .rundir import JOB_RECORD


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


CHECKPOINTS = "checkpoints"
"""The checkpoint directory's name in the run directory, where a job does not say
(``checkpoints.dir``)."""


@dataclasses.dataclass(frozen=True)
class RunPaths:
    """Where a run's files are: below its run directory, its checkpoints wherever the job put
    them."""

    root: Path
    checkpoints: str | None = None
    """Where the checkpoints are, as the job's ``checkpoints.dir`` resolved (an absolute path or
    an object store's URL); None: ``RUN_DIR/checkpoints``."""

    @classmethod
    def recorded(cls, root: str | os.PathLike[str]) -> RunPaths:
        """The paths of the run in ``root`` as the run recorded them: its checkpoints where
        ``RUN_DIR/job.json`` says (``checkpoints.dir``, recorded resolved), else (no record, an
        older one, one that cannot be read) ``RUN_DIR/checkpoints``. What every command given a
        RUN_DIR reads."""
        run = Path(root)
        try:
            doc = json.loads((run / JOB_RECORD).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            doc = None
        spec = doc.get("checkpoints") if isinstance(doc, dict) else None
        place = spec.get("dir") if isinstance(spec, dict) else None
        return cls(run, place if isinstance(place, str) and place else None)

    @property
    def ckpt_dir(self) -> str:
        """The checkpoint directory: a path, or an object store's URL (``s3://...``)."""
        return self.checkpoints or str(self.root / CHECKPOINTS)

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
        """Create the directories a supervised run writes to (the checkpoint directory where it
        is local: an object store's prefix exists once something is written under it)."""
        dirs = [self.root, self.plans_dir]
        if location.is_local(self.ckpt_dir):
            dirs.append(Path(location.local_path(self.ckpt_dir)))
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
        return self

    def stop_reason(self) -> str:
        """What ``STOP`` says (written by ``spikeguard stop``, Ctrl-C), or a default."""
        try:
            text = self.stop_file.read_text(errors="replace").strip()
        except OSError:
            text = ""
        return text or "stop requested"
