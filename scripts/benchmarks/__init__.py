"""scripts/bench.py's sections, one module each (the script's docstring lists them), and what
they share (``common.py``). Not part of the trainjob package: run them through scripts/bench.py."""
