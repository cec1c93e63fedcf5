"""Values more than one part needs and none owns, written once at the foundation.

``VERSION`` is trainjob's version, written here only: pyproject.toml reads it from this line (a
dynamic version), so the package metadata agrees, and start-up need not import
``importlib.metadata`` (a third of an idle ``trainjob --help``) to learn it. ``trainjob
--version``, ``trainjob.__version__`` and the image ``k8s render`` names by default all show it. ``BACKOFF_LIMIT`` is ``trainjob run``'s default retry
budget, which ``k8s render`` sizes the Job's ``backoffLimit`` from: here, deploy reads it without
importing the engine (and numpy and transitions with it). This module imports nothing of trainjob.
"""

from __future__ import annotations

VERSION = "0.1.0"
BACKOFF_LIMIT = 2
# --async-checkpoint: the longest the loop waits for a background write before it gives up with
# exit 75 (the previous checkpoint stands): bounded, never a hang, yet above a slow disk's minutes.
ASYNC_WRITE_TIMEOUT = 600.0
