"""Pagers as sinks: each on when its environment is set, each never in the way of a recovery.

``alertmanager`` (``SPIKEGUARD_ALERTMANAGER_URL``: an incident is an alert, kept alive while
open, ended when resolved), ``pagerduty`` (``SPIKEGUARD_PAGERDUTY_ROUTING_KEY``: Events API v2
trigger / acknowledge / resolve, one ``dedup_key`` per incident) and ``webhook``
(``SPIKEGUARD_WEBHOOK_URL``: one HMAC-signed JSON document per story event). ``follow`` folds
what they follow (through the one incident lifecycle), ``story`` words it (through the one
describer), ``delivery`` is their shared background queue (bounded, retried, what is given up
journaled as ``notify_undelivered``). Importing this package registers the three.
"""

from . import alertmanager, pagerduty, webhook  # noqa: F401 (each registers its sink)
