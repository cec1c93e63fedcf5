"""Which process is a rank's launcher, and a rank whose launcher is already gone ends at once
(ranks/parent.py). The parent-death signal itself is tested with a real SIGKILL of a real
launcher (tests/ranks/test_torchrun.py); nothing here sets it on the test process."""

from __future__ import annotations

import os

import pytest

from trainjob.ranks import parent
from trainjob.ranks.parent import LAUNCHER_PID, launcher_of_this_rank

NEVER = "4194305"  # above Linux's largest pid_max: no process has it


def test_a_rank_of_a_live_launcher_is_told_its_launcher():
    me = os.getpid()
    assert launcher_of_this_rank({LAUNCHER_PID: str(me)}, parent=me) == me


def test_a_child_of_a_rank_is_no_rank_and_is_left_alone():
    """A DataLoader worker, a `trainjob status` a loop starts: the launcher lives, the parent is another."""
    assert launcher_of_this_rank({LAUNCHER_PID: str(os.getpid())}, parent=os.getppid()) is None


def test_no_launcher_in_the_environment_is_no_rank():
    assert launcher_of_this_rank({}, parent=os.getppid()) is None
    assert launcher_of_this_rank({LAUNCHER_PID: "not a pid"}, parent=os.getppid()) is None


def test_a_launcher_already_gone_is_0_and_the_rank_ends_75_at_once(capsys):
    assert launcher_of_this_rank({LAUNCHER_PID: NEVER}, parent=1) == 0
    with pytest.raises(SystemExit) as ended:
        parent.die_with_launcher({LAUNCHER_PID: NEVER})
    assert ended.value.code == 75 and "its launcher is gone" in capsys.readouterr().err


def test_under_plain_torchrun_a_worker_is_a_session_leader_and_one_not_under_torchrun_was_orphaned(monkeypatch):
    """torchrun's workers lead sessions of their own; a DataLoader worker of theirs does not."""
    env = {"TORCHELASTIC_RUN_ID": "x"}
    monkeypatch.setattr(os, "getsid", lambda pid: os.getpid() + 1)  # not a session leader: a rank's child
    assert launcher_of_this_rank(env, parent=1) is None
    monkeypatch.setattr(os, "getsid", lambda pid: os.getpid())  # a session leader: a worker
    assert launcher_of_this_rank(env, parent=os.getppid()) == 0  # its parent (pytest's) is no torchrun: reparented
    monkeypatch.setattr(parent, "_is_torchrun", lambda pid: pid == 4242)
    assert launcher_of_this_rank(env, parent=4242) == 4242
