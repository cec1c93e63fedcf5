"""Values more than one part needs and none owns, written once at the foundation.

``VERSION`` is trainjob's version, written here only: pyproject.toml reads it from this line (a
dynamic version), so the package metadata agrees, and start-up need not import
``importlib.metadata`` (a third of an idle ``trainjob --help``) to learn it. ``trainjob
--version``, ``trainjob.__version__`` and the image ``k8s render`` names by default all show it. ``BACKOFF_LIMIT`` is ``trainjob run``'s default retry
budget, which ``k8s render`` sizes the Job's ``backoffLimit`` from: here, deploy reads it without
importing the engine (and numpy and transitions with it). ``IDEMPOTENT_ENV`` is the environment
variable that makes every ``trainjob.Run`` of a process idempotent, as ``--idempotent`` makes
``trainjob run``: ``k8s render`` sets it in an own loop's pods, the engine reads it. This module
imports nothing of trainjob.
"""

from __future__ import annotations

VERSION = "0.1.0"
BACKOFF_LIMIT = 2
# --async-checkpoint: the longest the loop waits for a background write before it gives up with
# exit 75 (the previous checkpoint stands): bounded, never a hang, yet above a slow disk's minutes.
ASYNC_WRITE_TIMEOUT = 600.0
# "1": a relaunch of a completed job verifies its artifact and exits 0, in a script that never
# passes idempotent=True (an own loop in a rendered pod); "0" or unset: the argument decides.
IDEMPOTENT_ENV = "TRAINJOB_IDEMPOTENT"
# The largest step and attempt a checkpoint's name holds (``step-%08d-a%04d``, checkpoint/plan.py):
# a run of more steps, or a retry budget of more attempts, is refused before it starts, since its
# later checkpoints would not be found (rotation, ``verify`` and a resume would miss them).
MAX_STEP, MAX_ATTEMPT = 10 ** 8 - 1, 10 ** 4 - 1
