"""Framework integrations: thin adapters that put another library's training loop under a ``trainjob.Run``.

Each lives in a folder of its own (``hf/`` for transformers' ``Trainer``) and is the only place that
imports its framework; nothing in trainjob imports this part (tests/test_layers.py gives it the
highest rank), so ``import trainjob`` never loads a framework, and the engine never learns one's name.
"""
