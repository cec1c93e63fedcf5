"""The engine: the state machine, and the launch that drives it from a training loop.

Owns the transition table (``machine.py``, the single source of truth), the pure decisions its
guards call (``decisions.py``), the job, the machine's model that persists before it announces
(``job.py``), what a launch is configured with (``config.py``, light enough for the CLI's
parser), ``Run``, one launch around any training loop, the CLI's or a user's (``run.py``),
the idempotent-completion check (``completion.py``), ``trainjob reshard``, and what a launch tells
the person watching it: its progress and its last line (``progress.py``).
Must not map errors to exit codes by itself (``exits.py`` does) nor know which model it drives
beyond the Stateful protocol. Start with ``machine.py``, then ``run.py``.
"""
