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
from pathlib import Path

import pytest

from conftest import ROOT, built_once
from trainjob.cli import build_parser

IN_CI = bool(os.environ.get("CI"))  # CI installs the test extra: there a missing mkdocs fails, never skips
# The files the pages include (pymdownx.snippets), each with the page that shows it.
INCLUDED = [("howto/own-loop", "examples/own_loop.py"), ("howto/typical-script", "examples/finetune.py"),
            ("howto/fsdp", "examples/fsdp.py"), ("trainers", "examples/minimal_trainer.py"),
            ("howto/vision", "examples/vision.py"), ("tutorial/walkthrough", "scripts/demo.sh"),
            ("howto/load-model", "examples/load_model.py"),
            # the Quickstart shows the two as one diff (scripts/mkdocs_hooks.py makes it from the files)
            ("quickstart", "examples/quickstart_before.py"), ("quickstart", "examples/quickstart_after.py")]


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


@pytest.fixture(scope="session")
def built_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`mkdocs build --strict` of this clone, once per pytest run: the site in ``site/``, the build's
    exit code and stderr beside it (a failed build is the strict-build test's to report)."""
    if importlib.util.find_spec("mkdocs") is None and not IN_CI:
        pytest.skip("mkdocs is not installed: pip install -e '.[docs]' (the test extra has it)")

    def build(directory: Path) -> None:
        built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                                str(directory / "site")], cwd=ROOT, capture_output=True, text=True, timeout=300,
                               env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
        (directory / "stderr").write_text(built.stderr)
        (directory / "returncode").write_text(str(built.returncode))

    return built_once(tmp_path_factory, "docs-site", build)


@pytest.mark.process
def test_the_site_builds_strict_with_the_api_every_subcommand_and_the_examples_as_they_are(built_site):
    """`mkdocs build --strict`: a broken link or anchor, a page left out of the nav, a missing snippet
    file or an API object mkdocstrings cannot find fails the build. Offline: the theme fetches no fonts."""
    stderr = (built_site / "stderr").read_text()
    assert (built_site / "returncode").read_text() == "0", stderr[-3000:]
    assert not re.search(r"^WARNING", stderr, re.M), stderr[-3000:]
    site = built_site / "site"

    api = (site / "reference/api/index.html").read_text()
    for entry in ("trainjob.Run", "trainjob.Run.gate", "trainjob.Run.report", "trainjob.State", "trainjob.torch.TrainingState",
                  "trainjob.integrations.hf.run", "trainjob.integrations.hf.metric", "trainjob.integrations.lightning.TrainJob",
                  "trainjob.engine.job.StopFlag", "trainjob.errors.TrainJobError", "trainjob.errors.TryAgainLater",
                  "trainjob.errors.Refused", "trainjob.errors.ReplicasDisagree"):
        assert f'id="{entry}"' in api, entry
    run_signature = text_of(re.search(r'id="trainjob.Run".*?<div class="doc-signature.*?</div>', api, re.S)[0])
    assert "async_checkpoint" in run_signature and max(map(len, run_signature.splitlines())) <= 100, \
        "Run's signature is one long line: the docs extra's Black wraps it (mkdocstrings' line_length)"

    cli = (site / "reference/cli/index.html").read_text()
    cli_text = text_of(cli)
    assert "``" not in cli_text  # an empty default shown as two backquotes (--s3-secret's, once)
    assert re.search(r"--seed SEED\s*0\s*seeds the instants", cli_text)  # prove's default 0, once shown blank
    for name, parser in leaves(build_parser()).items():
        anchor = name.replace(" ", "-")
        assert f'id="{anchor}"' in cli, f"{name} has no section in the CLI reference"
        section = cli_text[cli_text.index(f"{name}¶"):]
        for action in parser._actions:
            for flag in [] if isinstance(action, argparse._HelpAction) else action.option_strings:
                assert flag in section[:section.find("¶", len(name) + 1)], f"{name} {flag}"

    for page, example in INCLUDED:
        shown = text_of((site / page / "index.html").read_text())
        lines = [line.strip() for line in (ROOT / example).read_text().splitlines() if line.strip()]
        assert [line for line in lines if line not in shown] == [], f"{page} does not show {example} as it is"
    assert (site / "diagrams/walkthrough.html").read_bytes() == (ROOT / "diagrams/walkthrough.html").read_bytes()
    assert "fonts.googleapis.com" not in (site / "index.html").read_text()


# --- the built site in a real browser, from disk, with the network off ------------------------------

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
HAVE_BROWSER = CHROMIUM.exists() and CHROMEDRIVER.exists() and importlib.util.find_spec("selenium") is not None
needs_browser = pytest.mark.skipif(not (HAVE_BROWSER or IN_CI),
                                   reason="needs Debian's chromium and chromium-driver, and selenium (the test extra)")
# Every picture in the content column, as drawn: an inline <svg>'s size and state names, an <img>'s
# shown and natural widths, whether it links to its own file; and what is left of a mermaid block.
DRAWN = """const shown = (e) => e.getBoundingClientRect();
return {
  svgs: [...document.querySelectorAll("article figure.diagram svg")].map((svg) => ({
    width: shown(svg).width, box: shown(svg.parentElement).width,
    states: [...svg.querySelectorAll("g.node title")].map((t) => t.textContent),
    label: Math.max(...[...svg.querySelectorAll("g.node text")].map((t) => shown(t).height)),
  })),
  images: [...document.querySelectorAll("article img")].map((img) => ({
    src: img.src, loaded: img.complete && img.naturalWidth > 0, width: shown(img).width,
    natural: img.naturalWidth, linked: img.closest("a") !== null && img.closest("a").href === img.src,
  })),
  mermaid: document.querySelectorAll(".mermaid").length,
  text: document.querySelector("article").innerText,
};"""


