"""Loaded by every Python a docs page's commands start (tests/test_docs_commands.py puts this folder
first on PYTHONPATH): the modules of trainjob's extras that the page has not installed yet cannot be
imported, as in a fresh environment where only the page's own `pip install` lines ran.

The finder that reads site-packages (``PathFinder``) answers "not found" for them, so an import
raises ``ModuleNotFoundError`` and ``importlib.util.find_spec`` returns None, as when the package is
absent. The extras' modules come from the test (``TRAINJOB_DOCS_EXTRAS``, JSON: extra -> modules);
the extras installed so far are the lines of the file ``TRAINJOB_DOCS_INSTALLED``, which the `pip`
stand-in appends to.
"""

import importlib.machinery
import json
import os


def _blocked() -> frozenset[str]:
    modules = json.loads(os.environ.get("TRAINJOB_DOCS_EXTRAS", "{}"))
    try:
        with open(os.environ["TRAINJOB_DOCS_INSTALLED"]) as f:
            installed = set(f.read().split())
    except (KeyError, FileNotFoundError):
        installed = set()
    allowed = {m for extra in installed for m in modules.get(extra, [])}
    return frozenset(m for extra, names in modules.items() if extra not in installed for m in names) - allowed


_BLOCKED = _blocked()
_find_spec = importlib.machinery.PathFinder.find_spec.__func__  # type: ignore[attr-defined]


def _find_spec_unless_blocked(cls, name, path=None, target=None):  # noqa: ANN001, ANN202 (PathFinder's signature)
    if path is None and name.partition(".")[0] in _BLOCKED:
        return None
    return _find_spec(cls, name, path, target)


if _BLOCKED:
    importlib.machinery.PathFinder.find_spec = classmethod(_find_spec_unless_blocked)  # type: ignore[method-assign]
