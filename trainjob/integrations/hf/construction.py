"""A Trainer that cannot even be built, said as trainjob says bad input: one line, exit 2.

``transformers.Trainer(...)`` refuses a train data set without a length (a stream: an
``IterableDataset``) when ``max_steps`` is not set: a ValueError with its traceback, raised before
``hf.run`` exists to say anything, and Python ends the script in exit 1, which trainjob's table
keeps for an honest failure (issue 58). Importing ``trainjob.integrations.hf`` before the Trainer
is built (an import at the top of the script) puts ``hook`` in front of Python's handler of
uncaught exceptions: that error becomes one line on stderr and exit 2, before anything is
written; every other exception goes on to the handler that was there. Must not: import
transformers (the traceback names its file).
"""

from __future__ import annotations

import os
import sys
from types import TracebackType

from ...exits import EXIT_USAGE

LINE = ("trainjob: the Trainer's train_dataset is a stream (it has no length), so the Trainer cannot count "
        "its steps: give TrainingArguments(max_steps=N), the optimizer steps to train (exit 2)")


def refused_construction(exc: BaseException, tb: TracebackType | None) -> bool:
    """Whether ``exc`` is the Trainer's constructor refusing a stream without ``max_steps``."""
    if not isinstance(exc, ValueError) or "max_steps" not in str(exc):
        return False
    while tb is not None:  # raised from inside the Trainer's constructor
        code = tb.tb_frame.f_code
        if code.co_name == "__init__" and code.co_filename.replace(os.sep, "/").endswith("transformers/trainer.py"):
            return True
        tb = tb.tb_next
    return False


def install() -> None:
    """Put ``hook`` in front of the handler of uncaught exceptions there is now (once)."""
    previous = sys.excepthook
    if getattr(previous, "_trainjob_hf", False):
        return

    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        if refused_construction(exc, tb):
            print(LINE, file=sys.stderr)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_USAGE)  # an uncaught exception's exit code is Python's 1 otherwise
        previous(kind, exc, tb)

    hook._trainjob_hf = True  # type: ignore[attr-defined]
    sys.excepthook = hook
