"""Loaded by every Python a docs page's commands start (tests/test_docs_commands.py puts this folder
first on PYTHONPATH): the packages of trainjob's extras that the page has not installed yet are
absent, as in a fresh environment where only the page's own `pip install` lines ran.

The finder that reads site-packages (``PathFinder``) answers "not found" for their modules and
lists none of their distributions, so an import raises ``ModuleNotFoundError``,
``importlib.util.find_spec`` returns None and ``importlib.metadata`` finds no such package, as
when it is not installed (libraries that probe for an optional package ask either). What each
extra brings comes from the test (``TRAINJOB_DOCS_EXTRAS``, JSON: extra -> {"modules": [...],
"dists": [...]}); the extras installed so far are the lines of the file
``TRAINJOB_DOCS_INSTALLED``, which the `pip` stand-in appends to.
"""

import importlib.machinery
import json
import os
import re


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _blocked() -> tuple[frozenset[str], frozenset[str]]:
    extras = json.loads(os.environ.get("TRAINJOB_DOCS_EXTRAS", "{}"))
    try:
        with open(os.environ["TRAINJOB_DOCS_INSTALLED"]) as f:
            installed = set(f.read().split())
    except (KeyError, FileNotFoundError):
        installed = set()

    def union(key: str, chosen: bool) -> set[str]:
        return {_norm(n) if key == "dists" else n for extra, brings in extras.items()
                if (extra in installed) == chosen for n in brings[key]}

    return (frozenset(union("modules", False) - union("modules", True)),
            frozenset(union("dists", False) - union("dists", True)))


_MODULES, _DISTS = _blocked()
_PathFinder = importlib.machinery.PathFinder
_find_spec = _PathFinder.find_spec.__func__  # type: ignore[attr-defined]
_find_distributions = _PathFinder.find_distributions  # a staticmethod: the plain function


def _find_spec_unless_blocked(cls, name, path=None, target=None):  # noqa: ANN001, ANN202 (PathFinder's signature)
    if path is None and name in _MODULES:
        return None
    return _find_spec(cls, name, path, target)


def _find_distributions_unblocked(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 (PathFinder's signature)
    return (d for d in _find_distributions(*args, **kwargs) if _norm(d.metadata["Name"] or "") not in _DISTS)


if _MODULES or _DISTS:
    _PathFinder.find_spec = classmethod(_find_spec_unless_blocked)  # type: ignore[method-assign]
    _PathFinder.find_distributions = staticmethod(_find_distributions_unblocked)  # type: ignore[method-assign]
