"""Run the trainjob CLI, recording every fsync, rename and replace it makes, in order.

    python tests/fstrace.py OUT run --pvc P ...      writes OUT-rank<R>.json (R from --rank or $RANK, else 0)

Also a torchrun script: each worker writes its own file, a list of ``[call, on]`` pairs, ``on``
relative to the PVC with every run of digits written N (steps, attempts, ranks, pids), so a
trace reads like docs/checkpoints.md's table of durability points. In process, ``record`` is
the same tracer (tests/checkpoint/test_durability_points.py).
"""

import json
import os
import re
import sys
from collections.abc import Callable


def record(pvc: str, seen: list[tuple[str, str]], patch: Callable[[str, object], None]) -> None:
    """Wrap os.fsync, os.rename and os.replace with ``patch(name, wrapper)`` so that each call
    appends ``(call, on)`` to ``seen`` before it runs."""
    real = {name: getattr(os, name) for name in ("fsync", "rename", "replace")}

    def where(path) -> str:
        return re.sub(r"\d+", "N", os.path.relpath(os.fspath(path), pvc))

    def fsync(fd: int) -> None:
        seen.append(("fsync", where(os.readlink(f"/proc/self/fd/{fd}"))))
        real["fsync"](fd)

    def renamer(name: str):
        def rename(src, dst, **kwargs):
            seen.append(("rename", f"{where(src)} -> {where(dst)}"))
            real[name](src, dst, **kwargs)
        return rename

    patch("fsync", fsync)
    patch("rename", renamer("rename"))
    patch("replace", renamer("replace"))


if __name__ == "__main__":
    from trainjob import cli

    out, argv = sys.argv[1], sys.argv[2:]
    seen: list[tuple[str, str]] = []
    record(argv[argv.index("--pvc") + 1], seen, lambda name, f: setattr(os, name, f))
    code = cli.main(argv)
    rank = argv[argv.index("--rank") + 1] if "--rank" in argv else os.environ.get("RANK", "0")
    with open(f"{out}-rank{rank}.json", "w") as f:
        json.dump(seen, f)
    sys.exit(code)
