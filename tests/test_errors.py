"""The error tree: every class has exactly one exit code, OS errors are translated in one place."""

from __future__ import annotations

import ast
import errno
import importlib
import os
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
            if name == "trainjob.engine.progress":
                raise OSError(errno.EMFILE, "Too many open files", "/x/trainjob/engine/progress.py")
            return None

    monkeypatch.delitem(sys.modules, "trainjob.engine.progress", raising=False)
    monkeypatch.setattr(sys, "meta_path", [Failing(), *sys.meta_path])
    assert cli.main(["run", "--pvc", str(tmp_path / "pvc")]) == 75
    assert capsys.readouterr().err == ("trainjob run: the command's modules: cannot load (/x/trainjob/engine/"
                                       "progress.py): Too many open files; a fault of this node, not of the job: "
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
