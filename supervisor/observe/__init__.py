"""What the supervisor shows where people already look.

* :mod:`.metrics`   the run's Prometheus metrics as a pure fold over journal events and the
                    collector's views
* :mod:`.exporter`  ``/metrics``: the fold served by ``prometheus_client`` (the ``metrics`` extra)
* :mod:`.rundata`   a run directory read for the post-mortem (journal, reports, checkpoints,
                    batch forensics)
* :mod:`.svg`       inline SVG charts, drawn in Python
* :mod:`.report`    ``spikeguard report``: the post-mortem as one self-contained HTML file
"""
