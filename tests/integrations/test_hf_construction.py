"""trainjob.integrations.hf's hook for a Trainer refused at its construction (integrations/hf/construction.py):
the Trainer's ValueError for a stream without max_steps, and only that, is recognised. In process: the
traceback is made by code compiled under the Trainer's file name (no transformers import)."""

from __future__ import annotations

import sys

from trainjob.integrations.hf import construction

TRAINER = "/site-packages/transformers/trainer.py"


def raised(source: str, filename: str) -> tuple[BaseException, object]:
    scope: dict[str, object] = {}
    exec(compile(source, filename, "exec"), scope)
    try:
        scope["Trainer"]()  # type: ignore[operator]
    except BaseException as exc:  # noqa: BLE001
        return exc, exc.__traceback__
    raise AssertionError("nothing raised")


CHECK = ("class Trainer:\n"
         "    def __init__(self):\n"
         "        self._validate_args()\n"
         "    def _validate_args(self):\n"
         "        raise {error}('The train_dataset does not implement __len__, ... max_steps has to be specified.')\n")


def test_the_trainers_refusal_of_a_stream_without_max_steps_is_recognised():
    assert construction.refused_construction(*raised(CHECK.format(error="ValueError"), TRAINER))


def test_any_other_error_goes_to_pythons_own_handler():
    assert not construction.refused_construction(*raised(CHECK.format(error="TypeError"), TRAINER))
    assert not construction.refused_construction(*raised(CHECK.format(error="ValueError"), "/elsewhere/trainer.py"))
    other = CHECK.format(error="ValueError").replace("max_steps has to be specified", "a bad learning rate")
    assert not construction.refused_construction(*raised(other, TRAINER))


def test_the_hook_goes_in_front_of_the_handler_there_is_once(monkeypatch):
    """Importing the integration installs it; a handler put in front since (torch.distributed's) gets
    it in front again, and installing twice in a row adds nothing."""
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    construction.install()
    installed = sys.excepthook
    assert getattr(installed, "_trainjob_hf", False)
    construction.install()
    assert sys.excepthook is installed
