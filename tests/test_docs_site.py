"""The documentation site (mkdocs.yml, docs/) builds in strict mode and holds what it promises: the
Python API entries, every subcommand and flag of the parser, the examples as their files are; and
the README stays a front page with the two commands first."""

from __future__ import annotations

import argparse
import html
import importlib.util
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT
from trainjob.cli import build_parser

IN_CI = bool(os.environ.get("CI"))  # CI installs the test extra: there a missing mkdocs fails, never skips
# The files the pages include (pymdownx.snippets), each with the page that shows it.
INCLUDED = {"howto/own-loop": "examples/own_loop.py", "howto/typical-script": "examples/finetune.py",
            "howto/fsdp": "examples/fsdp.py", "howto/trainer": "examples/minimal_trainer.py",
            "tutorial/walkthrough": "scripts/demo.sh"}


def leaves(parser: argparse.ArgumentParser, prefix: str = "trainjob") -> dict[str, argparse.ArgumentParser]:
    """Every subcommand the parser accepts, nested ones by their full name (``trainjob k8s render``)."""
    found: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.update(leaves(sub, f"{prefix} {name}") or {f"{prefix} {name}": sub})
    return found


def text_of(page: str) -> str:
    """A built page's text, tags dropped (highlighted code is split into spans), entities decoded."""
    return html.unescape(re.sub(r"<[^>]+>", "", page))


def test_every_argument_of_every_subcommand_says_what_it_does():
    commands = leaves(build_parser())
    assert {"trainjob run", "trainjob k8s render", "trainjob prove"} <= set(commands)
    silent = [f"{name} {a.option_strings or a.dest}" for name, sub in commands.items() for a in sub._actions
              if not a.help and not isinstance(a, argparse._HelpAction)]
    assert silent == [], "the CLI reference shows each argument's help: give these one"


def test_the_readme_is_a_front_page_with_the_two_commands_first():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    blocks = re.findall(r"```(\w*)\n(.*?)```", readme, re.S)
    assert blocks[:2] == [("sh", "bash scripts/demo.sh\n"), ("sh", "bash scripts/test.sh\n")]
    # The README is not built by MkDocs: its links into the repository are checked here.
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)]+)\)", readme) if not t.startswith(("http", "#"))]
    assert len(targets) > 20 and [t for t in targets if not (ROOT / t).exists()] == []


@pytest.mark.process
def test_the_site_builds_strict_with_the_api_every_subcommand_and_the_examples_as_they_are(tmp_path):
    """`mkdocs build --strict`: a broken link or anchor, a page left out of the nav, a missing snippet
    file or an API object mkdocstrings cannot find fails the build. Offline: the theme fetches no fonts."""
    if importlib.util.find_spec("mkdocs") is None and not IN_CI:
        pytest.skip("mkdocs is not installed: pip install -e '.[docs]' (the test extra has it)")
    site = tmp_path / "site"
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                           cwd=ROOT, capture_output=True, text=True, timeout=300,
                           env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert built.returncode == 0, built.stderr[-3000:]
    assert not re.search(r"^WARNING", built.stderr, re.M), built.stderr[-3000:]

    api = (site / "reference/api/index.html").read_text()
    for entry in ("trainjob.Run", "trainjob.Run.gate", "trainjob.Run.report", "trainjob.torch.TrainingState",
                  "trainjob.errors.TrainJobError", "trainjob.errors.TryAgainLater", "trainjob.errors.Refused"):
        assert f'id="{entry}"' in api, entry

    cli = (site / "reference/cli/index.html").read_text()
    cli_text = text_of(cli)
    for name, parser in leaves(build_parser()).items():
        anchor = name.replace(" ", "-")
        assert f'id="{anchor}"' in cli, f"{name} has no section in the CLI reference"
        section = cli_text[cli_text.index(f"{name}¶"):]
        for action in parser._actions:
            for flag in [] if isinstance(action, argparse._HelpAction) else action.option_strings:
                assert flag in section[:section.find("¶", len(name) + 1)], f"{name} {flag}"

    for page, example in INCLUDED.items():
        shown = text_of((site / page / "index.html").read_text())
        lines = [line.strip() for line in (ROOT / example).read_text().splitlines() if line.strip()]
        assert [line for line in lines if line not in shown] == [], f"{page} does not show {example} as it is"
    assert (site / "diagrams/walkthrough.html").read_bytes() == (ROOT / "diagrams/walkthrough.html").read_bytes()
    assert "fonts.googleapis.com" not in (site / "index.html").read_text()
