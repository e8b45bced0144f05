"""What the supervisor shows where people already look: pictures of a run (more to come:
metrics, the HTML post-mortem).

* :mod:`.plots`  ``RUN_DIR/report.png``: loss, grade and attention entropy per generation
"""
