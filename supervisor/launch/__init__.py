"""The launch room: Ray, rank agents, processes, kills and the reaper.

* :mod:`.types`   the typed records and the ``Group`` protocol the controller uses (no Ray)
* :mod:`.agent`   ``RankAgent``: one Ray actor per rank that owns its training process
* :mod:`.group`   ``WorkerGroup``: the gang of agents in a placement group (imports Ray)
* :mod:`.reaper`  finds and kills rank processes that outlived their generation
* :mod:`.ray_init` attaching to a Ray cluster or starting an embedded one

Only :mod:`.group`, :mod:`.ray_init` and the reaper's remote sweep import Ray, and only when
used, so the controller imports this room on a machine without Ray installed.
"""

from .interface import GroupSpec, KillReport, LaunchedRank, LaunchError, RankKill, RankPoll

__all__ = ["GroupSpec", "KillReport", "LaunchError", "LaunchedRank", "RankKill", "RankPoll"]
