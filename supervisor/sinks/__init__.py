"""Notification: folds over the journal's events, for the people following a run.

``describe`` (one line per event, plain or Slack mrkdwn), ``console`` (the story as it is
journaled, the live view, ``spikeguard status``), ``charts`` (an incident's PNG) and ``slack``
(one thread per incident). Nothing here decides anything: each reads events and shows them.
"""