@pytest.fixture(scope="module")
def offline_browser(tmp_path_factory: pytest.TempPathFactory):
    """Headless Chromium with the network off (DevTools' offline emulation, and no host name
    resolves), recording every request a page makes (its performance log)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1280,1000",
                 "--host-resolver-rules=MAP * ~NOTFOUND", f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SE_OFFLINE", "true")  # the system browser and driver: Selenium Manager downloads nothing
        driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
    driver.execute_cdp_cmd("Network.enable", {})
    driver.execute_cdp_cmd("Network.emulateNetworkConditions",
                           {"offline": True, "latency": 0, "downloadThroughput": -1, "uploadThroughput": -1})
    yield driver
    driver.quit()


def requested(browser) -> list[str]:
    """The URL of every request the page made since the last call."""
    import json

    messages = [json.loads(entry["message"])["message"] for entry in browser.get_log("performance")]
    return [m["params"]["request"]["url"] for m in messages if m["method"] == "Network.requestWillBeSent"]


@needs_browser
@pytest.mark.process
@pytest.mark.browser
def test_the_built_site_draws_the_machine_and_its_pictures_from_disk_with_the_network_off(built_site, offline_browser):
    """The machine is drawn on the page (an inline <svg> with every state, not mermaid's source
    waiting for a script from a CDN), it fits the column and a click shows it with labels of a
    readable size, every other picture loads and reads (shown at half its size or more, or linked
    to its own file), and no page asks the network for anything."""
    from selenium.webdriver.support.ui import WebDriverWait

    from trainjob.states import State

    browser = offline_browser
    states = {state.value for state in State}
    # page -> the machines drawn on it (diagrams.md also shows the mermaid source, as text to copy)
    for page, machines in (("tutorial/machine", 2), ("diagrams", 2), ("benchmarks", 0)):
        requested(browser)
        browser.get((built_site / "site" / page / "index.html").as_uri())
        WebDriverWait(browser, 30).until(lambda b: b.execute_script("return document.readyState") == "complete")
        drawn = browser.execute_script(DRAWN)
        assert len(drawn["svgs"]) == machines, f"{page}: {len(drawn['svgs'])} machines drawn, expected {machines}"
        assert drawn["mermaid"] == 0, f"{page} holds a mermaid block, drawn only by a script from a CDN"
        for svg in drawn["svgs"]:
            assert set(svg["states"]) == states and 0 < svg["width"] <= svg["box"], (page, svg)
        for image in drawn["images"]:
            assert image["loaded"], (page, image["src"])
            assert image["width"] >= image["natural"] / 2 or image["linked"], (page, image)
        left = [url for url in requested(browser) if url.startswith(("http:", "https:", "ws:", "wss:", "ftp:"))]
        assert left == [], f"{page} asked the network for {left}"

    browser.get((built_site / "site" / "tutorial/machine" / "index.html").as_uri())
    assert "stateDiagram" not in browser.execute_script(DRAWN)["text"]  # no machine left as its source
    assert browser.execute_script(DRAWN)["svgs"][0]["label"] < 10  # the whole machine in the column: too small
    browser.find_element("css selector", "article figure.diagram svg").click()
    assert browser.execute_script(DRAWN)["svgs"][0]["label"] >= 12  # its own size: Graphviz's 14 pt as 14 px


def test_every_file_the_docs_name_exists_and_both_pages_name_the_exit_code_tables_home():
    """A page that names a module, a test or a script names one that is there; the exit code → Job
    action table is named where it is defined, by both pages that describe it (exit-codes.md and
    kubernetes.md once named different modules for it)."""
    texts = [*ROOT.glob("docs/**/*.md"), ROOT / "README.md", ROOT / "CONTRIBUTING.md"]
    named = {(str(f.relative_to(ROOT)), m[1]) for f in texts
             for m in re.finditer(r"`((?:trainjob|tests|scripts|examples)/[\w/.-]+\.\w+)`", f.read_text())}
    assert len(named) > 30 and sorted(n for n in named if not (ROOT / n[1]).exists()) == []
    home = [str(p.relative_to(ROOT)) for p in ROOT.glob("trainjob/**/*.py")
            if re.search(r"^JOB_ACTION_FOR_EXIT\b", p.read_text(), re.M)]
    assert len(home) == 1
    for page in ("docs/kubernetes.md", "docs/reference/exit-codes.md"):
        assert re.search(rf"`JOB_ACTION_FOR_EXIT`, `{re.escape(home[0])}`", (ROOT / page).read_text()), page


def test_the_walkthrough_names_every_step_of_the_test_command():
    """The tutorial says what `bash scripts/test.sh` runs: each of its named steps, in order (it once
    left out the fourth, the acceptance runs)."""
    steps = re.findall(r'^step "([^"]+)"', (ROOT / "scripts/test.sh").read_text(), re.M)
    said = " ".join((ROOT / "docs/tutorial/walkthrough.md").read_text().split())
    intro = re.search(r"Set up and run the whole test suite in (\w+) steps: (.*?):", said)
    assert intro and intro[1] == {3: "three", 4: "four", 5: "five"}.get(len(steps)), (steps, intro and intro[0])
    words = {"pytest": "pytest", "lab checks": "the lab's nine checks", "chaos campaign": "the chaos campaign",
             "acceptance": "the examples the issues were accepted on"}
    positions = [intro[2].find(words.get(step, step)) for step in steps]
    assert -1 not in positions and positions == sorted(positions), (steps, intro[2])
