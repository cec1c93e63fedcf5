"""A peer lost in a collective is recognised from the error alone (ranks/lost.py); a bug is not."""

from __future__ import annotations

import types

import pytest

from trainjob.ranks.lost import collective_failure

GLOO = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:35025. This is typically caused by a remote worker crashing.\nmore")


def test_gloos_lost_connection_is_recognised_by_its_first_line():
    assert collective_failure(RuntimeError(GLOO)) == f"RuntimeError: {GLOO.splitlines()[0]}"[:240]


def test_a_lost_connection_wrapped_by_autograd_or_a_hook_is_found_down_the_chain():
    try:
        try:
            raise RuntimeError("Connection reset by peer")
        except RuntimeError as inner:
            raise RuntimeError("Error detected in a backward hook") from inner
    except RuntimeError as outer:
        assert collective_failure(outer) == "RuntimeError: Connection reset by peer"


@pytest.mark.parametrize("bug", [RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x2)"),
                                 RuntimeError("ProcessGroupGloo does not support this op"),
                                 ValueError("Connection closed by peer"),  # not a process group's error
                                 KeyError("x")])
def test_a_bug_in_the_body_is_not_a_lost_peer(bug):
    assert collective_failure(bug) is None


def test_torch_distributed_error_classes_count_looked_up_never_imported(monkeypatch):
    class DistBackendError(RuntimeError):
        pass

    fake = types.SimpleNamespace(DistBackendError=DistBackendError)
    monkeypatch.setitem(__import__("sys").modules, "torch.distributed", fake)
    assert collective_failure(DistBackendError("NCCL error in: ..., unhandled system error")) == \
        "DistBackendError: NCCL error in: ..., unhandled system error"
    monkeypatch.delitem(__import__("sys").modules, "torch.distributed")
    assert collective_failure(DistBackendError("NCCL error in: ...")) is None  # no torch: only the messages
