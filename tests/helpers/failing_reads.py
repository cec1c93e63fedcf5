"""Run a script (``failing_reads.py RANK ERRNO SCRIPT ARGS...``) in which, in the process of rank
RANK only, every read of a checkpoint shard fails with ERRNO (a name: EIO, ETIMEDOUT), at the one
place every shard read goes through (``checkpoint.shards._File``: front to back and by offset), as
a failing disk or an NFS server gone quiet fails one node's reads. A test of what a read error in
one rank's share of a resume ends in."""

import errno
import os
import runpy
import sys

from trainjob.checkpoint import shards

rank, code, script, *args = sys.argv[1:]
if os.environ.get("RANK", "0") == rank:
    number = getattr(errno, code)

    def fail(self, view, *at):
        raise OSError(number, os.strerror(number))
    shards._File.readinto = shards._File.read_at = fail  # type: ignore[method-assign]

sys.argv = [script, *args]
runpy.run_path(script, run_name="__main__")
