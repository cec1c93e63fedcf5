"""The lab's starter build: trainjob with its three decisions replaced by the seed's stubs.

Each stub fails in the dangerous direction (never resume, never reject, never give up), and a
clean run still looks perfect. ``TRAINJOB="python scripts/starter.py" bash scripts/check.sh``
shows that the lab checks catch all three.
"""

from trainjob import cli
from trainjob.engine import decisions

decisions.should_resume = lambda *_args: False
decisions.drift_passes = lambda *_args: True
decisions.within_backoff = lambda *_args: True

cli.entry()
