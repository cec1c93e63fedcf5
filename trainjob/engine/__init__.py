"""The engine: the state machine and the job that drives it, one rank at a time.

Owns the transition table (``machine.py``, the single source of truth), the pure decisions its
guards call (``decisions.py``), the job that persists before it announces and runs the training
loop (``job.py``), ``trainjob reshard`` and the progress line. Must not map errors to exit codes
(``cli.py`` does) nor know which trainer it drives beyond the protocol. Start with ``machine.py``.
"""
