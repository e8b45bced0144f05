"""spikeguard.workers.integrations — spikeguard inside training frameworks' own loops.

Each module adapts one framework to the same :class:`~spikeguard.workers.session.Session`:
reports every step, grades in the framework's own checkpoints, and a rollback that resumes
through the framework's own resume path. A module imports its framework, so import it
explicitly (``from spikeguard.workers.integrations.hf import SpikeguardCallback``); this package
itself imports nothing.

- :mod:`.hf` — ``transformers.Trainer`` (extra ``spikeguard[hf]``)
- :mod:`.lightning` — ``lightning.Trainer`` (extra ``spikeguard[lightning]``)
"""
