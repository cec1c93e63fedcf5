"""The error tree: every class has exactly one exit code, OS errors are translated in one place."""

from __future__ import annotations

import ast
import errno
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

import trainjob
from trainjob import cli, exits
from trainjob.errors import (InputError, NoSpace, Refused, TrainJobError, TryAgainLater, UsageError, importing,
                             os_errors)

EXIT_BASES = [base for base in exits.EXIT_FOR_ERROR if base is not TrainJobError]


def error_class_modules() -> dict[str, str]:
    """Every class in the package whose bases lead to ``TrainJobError``, by name, with its module:
    found in the source (a subclass may live anywhere), so the test imports only those modules,
    not all of them (importing torch, lightning and transformers cost it 6 s of CPU)."""
    package = Path(trainjob.__path__[0])
    classes = {}
    for path in package.rglob("*.py"):
        module = ".".join(path.relative_to(package.parent).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                classes[node.name] = (module, [ast.unparse(base).rsplit(".", 1)[-1] for base in node.bases])
    found = {"TrainJobError": "trainjob.errors"}
    grew = True
    while grew:
        grew = False
        for name, (module, bases) in classes.items():
            if name not in found and set(bases) & set(found):
                found[name], grew = module, True
    return found


def every_error_class() -> list[type[TrainJobError]]:
    for module in set(error_class_modules().values()):
        importlib.import_module(module)
    found, todo = [], [TrainJobError]
    while todo:
        for sub in todo.pop().__subclasses__():
            found.append(sub)
            todo.append(sub)
    return found


def test_every_error_class_has_exactly_one_exit_code_base():
    classes = every_error_class()
    assert len(classes) >= 10
    # What the source says and what Python built agree: no class was missed either way.
    assert {kind.__name__ for kind in classes} == set(error_class_modules()) - {"TrainJobError"}
    for kind in classes:
        bases = [base for base in EXIT_BASES if issubclass(kind, base)]
        assert len(bases) == 1, f"{kind.__name__} has exit-code bases {bases}"
        assert exits.exit_code_for(kind) == exits.EXIT_FOR_ERROR[bases[0]]


def test_the_exit_codes_of_the_bases():
    assert exits.exit_code_for(UsageError) == exits.exit_code_for(InputError) == exits.EXIT_USAGE == 2
    assert exits.exit_code_for(NoSpace) == exits.EXIT_RELAUNCH == 75
    assert exits.exit_code_for(TrainJobError) == exits.EXIT_INTERNAL == 70


def test_each_error_also_is_the_builtin_it_resembles():
    assert issubclass(Refused, ValueError) and issubclass(TryAgainLater, OSError)


def test_a_bare_trainjob_error_is_internal_exit_70_not_1(monkeypatch, capsys):
    def unclassified(_args):
        raise TrainJobError("nobody classified me")

    monkeypatch.setitem(cli.COMMANDS, "status", unclassified)
    assert cli.main(["status", "log.jsonl"]) == 70
    assert capsys.readouterr().err == "trainjob status: nobody classified me\n"


@pytest.mark.parametrize(("code", "otherwise", "becomes"), [
    (errno.ENOSPC, InputError, NoSpace),
    (errno.EDQUOT, InputError, NoSpace),
    (errno.EROFS, InputError, TryAgainLater),
    (errno.EIO, InputError, TryAgainLater),
    (errno.ENOENT, InputError, InputError),
    (errno.ENAMETOOLONG, InputError, InputError),
    (errno.EISDIR, InputError, InputError),
    (errno.EACCES, TryAgainLater, TryAgainLater),
    (errno.EPIPE, UsageError, UsageError),
])
def test_os_errors_translates_by_errno_and_keeps_the_cause(code, otherwise, becomes):
    cause = OSError(code, "reason")
    with pytest.raises(TrainJobError) as caught:
        with os_errors("some/file", "cannot do it", otherwise):
            raise cause
    assert type(caught.value) is becomes
    assert str(caught.value) == "some/file: cannot do it: reason"
    assert caught.value.__cause__ is cause


def test_os_errors_lets_its_own_tree_and_other_exceptions_through():
    busy = TryAgainLater("busy")  # an OSError too: must not be translated twice
    with pytest.raises(TryAgainLater) as caught, os_errors("x", "y", InputError):
        raise busy
    assert caught.value is busy
    with pytest.raises(KeyError), os_errors("x", "y", InputError):
        raise KeyError("not an OSError")


@pytest.mark.parametrize("fault, becomes", [(errno.EMFILE, TryAgainLater), (errno.ENOMEM, TryAgainLater),
                                            (errno.EIO, TryAgainLater), (errno.ENOSPC, NoSpace),
                                            (errno.ENOENT, TryAgainLater)])  # a file of trainjob's own gone
def test_a_lazy_import_failing_on_a_node_fault_is_retryable_however_it_is_wrapped(fault, becomes):
    """An OSError raised by the import itself, or the ImportError a package (numpy) raises over
    one, is the node's fault: exit 75, naming the file; never 70."""
    os_error = OSError(fault, os.strerror(fault), "/site-packages/numpy/core/_multiarray_umath.py")
    with pytest.raises(becomes) as plain, importing("the command's modules"):
        raise os_error
    assert str(plain.value) == (f"the command's modules: cannot load (/site-packages/numpy/core/_multiarray_umath.py): "
                                f"{os.strerror(fault)}; a fault of this node, not of the job: relaunch")
    assert plain.value.__cause__ is os_error and exits.exit_code_for(type(plain.value)) == 75

    def numpy_like():
        try:
            raise os_error
        except OSError as exc:
            raise ImportError("numpy failed to import, please read this", name="numpy.core") from exc
    with pytest.raises(becomes) as wrapped, importing("the command's modules"):
        numpy_like()
    assert "cannot load numpy.core (/site-packages/" in str(wrapped.value)
    with pytest.raises(TryAgainLater, match="out of memory"), importing("x"):
        raise MemoryError()


def test_a_module_that_is_not_there_stays_an_import_error_for_its_caller():
    missing = ModuleNotFoundError("No module named 'sklearn'", name="sklearn")
    with pytest.raises(ModuleNotFoundError) as caught, importing("scikit-learn"):
        raise missing
    assert caught.value is missing


def test_run_whose_modules_fail_to_load_on_emfile_exits_75_with_one_line(tmp_path, monkeypatch, capsys):
    """What libfiu showed (``scripts/campaign/faults.py``'s import faults): ``open`` failing with
    EMFILE while ``cmd_run`` loads the engine ended 70 with a traceback."""
    import sys

    class Failing:  # first on the import path: the module's source cannot be opened
        def find_spec(self, name, path=None, target=None):
            if name == "trainjob.engine.run":
                raise OSError(errno.EMFILE, "Too many open files", "/x/trainjob/engine/run.py")
            return None

    monkeypatch.delitem(sys.modules, "trainjob.engine.run", raising=False)  # cmd_run imports it itself
    monkeypatch.setattr(sys, "meta_path", [Failing(), *sys.meta_path])
    assert cli.main(["run", "--pvc", str(tmp_path / "pvc")]) == 75
    assert capsys.readouterr().err == ("trainjob run: the command's modules: cannot load (/x/trainjob/engine/"
                                       "run.py): Too many open files; a fault of this node, not of the job: "
                                       "relaunch\n")
    assert not (tmp_path / "pvc").exists()


@pytest.mark.parametrize("codes, job", [
    ([0, 0], 0), ([75, 75], 75), ([2, 2], 2), ([1, 1], 1),
    ([0, 75], 0), ([0, -15], 0), ([0, -9], 0),  # a rank stopped after the outcome was decided: it stands
    ([75, 2], 2), ([-15, 2], 2), ([75, 70], 70), ([1, 75], 1),  # the rank that met the cause says it
    ([2, 70, 1, 0, 75], 2), ([70, 1], 70), ([1, 0], 1),
    ([-15, -9], 75), ([143, 137], 75), ([130], 75),  # killed by a launcher or the kernel: relaunchable
    ([-11], 70), ([139, 75], 70), ([3], 70), ([], 75),  # a crash, never 1; no rank at all: relaunch
])
def test_a_launchs_code_is_the_most_telling_of_its_ranks_codes(codes, job):
    assert exits.job_exit(codes) == job
    assert exits.job_exit(reversed(codes)) == job  # whichever rank, whatever order


# --- a missing optional package ------------------------------------------------------------------

WITHOUT = Path(__file__).resolve().parent / "helpers/without"  # its sitecustomize hides packages
ROOT = WITHOUT.parent.parent.parent
OWN_LOOP_ON_A_BUCKET = """
import sys, numpy as np, trainjob
class Vector:
    def state_dict(self): return {"w": np.zeros(2)}
    def load_state_dict(self, arrays): pass
with trainjob.Run("s3://bucket/job", state=Vector(), steps=2, ckpt_every=1) as run:
    for step in run:
        run.report(0.5)
    run.gate(holdout=trainjob.Score(correct=1, total=1), baseline=trainjob.Score(correct=1, total=1), export={})
sys.exit(run.exit_code)
"""
# A --trainer module of the user's that needs an extra (trainjob's integration, or the package itself).
TRAINER_MODULE = "{imports}\n\ndef make(data, lr):\n    raise AssertionError('not reached')\n"


def without(packages: str, *argv: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``python ARGV`` with ``packages`` (comma-separated) not importable, as if not installed."""
    env = {**os.environ, "TRAINJOB_TEST_WITHOUT": packages,
           "PYTHONPATH": os.pathsep.join([str(WITHOUT), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([sys.executable, *map(str, argv)], capture_output=True, text=True, timeout=120,
                          cwd=cwd, env=env)


@pytest.mark.process
@pytest.mark.parametrize(("packages", "extra", "argv"), [
    ("obstore", "s3", ["-m", "trainjob", "run", "--pvc", "s3://bucket/job"]),
    ("obstore", "s3", ["-m", "trainjob", "status", "s3://bucket/job/log.jsonl"]),
    ("obstore", "s3", ["-c", OWN_LOOP_ON_A_BUCKET]),  # an own loop: trainjob.Run says it as the CLI does
    pytest.param("torch", "torch", ["-m", "trainjob", "torchrun", "--standalone", "--nproc-per-node", "1",
                                    "-m", "trainjob", "run", "--pvc", "{tmp}/pvc"], marks=pytest.mark.torchrun),
    ("torch", "torch", ["-m", "trainjob", "run", "--pvc", "{tmp}/pvc", "--trainer", "examples.torch_digits:make"]),
    ("torch", "torch", ["-m", "trainjob", "run", "--pvc", "{tmp}/pvc", "--trainer", "mine:make",
                        "from trainjob.torch import TrainingState"]),
    ("torchdata", "torch", ["-m", "trainjob", "run", "--pvc", "{tmp}/pvc", "--trainer", "mine:make",
                            "from torchdata.stateful_dataloader import StatefulDataLoader"]),
    ("transformers", "hf", ["-m", "trainjob", "run", "--pvc", "{tmp}/pvc", "--trainer", "mine:make",
                            "from trainjob.integrations import hf"]),
    ("lightning", "lightning", ["-m", "trainjob", "run", "--pvc", "{tmp}/pvc", "--trainer", "mine:make",
                                "from trainjob.integrations.lightning import TrainJob"]),
    ("matplotlib", "plot", ["-m", "trainjob", "plot", "{log}", "-o", "{tmp}/run.png"]),
    ("graphviz", "diagrams", ["-m", "trainjob", "diagram", "--format", "dot", "-o", "{tmp}/machine.dot"]),
    ("sklearn", "digits", ["-m", "trainjob", "gen", "--dataset", "digits", "{tmp}/data"]),
], ids=lambda value: value if isinstance(value, str) else None)
def test_a_missing_optional_package_is_exit_2_with_one_line_naming_its_extra(tmp_path, walkthrough_log, packages,
                                                                            extra, argv):
    """Every optional package trainjob (or what it runs) imports, hidden as if not installed: the
    command, or an own loop's Run, exits 2 with one line saying which `pip install` brings it,
    and writes nothing. On a bucket it was a traceback and 70."""
    if argv[-1].startswith(("from ", "import ")):  # the --trainer module that needs it, in the working directory
        (tmp_path / "mine.py").write_text(TRAINER_MODULE.format(imports=argv.pop()))
    argv = [a.format(tmp=tmp_path, log=walkthrough_log) if "{" in a and "\n" not in a else a for a in argv]
    before = sorted(p.name for p in tmp_path.iterdir())
    result = without(packages, *argv, cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    (line,) = result.stderr.splitlines()
    assert line.startswith("trainjob") and line.endswith((f"pip install 'trainjob[{extra}]'",
                                                          f"pip install 'trainjob[{extra}]' (exit 2)")), line
    assert sorted(p.name for p in tmp_path.iterdir()) == before and result.stdout == ""


@pytest.mark.process
def test_a_script_importing_an_integration_without_its_framework_is_told_which_extra():
    """Imported by a script's own first lines, before trainjob runs anything: uncaught, one line and
    exit 2 (it was Python's traceback and exit 1, the code of an honest failure); it stays an
    ImportError, so a script may try it and go without."""
    result = without("lightning", "-c", "import trainjob.integrations.lightning")
    assert result.returncode == 2 and result.stderr.splitlines() == [
        "trainjob: trainjob.integrations.lightning needs lightning, which is not installed: "
        "pip install 'trainjob[lightning]' (exit 2)"], result.stderr
    caught = without("torch", "-c", "try:\n    import trainjob.torch\nexcept ImportError as e:\n    print(e.name)")
    assert (caught.returncode, caught.stdout) == (0, "torch\n")
