"""Ranks: the coordination interface, and the PVC implementation of each role."""

from __future__ import annotations

from trainjob.ranks.coordination import Coordination, Coordinator, Follower
from trainjob.ranks.peers import PvcCoordinator, PvcFollower
from trainjob.storage.pvc import Pvc


def test_each_pvc_side_implements_its_role_and_only_its_role(tmp_path):
    """Another transport (issue 16) implements the same Protocols; these pin what each side offers."""
    pvc = Pvc(tmp_path / "pvc")
    coordinator = PvcCoordinator(pvc, 2, 1.0, lambda: None)
    follower = PvcFollower(pvc, 1, 2, 1.0, lambda: None)
    assert isinstance(coordinator, Coordinator) and not isinstance(coordinator, Follower)
    assert isinstance(follower, Follower) and not isinstance(follower, Coordinator)
    assert isinstance(coordinator, Coordination) and isinstance(follower, Coordination)
