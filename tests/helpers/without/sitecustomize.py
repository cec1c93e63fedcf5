"""Put this directory first on PYTHONPATH, with TRAINJOB_TEST_WITHOUT=torch,obstore, and those
packages cannot be imported in the process (nor in the processes it starts with the same
environment), as if they were not installed: importing one, or a module inside it, raises
ModuleNotFoundError naming the package, as Python does for a package that is not there. What
tests/test_errors.py's missing-extra tests run under."""

import os
import sys

HIDDEN = frozenset(filter(None, os.environ.get("TRAINJOB_TEST_WITHOUT", "").split(",")))


class Hidden:
    """A meta path finder ahead of the real ones, refusing the hidden packages."""

    def find_spec(self, name, path=None, target=None):  # noqa: ANN001, ANN201 (importlib's protocol)
        top = name.partition(".")[0]
        if top in HIDDEN:
            raise ModuleNotFoundError(f"No module named {top!r}", name=top)
        return None


if HIDDEN:
    sys.meta_path.insert(0, Hidden())
