"""Ranks: who this process is among W, and how W processes agree through the PVC alone.

Owns rank identity (``identity.py``: ``--rank``, ``$RANK``, ``$JOB_COMPLETION_INDEX``), the
coordination protocol by role (``coordination.py``'s interfaces, implemented on PVC files in
``peers.py``: sessions, joins, receipts gathered by rank 0, the agreed stop step) and the local
launcher of W processes (``launcher.py``). Must not train, checkpoint or log decisions: the engine
asks, this part answers. Start with ``coordination.py``.
"""
