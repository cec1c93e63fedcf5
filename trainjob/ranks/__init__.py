"""Ranks: who this process is among W, and how W processes agree: through the launcher's store or the PVC.

Owns rank identity (``identity.py``: ``--rank``, ``$RANK``, a Slurm step's ``$SLURM_PROCID``, ``$JOB_COMPLETION_INDEX``), the
coordination protocol by role (``coordination.py``'s interfaces: sessions, joins, receipts
gathered by rank 0, the agreed stop step), its two transports (``store.py`` on torchrun's
rendezvous store, ``peers.py`` on PVC files) and the choice between them (``connect.py``), and the
local launcher of W processes (``launcher.py``). Must not train, checkpoint or log decisions: the
engine asks, this part answers. Start with ``coordination.py``.
"""
