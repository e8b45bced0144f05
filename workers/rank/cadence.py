"""When a checkpoint is due by the interval: the script's, or the job's ``checkpoint_every``.

The job's ``checkpoint_every`` (``SPIKEGUARD_CKPT_EVERY``) overrides the interval the script
passes to ``should_checkpoint(every=...)``, as every other ``SPIKEGUARD_*`` setting overrides
its ``attach()`` argument: what the job file says is what the run does. A script whose interval
differs is told once; so is a script that never asks ``should_checkpoint`` although the job
sets an interval (nothing can honour it then). Torch-free.
"""

from __future__ import annotations

from ..contract.env import ENV_CKPT_EVERY
from ..contract.logs import logger

log = logger(__name__)


def due(step: int, every: int | None) -> bool:
    """Whether ``step`` is a multiple of ``every`` (from step ``every`` on; never without
    ``every``)."""
    if not every:
        return False
    return step > 0 and step % int(every) == 0


class Cadence:
    """The interval checkpoints are due at: the job's when it sets one, else the script's."""

    def __init__(self, job_every: int | None) -> None:
        self.job_every = job_every
        """The job's ``checkpoint_every`` (None: the script's interval applies)."""
        self._asked = False
        """Whether the script asked :meth:`due` yet."""
        self._warned: set[str] = set()

    def every(self, script_every: int | None) -> int | None:
        """The interval in force: the job's, else ``script_every``."""
        if self.job_every is None:
            return script_every
        if script_every and int(script_every) != self.job_every:
            self._warn_once(
                "override",
                f"the job's checkpoint_every={self.job_every} ({ENV_CKPT_EVERY}) overrides the "
                f"script's interval of {int(script_every)} steps",
            )
        return self.job_every

    def due(self, step: int, script_every: int | None) -> bool:
        """Whether the interval in force makes ``step`` a checkpoint step."""
        self._asked = True
        return due(step, self.every(script_every))

    def stepped(self, step: int) -> None:
        """Training step ``step`` finished: once the job's interval has passed without the
        script ever asking :meth:`due`, say (once) that nothing honours it."""
        if self.job_every is None or self._asked or step < self.job_every:
            return
        self._warn_once(
            "never asked",
            f"the job sets checkpoint_every={self.job_every} but this script never calls "
            "should_checkpoint(step): no checkpoint is saved at that interval (call it at the "
            "end of every step and save when it says so)",
        )

    def _warn_once(self, key: str, text: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(text)
