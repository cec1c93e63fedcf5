"""Framework integrations: thin adapters that put a framework's own training loop under a ``trainjob.Run``.

Each lives in a folder of its own and is the only place that imports its framework: ``hf/``
(transformers' ``Trainer``, docs/hf.md) and ``lightning/`` (a Lightning ``Callback``,
docs/lightning.md). They sit above everything else (the engine and the torch adapter): nothing in
trainjob imports them (tests/test_layers.py gives the part the highest rank), so ``import
trainjob`` never loads a framework, and the engine never learns one's name.
"""
