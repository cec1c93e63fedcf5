"""trainjob: a training-job engine that refuses silent success.

The public surface is small: the CLI (``trainjob.cli.main``, run as a process by
``trainjob.cli.entry``), the state machine table (``trainjob.machine``), the pure decisions
(``trainjob.decisions``) and the error tree.
"""

from .defaults import VERSION as __version__
