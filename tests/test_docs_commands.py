"""The documentation's commands run as written: every ``sh`` block of the pages a user follows
(the site's "Getting started" and "How-to" sections) is run by a test, line by line in one shell,
and each line must exit with the code the page gives it (a trailing comment ``# exit N``; 0 when
it says none).

How a block runs, so that it tests the page and not this machine:

- in a fresh directory holding a link to the clone's ``examples/`` and ``scripts/``, as a user runs
  the pages from the root of a clone;
- in a network namespace of its own with only loopback (``unshare -n``, where allowed): no command
  can reach the internet, and a server a page starts on its fixed port meets no other test's;
- ``pip`` installs nothing: a stand-in (tests/helpers/docs_env/pip) checks that each extra the page
  names exists and each other package is installed here, and records the extras; until a page has
  installed an extra, its packages are absent to Python (tests/helpers/docs_env/sitecustomize.py),
  so a page that forgets ``pip install -e '.[torch]'`` fails as it would in a fresh venv;
- the shell's process group must be empty when the block ends: a page stops what it starts.

One test per page: its blocks run in order in one shell, as a user follows the page in one
terminal. A block that cannot run here says why in an HTML comment just above it (``<!-- not run
by the docs test: needs a Kubernetes cluster -->``). A ``text`` block under ``<!-- output -->``
shows what the commands print: each of its lines must be a line of their output (``…`` stands for
anything). A page that launches several ranks or ``trainjob prove`` is whole launches (tens of
seconds to minutes each): it carries the ``acceptance`` marker too, so the test command runs it
in its acceptance step.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, kinds_started

RUN_SECTIONS = ("Getting started", "How-to")  # the nav sections whose shell blocks are run
SHELL = ("sh", "bash")
NOTE = re.compile(r"<!-- ((?:(?!-->).)+) -->\s*\Z", re.S)  # an HTML comment just above a block says what it is
SKIP = "not run by the docs test: "
OUTPUT = "output"  # a text block of lines the page's commands print ("…" stands for anything)
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.S | re.M)
EXIT = re.compile(r"\bexit (\d+)\b")
HEAVY = ("torchrun", "trainjob prove")  # whole launches: the acceptance step runs them
ENV = ROOT / "tests/helpers/docs_env"


class _NavLoader(yaml.SafeLoader):
    """mkdocs.yml as plain data: its ``!!python/name:`` and ``!relative`` tags read as None."""


_NavLoader.add_multi_constructor("", lambda loader, suffix, node: None)
_NavLoader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)


def run_pages() -> list[str]:
    """The pages of the sections a user follows step by step, in the nav's order."""
    nav = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=_NavLoader)["nav"]
    pages: list[str] = []

    def walk(entries: list, inside: bool) -> None:
        for entry in entries:
            for title, value in entry.items():
                if isinstance(value, list):
                    walk(value, inside or title in RUN_SECTIONS)
                elif inside:
                    pages.append(value)

    walk(nav, False)
    return pages


def fences(page: str) -> list[tuple[str, str, str]]:
    """Every fenced block of a page: its language, its body, and the HTML comment just above it ("" if none)."""
    text = (ROOT / "docs" / page).read_text()
    found = []
    for m in FENCE.finditer(text):
        note = NOTE.search(text[:m.start()])
        found.append((m["lang"], re.sub(rf"^{m['indent']}", "", m["body"], flags=re.M), note[1] if note else ""))
    return found


def printed(body: str) -> list[re.Pattern[str]]:
    """An output block's lines as patterns a line of the output must match ("…" matches anything)."""
    return [re.compile(".*".join(map(re.escape, line.strip().split("…")))) for line in body.splitlines() if line.strip()]


def split_comment(line: str) -> tuple[str, str]:
    """A shell line's command and its trailing comment (a ``#`` after a blank, outside quotes)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i].rstrip(), line[i + 1:].strip()
    return line.rstrip(), ""


def commands(body: str) -> list[tuple[str, int | None]]:
    """The commands' logical lines (backslash continuations joined), each with the exit code the page
    gives it; None for a line sent to the background (``&``), whose code the shell never sees."""
    lines = re.sub(r"\\\n", " ", body).splitlines()
    out = []
    for line in lines:
        command, comment = split_comment(line)
        if not command.strip():
            continue
        said = EXIT.search(comment)
        out.append((command, None if command.endswith("&") and not command.endswith("&&") else
                    int(said[1]) if said else 0))
    return out


def script(page: str, body: str) -> str:
    """The page's commands as one bash script that stops at the first whose exit code is not the page's."""
    out = []
    for n, (command, expected) in enumerate(commands(body), 1):
        out.append(command)
        if expected is not None:
            what = json.dumps(f"{page}: command {n} exited $rc where the page says {expected}: {command}")
            out.append(f'rc=$?; [ "$rc" = {expected} ] || {{ echo {what} >&2; exit 99; }}')
    return "\n".join(out) + "\n"


def pages() -> list:
    """One test per page: its shell blocks in order, in one shell, as a user follows the page in one
    terminal (an ``export`` or an install carries on to the next block), and its output blocks."""
    params = []
    for page in run_pages():
        blocks = fences(page)
        body = "".join(b for lang, b, note in blocks if lang in SHELL and not note.startswith(SKIP))
        if not body:
            continue
        shown = [pattern for lang, b, note in blocks if lang == "text" and note == OUTPUT for pattern in printed(b)]
        kinds = kinds_started(body.split())
        marks = [pytest.mark.docs, pytest.mark.process, *(getattr(pytest.mark, k) for k in sorted(kinds))]
        if any(word in body for word in HEAVY):
            marks.append(pytest.mark.acceptance)
        params.append(pytest.param(page, body, shown, marks=marks, id=page.removesuffix(".md")))
    return params


def extras_brought() -> dict[str, dict[str, list[str]]]:
    """What each extra of pyproject.toml brings (its direct requirements, as installed here): their
    distributions and top-level modules, the core dependencies' left out; the test extra is
    everything, so it is left out too."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def name(requirement: str) -> str:
        return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement)[0]).lower()

    by_dist: dict[str, set[str]] = {}
    for module, dists in importlib.metadata.packages_distributions().items():
        for dist in dists:
            by_dist.setdefault(name(dist), set()).add(module)
    core = {name(r) for r in project["dependencies"]}
    brought = {}
    for extra, requirements in project["optional-dependencies"].items():
        dists = sorted({name(r) for r in requirements} - core)
        if extra != "test":
            brought[extra] = {"dists": dists, "modules": sorted({m for d in dists for m in by_dist.get(d, ())})}
    return brought


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """``python``, ``python3``, ``trainjob`` and ``pip`` as the pages' commands find them on PATH:
    this environment's, with the clone and the import guard first on their PYTHONPATH (a page may
    set its own, ``PYTHONPATH=examples``: it is kept, after them); and this environment's bin
    directory, for the rest (torchrun, weed)."""
    bin_dir = tmp_path_factory.mktemp("docs-bin")
    venv_bin = Path(sys.executable).parent
    prefix = f"{ENV}:{ROOT}"
    for name, target in (("python", sys.executable), ("python3", sys.executable),
                         ("trainjob", f"{sys.executable} -m trainjob"), ("pip", f"{sys.executable} {ENV / 'pip'}")):
        (bin_dir / name).write_text(f'#!/bin/sh\nPYTHONPATH="{prefix}${{PYTHONPATH:+:$PYTHONPATH}}" exec {target} "$@"\n')
        (bin_dir / name).chmod(0o755)
    return bin_dir, venv_bin


