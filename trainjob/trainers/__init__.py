"""Trainers: the models the engine drives, behind one protocol, and the data sets they train on.

Owns the Trainer protocol and its checks (``protocol.py``), the built-in trainers (``linear``,
``digits``), the PyTorch adapter and the data sets ``trainjob gen`` writes. Imports only the
foundation (errors, records, tensors): a trainer knows nothing of the PVC, checkpoints, ranks or
the state machine. Start with ``protocol.py``.
"""
