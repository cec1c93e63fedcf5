"""The engine's handling of the trainer's state (job.py): a resume reads into the trainer's own arrays."""

from __future__ import annotations

from conftest import ROOT, events
from trainjob import cli


def test_a_resume_holds_the_state_once_in_the_arrays_the_trainer_built(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tests/helpers"))
    import user_trainers

    pvc, flags = tmp_path / "pvc", ["--trainer", "user_trainers:watched", "--ckpt-every", "1"]
    assert cli.main(["run", "--pvc", str(pvc), *flags, "--die-at", "2"]) == 75
    user_trainers.WATCH["built"].clear()
    user_trainers.WATCH["stepped"].clear()
    assert cli.main(["run", "--pvc", str(pvc), *flags]) == 0
    assert ("resumed", "from_step=2") in events(pvc / "log.jsonl")
    built = user_trainers.WATCH["built"]
    step, state = user_trainers.WATCH["stepped"][0]
    assert len(built) == 1  # no second initial state for the resume
    assert step == 3 and state is built[0]  # the checkpoint was read into the trainer's own array
