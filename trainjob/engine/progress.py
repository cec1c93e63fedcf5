"""A progress line on stderr for long runs: step, loss, rate and ETA, only on a terminal.

It is for the person watching, never a record: it does not go to the decision log, and when
stderr is a file or a pipe (a pod's log, CI) it prints nothing, so logs stay quiet and stable.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TextIO


def line(step: int, steps: int, loss_milli: int, done: int, elapsed: float) -> str:
    """The text for ``step`` of ``steps``, ``done`` steps having taken ``elapsed`` seconds here."""
    rate = done / elapsed if elapsed > 0 else 0.0
    eta = f"{(steps - step) / rate:.0f}s" if rate > 0 else "?"
    return f"step {step}/{steps}  loss {loss_milli / 1000:.3f}  {rate:.2f} steps/s  ETA {eta}"


class Progress:
    """Rewrites one line in place (carriage return) after every step; a newline at the last."""

    def __init__(self, stream: TextIO, steps: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.stream, self.steps, self.clock = stream, steps, clock
        self.started = clock()
        self.first: int | None = None

    def __call__(self, step: int, loss_milli: int) -> None:
        if self.first is None:  # a resumed launch's rate counts only the steps done in this launch
            self.first = step - 1
        text = line(step, self.steps, loss_milli, step - self.first, self.clock() - self.started)
        try:
            self.stream.write(f"\r{text}\x1b[K" + ("\n" if step >= self.steps else ""))
            self.stream.flush()
        except OSError:
            pass  # a progress line must never change how the run ends

    @classmethod
    def for_stream(cls, stream: TextIO, steps: int) -> Progress | None:
        """A Progress when ``stream`` is a terminal, else None (say nothing)."""
        try:
            return cls(stream, steps) if stream.isatty() else None
        except (AttributeError, ValueError):
            return None
