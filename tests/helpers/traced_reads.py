"""Run a script (``traced_reads.py OUT_DIR SCRIPT ARGS...``) counting the bytes this process reads
from each checkpoint shard file, at the one place every shard read goes through
(``checkpoint.shards._File``: front to back and by offset); written to ``OUT_DIR/rank-R.json``
when the script ends, however it ends. A test of how much of a checkpoint each rank reads."""

import json
import os
import runpy
import sys
from pathlib import Path

from trainjob.checkpoint import shards

out, script, *args = sys.argv[1:]
read: dict[str, int] = {}
for method in ("readinto", "read_at"):
    real = getattr(shards._File, method)

    def counted(self, view, *at, real=real):
        n = real(self, view, *at)
        read[self.name] = read.get(self.name, 0) + n
        return n
    setattr(shards._File, method, counted)

sys.argv = [script, *args]
try:
    runpy.run_path(script, run_name="__main__")
finally:
    Path(out, f"rank-{os.environ.get('RANK', '0')}.json").write_text(json.dumps(read))