@functools.cache
def own_network() -> list[str]:
    """The prefix that runs a command in a network namespace of its own, loopback up; [] where not allowed."""
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True) if shutil.which("unshare") else None
    return ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$0" "$@"'] if probe and probe.returncode == 0 \
        and shutil.which("ip") else []


@pytest.mark.parametrize(("page", "body", "shown"), pages())
def test_the_pages_commands_exit_as_the_page_says(page: str, body: str, shown: list[re.Pattern[str]], tmp_path: Path,
                                                  stand_ins) -> None:
    bin_dir, venv_bin = stand_ins
    isolate = own_network()
    if not isolate and "weed" in body and not os.environ.get("CI"):
        pytest.skip("starts a server on fixed ports: needs `unshare -n` (root or user namespaces) to keep it apart")
    work = tmp_path / "clone"
    work.mkdir()
    for linked in ("examples", "scripts"):
        (work / linked).symlink_to(ROOT / linked)
    (tmp_path / "block.sh").write_text(script(page, body))
    env = {**os.environ, "PATH": f"{bin_dir}:{venv_bin}:{os.environ['PATH']}", "TRAINJOB_DOCS_ROOT": str(ROOT),
           "TRAINJOB_DOCS_EXTRAS": json.dumps(extras_brought()),
           "TRAINJOB_DOCS_INSTALLED": str(tmp_path / "installed-extras")}
    for leaked in ("PYTHONPATH", "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "TRAINJOB_IDEMPOTENT"):
        env.pop(leaked, None)  # a user's shell has none of the test run's
    timeout = 900 if "torchrun" in body or "prove" in body else 180
    with open(tmp_path / "output", "wb") as output:
        shell = subprocess.Popen([*isolate, "bash", str(tmp_path / "block.sh")], cwd=work, env=env,
                                 stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = shell.wait(timeout)
        finally:
            left = _stop_group(shell.pid)
    output = (tmp_path / "output").read_text(errors="replace")
    assert code == 0, f"{page}: the block failed (exit {code}); its output ends:\n{output[-4000:]}"
    assert not left, f"{page}: the block left processes running (a page stops what it starts): {left}"
    lines = [line.strip() for line in output.splitlines()]
    missing = [p.pattern for p in shown if not any(p.fullmatch(line) for line in lines)]
    assert missing == [], f"{page} shows output its commands did not print; they printed:\n{output[-4000:]}"


def _stop_group(pgid: int) -> list[str]:
    """Kill what is left of the block's process group, and name it (its command lines)."""
    left = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and os.getpgid(int(proc.name)) == pgid:
                left.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip())
        except (ProcessLookupError, FileNotFoundError, PermissionError):
            continue
    if left:
        os.killpg(pgid, signal.SIGKILL)
    return left


def test_every_block_on_the_pages_a_user_follows_says_its_language():
    """An unlabelled block would be neither run nor known for what it is: label commands ``sh``,
    output ``text``, code ``python``."""
    unlabelled = [page for page in run_pages() for lang, _, _ in fences(page) if not lang]
    assert unlabelled == []


def test_a_line_the_page_gives_an_exit_code_is_checked_for_it():
    """The parsing the runner relies on: continuations joined, comments split outside quotes,
    ``# exit N`` read, background lines unchecked."""
    body = ("trainjob run --pvc out/p --die-at 4   # exit 75: killed\n"
            "trainjob status out/p/log.jsonl \\\n    --path\n"
            "echo '# exit 3 is text'\n"
            "weed mini -dir=out/s3 > out/s3.log 2>&1 &   # the server\n"
            "a && b\n")
    assert commands(body) == [("trainjob run --pvc out/p --die-at 4", 75),
                              ("trainjob status out/p/log.jsonl      --path", 0),
                              ("echo '# exit 3 is text'", 0),
                              ("weed mini -dir=out/s3 > out/s3.log 2>&1 &", None),
                              ("a && b", 0)]
