"""spikeguard.workers.rank — the parts :class:`~spikeguard.workers.session.Session` is made of.

``Session`` is the one public rank API; it owns one of each part below and wires them together.
Each part is a module with one job, and a part uses another only through its public methods:

* :mod:`.config`       the ``SPIKEGUARD_*`` environment (and ``attach()``'s arguments), read once
* :mod:`.reports`      messages to the supervisor, its requests back (checkpoints, batch ids), the
                       batch-ids ring, and the fence that refuses a replaced generation's writes
* :mod:`.sampling`     the probes, armed on sampled steps only, and the latest sample's grade
* :mod:`.checkpoints`  the two save paths (replicated, DCP-sharded) and the ranks' collectives
* :mod:`.cadence`      the checkpoint interval in force (the job's ``checkpoint_every`` over the
                       script's)
* :mod:`.resume`       the launch's plan (a standby waits for it), applying it, batch skipping,
                       and the LR scale as optimizer step hooks
* :mod:`.framework`    what a framework integration (Hugging Face, Lightning) calls
* :mod:`.timing`       the rank's compute time in a step (its forwards, the script's phases)

This package itself imports nothing (torch is loaded by the parts that need it).
"""
