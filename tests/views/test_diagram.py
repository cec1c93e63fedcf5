"""`trainjob diagram`: the machine drawn from the table, a run's path on it, and the committed pictures."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, trainjob
from trainjob.views import diagram
from trainjob.views import history
from trainjob.engine.machine import FINAL, STATES, TRANSITIONS

IN_CI = bool(os.environ.get("CI"))  # CI installs everything: there a missing tool fails, never skips
HAVE_GRAPHVIZ = importlib.util.find_spec("graphviz") is not None
HAVE_DOT = shutil.which("dot") is not None
needs_graphviz = pytest.mark.skipif(not (HAVE_GRAPHVIZ or IN_CI), reason="graphviz Python package not installed")
needs_dot = pytest.mark.skipif(not (HAVE_GRAPHVIZ and HAVE_DOT or IN_CI), reason="Graphviz's dot not installed")

DOT_EDGE = re.compile(r'\t(\w+) -> (\w+) \[(.*)\]')
DOT_NODE = re.compile(r'\t(\w+) \[label="\w+\\l"(.*)\]')
MERMAID_EDGE = re.compile(r"  (\w+) --> (\w+): (.*)")
# The walkthrough (kill at 4, resume, complete): every edge it took, and how often.
WALKTHROUGH_TAKEN = {
    ("pending", "started"): 1, ("started", "checkpointed"): 1, ("checkpointed", "checkpointed"): 3,
    ("checkpointed", "killed"): 1, ("pending", "resumed"): 1, ("resumed", "checkpointed"): 1,
    ("checkpointed", "completed"): 1,
}


def table_edges() -> set[tuple[str, str]]:
    return {(source, row["dest"]) for row in TRANSITIONS
            for source in ([row["source"]] if isinstance(row["source"], str) else row["source"])}


def dot_edges(dot: str) -> dict[tuple[str, str], str]:
    return {(m[1], m[2]): m[3] for m in map(DOT_EDGE.fullmatch, dot.splitlines()) if m}


def dot_nodes(dot: str) -> dict[str, str]:
    return {m[1]: m[2] for m in map(DOT_NODE.fullmatch, dot.splitlines()) if m}


def python_without(module: str, *args: str) -> subprocess.CompletedProcess:
    """The CLI in a Python where ``module`` cannot be imported."""
    code = f"import sys; sys.modules[{module!r}] = None; from trainjob.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60)


# --- the machine ----------------------------------------------------------------------------------

@pytest.mark.process
def test_mermaid_draws_every_table_edge_with_trigger_and_guard():
    result = trainjob("diagram")
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    labels = {(m[1], m[2]): m[3] for m in map(MERMAID_EDGE.fullmatch, lines) if m}
    assert set(labels) == table_edges()
    assert labels["checkpointed", "checkpointed"] == ("checkpoint [step % ckpt_every == 0, last step or SIGTERM "
                                                      "& synchronous]")
    # --async-checkpoint: where the loop and the writer part, and where they meet
    assert labels["checkpointed", "snapshotted"] == ("checkpoint [step % ckpt_every == 0, last step or SIGTERM "
                                                     "& --async-checkpoint]")
    assert labels["snapshotted", "checkpointed"] == "land [writer committed, durable]"
    assert labels["pending", "started"] == "start [attempts <= backoff_limit & no attempt in flight]"
    assert labels["checkpointed", "drift_failed"] == "gate [correct*100 < bcorrect*(100-max_drop)]"
    assert labels["started", "killed"] == "kill"
    assert "  direction TB" in lines and "  [*] --> pending" in lines
    assert {line.split()[0] for line in lines if line.endswith("--> [*]")} == set(FINAL)


@pytest.mark.process
def test_dot_draws_terminal_states_double_top_to_bottom_in_run_order():
    result = trainjob("diagram", "--format", "dot")
    assert result.returncode == 0, result.stderr
    nodes = dot_nodes(result.stdout)
    assert list(nodes) == STATES
    assert {name for name, attrs in nodes.items() if "peripheries=2" in attrs} == set(FINAL)
    assert "rankdir=TB" in result.stdout
    edges = dot_edges(result.stdout)
    assert set(edges) == table_edges()
    assert edges["pending", "resumed"] == 'label="start\\n[attempt in flight]"'


def test_a_changed_table_changes_the_picture(monkeypatch):
    before = diagram.render("mermaid")
    monkeypatch.setattr(history, "TRANSITIONS",
                        [*TRANSITIONS, dict(trigger="retry", source="drift_failed", dest="pending")])
    after = diagram.render("mermaid").decode()
    assert after != before.decode() and "drift_failed --> pending: retry" in after


@needs_dot
@pytest.mark.process
def test_svg_is_drawn_from_the_dot_source_and_says_which(tmp_path):
    dot = trainjob("diagram", "--format", "dot").stdout
    assert trainjob("diagram", "-o", tmp_path / "m.svg").returncode == 0  # format from the suffix
    svg = (tmp_path / "m.svg").read_text()
    assert f"drawn from DOT sha256={hashlib.sha256(dot.encode()).hexdigest()}" in svg
    assert set(re.findall(r'<g id="node\d+" class="node">\n<title>(\w+)</title>', svg)) == set(STATES)


@needs_dot
@pytest.mark.process
def test_png_is_a_png(tmp_path):
    assert trainjob("diagram", "--format", "png", "-o", tmp_path / "m.png").returncode == 0
    assert (tmp_path / "m.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


@needs_graphviz
@pytest.mark.parametrize("fmt", ["svg", "png"])
@pytest.mark.process
def test_without_dot_svg_and_png_exit_2_saying_how_to_install_it(tmp_path, fmt):
    result = subprocess.run([sys.executable, "-m", "trainjob", "diagram", "--format", fmt, "-o", tmp_path / "x"],
                            capture_output=True, text=True, env={**os.environ, "PATH": str(tmp_path)})
    assert result.returncode == 2 and result.stdout == ""
    assert len(result.stderr.splitlines()) == 1 and "apt-get install graphviz" in result.stderr
    assert not (tmp_path / "x").exists()


@pytest.mark.process
def test_without_the_graphviz_package_dot_exits_2_instead_of_falling_back_to_mermaid():
    result = python_without("graphviz", "diagram", "--format", "dot")
    assert result.returncode == 2 and result.stdout == ""
    assert "pip install 'trainjob[diagrams]'" in result.stderr
    mermaid = python_without("graphviz", "diagram")
    assert mermaid.returncode == 0 and "stateDiagram-v2" in mermaid.stdout


# --- a run's path ---------------------------------------------------------------------------------

@needs_graphviz
@pytest.mark.process
def test_walkthrough_highlights_exactly_the_edges_it_took_with_counts(walkthrough_log):
    result = trainjob("diagram", "--format", "dot", "--log", walkthrough_log)
    assert result.returncode == 0, result.stderr
    edges = dot_edges(result.stdout)
    taken = {edge: attrs for edge, attrs in edges.items() if "color=blue" in attrs}
    counts = {edge: int(re.search(r"×(\d+)", attrs)[1]) for edge, attrs in taken.items()}
    assert counts == WALKTHROUGH_TAKEN
    assert not any("×" in attrs for edge, attrs in edges.items() if edge not in taken)
    nodes = dot_nodes(result.stdout)
    assert "color=red" in nodes["completed"]  # the last state
    assert {n for n, attrs in nodes.items() if "color=blue" in attrs} == {
        "pending", "started", "resumed", "checkpointed", "killed"}
    assert {n for n, attrs in nodes.items() if "gray" in attrs} == {"drift_failed", "job_failed", "resharded",
                                                                    "snapshotted", "refused"}
    assert "last state completed" in result.stdout


@pytest.mark.process
def test_walkthrough_in_mermaid_marks_the_last_state_and_counts_edges(walkthrough_log):
    out = trainjob("diagram", "--log", walkthrough_log).stdout.splitlines()
    assert "  Class completed s_final_last" in out and "  Class drift_failed s_final_unvisited" in out
    assert ("  checkpointed --> checkpointed: checkpoint [step % ckpt_every == 0, last step or SIGTERM & synchronous] ×3"
            in out)


@pytest.mark.process
def test_an_illegal_log_is_refused_not_drawn(tmp_path, walkthrough_log):
    log = tmp_path / "log.jsonl"
    log.write_text("".join(walkthrough_log.read_text().splitlines(keepends=True)[:4]) * 2)
    result = trainjob("diagram", "--log", log)
    assert result.returncode == 2 and result.stdout == ""
    assert ("line 5: illegal step from killed: job_started "
            "(expected one of: ranks_coordinated, cleaned_up, checkpoint_rejected, resumed, rank_local_dropped, resharded)") in result.stderr


# --- the committed pictures -----------------------------------------------------------------------

def render_script():
    spec = importlib.util.spec_from_file_location("render_diagrams", ROOT / "scripts" / "render_diagrams.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_graphviz
@pytest.mark.process
def test_committed_diagrams_match_the_table(walkthrough_log):
    script = render_script()
    for name, data in script.render_all(walkthrough_log, script.TEXT).items():
        assert (ROOT / "diagrams" / name).read_bytes() == data, \
            f"diagrams/{name} is stale: run .venv/bin/python scripts/render_diagrams.py"


@pytest.mark.process
def test_committed_replay_page_is_the_walkthrough_on_the_committed_machine(tmp_path, walkthrough_log):
    page = render_script().replay_walkthrough(walkthrough_log, (ROOT / "diagrams" / "machine.svg").read_bytes(),
                                              tmp_path)
    assert (ROOT / "diagrams" / "walkthrough.html").read_bytes() == page, \
        "diagrams/walkthrough.html is stale: run .venv/bin/python scripts/render_diagrams.py"
    for doc in ("docs/tutorial/machine.md", "docs/diagrams.md"):
        assert "diagrams/walkthrough.html)" in (ROOT / doc).read_text(), f"{doc} must link the replay page"


@pytest.mark.parametrize("name", ["machine", "walkthrough"])
def test_committed_svg_was_drawn_from_the_committed_dot(name):
    dot = (ROOT / "diagrams" / f"{name}.dot").read_bytes()
    svg = (ROOT / "diagrams" / f"{name}.svg").read_text()
    assert f"drawn from DOT sha256={hashlib.sha256(dot).hexdigest()}" in svg, \
        f"diagrams/{name}.svg is stale: run .venv/bin/python scripts/render_diagrams.py"


def test_docs_embed_the_committed_mermaid():
    mermaid = (ROOT / "diagrams" / "machine.mmd").read_text()
    docs = [ROOT / "docs" / "diagrams.md"]
    embedded = [doc for doc in docs if doc.exists() and "BEGIN machine.mmd" in doc.read_text()]
    assert ROOT / "docs" / "diagrams.md" in embedded
    # The tutorial shows the committed SVG itself (drawn inline by scripts/mkdocs_hooks.py), so it cannot go stale.
    assert "](/diagrams/machine.svg)" in (ROOT / "docs" / "tutorial" / "machine.md").read_text()
    script = render_script()
    for doc in embedded:
        text = doc.read_text()
        assert script.embed(text, mermaid) == text, f"{doc.name}: run .venv/bin/python scripts/render_diagrams.py"
