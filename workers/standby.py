"""A standby rank process waiting to be released (the job's ``standby: true``).

The supervisor starts the next generation's processes while the current one trains. Such a
process runs the user's script as usual (imports, ``init_process_group`` on its own port, the
model) until the script first needs to know where to start: ``resume()``, or the first
``step()`` / ``should_checkpoint()`` / ``save_checkpoint()`` of a script that never calls
``resume()``. There it waits, sending nothing, until one of:

* a ``release`` request for its generation arrives on the report socket: it becomes that
  generation and resumes from the plan the request names (a file the supervisor wrote);
* the FENCE file names a later generation (it was prepared for a generation that never came):
  it exits with :data:`EXIT_FENCED`;
* its parent (the rank agent) is gone: it exits with :data:`EXIT_ORPHANED`, so no standby
  outlives the supervisor that prepared it.

Only its agent can release it: a standby's report channel talks to a server with the agent's
pid alone (``SO_PEERCRED``, :func:`~.channel.peer_problem`; the agent's pid is what
``SPIKEGUARD_STANDBY`` names), so nothing posing as the agent hands it a release and a plan.
On the agent's side the standby's socket takes lines only from the standby's own session, and
what arrived on it before the release (its hello) is discarded at the release: no line said
while it waited counts as the new generation's.
"""

from __future__ import annotations

import os
import time
from typing import Any

from .contract import ResumePlan
from .contract.logs import logger

log = logger(__name__)

EXIT_FENCED = 75
"""Exit code of a standby whose generation was passed over (FENCE names a later one)."""
EXIT_ORPHANED = 76
"""Exit code of a standby whose agent (its parent process) is gone."""
POLL_S = 0.005
"""How often the request queue is looked at while waiting (a queue check, no I/O)."""
CHECK_S = 0.5
"""How often the FENCE file and the parent are looked at while waiting."""


class Released:
    """What a release said: the plan to resume from (None: a fresh start)."""

    def __init__(self, plan: ResumePlan | None, waited_s: float) -> None:
        self.plan = plan
        self.waited_s = waited_s


def fenced_past(fence_file: str | None, generation: int) -> int | None:
    """The generation the FENCE file names when it is later than ``generation``, else None."""
    if not fence_file:
        return None
    try:
        with open(fence_file, encoding="utf-8") as f:
            current = int(f.read().strip() or 0)
    except (OSError, ValueError):
        return None
    return current if current > generation else None


def wait_for_release(
    channel: Any,
    *,
    generation: int,
    rank: int,
    fence_file: str | None,
    parent_pid: int,
) -> Released:
    """Block until the supervisor releases this standby (see the module docstring); exit the
    process if it is fenced or orphaned."""
    t0 = time.monotonic()
    next_check = t0
    while True:
        for req in channel.poll_requests():
            if req.get("type") != "release" or req.get("generation") != generation:
                continue
            path = req.get("plan")
            plan = None
            if isinstance(path, str) and path:
                with open(path, encoding="utf-8") as f:
                    plan = ResumePlan.from_json(f.read())
            return Released(plan, time.monotonic() - t0)
        now = time.monotonic()
        if now >= next_check:
            next_check = now + CHECK_S
            later = fenced_past(fence_file, generation)
            if later is not None:
                _leave(
                    EXIT_FENCED,
                    f"standby rank {rank} of generation {generation} was fenced "
                    f"(current generation {later}): exiting",
                )
            if os.getppid() != parent_pid:
                _leave(EXIT_ORPHANED, f"standby rank {rank}: its agent is gone: exiting")
        time.sleep(POLL_S)


def _leave(code: int, why: str) -> None:
    """Say why and end the process at once (a standby has nothing to clean up)."""
    log.warning(f"{why} (exit {code})")
    os._exit(code)
