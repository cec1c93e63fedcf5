"""Framework integrations: thin adapters that put a framework's own training loop under ``trainjob.Run``.

Each lives in a folder of its own and imports its framework only there, so ``import trainjob``
never does. They sit above everything else (the engine and the torch adapter): nothing in
trainjob imports them. ``lightning``: a Lightning ``Callback`` (docs/lightning.md).
"""
