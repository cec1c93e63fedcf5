"""Views: what a log or a PVC says, read back for people: status, path, verify, diagrams, plots.

Owns ``trainjob status`` (``status.py``), the replay of a log against the machine's table
(``history.py``), ``trainjob verify``, and the pictures (``diagram.py``, ``plot.py``). Reads only:
must not write to the PVC or change what a run decides. Start with ``status.py``.
"""
