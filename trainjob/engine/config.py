"""What one launch of a job is configured with: the settings of ``trainjob run`` and ``Run``.

Kept apart from the engine (``job.py`` imports numpy and ``transitions``) because the command
line builds its parser from these defaults, and ``trainjob --help`` must start without the engine.
Must not import anything heavier than attrs.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import attrs

from ..defaults import BACKOFF_LIMIT, IDEMPOTENT_ENV, MAX_ATTEMPT, MAX_STEP
from ..errors import UsageError

DEFAULT_LOG = "log.jsonl"  # the decision log's name inside the PVC, unless --log says otherwise


@attrs.frozen
class RunConfig:
    steps: int = 10
    ckpt_every: int = 2
    lr: float = 0.05
    max_drop: int = 20
    backoff_limit: int = BACKOFF_LIMIT
    die_at: int | None = None
    force_weights: tuple[float, float, float] | None = None
    keep: int = 3
    world_size: int = 1
    rank_timeout: float = 60.0
    trainer: str = "linear"
    async_checkpoint: bool = False  # write checkpoints on a thread while training goes on (overlap.py)

    def check(self, lr_required: bool = True) -> None:
        """Raise UsageError for settings that cannot work, naming the flag and what to change.
        ``lr_required=False``: an own loop that names no learning rate (recorded as 0)."""
        if self.steps < 1:
            raise UsageError(f"--steps must be at least 1, got {self.steps}")
        if self.steps > MAX_STEP:
            raise UsageError(f"--steps must be at most {MAX_STEP} (a checkpoint's name holds the step in "
                             f"{len(str(MAX_STEP))} digits), got {self.steps}")
        if self.ckpt_every < 1:
            raise UsageError(f"--ckpt-every must be at least 1, got {self.ckpt_every}")
        if (lr_required or self.lr != 0) and not (self.lr > 0 and self.lr < float("inf")):
            raise UsageError(f"--lr must be a positive finite number, got {self.lr}")
        if not 0 <= self.max_drop <= 100:
            raise UsageError(f"--max-drop is a percentage from 0 to 100, got {self.max_drop}")
        if self.backoff_limit < 0:
            raise UsageError(f"--backoff-limit must be 0 or more, got {self.backoff_limit}")
        if self.backoff_limit >= MAX_ATTEMPT:
            raise UsageError(f"--backoff-limit must be at most {MAX_ATTEMPT - 1} (a checkpoint's name holds the "
                             f"attempt in {len(str(MAX_ATTEMPT))} digits), got {self.backoff_limit}")
        if self.die_at is not None and not 1 <= self.die_at <= self.steps:
            raise UsageError(f"--die-at must be a step from 1 to --steps ({self.steps}), got {self.die_at}")
        if self.keep < 1:
            raise UsageError(f"--keep must be at least 1 (the newest checkpoint is always kept), got {self.keep}")
        if not (self.rank_timeout > 0 and self.rank_timeout < float("inf")):
            raise UsageError(f"--rank-timeout must be a positive number of seconds, got {self.rank_timeout}")

    def settings(self, data_sha256: str) -> str:
        """What every rank of one launch must agree on to compute the same updates."""
        return (f"steps={self.steps} ckpt_every={self.ckpt_every} lr={self.lr!r} die_at={self.die_at} "
                f"data={data_sha256[:16]} trainer={self.trainer}")


# The settings a Python caller may pass (``trainjob.Run``), by the kind of number each is. The
# command line's parser already makes these types; a script may hand over a numpy scalar or a str.
PYTHON_SETTINGS = {"steps": int, "ckpt_every": int, "lr": float, "max_drop": int, "backoff_limit": int,
                   "die_at": int, "keep": int, "world_size": int, "rank_timeout": float}


def as_setting(name: str, value: object, kind: type[int] | type[float]) -> int | float:
    """``value`` as the plain int or float setting ``name`` is (a numpy scalar passes); UsageError
    naming it for a bool, a str, or a float where an integer belongs. Without this a wrong type
    failed a comparison, or the JSON of a record, as an internal error (exit 70)."""
    if not isinstance(value, bool | str | bytes):
        try:
            return operator.index(value) if kind is int else float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            pass
    raise UsageError(f"{name}= must be {'an integer' if kind is int else 'a number'}, got {value!r:.60}")


def from_python(cfg: RunConfig) -> RunConfig:
    """``cfg`` with every setting a Python caller gave as a plain int or float (``as_setting``)."""
    plain: dict[str, Any] = {name: as_setting(name, getattr(cfg, name), kind) for name, kind in PYTHON_SETTINGS.items()
                             if name != "die_at" or cfg.die_at is not None}  # the one that may be None
    return attrs.evolve(cfg, **plain)


def idempotent_from(env: Mapping[str, str]) -> bool:
    """Whether the environment asks for idempotent starts (``IDEMPOTENT_ENV``): "1" yes, "0" or
    unset no. Any other value is a UsageError: a typo must not quietly leave a relaunched pod to
    be refused (exit 2, which a rendered Job turns into FailJob)."""
    value = env.get(IDEMPOTENT_ENV, "")
    if value not in ("", "0", "1"):
        raise UsageError(f"{IDEMPOTENT_ENV} must be 1 (a relaunch of a completed job verifies it and exits 0) "
                         f"or 0, got {value!r:.40}")
    return value == "1"
