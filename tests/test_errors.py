"""The error tree: every class has exactly one exit code, OS errors are translated in one place."""

from __future__ import annotations

import errno
import importlib
import pkgutil

import pytest

import trainjob
from trainjob import cli, exits
from trainjob.errors import (InputError, NoSpace, Refused, TrainJobError, TryAgainLater, UsageError,
                             os_errors)

EXIT_BASES = [base for base in exits.EXIT_FOR_ERROR if base is not TrainJobError]


def every_error_class() -> list[type[TrainJobError]]:
    for module in pkgutil.walk_packages(trainjob.__path__, "trainjob."):  # a subclass may live anywhere
        if module.name.endswith("__main__"):
            continue
        try:
            importlib.import_module(module.name)
        except ImportError:  # an optional extra (matplotlib, scikit-learn) that is not installed
            pass
    found, todo = [], [TrainJobError]
    while todo:
        for sub in todo.pop().__subclasses__():
            found.append(sub)
            todo.append(sub)
    return found


def test_every_error_class_has_exactly_one_exit_code_base():
    classes = every_error_class()
    assert len(classes) >= 10
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
