"""trainjob: a training-job engine that refuses silent success.

The public surface is small: the CLI (``trainjob.cli.main``, run as a process by
``trainjob.cli.entry``), the state machine table (``trainjob.machine``), the pure decisions
(``trainjob.decisions``) and the error tree.
"""

__version__ = "0.1.0"
