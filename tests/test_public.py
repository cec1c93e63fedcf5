"""The public surface: ``trainjob.__all__`` is pinned, every name in it resolves, the version is
the package metadata's, and the examples and docs import only what is public."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import trainjob
from trainjob import errors
from trainjob.errors import TrainJobError

ROOT = Path(__file__).resolve().parent.parent
# Adding a name is a promise to keep it: add it here too. Removing one breaks users.
PUBLIC = [
    "__version__",
    "Run", "Stateful",
    "Factory", "Metric", "Score", "State", "Trainer",
    "AlreadyCompleted", "ArtifactUnverified", "InputError", "MissingExtra", "NoSpace", "NoVerifiedCheckpoint", "OutOfMemory",
    "PeerFailed", "PeerRefused", "PvcBusy", "RankTimeout",
    "Refused", "ReplicasDisagree", "StateMismatch", "Superseded", "TrainJobError", "TryAgainLater", "UsageError", "WorldSizeMismatch",
    "WriteTimeout",
]
# Public modules beside the package itself (optional extras, so not imported by `import trainjob`).
# ``trainjob.trainers.torch_state`` is the tensors-only helpers' deprecated path: it still works, and
# nothing shown to users imports it.
PUBLIC_MODULES = {"trainjob", "trainjob.torch", "trainjob.trainers.digits",
                  # the framework integrations (docs/hf.md, docs/lightning.md)
                  "trainjob.integrations", "trainjob.integrations.hf", "trainjob.integrations.lightning"}
TORCH_PUBLIC = ["FromRank0", "RankLocal", "Replicated", "TrainingState", "load_state_dict", "materialize_sgd",
                "state_dict"]


def test_all_is_pinned():
    assert sorted(trainjob.__all__) == sorted(PUBLIC)


def test_every_public_name_resolves():
    assert [name for name in trainjob.__all__ if not hasattr(trainjob, name)] == []


@pytest.mark.process
def test_import_trainjob_loads_no_engine_until_run_is_used():
    """``trainjob.Run`` is imported lazily: `trainjob k8s render` must start without numpy or
    transitions (tests/test_layers.py), and the package's __init__ is imported first."""
    code = ("import sys, trainjob; assert 'transitions' not in sys.modules, 'eager'; "
            "trainjob.Run; assert 'transitions' in sys.modules; print(trainjob.Run.__module__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "trainjob.engine.run", done.stderr


def test_every_error_trainjob_raises_is_public():
    tree = {name for name, obj in vars(errors).items() if isinstance(obj, type) and issubclass(obj, TrainJobError)}
    assert tree - set(trainjob.__all__) == set()


def test_the_version_is_written_once_in_the_package_metadata():
    assert trainjob.__version__ == importlib.metadata.version("trainjob")
    assert not re.search(r"^__version__\s*=", (ROOT / "trainjob/__init__.py").read_text(), re.M)


def test_examples_readme_and_docs_import_only_the_public_surface():
    texts = [*ROOT.glob("examples/*.py"), ROOT / "README.md", *ROOT.glob("docs/**/*.md")]
    assert ROOT / "docs/howto/own-loop.md" in texts
    imported = {(p.name, m) for p in texts
                for m in re.findall(r"^\s*(?:from|import)\s+(trainjob[\w.]*)", p.read_text(), re.M)}
    assert {(name, m) for name, m in imported if m not in PUBLIC_MODULES} == set()


USER_SCRIPT = """
import sys
import numpy as np
import trainjob
from trainjob import Run, Score, Stateful


class Vector:
    def __init__(self) -> None:
        self.w = np.zeros(3)

    def state_dict(self) -> dict[str, np.ndarray]:
        return {"w": self.w}

    def load_state_dict(self, arrays: trainjob.State) -> None:
        self.w[...] = arrays["w"]


state: Stateful = Vector()
with Run("pvc", state=state, steps=STEPS, ckpt_every=1) as run:
    for step in run:
        run.report(float(step))
    run.gate(holdout=Score(correct=1, total=1), baseline=Score(correct=1, total=1), export=state.state_dict())
code: int = run.exit_code
sys.exit(code)
"""


@pytest.mark.process
def test_the_public_api_type_checks_as_a_users_script_under_mypy_strict(tmp_path):
    pytest.importorskip("mypy")

    def mypy(steps: str) -> subprocess.CompletedProcess:
        script = tmp_path / "own_loop.py"
        script.write_text(USER_SCRIPT.replace("STEPS", steps))
        return subprocess.run([sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent",
                               "--cache-dir", str(tmp_path / "cache"), str(script)],
                              env={**os.environ, "MYPYPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)

    good = mypy("3")
    assert good.returncode == 0, good.stdout
    bad = mypy('"3"')  # the checker must see trainjob's hints, not Any
    assert bad.returncode == 1 and 'Argument "steps" to "Run" has incompatible type "str"' in bad.stdout


@pytest.mark.process
def test_the_torch_adapter_has_one_public_path_and_the_old_one_warns_and_re_exports_it():
    """``trainjob.torch`` lists the adapter's names; ``trainjob.trainers.torch_state``, the tensors-only
    helpers' path before it, still hands out the same functions, with a DeprecationWarning naming the
    new one. In a fresh interpreter: the warning comes at the first import, and torch costs 2 s to import."""
    pytest.importorskip("torch")
    code = ("import json, warnings, trainjob.torch as new\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            "    import trainjob.trainers.torch_state as old\n"
            "print(json.dumps({'all': new.__all__, 'missing': [n for n in new.__all__ if not hasattr(new, n)],\n"
            "    'same': [getattr(old, n) is getattr(new, n) for n in old.__all__], 'old': old.__all__,\n"
            "    'warned': [str(w.message) for w in caught if w.category is DeprecationWarning]}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    assert sorted(seen["all"]) == sorted(TORCH_PUBLIC) and seen["missing"] == []
    assert sorted(seen["old"]) == ["load_state_dict", "materialize_sgd", "state_dict"] and all(seen["same"])
    assert len(seen["warned"]) == 1 and "from trainjob.torch" in seen["warned"][0]
